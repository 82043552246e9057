"""Launch Triton kernels that read operands through TMA descriptors they build on device.

A kernel calling ``tl.make_tensor_descriptor`` writes each descriptor into a global scratch buffer
that Triton's launch ABI hands it after the kernel's own arguments. jax_triton 0.3 (what the ``gpu``
extra installs) launches every kernel with a null scratch pointer, so such a kernel would fault.
jaxlib's Triton custom call allocates the buffer itself when its ``TritonKernel`` is told the
kernel's scratch size (jaxlib after 0.11.0, the API jax_triton 0.4 builds on). This module compiles
the kernel with Triton and emits that custom call, for the launches that read through descriptors;
every other launch stays on ``jax_triton.triton_call``, whose calling convention :func:`triton_call`
keeps (operands then outputs as the kernel's pointer arguments, every other argument a constant).

On an H100, descriptor (TMA) loads of the weights and rows made the row-tiled products 3-13% faster
than pointer loads at the same tile, with the same bits (``benchmarks/NOTES.md``).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import inspect
import logging
import os
import shutil
import tempfile
import zlib

import jax
import numpy as np

from moe_lowering import _compat

log = logging.getLogger(__name__)

MIN_COMPUTE_CAPABILITY = 90
"""TMA exists from Hopper on."""

_POINTER_TYPES = {np.dtype(np.float32): "*fp32", np.dtype(np.float16): "*fp16", np.dtype(np.int32): "*i32",
                  np.dtype(jax.numpy.bfloat16): "*bf16"}

descriptor_kernel_call_p = _compat.Primitive("moe_lowering_descriptor_kernel_call")
descriptor_kernel_call_p.multiple_results = True


def _gpu_triton():
    """jaxlib's Triton custom-call module, or ``None`` without a CUDA plugin."""
    try:
        from jax._src.lib import gpu_triton
    except ImportError:
        return None
    return gpu_triton if hasattr(gpu_triton, "TritonKernel") else None


@functools.cache
def available() -> bool:
    """Whether descriptor kernels can launch here: a CUDA GPU of compute capability 9.0 or more, and a
    jaxlib whose Triton custom call allocates a kernel's global scratch."""
    gpu_triton = _gpu_triton()
    if gpu_triton is None or not any(d.platform == "gpu" for d in jax.devices()):
        return False
    try:
        capability = gpu_triton.get_compute_capability(0)
        gpu_triton.TritonKernel("probe", 4, 1, 0, "", "", capability, 128, 128)
    except (TypeError, RuntimeError, ValueError) as exc:
        log.info("descriptor kernels unavailable: this jaxlib's TritonKernel takes no scratch size (%s)", exc)
        return False
    if capability < MIN_COMPUTE_CAPABILITY:
        log.info("descriptor kernels unavailable: compute capability %d has no TMA", capability)
        return False
    return True


def triton_call(*arrays, kernel, out_shape, grid, num_warps: int, num_stages: int, **constants):
    """``kernel[grid](*arrays, *outputs, **constants)`` as an XLA custom call; ``out_shape`` one
    ``jax.ShapeDtypeStruct`` or a sequence of them (then a tuple is returned), as in jax_triton."""
    many = isinstance(out_shape, (tuple, list))
    shapes = tuple(out_shape) if many else (out_shape,)
    grid = tuple(grid) + (1,) * (3 - len(grid))
    outs = descriptor_kernel_call_p.bind(
        *arrays, kernel=kernel, out_shapes=tuple((tuple(s.shape), np.dtype(s.dtype)) for s in shapes), grid=grid,
        num_warps=num_warps, num_stages=num_stages, constants=tuple(sorted(constants.items())))
    return tuple(outs) if many else outs[0]


def _abstract_eval(*avals, out_shapes, **_):
    return [_compat.ShapedArray(shape, dtype) for shape, dtype in out_shapes]


descriptor_kernel_call_p.def_abstract_eval(_abstract_eval)
_compat.def_impl_by_lowering(descriptor_kernel_call_p)


