"""The sharded layer in a multi-process job: 2 processes x 4 host devices, the mesh across them.

The test starts the job itself (``moe_lowering.testing.multiprocess``: ``jax.distributed`` on
127.0.0.1, gloo collectives on XLA:CPU). Each process runs every case once, through
``moe_optimize`` with ``in_shardings`` on the global mesh, inputs made with
``jax.make_array_from_callback`` / ``make_array_from_process_local_data``, and writes the shards
of the outputs and gradients it holds. Here the shards of both processes are put together and
compared with the same layer in this one process over 8 host devices (the same mesh shape), and
with the dense reference.

Run as a script (``python tests/parallel/test_multiprocess.py OUT_DIR``) it is one such process.
"""

from __future__ import annotations

import contextlib
import json
import logging
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from moe_lowering import explain, moe_optimize
from moe_lowering.testing import multiprocess
from moe_lowering.testing.zoo import ZOO

# Each case traces, compiles and runs a forward and a gradient in both processes, and again here on
# one process: about 2.3 CPU-minutes in all (measured on the 2-core CI machine's kind); the timeout
# only guards against a hang.
JOB_TIMEOUT_S = 600
NUM_PROCESSES, DEVICES_PER_PROCESS = 2, 4


@dataclass(frozen=True)
class Case:
    """One sharded layer: a zoo model on a mesh of the job's 8 devices and ``moe_optimize``'s options.

    ``mesh``: ``"expert8"`` (EP over all devices, across the processes), ``"ep_across"`` (EP=2
    across the processes, FSDP=4 inside each) or ``"fsdp_across"`` (FSDP=2 across, EP=4 inside).
    ``layout_says``: words every expert-parallel lowering of the case must log for its layout
    (the transport that runs), and ``explain`` must give it.
    """

    name: str
    model: str
    mesh: str
    options: dict = field(default_factory=dict)
    explicit_axes: bool = False
    eager: bool = False  # the output from moe_optimize(fn) called on the committed arrays (layout read off them)
    layout_says: str = ""
    dense_tolerance: tuple[float, float] = (1e-5, 1e-5)  # relative, against the dense reference: output, grads


CASES = (
    Case("dropless_all_to_all", "mixtral", "expert8", layout_says="(8 ranks x 1 experts): all-to-all of token rows"),
    Case("ep_across_ppermute_capacity", "mixtral", "ep_across", {"exchange_transport": "ppermute",
                                                                 "capacity_factor": 0.8},
         layout_says="(2 ranks x 4 experts): collective permutes"),
    Case("fsdp_across_fp8", "mixtral", "fsdp_across", {"weight_gather_quant": "fp8_e4m3"},
         # e4m3 keeps 3 mantissa bits (2.7% per weight), three GEMMs in a row (as test_sharded_moe's bounds)
         layout_says="FSDP over 'fsdp' (2 shards", dense_tolerance=(5e-2, 1e-1)),
    Case("switch_peer_reference", "switch", "ep_across", {"exchange_transport": "peer"},
         layout_says="the peer transport's all-gather reference"),
    Case("explicit_axes_eager", "mixtral", "expert8", explicit_axes=True, eager=True,
         layout_says="(8 ranks x 1 experts): all-to-all of token rows"),
)


def _model(case: Case):
    return ZOO[case.model].sized(E=8, T=64)


def _mesh(case: Case, devices):
    grid = np.array(devices).reshape(NUM_PROCESSES, DEVICES_PER_PROCESS)  # row: a process's devices
    axis_type = AxisType.Explicit if case.explicit_axes else AxisType.Auto
    if case.mesh == "expert8":
        return Mesh(grid.reshape(-1), ("expert",), axis_types=(axis_type,))
    if case.mesh == "ep_across":
        return Mesh(grid.T, ("fsdp", "expert"), axis_types=(axis_type,) * 2)
    if case.mesh == "fsdp_across":
        return Mesh(grid, ("fsdp", "expert"), axis_types=(axis_type,) * 2)
    raise ValueError(case.mesh)


