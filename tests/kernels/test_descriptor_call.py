"""``descriptor_call``: what it can check without a GPU.

The launches themselves run on a GPU (``tests/gpu/test_triton_grouped_matmul.py``: descriptor loads
give the pointer loads' bits) and, through the interpreter stand-in, on the CPU
(``test_triton_backend_interpreter.py``). Here: a machine without a CUDA GPU never takes the path,
and a launch whose arguments do not fit the kernel fails naming the argument.
"""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

from moe_lowering.kernels import descriptor_call  # noqa: E402
from moe_lowering.kernels.grouped_matmul.triton_kernels import gather_gmm_kernel, gmm_kernel  # noqa: E402

GMM_CONSTANTS = dict(M=64, K=32, N=48, NUM_LOCAL_GROUPS=2, NUM_GROUPS=2, GROUPS_PAD=2, TRANSPOSE_RHS=False,
                     BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, NUM_PROGRAMS=4, COMPUTE_F32=True)


def test_unavailable_without_a_cuda_gpu():
    import jax

    if any(device.platform == "gpu" for device in jax.devices()):
        pytest.skip("a GPU is present")
    descriptor_call.available.cache_clear()
    assert descriptor_call.available() is False


def test_kernel_arguments_are_the_arrays_then_every_constant_with_its_default():
    pointers, constexprs = descriptor_call._kernel_arguments(gmm_kernel, tuple(GMM_CONSTANTS.items()))
    assert pointers == ["lhs_ptr", "rhs_ptr", "group_sizes_ptr", "group_offset_ptr", "out_ptr"]
    values = dict(constexprs)
    assert values["DESCRIPTORS"] is False and values["ZERO_OUTSIDE"] is True and values["M"] == 64
    assert set(values) == {p.name for p in gmm_kernel.params if p.is_constexpr}


@pytest.mark.parametrize("constants, message", [
    ({k: v for k, v in GMM_CONSTANTS.items() if k != "BLOCK_K"}, "constant BLOCK_K was not given"),
    ({**GMM_CONSTANTS, "BLOCK_Q": 4}, "has no constants ['BLOCK_Q']"),
    ({**GMM_CONSTANTS, "out_ptr": 0}, "out_ptr is an array argument"),
])
def test_kernel_arguments_name_what_does_not_fit(constants, message):
    with pytest.raises(TypeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        descriptor_call._kernel_arguments(gmm_kernel, tuple(constants.items()))


def test_gathered_kernel_takes_nine_arrays():
    constants = dict(M=64, K=32, N=48, LHS_SOURCE_ROWS=40, NUM_LOCAL_GROUPS=2, NUM_GROUPS=2, GROUPS_PAD=2,
                     TRANSPOSE_RHS=True, BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2, NUM_PROGRAMS=4,
                     COMPUTE_F32=True, WITH_DOTS=True, DESCRIPTORS=True)
    pointers, _ = descriptor_call._kernel_arguments(gather_gmm_kernel, tuple(constants.items()))
    assert len(pointers) == 9 and pointers[-2:] == ["out_ptr", "dots_ptr"]