@functools.cache
def _private_cache_dir() -> str:
    path = tempfile.mkdtemp(prefix="moe_lowering-triton-")
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@contextlib.contextmanager
def _triton_cache():
    """``triton.compile`` needs an on-disk cache, which importing jax_triton turns off for the whole
    process (``TRITON_CACHE_DIR=""``): a directory of this process's own while it compiles."""
    saved = os.environ.get("TRITON_CACHE_DIR")
    if not saved:
        os.environ["TRITON_CACHE_DIR"] = _private_cache_dir()
    try:
        yield
    finally:
        if not saved:
            if saved is None:
                del os.environ["TRITON_CACHE_DIR"]
            else:
                os.environ["TRITON_CACHE_DIR"] = saved


@functools.cache
def _compiled(kernel, signature: tuple, constexprs: tuple, num_warps: int, num_stages: int, capability: int):
    """The kernel compiled by Triton for ``sm_<capability>``: its PTX and launch metadata (the warp
    count it launches with, shared memory, the descriptors' scratch bytes per program)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    pointers = dict(signature)
    full_signature = {name: pointers.get(name, "constexpr") for name in kernel.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, name in enumerate(kernel.arg_names) if name in pointers}
    source = ASTSource(fn=kernel, signature=full_signature, constexprs=dict(constexprs), attrs=attrs)
    with _triton_cache():
        return triton.compile(source, target=GPUTarget("cuda", capability, 32),
                              options={"num_warps": num_warps, "num_stages": num_stages, "num_ctas": 1})


def _kernel_arguments(kernel, constants: tuple):
    """``(pointer argument names, every constexpr's value)``: the constants given, the others' defaults."""
    given = dict(constants)
    pointers, constexprs = [], {}
    for param in kernel.params:
        if not param.is_constexpr:
            if param.name in given:
                raise TypeError(f"{kernel.fn.__name__}: {param.name} is an array argument, not a constant")
            pointers.append(param.name)
        elif param.name in given:
            constexprs[param.name] = given[param.name]
        elif param.default is not inspect.Parameter.empty:
            constexprs[param.name] = param.default
        else:
            raise TypeError(f"{kernel.fn.__name__}: constant {param.name} was not given")
    unknown = set(given) - set(constexprs)
    if unknown:
        raise TypeError(f"{kernel.fn.__name__} has no constants {sorted(unknown)}")
    return pointers, tuple(sorted(constexprs.items()))


def _lowering(ctx, *operands, kernel, out_shapes, grid, num_warps, num_stages, constants):
    gpu_triton = _gpu_triton()
    if gpu_triton is None:
        raise RuntimeError("moe_lowering: a descriptor kernel was lowered without jaxlib's CUDA Triton support")
    avals = list(ctx.avals_in) + [_compat.ShapedArray(shape, dtype) for shape, dtype in out_shapes]
    pointers, constexprs = _kernel_arguments(kernel, constants)
    if len(pointers) != len(avals):
        raise TypeError(f"{kernel.fn.__name__} takes {len(pointers)} arrays ({', '.join(pointers)}), "
                        f"was given {len(avals)} operands and outputs")
    signature = tuple((name, _POINTER_TYPES[np.dtype(aval.dtype)]) for name, aval in zip(pointers, avals))
    capability = gpu_triton.get_compute_capability(0)
    compiled = _compiled(kernel, signature, constexprs, num_warps, num_stages, capability)
    metadata = compiled.metadata
    triton_kernel = gpu_triton.TritonKernel(metadata.name, metadata.num_warps, 1, metadata.shared, compiled.asm["ptx"],
                                            "", capability, metadata.global_scratch_size or 0,
                                            metadata.global_scratch_align or 1)
    parameters = [gpu_triton.create_array_parameter(0, 16) for _ in avals]
    call = gpu_triton.TritonKernelCall(triton_kernel, *grid, parameters)
    rule = jax.ffi.ffi_lowering("triton_kernel_call", api_version=2,
                                backend_config=zlib.compress(call.to_proto(kernel.fn.__name__, b"")))
    return rule(ctx, *operands)


_compat.register_platform_lowering(descriptor_kernel_call_p, _lowering, platform="cuda")
