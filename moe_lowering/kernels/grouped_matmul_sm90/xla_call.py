"""The Gluon kernels launched from XLA: a GPU custom call whose handler encodes the TMA descriptors on
the host, from the buffers' addresses at run time, and launches the cubin.

A host-side TMA descriptor is a 128-byte kernel parameter that holds the tensor's address, which XLA
knows only when the call runs; jaxlib's Triton call passes pointers and scalars only, and Triton's
device-side descriptors need a global scratch buffer it does not allocate. So the handler here is a
``ctypes`` callback registered as a legacy custom-call target (status-returning API): it reads the
buffer pointers, fills the descriptors with the driver's ``cuTensorMapEncodeTiled`` exactly as
Triton's own launcher does (``tensordesc_meta`` of the compiled kernel: box, swizzle, element type),
and calls ``cuLaunchKernel`` on XLA's stream. Nothing is allocated or synchronised per launch; the
handler costs a few tens of microseconds of host time, against GEMMs of milliseconds.

Kernels are loaded into every local GPU's context when the call is lowered (:func:`preload`), not at
its first launch. Loading a module can wait for the work already queued on its GPU (CUDA's lazy
loading synchronises the context), and at launch time that work may be a peer exchange's wait that
spins until another GPU's launch thread reaches its push: one process driving two H200s deadlocked
so at the first forward+backward of the expert-parallel layer, while one launch thread held a lock
around its load and the other waited for that lock before its push (``benchmarks/EP_NOTES.md``).
A launch that still finds its kernel unloaded (a context other than the device's primary one) loads
it holding no lock across the driver call.

A launch is a :class:`LaunchPlan` (the compiled kernel, grid, and each parameter's source) registered
once per trace; the custom call's opaque bytes name it by a hash of its content, the same in every process.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import struct
import threading
from dataclasses import dataclass

logger = logging.getLogger(__name__)

CUSTOM_CALL_TARGET = "moe_lowering_gluon_call"
_TMA_DTYPE_DEVICE_TO_HOST = {**{i: i for i in range(16)}, 8: 10, 9: 8, 10: 9}  # as Triton's driver.py
_MAX_DYNAMIC_SHARED = 8  # CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES
_L2_PROMOTION_128B = 2


@dataclass(frozen=True)
class Descriptor:
    """A TMA descriptor parameter over buffer ``buffer`` (custom-call operands first, then results) seen
    as the row-major ``shape`` with element ``strides``; ``meta``: the kernel's ``tensordesc_meta`` entry."""

    buffer: int
    shape: tuple[int, ...]
    strides: tuple[int, ...]
    swizzle: int
    elem_size: int
    elem_type: int
    block_size: tuple[int, ...]


@dataclass(frozen=True)
class LaunchPlan:
    """Everything one launch needs but the buffer addresses. ``params``: the kernel's parameters in
    order, each ``("desc", Descriptor)``, ``("ptr", buffer index)`` or ``("i32", value)``; Triton's two
    scratch pointers follow them (null: the kernels use no scratch). ``result``: the output's buffer
    index and bytes, filled with NaN when a launch fails and XLA's status cannot say so."""

    cubin: bytes
    name: str
    num_warps: int
    shared: int
    grid: int
    params: tuple
    result: tuple[int, int] = (-1, 0)
    kernel_hash: str = ""  # Triton's compilation hash (source, options, target); "": the cubin names the kernel


