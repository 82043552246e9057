"""The Triton FP8-weight grouped GEMM run by Triton's interpreter on the CPU, against the jnp reference.

Checks the kernel's in-register dequantisation (scale rows per K step, scale columns per tile,
E8M0 exponents) and its scheduling (ragged groups, an empty group, rows outside every group, a
``group_offset`` window) at tiny tile sizes, both quant formats, against ``fp8_gmm`` of
:mod:`fp8_grouped_matmul` on the same quantised weights. The weights are scaled by powers of two
per row and per column before quantising, so neighbouring scale blocks differ by up to 2**12 and
a scale read from the wrong block shows. Both operand orders run every case: ``rhs`` (the weight
as the dot's second operand, 16 x 16 tiles) and ``lhs`` (``WEIGHT_AS_LHS``: the transposed tile
``weight^T @ lhs^T``, on 16-row x 32-column tiles so a swapped row/column extent shows).

Activations are float16: Triton 3.9's interpreter keeps bfloat16 as raw ``uint16`` bits, which
its ``tl.dot`` multiplies as integers (and it truncates float32 -> bfloat16 casts), so bf16 runs
on the GPU only (``tests/gpu/test_triton_fp8_gmm.py``). Float16 takes the same kernel path; with a
float32 output the result must match the reference up to accumulation order, which also pins
down the rounding of each dequantised weight to float16. The kernel runs in a child
process (``interpreter_harness``), on its grouped cases.
"""

from __future__ import annotations

import numpy as np

import interpreter_harness as harness
from interpreter_harness import CASES, HostTensor

if __name__ != "__main__":
    import pytest

    harness.skip_without_interpreter(pytest)

# (K, N, BLOCK_K). K=96, N=40: fp8_e4m3 scale blocks of 32 x 8, so two K steps per scale row, two
# scale columns per 16-wide tile and an N remainder. K=N=64: one 64 x 64 fp8_e4m3 block shared by
# several tiles; for mxfp8 a K step exactly one scale block.
SHAPES = {"k96-n40": (96, 40, 16), "k64-n64": (64, 64, 32)}
QUANTS = ("fp8_e4m3", "mxfp8")
# Operand order: the kernel's WEIGHT_AS_LHS and the tile each order runs on.
ORDERS = {"rhs": (False, dict(BLOCK_M=16, BLOCK_N=16, GROUP_M=2)),
          "lhs": (True, dict(BLOCK_M=16, BLOCK_N=32, GROUP_M=2))}
VARIANTS = {f"{case}-{shape}-{quant}-w{order}": (case, shape, quant, order)
            for case in CASES for shape in SHAPES for quant in QUANTS for order in ORDERS}
NUM_PROGRAMS = 3


def _quantised_weights(rng, num_local, k, n, quant):
    """Weights with magnitudes spread over 2**-6 .. 2**6 by row and column, quantised as ``quant``."""
    from moe_lowering.kernels.fp8_grouped_matmul.quant_format import quantize_blocks

    weights = rng.standard_normal((num_local, k, n)) * np.exp2(rng.integers(-3, 4, (num_local, k, 1)))
    weights *= np.exp2(rng.integers(-3, 4, (num_local, 1, n)))
    values, scales = quantize_blocks(weights.astype(np.float32), quant)
    return np.asarray(values), np.asarray(scales)


def _run(kernels, case, shape, quant, order):
    import jax.numpy as jnp

    from moe_lowering.kernels.fp8_grouped_matmul import check_fp8_operands, fp8_gmm

    host = HostTensor
    group_sizes, num_rows, group_offset, num_local = CASES[case]
    k, n, block_k = SHAPES[shape]
    weight_as_lhs, block = ORDERS[order]
    rng = np.random.default_rng(len(group_sizes) * 100 + num_rows + k + n)
    group_sizes = np.asarray(group_sizes, np.int32)
    lhs = rng.standard_normal((num_rows, k)).astype(np.float16)
    values, scales = _quantised_weights(rng, num_local, k, n, quant)
    scale_block_k, scale_block_n = check_fp8_operands(lhs, values, scales, group_sizes, quant, "test")
    out = np.full((num_rows, n), np.nan, np.float32)
    kernels.fp8_gmm_kernel[(NUM_PROGRAMS,)](
        host(lhs), host(values), host(scales), host(group_sizes), host(np.array([group_offset], np.int32)),
        host(out), M=num_rows, K=k, N=n, NUM_LOCAL_GROUPS=num_local, NUM_GROUPS=len(group_sizes), GROUPS_PAD=8,
        SCALE_BLOCK_K=scale_block_k, SCALE_BLOCK_N=scale_block_n, E8M0_SCALES=quant == "mxfp8", BLOCK_K=block_k,
        NUM_PROGRAMS=NUM_PROGRAMS, WEIGHT_AS_LHS=weight_as_lhs, **block,
    )
    expected = fp8_gmm(jnp.asarray(lhs), jnp.asarray(values), jnp.asarray(scales), jnp.asarray(group_sizes),
                       quant=quant, group_offset=group_offset, preferred_element_type=jnp.float32)
    return harness.summary(out, np.asarray(expected, np.float64))


def _jobs():
    """Every variant as a job for the interpreter child (see ``interpreter_harness``)."""
    from moe_lowering.kernels.fp8_grouped_matmul import triton_kernels

    return {name: (lambda v=variant: _run(triton_kernels, *v)) for name, variant in VARIANTS.items()}


if __name__ == "__main__":
    harness.run_as_child(_jobs)
else:
    # JAX computes the reference in the child: on its CPU, whatever the machine has
    interpreter_report = harness.report_fixture(__file__, VARIANTS, JAX_PLATFORMS="cpu")

    @pytest.mark.parametrize("name", sorted(VARIANTS))
    def test_fp8_gmm_kernel_matches_reference(interpreter_report, name):
        result = interpreter_report[name]
        assert result["unwritten"] == 0, f"{result['unwritten']} output elements were never written"
        assert result["max_error"] < 1e-5, result