def _shardings(case: Case, mesh, params):
    weight = P("expert", "fsdp", None) if "fsdp" in mesh.axis_names else P("expert")
    # with explicit axes the dense program's own einsums must type-check: tokens replicated there
    tokens = NamedSharding(mesh, P() if case.explicit_axes else P(tuple(mesh.axis_names), None))
    return ({k: NamedSharding(mesh, weight if v.ndim == 3 else P()) for k, v in params.items()}, tokens)


def _host_args(case: Case):
    params, x = _model(case).args(jax.random.key(7))
    return jax.tree.map(np.asarray, (params, x))


def _layer(case: Case, shardings):
    """The optimised layer's ``(params, x) -> (output, (param grads, token grads))``: one jit for both,
    or for an eager case the output from the call on the committed arrays and the gradients by jit."""
    fn = _model(case).fn
    optimized = moe_optimize(fn if case.eager else jax.jit(fn, in_shardings=shardings), strict=True, **case.options)

    def loss(params, x):
        out = optimized(params, x)
        return jnp.sum(out ** 2), out

    step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True), in_shardings=shardings)

    def run(params, x):
        (_, out), grads = step(params, x)
        return (optimized(params, x) if case.eager else out), grads

    return run


def _run(case: Case, devices, place):
    """``(output, (param grads, token grads), layouts)`` of ``case`` on ``devices``: the layouts
    the rewrite logged, then the one ``explain`` gives."""
    host_params, host_x = _host_args(case)
    mesh = _mesh(case, devices)
    shardings = _shardings(case, mesh, host_params)
    params, x = place((host_params, host_x), shardings)
    with _set_mesh(mesh) if case.explicit_axes else contextlib.nullcontext(), _LayoutLog() as layouts:
        out, grads = _layer(case, shardings)(params, x)
        layouts.append(_explained_layout(case, shardings, params, x))
    return out, grads, layouts


def _explained_layout(case: Case, shardings, params, x) -> str:
    """What ``explain`` says of the case's layout (it traces, nothing runs)."""
    fn = _model(case).fn
    optimized = moe_optimize(fn if case.eager else jax.jit(fn, in_shardings=shardings), **case.options)
    return str(explain(optimized, params, x).regions[0].parallel_layout)


def _set_mesh(mesh):
    return (jax.set_mesh if hasattr(jax, "set_mesh") else jax.sharding.use_mesh)(mesh)


class _LayoutLog(logging.Handler):
    """The layouts the rewrite logs while the block runs (``expert-parallel lowering, ...``)."""

    def __enter__(self):
        self.layouts = []
        self._logger = logging.getLogger("moe_lowering")
        self._level = self._logger.level
        self._logger.setLevel(logging.INFO)
        self._logger.addHandler(self)
        return self.layouts

    def __exit__(self, *exc):
        self._logger.removeHandler(self)
        self._logger.setLevel(self._level)
        return False

    def emit(self, record):
        message = record.getMessage()
        if "expert-parallel lowering" in message:
            self.layouts.append(message)


def _place_global(tree, shardings):
    """Global arrays from host data, as a job's processes make them: the tokens from this
    process's rows (``make_array_from_process_local_data``), the params from a callback."""
    params, x = tree
    param_shardings, token_sharding = shardings
    placed = {k: jax.make_array_from_callback(v.shape, param_shardings[k], lambda index, v=v: v[index])
              for k, v in params.items()}
    rows = sorted({index[0].indices(x.shape[0])[:2]
                   for index in token_sharding.addressable_devices_indices_map(x.shape).values()})
    local = np.concatenate([x[start:stop] for start, stop in rows])
    return placed, jax.make_array_from_process_local_data(token_sharding, local, x.shape)


def _flat(out, grads):
    leaves, _ = jax.tree_util.tree_flatten_with_path((out, grads))
    return {jax.tree_util.keystr(path): leaf for path, leaf in leaves}


