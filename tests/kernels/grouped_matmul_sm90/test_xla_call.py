"""The Gluon kernels' XLA custom call without a GPU: plan registration, the kernel-parameter packing
(the ABI Triton's launcher uses: each TMA descriptor then its shape as int32 and strides as int64,
pointers, int32 scalars, two null scratch pointers), kernel loading (preloaded per device, no lock
held across a load), failures reported to XLA, the CPU lowering's error, and when the backend's weight
gradient takes the Hopper kernel."""

from __future__ import annotations

import ctypes
import struct
import threading

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from moe_lowering.kernels.grouped_matmul_sm90 import jax_launch, xla_call

DESC = xla_call.Descriptor(buffer=0, shape=(1000, 256), strides=(256, 1), swizzle=3, elem_size=2, elem_type=10,
                           block_size=(64, 64))
PLAN = xla_call.LaunchPlan(cubin=b"\x7fELF", name="k", num_warps=12, shared=200_000, grid=132,
                           params=(("desc", DESC), ("ptr", 2), ("ptr", 1), ("i32", 1000), ("i32", -5)),
                           result=(2, 1000 * 256 * 2))


class _FakeLib:
    def __init__(self):
        self.launches = []
        self.memsets = []

    def cuStreamGetCtx(self, stream, context):
        context._obj.value = 77
        return 0

    def cuCtxPushCurrent_v2(self, context):
        return 0

    def cuCtxPopCurrent_v2(self, context):
        return 0

    def cuMemsetD32Async(self, address, value, count, stream):
        self.memsets.append((address, value, count, stream.value))
        return 0

    def cuLaunchKernel(self, function, gx, gy, gz, bx, by, bz, shared, stream, params, extra):
        count = len(params)  # decoded now: the handler frees the parameters' storage once the launch returns
        values = [ctypes.c_uint64.from_address(params[i]).value for i in range(count)]
        int32 = [ctypes.c_int32.from_address(params[i]).value for i in range(count)]
        self.launches.append(dict(grid=(gx, gy, gz), block=(bx, by, bz), shared=shared, stream=stream.value,
                                  values=values, int32=int32, descriptor_aligned=params[0] % 64 == 0))
        return 0


class _FakeDriver:
    def __init__(self):
        self.lib = _FakeLib()
        self.maps = []

    def check(self, result, what):
        assert result == 0, what

    def function(self, plan_key, plan, context, at_launch=False):
        return ctypes.c_void_p(context)

    def tensor_map(self, desc, address):
        storage = (ctypes.c_uint8 * 192)()
        aligned = (ctypes.addressof(storage) + 63) // 64 * 64
        ctypes.c_uint64.from_address(aligned).value = address  # stands in for the encoded map
        self.maps.append((desc, address))
        return storage, aligned


def test_plans_register_once_and_the_opaque_names_them():
    first = xla_call.register_plan(PLAN)
    assert xla_call.register_plan(PLAN) == first
    other = xla_call.register_plan(xla_call.LaunchPlan(b"x", "k2", 4, 0, 1, ()))
    assert other != first and xla_call._plans[struct.unpack("<q", first)[0]] is PLAN
    assert struct.unpack("<q", first)[0] >= 0
    assert xla_call.plan_buffers(PLAN) == 2
    assert xla_call.plan_buffers(xla_call.LaunchPlan(b"x", "k3", 4, 0, 1, (("ptr", 1),), result=(4, 16))) == 4


def test_a_plans_key_is_its_content_not_its_registration_order(monkeypatch):
    """Processes of one job trace different things before the layer (an evaluation step on rank 0 only):
    the opaque bytes, part of the program every process must compile alike, name the plan by content."""
    plans = [xla_call.LaunchPlan(b"cubin-a", "a", 4, 0, 1, ()),
             xla_call.LaunchPlan(b"cubin-b", "b", 4, 0, 1, (("ptr", 1),), kernel_hash="3f2a")]
    keys = []
    for order in (plans, plans[::-1]):
        monkeypatch.setattr(xla_call, "_plans", {})
        keys.append({plan.name: xla_call.register_plan(plan) for plan in order})
    assert keys[0] == keys[1]
    same_kernel_other_grid = xla_call.LaunchPlan(b"cubin-b", "b", 4, 0, 2, (("ptr", 1),), kernel_hash="3f2a")
    other_kernel = xla_call.LaunchPlan(b"cubin-b", "b", 4, 0, 1, (("ptr", 1),), kernel_hash="77e0")
    assert len({xla_call.plan_key(p) for p in (plans[1], same_kernel_other_grid, other_kernel)}) == 3
    recompiled = xla_call.LaunchPlan(b"cubin-b, another ptxas", "b", 4, 0, 1, (("ptr", 1),), kernel_hash="3f2a")
    assert xla_call.plan_key(recompiled) == xla_call.plan_key(plans[1])  # Triton's hash names the kernel


