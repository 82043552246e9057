"""The ``"peer"`` exchange across processes: two processes of one GPU each (``jax.distributed`` on
127.0.0.1), the receive buffers in the peer heap (``kernels/peer_store/heap.py``).

The test starts two jobs of this file as a script (``moe_lowering.testing.multiprocess``): one of
two processes with a GPU each, one of one process with both GPUs (the one-process ``"peer"``
layer, and the dense reference). Each runs every case: the sharded layer at EP=2 on transport
``"peer"``, forward and gradients, three calls in a row (the heap's epoch protocol: regions are
reused call after call), and a program of two layers (two exchange sites), and writes the shards
it holds. Here the two jobs must agree to float32 reordering, and the one-process layer must match the dense
reference. The parent never touches a GPU (its own JAX would take the memory the jobs need).
Both jobs run with XLA's defaults (sharded autotuning on: the processes must compile the same
program, which the heap's placement gives).

Measured on 2 x H200 (2026-11-28): every case within float32 reordering of the one-process layer
(the DeepSeek-like case's sums change order from call to call in both jobs, ~4e-8 relative).

Run by hand: ``python -m pytest -p no:xdist -q tests/gpu/test_peer_exchange_multiprocess.py -s``;
``MOE_PEER_MP_CASES=mixtral_like,deepseek_like`` runs only the cases named (both jobs read it);
``MOE_PEER_MP_REPORTS=path.json`` keeps the jobs' reports (errors, changes between calls).
"""

from __future__ import annotations

import glob
import json
import logging
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
JOB_TIMEOUT_S = 600
GPU_COUNT = len(glob.glob("/dev/nvidia[0-9]*"))  # no JAX backend in the parent
pytestmark = pytest.mark.skipif(GPU_COUNT < 2, reason="needs two GPUs of one host")


@dataclass(frozen=True)
class Case:
    name: str
    num_experts: int
    top_k: int
    dtype: str = "float32"
    exchange_capacity: int | None = None  # small: several rounds (the overflow loop's sites, zeroed homes)
    dense_tolerance: float = 1e-5  # relative, the one-process layer against the dense reference
    # Relative (norm) change allowed between calls and between the two jobs: float sums whose order
    # can change from call to call (atomic accumulation on the GPU); a misplaced row is O(1).
    reorder_tolerance: float = 1e-6


CASES = (
    Case("mixtral_like", num_experts=8, top_k=2),
    Case("deepseek_like", num_experts=16, top_k=4),  # EP=2: the deduplicated dispatch (tokens once per rank)
    Case("mixtral_rounds", num_experts=8, top_k=2, exchange_capacity=5),
    Case("mixtral_bf16", num_experts=8, top_k=2, dtype="bfloat16", dense_tolerance=2e-2, reorder_tolerance=4e-3),
)
if os.environ.get("MOE_PEER_MP_CASES"):
    CASES = tuple(c for c in CASES if c.name in os.environ["MOE_PEER_MP_CASES"].split(","))
CALLS = 3


# --------------------------------------------------------------------------- a job's process


def _relative_change(x, y) -> float:
    """How far ``x`` is from ``y``: the norm of the difference over ``y``'s."""
    return float(np.linalg.norm(x - y) / max(np.linalg.norm(y), 1e-30))


def _local(x) -> list:
    """The shards of ``x`` this process holds, as float32 numpy arrays."""
    return [np.asarray(shard.data).astype(np.float32) for shard in x.addressable_shards]