class _Driver:
    """The CUDA driver entry points the handler needs (``libcuda``, loaded on first use)."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")
        self.lib = lib
        lib.cuTensorMapEncodeTiled.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_uint32, ctypes.c_void_p,
                                               ctypes.POINTER(ctypes.c_uint64), ctypes.POINTER(ctypes.c_uint64),
                                               ctypes.POINTER(ctypes.c_uint32), ctypes.POINTER(ctypes.c_uint32),
                                               ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_int]
        lib.cuModuleLoadData.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_char_p]
        lib.cuModuleGetFunction.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p, ctypes.c_char_p]
        lib.cuFuncSetAttribute.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_int]
        lib.cuLaunchKernel.argtypes = [ctypes.c_void_p] + [ctypes.c_uint] * 7 + [ctypes.c_void_p,
                                                                                 ctypes.POINTER(ctypes.c_void_p),
                                                                                 ctypes.c_void_p]
        lib.cuStreamGetCtx.argtypes = [ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)]
        lib.cuCtxPushCurrent_v2.argtypes = [ctypes.c_void_p]
        lib.cuCtxPopCurrent_v2.argtypes = [ctypes.POINTER(ctypes.c_void_p)]
        lib.cuGetErrorString.argtypes = [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)]
        lib.cuMemsetD32Async.argtypes = [ctypes.c_uint64, ctypes.c_uint, ctypes.c_size_t, ctypes.c_void_p]
        lib.cuModuleUnload.argtypes = [ctypes.c_void_p]
        lib.cuDeviceGet.argtypes = [ctypes.POINTER(ctypes.c_int), ctypes.c_int]
        lib.cuDevicePrimaryCtxRetain.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_int]
        self.func_load = getattr(lib, "cuFuncLoad", None)  # CUDA >= 12.4: load now, not at the first launch
        if self.func_load is not None:
            self.func_load.argtypes = [ctypes.c_void_p]
        self.functions: dict[tuple[int, int], ctypes.c_void_p] = {}
        self.primary_contexts: dict[int, int] = {}
        self.launch_time_loads = 0
        self.lock = threading.Lock()  # guards the tables only: never held across a driver call

    def check(self, result: int, what: str):
        if result != 0:
            message = ctypes.c_char_p()
            self.lib.cuGetErrorString(result, ctypes.byref(message))
            raise RuntimeError(f"{what}: CUDA error {result} ({(message.value or b'?').decode()})")

    def function(self, plan_key: int, plan: LaunchPlan, context: int, at_launch: bool = False):
        """The plan's kernel loaded in ``context``, the current one (once per plan and context). The load
        runs outside the lock: it can wait for the context's queued work (see the module docstring)."""
        key = (plan_key, context)
        with self.lock:
            function = self.functions.get(key)
            if function is None and at_launch:
                self.launch_time_loads += 1
        if function is not None:
            return function
        if at_launch:
            logger.debug("Gluon kernel %s loaded at its launch: context %#x was not preloaded", plan.name, context)
        module, function = self._load(plan)
        with self.lock:
            kept = self.functions.setdefault(key, function)
        if kept is not function:  # another thread loaded it meanwhile
            self.lib.cuModuleUnload(module)
        return kept

    def _load(self, plan: LaunchPlan):
        module, function = ctypes.c_void_p(), ctypes.c_void_p()
        self.check(self.lib.cuModuleLoadData(ctypes.byref(module), plan.cubin), "cuModuleLoadData")
        self.check(self.lib.cuModuleGetFunction(ctypes.byref(function), module, plan.name.encode()),
                   "cuModuleGetFunction")
        if self.func_load is not None:
            self.check(self.func_load(function), "cuFuncLoad")
        if plan.shared > 48 * 1024:
            self.check(self.lib.cuFuncSetAttribute(function, _MAX_DYNAMIC_SHARED, plan.shared), "cuFuncSetAttribute")
        return module, function

    def primary_context(self, ordinal: int) -> int:
        """Device ``ordinal``'s primary context (the one XLA runs in), retained once."""
        with self.lock:
            context = self.primary_contexts.get(ordinal)
        if context is None:
            device, handle = ctypes.c_int(), ctypes.c_void_p()
            self.check(self.lib.cuDeviceGet(ctypes.byref(device), ordinal), "cuDeviceGet")
            self.check(self.lib.cuDevicePrimaryCtxRetain(ctypes.byref(handle), device), "cuDevicePrimaryCtxRetain")
            with self.lock:
                context = self.primary_contexts.setdefault(ordinal, handle.value or 0)
        return context

    def preload(self, plan_key: int, plan: LaunchPlan, ordinals) -> None:
        """Loads the plan's kernel into each device's primary context, from the calling thread."""
        for ordinal in ordinals:
            context = self.primary_context(ordinal)
            if (plan_key, context) in self.functions:
                continue
            self.check(self.lib.cuCtxPushCurrent_v2(ctypes.c_void_p(context)), "cuCtxPushCurrent")
            try:
                self.function(plan_key, plan, context)
            finally:
                self.lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))

    def tensor_map(self, desc: Descriptor, address: int):
        """The 128-byte ``CUtensorMap`` (64-byte aligned, as a kernel parameter must be)."""
        storage = (ctypes.c_uint8 * 192)()
        aligned = (ctypes.addressof(storage) + 63) // 64 * 64
        rank = len(desc.shape)
        dims = (ctypes.c_uint64 * rank)(*reversed(desc.shape))
        strides = (ctypes.c_uint64 * rank)(*[desc.elem_size * s for s in reversed(desc.strides[:-1])], 0)
        box = (ctypes.c_uint32 * rank)(*reversed(desc.block_size))
        element_strides = (ctypes.c_uint32 * rank)(*([1] * rank))
        self.check(self.lib.cuTensorMapEncodeTiled(aligned, _TMA_DTYPE_DEVICE_TO_HOST[desc.elem_type], rank,
                                                   ctypes.c_void_p(address), dims, strides, box, element_strides, 0,
                                                   desc.swizzle, _L2_PROMOTION_128B, 0), "cuTensorMapEncodeTiled")
        return storage, aligned