def test_plans_registered_from_many_threads_get_distinct_keys():
    import concurrent.futures

    plans = [xla_call.LaunchPlan(b"t", f"thread-{i}", 4, 0, 1, ()) for i in range(64)]
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        keys = list(pool.map(xla_call.register_plan, plans))
    assert len(set(keys)) == len(plans)
    assert all(xla_call._plans[struct.unpack("<q", key)[0]] is plan for key, plan in zip(keys, plans))


def test_parameters_packed_in_the_kernel_abi_order(monkeypatch):
    driver = _FakeDriver()
    monkeypatch.setattr(xla_call, "_driver", driver)
    buffers = [0x1000, 0x2000, 0x3000]
    (key,) = struct.unpack("<q", xla_call.register_plan(PLAN))
    xla_call._launch(0xABC, buffers, key, PLAN)
    (launch,) = driver.lib.launches
    assert launch["grid"] == (132, 1, 1) and launch["block"] == (384, 1, 1) and launch["shared"] == 200_000
    assert launch["stream"] == 0xABC
    assert driver.maps == [(DESC, 0x1000)]
    values, int32 = launch["values"], launch["int32"]
    assert len(values) == 11
    assert values[0] == 0x1000 and launch["descriptor_aligned"]  # the descriptor
    assert int32[1:3] == [1000, 256] and values[3:5] == [256, 1]  # its shape (int32), strides (int64)
    assert values[5:7] == [0x3000, 0x2000]  # ("ptr", 2), ("ptr", 1)
    assert int32[7:9] == [1000, -5]
    assert values[9:11] == [0, 0]  # the scratch pointers


class _LoadingLib:
    """libcuda's loading entry points; a load in a context listed in ``blocked`` waits for ``release``
    (as CUDA's lazy loading waits for the work queued in that context)."""

    def __init__(self):
        self.current = threading.local()
        self.blocked, self.release = set(), threading.Event()
        self.loaded, self.unloaded, self.retained = [], [], []
        self.modules = iter(range(1000, 10**6))

    def cuCtxPushCurrent_v2(self, context):
        self.current.context = context.value
        return 0

    def cuCtxPopCurrent_v2(self, context):
        self.current.context = None
        return 0

    def cuModuleLoadData(self, module, cubin):
        context = getattr(self.current, "context", None)
        if context in self.blocked:
            assert self.release.wait(30), "the blocked load was never released"
        module._obj.value = next(self.modules)
        self.loaded.append(context)
        return 0

    def cuModuleGetFunction(self, function, module, name):
        function._obj.value = module.value + 10**6
        return 0

    def cuFuncSetAttribute(self, function, attribute, value):
        return 0

    def cuModuleUnload(self, module):
        self.unloaded.append(module.value)
        return 0

    def cuDeviceGet(self, device, ordinal):
        device._obj.value = ordinal
        return 0

    def cuDevicePrimaryCtxRetain(self, context, device):
        self.retained.append(device.value)
        context._obj.value = 0x100 + device.value
        return 0


def _loading_driver():
    driver = object.__new__(xla_call._Driver)  # the real bookkeeping over a stand-in libcuda
    driver.lib, driver.func_load = _LoadingLib(), None
    driver.functions, driver.primary_contexts, driver.launch_time_loads = {}, {}, 0
    driver.lock = threading.Lock()
    return driver