def _worker(out_dir: Path) -> None:
    from moe_lowering.testing import multiprocess

    identity = multiprocess.initialize()
    logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(name)s: %(message)s")
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    from moe_lowering.kernels.peer_store import heap, peer_store
    from moe_lowering.parallel import plan_layout, sharded_sparse_moe
    from moe_lowering.parallel._jax_shim import shard_map
    from moe_lowering.parallel.exchange import prepare_peer_transport, resolve_transport
    from parallel_cases import dense_reference, random_case, random_peer_routes, swiglu_program

    devices = jax.devices()
    mesh = jax.make_mesh((len(devices),), ("expert",), axis_types=(AxisType.Auto,), devices=devices)
    report = {"processes": jax.process_count(), "local_devices": [str(d) for d in jax.local_devices()],
              "auto": resolve_transport("auto", devices, "auto"), "cases": {}}
    print("worker", identity.process_id, json.dumps(report), flush=True)
    entries = {}

    def placed(x, spec=P()):
        x = np.asarray(x)
        return jax.make_array_from_callback(x.shape, NamedSharding(mesh, spec), lambda index: x[index])

    # The bare store first (no layer around it): its Triton path against the all-gather reference,
    # zeroed and not, three calls in a row; a failure here points at the heap, not at the layer.
    ranks = len(devices)
    device_ids = [device.id for device in devices]
    prepare_peer_transport(devices, "auto")
    report["store_max_error"] = 0.0
    for zeroed in (True, False):
        rng = np.random.default_rng(17 + zeroed)
        routes = random_peer_routes(rng, ranks=ranks, slots=300, recv_rows=500, packed=not zeroed)
        num_arrived = 500 if zeroed else min(int((routes[1] == r).sum()) for r in range(ranks))
        values = placed(rng.standard_normal((ranks, 300, 40)).astype(np.float32), P("expert"))
        routes = [placed(r, P("expert")) for r in routes]

        def store(backend, zeroed=zeroed, num_arrived=num_arrived):
            def body(v, s, d, r):
                with heap.placement(device_ids, ("expert",)):  # one program in every process
                    return peer_store(v[0], s[0], d[0], r[0], 500, num_arrived, axis_name="expert",
                                      axis_size=ranks, zeroed=zeroed, backend=backend)[None]

            return jax.jit(shard_map(body, mesh=mesh, in_specs=(P("expert"),) * 4, out_specs=P("expert")))

        want = _local(store("xla")(values, *routes))
        triton = store("auto")
        for _ in range(CALLS):
            got = _local(triton(values, *routes))
            report["store_max_error"] = max(report["store_max_error"],
                                            *(float(np.max(np.abs(a - b))) for a, b in zip(got, want)))
    print("worker", identity.process_id, "store max error", report["store_max_error"], flush=True)

    for case in CASES:
        dtype = jnp.dtype(case.dtype)
        tokens, indices, weights, params = random_case(3, num_tokens=256, d_model=128, d_ff=64,
                                                       num_experts=case.num_experts, top_k=case.top_k, dtype=dtype,
                                                       token_scale=True)
        _, _, _, params2 = random_case(4, num_tokens=256, d_model=128, d_ff=64, num_experts=case.num_experts,
                                       top_k=case.top_k, dtype=dtype, token_scale=True)
        cotangent = np.random.default_rng(5).standard_normal(tokens.shape).astype(dtype)
        tokens, indices, weights, params, params2, cotangent = jax.tree.map(
            placed, (tokens, indices, weights, params, params2, cotangent))
        program = swiglu_program(token_scale=True)
        layout = plan_layout(mesh, P("expert"), [P("expert")] * 3, case.num_experts)

        def moe(t, w, p):
            return sharded_sparse_moe(t, indices, w, p, program, num_experts=case.num_experts, layout=layout,
                                      exchange_transport="peer", exchange_capacity=case.exchange_capacity)

        @jax.jit
        def step(t, w, p, g):
            out, vjp = jax.vjp(moe, t, w, p)
            return out, vjp(g)

        @jax.jit
        def two_layers(t, w, p, p2, g):
            out, vjp = jax.vjp(lambda t, w, p, p2: moe(moe(t, w, p), w, p2), t, w, p, p2)
            return out, vjp(g)

        results = [step(tokens, weights, params, cotangent) for _ in range(CALLS)]
        again = [two_layers(tokens, weights, params, params2, cotangent) for _ in range(CALLS)]
        drift = max(_relative_change(x, y)
                    for runs in (results, again) for later in runs[1:]
                    for a, b in zip(jax.tree.leaves(later), jax.tree.leaves(runs[0]))
                    for x, y in zip(_local(a), _local(b)))
        entries.update(multiprocess.shard_entries(f"{case.name}|step", results[-1]))
        entries.update(multiprocess.shard_entries(f"{case.name}|two", again[-1]))
        if jax.process_count() == 1:
            def dense(t, w, p):
                return dense_reference(t, indices, w, p, num_experts=case.num_experts, token_scale=True)

            with jax.default_matmul_precision("highest"):  # float32 products, not TF32 (the layer's are)
                out, vjp = jax.vjp(dense, tokens, weights, params)
                entries.update(multiprocess.shard_entries(f"{case.name}|dense", (out, vjp(cotangent))))
        live = heap.current_heap()
        report["cases"][case.name] = {
            "max_change_between_calls": drift,
            "heap_used_bytes": None if live is None else live.regions.used,
            "heap_bases": None if live is None else {k: hex(v) for k, v in live.bases.items()}}
        print("worker", identity.process_id, case.name, json.dumps(report["cases"][case.name]), flush=True)
    np.savez(out_dir / f"shards_{jax.process_count()}_{identity.process_id}.npz", **entries)
    (out_dir / f"report_{jax.process_count()}_{identity.process_id}.json").write_text(json.dumps(report))


