"""A/B of the weight-gradient kernel (``tgmm``): this checkout's kernel against other revisions'.

Each other revision's kernel file is passed as a file (``git show REV:moe_lowering/kernels/
grouped_matmul/triton_kernels.py > old.py``; before the kernels' folders, ``kernels/triton_gmm_kernels.py``);
its ``tgmm_kernel`` is launched with the same operands, grid and tile shape as the library's
``tgm.tgmm``. For each layer's two weight-gradient products
(``gmm_sweep.products``) and each tile shape, prints every kernel's TFLOP/s against the first
file's and the largest difference of its output from the first file's (relative to the output's
scale), and writes JSON.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import jax_triton

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gmm_sweep import CANDIDATES, group_sizes_for, products  # noqa: E402
from moe_layer import CONFIGS, _time_ms  # noqa: E402

from moe_lowering.kernels.grouped_matmul import triton_launch as tgm  # noqa: E402


def load_kernels(path: Path):
    # Files from before the kernels' folders import the peer-address helpers by their old name.
    from moe_lowering.kernels.peer_address import triton_kernels as peer_address

    sys.modules.setdefault("moe_lowering.kernels.triton_peer_address", peer_address)
    spec = importlib.util.spec_from_file_location("baseline_gmm_kernels", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@jax.jit
def _max_abs(x):
    return jnp.abs(x.astype(jnp.float32)).max()


@jax.jit
def _max_abs_diff(x, y):
    """Fused, so the float32 difference of two ``[E, K, N]`` weight gradients is never materialised."""
    return jnp.abs(x.astype(jnp.float32) - y.astype(jnp.float32)).max()


def baseline_tgmm(kernel, lhs, grad, group_sizes, num_groups: int, config: tgm.TileConfig):
    """``tgm.tgmm``'s launch, with ``kernel`` in place of the library's."""
    num_rows, k = lhs.shape
    n = grad.shape[1]
    num_programs = tgm._grid_size(num_groups * -(-k // config.block_m) * -(-n // config.block_n), config)
    return jax_triton.triton_call(
        lhs, grad, group_sizes, tgm._offset_array(0), kernel=kernel,
        out_shape=jax.ShapeDtypeStruct((num_groups, k, n), lhs.dtype), grid=(num_programs,),
        num_warps=config.num_warps, num_stages=config.num_stages, M=num_rows, K=k, N=n,
        NUM_LOCAL_GROUPS=num_groups, NUM_GROUPS=num_groups, GROUPS_PAD=tgm._next_power_of_two(num_groups),
        BLOCK_K=config.block_m, BLOCK_N=config.block_n, BLOCK_R=config.block_k, GROUP_M=config.group_m,
        NUM_PROGRAMS=num_programs, COMPUTE_F32=False,
    )


def skewed_sizes(config, hot_share: float = 1 / 64, hot_factor: int = 8):
    """A collapsing router: ``E * hot_share`` experts (at least one) get ``hot_factor`` times the mean
    rows, the others share the rest evenly."""
    total, experts = config.T * config.k, config.E
    hot = max(1, int(experts * hot_share))
    hot_rows = hot_factor * total // experts
    rest = total - hot * hot_rows
    cold = [rest // (experts - hot) + (i < rest % (experts - hot)) for i in range(experts - hot)]
    return jnp.asarray([hot_rows] * hot + cold, jnp.int32)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--baselines", type=Path, nargs="+", required=True,
                        help="other revisions' grouped-matmul triton_kernels.py; the first is the reference")
    parser.add_argument("--configs", nargs="+", default=["deepseek", "qwen3", "mixtral"])
    parser.add_argument("--candidates", nargs="+", choices=list(CANDIDATES), default=["128x256x64s3"])
    parser.add_argument("--routing", choices=("uniform", "balanced", "skewed"), default="uniform",
                        help="group sizes: uniform top-k routing, every group T * k / E rows, or skewed_sizes")
    parser.add_argument("--reps", type=int, default=10)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)
    baselines = {path.stem: load_kernels(path) for path in args.baselines}
    reference = args.baselines[0].stem
    results = []
    for name in args.configs:
        config = CONFIGS[name]
        sizes = {"uniform": lambda: group_sizes_for(config, jax.random.key(0)),
                 "balanced": lambda: jnp.full((config.E,), config.T * config.k // config.E, jnp.int32),
                 "skewed": lambda: skewed_sizes(config)}[args.routing]()
        for product, kind, lhs_shape, grad_shape, _ in products(config):
            if kind != "tgmm":
                continue
            keys = jax.random.split(jax.random.key(1), 2)
            lhs = jax.random.normal(keys[0], lhs_shape, jnp.float32).astype(jnp.bfloat16)
            grad = jax.random.normal(keys[1], grad_shape, jnp.float32).astype(jnp.bfloat16)
            flops = 2.0 * lhs_shape[0] * lhs_shape[1] * grad_shape[1]
            for label in args.candidates:
                tile = CANDIDATES[label]
                row = {"config": name, "product": product, "candidate": label}
                variants = {stem: jax.jit(lambda a, b, s, c=tile, g=config.E, m=module:
                                          baseline_tgmm(m.tgmm_kernel, a, b, s, g, c))
                            for stem, module in baselines.items()}
                variants["library"] = jax.jit(lambda a, b, s, c=tile, g=config.E: tgm.tgmm(a, b, s, num_groups=g, config=c))
                outputs = {}
                for variant, fn in variants.items():
                    try:
                        compiled = fn.lower(lhs, grad, sizes).compile()
                        outputs[variant] = jax.block_until_ready(compiled(lhs, grad, sizes))
                        ms = _time_ms(compiled, (lhs, grad, sizes), args.reps)
                        row[f"{variant}_ms"] = ms
                        row[f"{variant}_tflops"] = flops / (ms * 1e-3) / 1e12
                    except Exception as err:  # noqa: BLE001 - a variant that fails to compile is a result
                        row[f"{variant}_error"] = str(err)[:300]
                if reference in outputs:
                    scale = max(float(_max_abs(outputs[reference])), 1e-30)
                    for variant, out in outputs.items():
                        row[f"{variant}_max_rel_diff"] = float(_max_abs_diff(out, outputs[reference])) / scale
                del outputs
                results.append(row)
                print(json.dumps(row), flush=True)
    args.out.write_text(json.dumps(results, indent=1))
    names = [*baselines, "library"]
    print(f"{'config':9s} {'product':8s} {'tile':18s} " + " ".join(f"{n + ' TF/s':>22s}" for n in names))
    for row in results:
        base = row.get(f"{reference}_tflops")
        cells = []
        for name in names:
            tflops = row.get(f"{name}_tflops")
            cells.append(f"{tflops:7.0f} x{tflops / base:4.2f} d{row.get(f'{name}_max_rel_diff', float('nan')):6.0e}"
                         if tflops and base else f"{'err':>22s}")
        print(f"{row['config']:9s} {row['product']:8s} {row['candidate']:18s} " + " ".join(cells))


if __name__ == "__main__":
    main()