def test_a_load_waiting_on_one_gpu_does_not_hold_up_another_gpus_launch():
    """The deadlock of one process driving two GPUs: GPU A's load waits for A's queued work (a wait
    for rows GPU B has yet to push); B's launch thread must still get its kernel and go on to that push."""
    driver = _loading_driver()
    driver.lib.blocked.add(0xA)
    waiting = threading.Thread(target=lambda: (driver.lib.cuCtxPushCurrent_v2(ctypes.c_void_p(0xA)),
                                               driver.function(7, PLAN, 0xA, at_launch=True)))
    waiting.start()
    other = threading.Thread(target=lambda: (driver.lib.cuCtxPushCurrent_v2(ctypes.c_void_p(0xB)),
                                             driver.function(7, PLAN, 0xB, at_launch=True)))
    other.start()
    other.join(10)
    try:
        assert not other.is_alive(), "GPU B's launch waited for GPU A's load"
        assert (7, 0xB) in driver.functions and (7, 0xA) not in driver.functions
    finally:
        driver.lib.release.set()
        waiting.join(10)
    assert (7, 0xA) in driver.functions and driver.launch_time_loads == 2


def test_kernels_are_preloaded_into_every_gpus_primary_context(monkeypatch):
    driver = _loading_driver()
    monkeypatch.setattr(xla_call, "_driver", driver)
    opaque = xla_call.register_plan(PLAN)
    (key,) = struct.unpack("<q", opaque)
    xla_call.preload(opaque, [0, 1])
    xla_call.preload(opaque, [0, 1])  # once per plan and context
    assert driver.lib.loaded == [0x100, 0x101] and driver.lib.retained == [0, 1]
    assert set(driver.functions) == {(key, 0x100), (key, 0x101)}
    assert driver.function(key, PLAN, 0x101, at_launch=True) == driver.functions[key, 0x101]
    assert driver.launch_time_loads == 0


def test_a_load_raced_by_another_thread_keeps_one_module():
    driver = _loading_driver()
    driver.lib.blocked.add(0xA)
    first = threading.Thread(target=lambda: (driver.lib.cuCtxPushCurrent_v2(ctypes.c_void_p(0xA)),
                                             driver.function(3, PLAN, 0xA)))
    first.start()
    driver.lib.blocked.clear()
    driver.lib.cuCtxPushCurrent_v2(ctypes.c_void_p(0xA))
    kept = driver.function(3, PLAN, 0xA)  # loads while the first thread's load still waits
    driver.lib.release.set()
    first.join(10)
    assert driver.functions[3, 0xA] == kept and len(driver.lib.unloaded) == 1


def test_no_driver_at_lowering_leaves_the_load_to_the_launch(monkeypatch, caplog):
    def no_driver():
        raise OSError("libcuda.so.1: cannot open shared object file")
    monkeypatch.setattr(xla_call, "_loaded_driver", no_driver)
    with caplog.at_level("DEBUG", logger=xla_call.__name__):
        xla_call.preload(xla_call.register_plan(PLAN), [0])
    assert "not preloaded" in caplog.text


def test_a_failed_launch_is_reported_to_xla_not_raised(monkeypatch, caplog):
    driver = _FakeDriver()
    driver.lib.cuLaunchKernel = lambda *args: 1
    driver.check = lambda result, what: (_ for _ in ()).throw(RuntimeError(f"{what}: CUDA error {result}"))
    monkeypatch.setattr(xla_call, "_driver", driver)
    reported = []
    monkeypatch.setattr(xla_call, "_status_setter", lambda: lambda status, message, size: reported.append(message))
    opaque = xla_call.register_plan(PLAN)
    buffers = (ctypes.c_void_p * 3)(0x1000, 0x2000, 0x3000)
    opaque_buffer = ctypes.create_string_buffer(opaque, len(opaque))
    driver.lib.cuStreamGetCtx = lambda stream, context: 0
    xla_call._handler(0xABC, buffers, ctypes.addressof(opaque_buffer), len(opaque), None)
    assert reported and b"CUDA error" in reported[0]
    assert "Gluon kernel launch failed" in caplog.text
    assert driver.lib.memsets == []  # XLA was told: nothing to poison