_plans: dict[int, LaunchPlan] = {}
_plans_lock = threading.Lock()
_driver: _Driver | None = None


def plan_key(plan: LaunchPlan) -> int:
    """The plan's key: a hash of what it launches, not the order plans were registered in. Every process
    of a multi-process job must compile one program (XLA's sharded autotuning waits for all of them, and a
    persistent compilation cache maps the program's text to an executable), so the key in the custom
    call's opaque bytes must name the same launch in every process, whatever else each one traced first."""
    kernel = plan.kernel_hash.encode() if plan.kernel_hash else hashlib.sha256(plan.cubin).digest()
    described = repr((plan.name, plan.num_warps, plan.shared, plan.grid, plan.params, plan.result)).encode()
    return int.from_bytes(hashlib.sha256(kernel + b"\0" + described).digest()[:8], "little") >> 1


def register_plan(plan: LaunchPlan) -> bytes:
    """The custom call's opaque bytes naming ``plan`` (:func:`plan_key`), registered in this process."""
    key = plan_key(plan)
    with _plans_lock:
        _plans.setdefault(key, plan)
    return struct.pack("<q", key)


def preload(opaque: bytes, ordinals) -> None:
    """Loads the kernel of the plan ``opaque`` names into the primary context of each GPU ordinal, now
    (at lowering) rather than at its first launch; best effort: where it fails, the launch loads it."""
    (key,) = struct.unpack("<q", opaque[:8])
    try:
        _loaded_driver().preload(key, _plan(key), ordinals)
    except Exception as error:  # noqa: BLE001 - no driver here (lowering without a GPU): the launch loads it
        logger.debug("Gluon kernel not preloaded: %s", error)


def _loaded_driver() -> _Driver:
    global _driver
    with _plans_lock:
        if _driver is None:
            _driver = _Driver()
        return _driver


def _launch(stream: int, buffers, plan_key: int, plan: LaunchPlan):
    driver = _loaded_driver()
    context = ctypes.c_void_p()
    driver.check(driver.lib.cuStreamGetCtx(ctypes.c_void_p(stream), ctypes.byref(context)), "cuStreamGetCtx")
    driver.check(driver.lib.cuCtxPushCurrent_v2(context), "cuCtxPushCurrent")
    try:
        function = driver.function(plan_key, plan, context.value or 0, at_launch=True)
        keep, pointers = [], []
        for kind, value in plan.params:
            if kind == "desc":
                storage, aligned = driver.tensor_map(value, buffers[value.buffer])
                keep.append(storage)
                pointers.append(aligned)
                scalars = [ctypes.c_int32(s) for s in value.shape] + [ctypes.c_int64(s) for s in value.strides]
            elif kind == "ptr":
                scalars = [ctypes.c_uint64(buffers[value] or 0)]
            else:
                scalars = [ctypes.c_int32(value)]
            for scalar in scalars:
                keep.append(scalar)
                pointers.append(ctypes.addressof(scalar))
        for _ in range(2):  # global and profile scratch: none
            scalar = ctypes.c_uint64(0)
            keep.append(scalar)
            pointers.append(ctypes.addressof(scalar))
        params = (ctypes.c_void_p * len(pointers))(*pointers)
        driver.check(driver.lib.cuLaunchKernel(function, plan.grid, 1, 1, 32 * plan.num_warps, 1, 1, plan.shared,
                                               ctypes.c_void_p(stream), params, None), f"launch {plan.name}")
    finally:
        driver.lib.cuCtxPopCurrent_v2(ctypes.byref(ctypes.c_void_p()))