# --------------------------------------------------------------------------- the test


def _run_job(out_dir: Path, num_processes: int, devices_per_process: int) -> None:
    from moe_lowering.testing import multiprocess

    path = [str(ROOT), str(ROOT / "tests" / "parallel")] + [p for p in [os.environ.get("PYTHONPATH")] if p]
    env = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "MOE_LOWERING_PEER_HEAP_MB": "256",
           "PYTHONPATH": os.pathsep.join(path)}
    multiprocess.launch([sys.executable, __file__, str(out_dir)], num_processes=num_processes, platform="gpu",
                        devices_per_process=devices_per_process, timeout_s=JOB_TIMEOUT_S, env=env, cwd=ROOT)


def _merged(out_dir: Path, num_processes: int) -> dict:
    from moe_lowering.testing import multiprocess

    entries = {}
    for process in range(num_processes):
        with np.load(out_dir / f"shards_{num_processes}_{process}.npz") as f:
            entries.update({k: f[k] for k in f.files})
    return entries


@pytest.fixture(scope="module")
def jobs():
    with tempfile.TemporaryDirectory(prefix="peer_mp_") as tmp:
        out_dir = Path(tmp)
        _run_job(out_dir, 2, 1)
        _run_job(out_dir, 1, 2)
        reports = {(n, p): json.loads((out_dir / f"report_{n}_{p}.json").read_text()) for n, p in
                   ((2, 0), (2, 1), (1, 0))}
        if os.environ.get("MOE_PEER_MP_REPORTS"):  # a file to keep the jobs' reports in
            Path(os.environ["MOE_PEER_MP_REPORTS"]).write_text(
                json.dumps({f"{n}x{p}": r for (n, p), r in reports.items()}, indent=1))
        yield _merged(out_dir, 2), _merged(out_dir, 1), reports


def test_auto_picks_peer_across_processes_and_uses_the_heap(jobs):
    _, _, reports = jobs
    for process in (0, 1):
        report = reports[(2, process)]
        assert report["processes"] == 2 and report["auto"] == "peer", report
        for case in report["cases"].values():
            assert case["heap_used_bytes"] and len(case["heap_bases"]) == 2, case
    assert reports[(1, 0)]["auto"] == "peer"
    assert all(report["store_max_error"] == 0.0 for report in reports.values()), reports
    assert all(case["heap_used_bytes"] is None for case in reports[(1, 0)]["cases"].values())


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
@pytest.mark.parametrize("program", ["step", "two"])
def test_process_per_gpu_matches_one_process(jobs, case, program):
    from moe_lowering.testing import multiprocess

    across, one, reports = jobs
    for report in reports.values():
        assert report["cases"][case.name]["max_change_between_calls"] <= case.reorder_tolerance, report
    got = multiprocess.assemble(across, f"{case.name}|{program}")
    want = multiprocess.assemble(one, f"{case.name}|{program}")
    assert got.keys() == want.keys() and got
    for leaf in want:
        assert np.isfinite(got[leaf]).all(), leaf
        assert _relative_change(got[leaf], want[leaf]) <= case.reorder_tolerance, (leaf, got[leaf], want[leaf])


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_one_process_layer_matches_dense_reference(jobs, case):
    from moe_lowering.testing import multiprocess

    _, one, _ = jobs
    got = multiprocess.assemble(one, f"{case.name}|step")
    want = multiprocess.assemble(one, f"{case.name}|dense")
    assert got.keys() == want.keys()
    for leaf in want:
        assert np.isfinite(want[leaf]).all() and np.isfinite(got[leaf]).all(), leaf
        error = np.linalg.norm(got[leaf] - want[leaf]) / max(np.linalg.norm(want[leaf]), 1e-30)
        assert error < case.dense_tolerance, (leaf, error)


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "parallel")]
    _worker(Path(sys.argv[1]))
