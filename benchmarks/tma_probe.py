"""Whether TMA descriptors help the grouped products on Hopper, through jax-triton 0.4.0.

Triton's automatic warp specialisation is Blackwell-only; on Hopper the first step is TMA (the copy
engine moves the blocks, the warps only compute), which the carried jax-triton 0.3.1 cannot launch and
0.4.0 can (``TensorDescriptor``, host-side descriptors). ``.whl-next`` holds 0.4.0 patched to import
with the GPU machines' Triton 3.6 (``NOTES.md``, "Flattened tile loops, TMA descriptors ..."). This
probe runs, checks against the XLA reference and times by GPU kernel time (``jax.profiler``), at
SonicMoE's small-n products, ``gmm`` (``gmm_kernel``, pointer loads) against ``tma_gmm_kernel`` (the
same persistent tile loop, operand blocks loaded through descriptors: ``lhs [M, K]`` and the weights as
``[G * K, N]``), with or without TMA stores and a flattened tile loop, over the tiles of ``VARIANTS``.

0.4.0 gives an aliased output no kernel parameter of its own, which ``gmm``'s tail launch relies on:
here ``gmm`` runs its whole product in ``gmm_kernel`` (``TAIL_APART`` off), as ``tma_gmm_kernel``
does, so neither has the tail kernel that the package's ``gmm`` launches.

``tma_gmm_kernel`` needs ``K % BLOCK_K == 0`` (a block past a group's ``K`` rows of the flattened
weights would read the next group's; the descriptor zero-fills only past the array). Rows past a
group are computed from the next group's rows and never stored, as in ``gmm_kernel``.

    bash benchmarks/gpu_run.sh tma-probe          # installs .whl-next over .whl first
    python benchmarks/tma_probe.py --out /tmp/tma
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sonic import SHAPES  # noqa: E402

from moe_lowering.kernels.grouped_matmul.triton_kernels import (  # noqa: E402
    _group_layout,
    _tile_position,
    _zero_outside_groups,
)

PRODUCTS = {  # name: (rows per copy, K, N) of one SwiGLU expert's products, in SonicMoE's terms
    "down": lambda s: (s.d, s.n, s.d),  # act [M, n] @ W2 [n, d]: the short contraction
    "up": lambda s: (s.d, s.d, 2 * s.n),  # rows [M, d] @ [Wg | Wu] [d, 2n]
}
VARIANTS = {  # name: (kernel, (block_m, block_n, block_k, num_warps, num_stages, programs_per_sm), TMA store, flatten)
    "gmm-128x256s4": ("gmm", (128, 256, 64, 8, 4, 1), False, False),
    "tma-128x256s4": ("tma", (128, 256, 64, 8, 4, 1), False, False),
    "tma_flat-128x256s3": ("tma", (128, 256, 64, 8, 3, 1), False, True),
    "tma_flat-128x256s4": ("tma", (128, 256, 64, 8, 4, 1), False, True),
    "tma_flat-128x128s4": ("tma", (128, 128, 64, 8, 4, 1), False, True),
    "tma_store-128x256s3": ("tma", (128, 256, 64, 8, 3, 1), True, False),
    "tma_store_flat-128x256s2": ("tma", (128, 256, 64, 8, 2, 1), True, True),
    "gmm-128x128s4": ("gmm", (128, 128, 64, 8, 4, 1), False, False),
    "tma_store-128x128s4": ("tma", (128, 128, 64, 8, 4, 1), True, False),
    "tma_store_flat-128x128s4": ("tma", (128, 128, 64, 8, 4, 1), True, True),
    "tma_store-128x128s2x2": ("tma", (128, 128, 64, 8, 2, 2), True, False),
    "tma_store-128x128s3w4x2": ("tma", (128, 128, 64, 4, 3, 2), True, False),
}


@triton.jit
def _tma_tile_product(lhs_desc, rhs_desc, row0, weight_row0, col0, K: tl.constexpr, BLOCK_M: tl.constexpr,
                      BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    """One output tile's product, both operands' blocks loaded through their descriptors."""
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        a = lhs_desc.load([row0, k0])
        b = rhs_desc.load([weight_row0 + k0, col0])
        acc = tl.dot(a, b, acc)
    return acc


@triton.jit
def _masked_store(out_ptr, acc, row0, col0, row_end, N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """The tile's rows before ``row_end`` and columns before ``N``, through pointers."""
    in_m = tl.arange(0, BLOCK_M)
    cols = col0 + tl.arange(0, BLOCK_N)
    out_ptrs = out_ptr + tl.cast(row0, tl.int64) * N + in_m[:, None] * N + cols[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=((row0 + in_m) < row_end)[:, None] & (cols < N)[None, :])