_HANDLER_TYPE = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                                 ctypes.c_size_t, ctypes.c_void_p)


@functools.cache
def _status_setter():
    """XLA's ``XlaCustomCallStatusSetFailure`` where a loaded jaxlib or CUDA-plugin library exports it
    (jaxlib 0.11's do not), else ``None``."""
    import importlib.util
    import pathlib

    folders = []
    for package in ("jaxlib", "jax_plugins", "jax_cuda13_plugin", "jax_cuda12_plugin"):
        spec = importlib.util.find_spec(package)
        folders += [pathlib.Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
    for path in sorted(p for folder in folders for p in folder.rglob("*.so")):
        try:
            setter = ctypes.CDLL(str(path)).XlaCustomCallStatusSetFailure
        except (OSError, AttributeError):
            continue
        setter.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_size_t]
        return setter
    return None


_NAN_WORDS = 0x7FC07FC0  # two bf16 NaNs, and a float32 NaN


def _plan(key: int) -> LaunchPlan:
    plan = _plans.get(key)
    if plan is None:
        raise RuntimeError(f"Gluon launch plan {key:#x} is not registered in this process: the executable was "
                           "compiled in another one (a serialized or exported program); trace it here instead")
    return plan


def _handler(stream, buffers, opaque, opaque_len, status):
    plan = None
    try:
        (plan_key,) = struct.unpack("<q", ctypes.string_at(opaque, min(opaque_len, 8)))
        plan = _plan(plan_key)
        _launch(stream or 0, [buffers[i] for i in range(plan_buffers(plan) + 1)], plan_key, plan)
    except Exception as error:  # noqa: BLE001 - a Python exception cannot cross into XLA: reported instead
        logger.error("Gluon kernel launch failed: %s", error)
        setter = _status_setter()
        if setter is not None:
            message = str(error).encode()
            setter(status, message, len(message))
        elif plan is not None and plan.result[1]:
            _poison(stream or 0, buffers[plan.result[0]], plan.result[1])


def _poison(stream: int, address: int, size: int):
    """Fills a failed launch's output with NaN, so that the failure shows in the results where XLA's
    status cannot carry it (best effort: the driver may be what failed)."""
    try:
        driver = _loaded_driver()
        driver.check(driver.lib.cuMemsetD32Async(address or 0, _NAN_WORDS, size // 4, ctypes.c_void_p(stream)),
                     "cuMemsetD32Async")
    except Exception as error:  # noqa: BLE001
        logger.error("could not fill the failed launch's output with NaN: %s", error)


def plan_buffers(plan: LaunchPlan) -> int:
    """The highest buffer index the plan reads or writes."""
    indices = [value.buffer if kind == "desc" else value for kind, value in plan.params if kind in ("desc", "ptr")]
    return max(indices + [plan.result[0]], default=-1)


_handler_pointer = _HANDLER_TYPE(_handler)


@functools.cache
def register_target() -> None:
    """Registers the handler with XLA for CUDA (once)."""
    import jax

    capsule_new = ctypes.pythonapi.PyCapsule_New
    capsule_new.restype = ctypes.py_object
    capsule_new.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p]
    address = ctypes.cast(_handler_pointer, ctypes.c_void_p).value
    capsule = capsule_new(address, b"xla._CUSTOM_CALL_TARGET", None)
    jax.ffi.register_ffi_target(CUSTOM_CALL_TARGET, capsule, platform="CUDA", api_version=0)
    logger.debug("registered %s", CUSTOM_CALL_TARGET)