def worker_main(out_dir: str) -> None:
    """One process of the job: every case, the shards this process holds written to ``out_dir``."""
    identity = multiprocess.initialize()
    entries, layouts = {}, {}
    for case in CASES:
        started = time.perf_counter()
        out, grads, layouts[case.name] = _run(case, jax.devices(), _place_global)
        entries.update(multiprocess.shard_entries(case.name, (out, grads)))
        print(f"{case.name}: {time.perf_counter() - started:.1f} s", flush=True)
    np.savez(Path(out_dir) / f"process{identity.process_id}.npz", **entries)
    (Path(out_dir) / f"process{identity.process_id}.json").write_text(json.dumps(layouts))


# ------------------------------------------------------------------------------------------------
# The test: one job runs every case (one ``jax.distributed`` start-up, one set of workers), then each
# case is compared here; one test, so that pytest-xdist never starts the job twice.


def _job(out_dir: Path):
    """``(every process's shard entries, {process: {case: layout words}})`` from one job over ``CASES``."""
    multiprocess.launch([sys.executable, __file__, str(out_dir)], num_processes=NUM_PROCESSES,
                        devices_per_process=DEVICES_PER_PROCESS, timeout_s=JOB_TIMEOUT_S,
                        cwd=Path(__file__).parents[2])
    entries, layouts = {}, {}
    for process in range(NUM_PROCESSES):
        with np.load(out_dir / f"process{process}.npz") as saved:
            entries.update({k: saved[k] for k in saved.files})
        layouts[process] = json.loads((out_dir / f"process{process}.json").read_text())
    return entries, layouts


def _rel(expected, actual) -> float:
    expected, actual = np.asarray(expected, np.float64), np.asarray(actual, np.float64)
    return float(np.linalg.norm(expected - actual) / np.linalg.norm(expected))


def _mismatches(case: Case, entries: dict, layouts: dict) -> list[str]:
    """What of ``case``'s job results differs from the one-process layer, the dense reference or the layout."""

    found = [f"process {process} lowered {case.name} as {layouts[process][case.name]!r}, not {case.layout_says!r}"
             for process in range(NUM_PROCESSES) if not layouts[process][case.name]
             or any(case.layout_says not in layout for layout in layouts[process][case.name])]
    out, grads, _ = _run(case, jax.devices("cpu")[: NUM_PROCESSES * DEVICES_PER_PROCESS], jax.device_put)
    one_process = _flat(out, grads)
    params, x = _host_args(case)
    fn = _model(case).fn
    if "capacity_factor" in case.options:  # copies are dropped: one device's capacity layer is the reference
        fn = moe_optimize(fn, capacity_factor=case.options["capacity_factor"])
    dense = _flat(fn(params, x), jax.grad(lambda p, x: jnp.sum(fn(p, x) ** 2), argnums=(0, 1))(params, x))
    assembled = multiprocess.assemble(entries, case.name, {name: value.shape for name, value in one_process.items()})
    for name, expected in one_process.items():
        got = assembled.get(name)
        if got is None or np.isnan(got).any():
            found.append(f"{case.name}: the processes' shards of {name} leave elements out")
            continue
        tolerance = case.dense_tolerance[0 if name.startswith("[0]") else 1]
        errors = (_rel(expected, got), _rel(dense[name], got))
        if errors[0] > 1e-6 or errors[1] > tolerance:
            found.append(f"{case.name}: {name} off by {errors[0]:.2e} from the one-process layer (at most 1e-6), "
                         f"{errors[1]:.2e} from the dense reference (at most {tolerance:g})")
    return found


@pytest.mark.multiprocess
def test_multiprocess_layer_matches_one_process_and_dense(tmp_path):
    entries, layouts = _job(tmp_path)
    mismatches = [m for case in CASES for m in _mismatches(case, entries, layouts)]
    assert not mismatches, "\n".join(mismatches)


if __name__ == "__main__":
    worker_main(sys.argv[1])