def test_a_failed_launch_fills_its_output_with_nan_where_xla_cannot_be_told(monkeypatch):
    driver = _FakeDriver()
    driver.lib.cuLaunchKernel = lambda *args: 1
    monkeypatch.setattr(xla_call, "_driver", driver)
    monkeypatch.setattr(xla_call, "_status_setter", lambda: None)
    opaque = ctypes.create_string_buffer(xla_call.register_plan(PLAN), 8)
    buffers = (ctypes.c_void_p * 3)(0x1000, 0x2000, 0x3000)
    xla_call._handler(0xABC, buffers, ctypes.addressof(opaque), 8, None)
    assert driver.lib.memsets == [(0x3000, 0x7FC07FC0, 1000 * 256 * 2 // 4, 0xABC)]
    word = np.array([0x7FC07FC0], np.uint32)
    assert np.isnan(word.view(np.float32)).all()
    halves = word.view(np.uint16).astype(np.uint32) << 16  # each bf16 half as the float32 it widens to
    assert np.isnan(halves.view(np.float32)).all()


def _bind_on_cpu(x):
    return jax_launch.gluon_call_p.bind(x, opaque=b"\0" * 8, out_avals=(jax.core.ShapedArray((4,), jnp.float32),),
                                        aliases=())


def test_the_call_off_a_gpu_raises_naming_the_requirement():
    operand = jax.device_put(jnp.zeros((4,), jnp.float32), jax.devices("cpu")[0])  # compiled for the CPU
    with pytest.raises(RuntimeError, match="Hopper GPUs"):
        jax.jit(_bind_on_cpu)(operand)


def test_the_call_evaluates_outside_jit():
    """Evaluated op by op (an un-jitted ``jax.grad`` reaches it so) the call is compiled alone: off a GPU
    that gives the lowering's error, not JAX's missing evaluation rule."""
    operand = jax.device_put(jnp.zeros((4,), jnp.float32), jax.devices("cpu")[0])
    with pytest.raises(RuntimeError, match="Hopper GPUs"):
        _bind_on_cpu(operand)


@pytest.mark.parametrize("change, applies", [
    ({}, True),
    ({"lhs_dtype": jnp.float32}, False),
    ({"out_dtype": jnp.float16}, False),
    ({"group_offset": 1}, False),
    ({"group_offset": jnp.int32(0)}, False),  # a traced offset: not provably 0
    ({"num_groups": 3}, False),
    ({"k": 120}, False),
    ({"sm90": False}, False),
    ({"shared_binaries": True}, False),  # other processes would run the program without its launch plans
])
def test_when_the_weight_gradient_takes_the_hopper_kernel(monkeypatch, change, applies):
    case = dict(lhs_dtype=jnp.bfloat16, out_dtype=jnp.float32, group_offset=0, num_groups=None, k=128, sm90=True,
                shared_binaries=False)
    case.update(change)
    monkeypatch.setattr(jax_launch, "_all_gpus_sm90", lambda: case["sm90"])
    monkeypatch.setattr(jax_launch, "_gluon_available", lambda: True)
    lhs = jax.ShapeDtypeStruct((256, case["k"]), case["lhs_dtype"])
    grad = jax.ShapeDtypeStruct((256, 64), jnp.bfloat16)
    sizes = jax.ShapeDtypeStruct((4,), jnp.int32)
    previous = getattr(jax.config, "jax_share_binary_between_hosts", None)
    if previous is None:
        pytest.skip("this JAX has no jax_share_binary_between_hosts")
    jax.config.update("jax_share_binary_between_hosts", case["shared_binaries"])
    try:
        assert jax_launch.tgmm_applies(lhs, grad, sizes, case["num_groups"], case["group_offset"],
                                       jnp.dtype(case["out_dtype"])) is applies
    finally:
        jax.config.update("jax_share_binary_between_hosts", previous)


def test_no_gpu_means_no_hopper_kernel():
    if any(d.platform == "gpu" for d in jax.devices()):
        pytest.skip("a GPU is present")
    assert not jax_launch._all_gpus_sm90()
    np.testing.assert_equal(jax_launch._check_widths("tgmm", 128, 64), None)
    with pytest.raises(ValueError, match="multiples of 16"):
        jax_launch._check_widths("tgmm", 120, 64)


def test_an_unknown_plan_is_reported_naming_the_cause(monkeypatch):
    reported = []
    monkeypatch.setattr(xla_call, "_status_setter", lambda: lambda status, message, size: reported.append(message))
    opaque = ctypes.create_string_buffer(struct.pack("<q", 10**9), 8)
    xla_call._handler(0, (ctypes.c_void_p * 1)(0), ctypes.addressof(opaque), 8, None)
    assert reported and b"not registered in this process" in reported[0]




@pytest.fixture
def triton_launch():
    """``grouped_matmul.triton_launch`` (its tile table), importable without ``jax_triton`` (a placeholder
    while the test runs; the modules are put back as they were, so no later test sees the placeholder)."""
    import importlib
    import sys
    import types

    from moe_lowering.kernels import grouped_matmul

    names = ("jax_triton", "moe_lowering.kernels.grouped_matmul.triton_launch")
    saved = {name: sys.modules.get(name) for name in names}
    had_attribute = hasattr(grouped_matmul, "triton_launch")
    try:
        importlib.import_module("jax_triton")
    except ImportError:
        sys.modules["jax_triton"] = types.ModuleType("jax_triton")
    yield importlib.import_module(names[1])
    for name, module in saved.items():
        if module is None:
            sys.modules.pop(name, None)
        else:
            sys.modules[name] = module
    if not had_attribute and hasattr(grouped_matmul, "triton_launch"):
        delattr(grouped_matmul, "triton_launch")


@pytest.mark.parametrize("rows, groups, out_dtype, kernel", [
    (512, 8, jnp.bfloat16, "gluon"),  # small groups, bf16: the Gluon kernel's TMA-store path
    (512, 8, jnp.float32, "triton"),  # small groups, float32: masked stores, the resident kernel is faster
    (4096, 4, jnp.float32, "gluon"),  # large groups: the stores are a small share whatever the path
])
def test_which_kernel_the_backends_weight_gradient_takes(monkeypatch, triton_launch, rows, groups, out_dtype,
                                                         kernel):
    taken = []
    monkeypatch.setattr(jax_launch, "tgmm_applies", lambda *_: True)
    monkeypatch.setattr(jax_launch, "tgmm", lambda *_, **__: taken.append("gluon"))
    monkeypatch.setattr(triton_launch, "tgmm", lambda *_, **__: taken.append("triton"))
    lhs, grad = jnp.zeros((rows, 32), jnp.bfloat16), jnp.zeros((rows, 48), jnp.bfloat16)
    jax_launch.backend_tgmm(lhs, grad, jnp.full((groups,), rows // groups, jnp.int32),
                            preferred_element_type=out_dtype)
    assert taken == [kernel]


def test_an_expert_parallel_buffer_picks_the_weight_gradient_by_its_balanced_rows(monkeypatch, triton_launch):
    """A receive buffer sized for the worst case (4 x a balanced arrival) holds ~128 rows a local expert when
    balanced: the backend passes ``expected_rows`` on, so the resident-``dout`` config is the one launched."""
    launched = []
    monkeypatch.setattr(jax_launch, "tgmm_applies", lambda *_: True)
    monkeypatch.setattr(jax_launch, "_compiled_tgmm", lambda config, out_dtype: launched.append(config))
    monkeypatch.setattr(jax_launch, "_plan", lambda *_: (_ for _ in ()).throw(RuntimeError("planned")))
    lhs, grad = jnp.zeros((4 * 8192, 256), jnp.bfloat16), jnp.zeros((4 * 8192, 256), jnp.bfloat16)
    sizes = jnp.full((64,), 128, jnp.int32)
    for expected_rows, config in ((8192, jax_launch.RESIDENT_TGMM_CONFIG), (None, jax_launch.DEFAULT_TGMM_CONFIG)):
        with pytest.raises(RuntimeError, match="planned"):
            jax_launch.backend_tgmm(lhs, grad, sizes, expected_rows=expected_rows)
        assert launched.pop().name == config.name


@pytest.mark.parametrize("rows, groups, kernel", [
    (8 * 128, 8, "gluon-pingpong"),  # DeepSeek-V3-like ~128 rows a group: the ping-pong tile
    (4 * 1024, 4, "gluon-cooperative"),  # Qwen3-like ~1024, a long contraction: the cooperative tile
    (4 * 2048, 4, "triton"),  # Mixtral-like ~2048: gmm_kernel measured faster there
])
def test_which_kernel_the_backends_forward_products_take(monkeypatch, triton_launch, rows, groups, kernel):
    """``gmm`` (both weight layouts), ``gmm_pair`` and ``gmm_sum`` go to the Gluon kernels by the rows a group
    holds on average, with the tile :func:`~jax_launch.gmm_config` picks, and to Triton's otherwise."""
    taken = []
    monkeypatch.setattr(jax_launch, "_all_gpus_sm90", lambda: True)
    monkeypatch.setattr(jax_launch, "_gluon_available", lambda: True)
    gluon_name = lambda config: "gluon-pingpong" if config.pingpong else "gluon-cooperative"
    monkeypatch.setattr(jax_launch, "gmm", lambda *args, **__: taken.append(gluon_name(args[3])))
    monkeypatch.setattr(jax_launch, "gmm_sum", lambda *args, **__: taken.append(gluon_name(args[5])))
    for name in ("gmm", "gmm_pair", "gmm_sum"):
        monkeypatch.setattr(triton_launch, name, lambda *_, **__: taken.append("triton"))
    k, n = 2048, 256
    lhs, weight = jnp.zeros((rows, k), jnp.bfloat16), jnp.zeros((groups, k, n), jnp.bfloat16)
    weight_t = jnp.zeros((groups, n, k), jnp.bfloat16)  # [E, N, K], read transposed
    sizes = jnp.full((groups,), rows // groups, jnp.int32)
    jax_launch.backend_gmm(lhs, weight, sizes)
    jax_launch.backend_gmm(lhs, weight_t, sizes, transpose_rhs=True)
    jax_launch.backend_gmm_pair(lhs, weight, weight, sizes)
    jax_launch.backend_gmm_sum(lhs, lhs, weight_t, weight_t, sizes)
    pairs = 1 if kernel == "triton" else 2  # the Gluon pair is two launches, Triton's one call
    assert taken == [kernel] * (3 + pairs)


def test_forward_products_the_gluon_kernels_cannot_take_stay_on_triton(monkeypatch, triton_launch):
    """A group offset (an expert-parallel shard's local experts), float32 operands, a float32 result, K off the
    weight box for untransposed weights, fewer sizes than weights: Triton's kernels, whatever the GPU."""
    monkeypatch.setattr(jax_launch, "_all_gpus_sm90", lambda: True)
    monkeypatch.setattr(jax_launch, "_gluon_available", lambda: True)
    sizes = jnp.full((4,), 64, jnp.int32)
    lhs, weight = jnp.zeros((256, 128), jnp.bfloat16), jnp.zeros((4, 128, 256), jnp.bfloat16)
    assert jax_launch.gmm_applies(lhs, weight, sizes, 0, jnp.bfloat16, False)
    assert not jax_launch.gmm_applies(lhs, weight, sizes, 1, jnp.bfloat16, False)
    assert not jax_launch.gmm_applies(lhs, weight, sizes, 0, jnp.float32, False)
    assert not jax_launch.gmm_applies(lhs.astype(jnp.float32), weight, sizes, 0, jnp.bfloat16, False)
    odd_k = jnp.zeros((256, 80), jnp.bfloat16)
    assert not jax_launch.gmm_applies(odd_k, jnp.zeros((4, 80, 256), jnp.bfloat16), sizes, 0, jnp.bfloat16, False)
    assert jax_launch.gmm_applies(odd_k, jnp.zeros((4, 256, 80), jnp.bfloat16), sizes, 0, jnp.bfloat16, True)
    assert not jax_launch.gmm_applies(lhs, weight, sizes[:3], 0, jnp.bfloat16, False)
    # an expert-parallel receive buffer judged by the rows it holds when balanced
    big = jnp.zeros((4 * 4096, 128), jnp.bfloat16)
    assert not jax_launch.gmm_applies(big, weight, sizes, 0, jnp.bfloat16, False)
    assert jax_launch.gmm_applies(big, weight, sizes, 0, jnp.bfloat16, False, expected_rows=4096)