@triton.jit
def tma_gmm_kernel(lhs_desc, rhs_desc, group_sizes_ptr, group_offset_ptr, out_ptr, M: tl.constexpr, K: tl.constexpr,
                   N: tl.constexpr, NUM_LOCAL_GROUPS: tl.constexpr, NUM_GROUPS: tl.constexpr,
                   GROUPS_PAD: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                   GROUP_M: tl.constexpr, NUM_PROGRAMS: tl.constexpr, TMA_STORE: tl.constexpr,
                   FLATTEN: tl.constexpr):
    """``gmm_kernel``'s product (``rhs`` not transposed) with both operands' blocks loaded through TMA
    descriptors: ``lhs_desc`` over ``[M, K]``, ``rhs_desc`` over the weights as ``[G * K, N]``.

    ``TMA_STORE``: tiles are stored through a descriptor (the copy engine writes while the warps go on
    to the next tile). A TMA store cannot be masked, so a group's last, partial row tile is moved back
    to end at the group's end: it recomputes rows of the tile before it, bit for bit, and writes the
    same values; groups shorter than a tile are stored with masked pointer stores. ``FLATTEN``: the
    tile loop and the K loop software-pipelined as one (``tl.range(..., flatten=True)``)."""
    pid = tl.program_id(0)
    n_tiles = (N + BLOCK_N - 1) // BLOCK_N
    group_ids, sizes, offset, starts, ends, is_local, m_tiles, tile_ends, num_tiles = _group_layout(
        group_sizes_ptr, group_offset_ptr, n_tiles, NUM_LOCAL_GROUPS, NUM_GROUPS, GROUPS_PAD, BLOCK_M
    )
    if TMA_STORE:
        out_desc = tl.make_tensor_descriptor(out_ptr, shape=[M, N], strides=[N, 1], block_shape=[BLOCK_M, BLOCK_N])
    for tile in tl.range(pid, num_tiles, NUM_PROGRAMS, flatten=FLATTEN):
        group, group_start, group_end, pm, pn = _tile_position(
            tile, group_ids, starts, ends, m_tiles, tile_ends, n_tiles, M, GROUP_M
        )
        row0 = group_start + pm * BLOCK_M
        if TMA_STORE:
            row0 = tl.where(group_end - group_start >= BLOCK_M, tl.minimum(row0, group_end - BLOCK_M), row0)
        col0 = pn * BLOCK_N
        acc = _tma_tile_product(lhs_desc, rhs_desc, row0, (group - offset) * K, col0, K, BLOCK_M, BLOCK_N, BLOCK_K)
        if TMA_STORE:
            if group_end - group_start >= BLOCK_M:
                out_desc.store([row0, col0], acc.to(out_ptr.dtype.element_ty))
            else:
                _masked_store(out_ptr, acc, row0, col0, group_end, N, BLOCK_M, BLOCK_N)
        else:
            _masked_store(out_ptr, acc, row0, col0, group_end, N, BLOCK_M, BLOCK_N)
    _zero_outside_groups(out_ptr, pid, sizes, group_ids, offset, is_local, n_tiles, M, N, BLOCK_M, BLOCK_N,
                         NUM_PROGRAMS)


def tma_gmm(lhs, rhs, group_sizes, config, tma_store=False, flatten=False):
    """``gmm(lhs, rhs, group_sizes)`` (all groups local) on ``tma_gmm_kernel``."""
    import jax_triton
    from moe_lowering.kernels.grouped_matmul import triton_launch as tgm

    num_rows, k = lhs.shape
    num_groups, _, n = rhs.shape
    if k % config.block_k:
        raise ValueError(f"tma_gmm: K = {k} is not a multiple of the block's {config.block_k}")
    launch = tgm._row_tiled_launch(lhs.dtype, rhs.dtype, num_rows, k, n, num_groups, num_groups, config)
    launch.pop("COMPUTE_F32")
    launch.pop("FLATTEN")
    lhs_desc = jax_triton.TensorDescriptor.from_array(lhs, (launch["BLOCK_M"], launch["BLOCK_K"]))
    rhs_desc = jax_triton.TensorDescriptor.from_array(rhs.reshape(num_groups * k, n),
                                                      (launch["BLOCK_K"], launch["BLOCK_N"]))
    return jax_triton.triton_call(
        lhs_desc, rhs_desc, group_sizes.astype(jnp.int32), tgm._offset_array(0), kernel=tma_gmm_kernel,
        out_type=jax.ShapeDtypeStruct((num_rows, n), lhs.dtype), TMA_STORE=tma_store, FLATTEN=flatten, **launch)


def _operands(shape, product, key):
    from moe_lowering.sparse_moe import sort_by_expert

    _, k, n = PRODUCTS[product](shape)
    keys = jax.random.split(key, 3)
    idx = jax.lax.top_k(jax.random.normal(keys[0], (shape.T, shape.E)), shape.K)[1]
    sizes = sort_by_expert(idx, shape.E).group_sizes
    lhs = jax.random.normal(keys[1], (shape.T * shape.K, k), jnp.bfloat16)
    rhs = (jax.random.normal(keys[2], (shape.E, k, n)) / k ** 0.5).astype(jnp.bfloat16)
    return lhs, rhs, sizes


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", nargs="+", default=["1.4B-n256", "7B-n256", "1.4B-n512", "30B-n256", "120B-n512"],
                        choices=sorted(SHAPES))
    parser.add_argument("--products", nargs="+", default=list(PRODUCTS), choices=list(PRODUCTS))
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    import jax_triton
    from ep_overlap import profile_summary
    from moe_lowering.kernels.grouped_matmul import reference
    from moe_lowering.kernels.grouped_matmul import triton_launch as tgm

    # jax-triton 0.4.0 no longer gives an aliased output a kernel parameter of its own, which the
    # tail launch's kernel has: gmm runs its whole product in gmm_kernel here, as tma_gmm does.
    tgm.TAIL_APART = False
    args.out.mkdir(parents=True, exist_ok=True)
    results = {"device": jax.devices()[0].device_kind, "date": datetime.date.today().isoformat(),
               "jax": jax.__version__, "jax_triton": getattr(jax_triton, "__version__", "?"),
               "triton": triton.__version__, "rows": []}
    print(f"jax {results['jax']}, jax_triton {results['jax_triton']}, triton {results['triton']}", flush=True)
    for name in args.shapes:
        for product in args.products:
            lhs, rhs, sizes = _operands(SHAPES[name], product, jax.random.key(0))
            flops = 2.0 * lhs.shape[0] * lhs.shape[1] * rhs.shape[2]
            want = jax.jit(lambda a, b: reference.gmm(a, b, sizes, preferred_element_type=jnp.float32))(lhs, rhs)
            row = {"shape": name, "product": product, "flops": flops}
            for variant in ["table", *args.variants]:
                if variant == "table":
                    kind, config, tma_store, flatten = "gmm", None, False, False
                else:
                    kind, tile, tma_store, flatten = VARIANTS[variant]
                    config = tgm.TileConfig(*tile[:3], num_warps=tile[3], num_stages=tile[4], programs_per_sm=tile[5])
                if kind == "gmm":
                    fn = lambda a, b, c=config: tgm.gmm(a, b, sizes, config=c)
                else:
                    fn = lambda a, b, c=config, s=tma_store, f=flatten: tma_gmm(a, b, sizes, c, s, f)
                try:
                    compiled = jax.jit(fn)
                    got = compiled(lhs, rhs).astype(jnp.float32)
                    error = float(jnp.linalg.norm(got - want) / jnp.linalg.norm(want))
                    summary = profile_summary(compiled, (lhs, rhs), args.out / "traces" / f"{name}_{product}")
                    ms = sum(summary.get("top_kernels_ms", {}).values())
                    row[variant] = {"ms": round(ms, 4), "tflops": round(flops / ms / 1e9, 1), "rel_error": error}
                except Exception as err:  # a kernel that does not compile or launch is a result here
                    row[variant] = {"error": f"{type(err).__name__}: {str(err)[:300]}"}
            print(json.dumps(row), flush=True)
            results["rows"].append(row)
            (args.out / "tma_probe.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
