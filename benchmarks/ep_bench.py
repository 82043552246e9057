"""Expert-parallel MoE layer on 1, 2 and 4 GPUs: sharded sparse MoE vs the dense reference.

Measures, in one process (so one call on the GPU machine), in priority order under a deadline:

1. ``transport``: a bare exchange of one padded DeepSeek-size dispatch buffer at EP=4 and EP=2,
   as one ``all_to_all`` and as ``ep - 1`` ``ppermute`` shifts, each compiled with NCCL (default)
   and with ``xla_gpu_use_memcpy_local_p2p`` (copy engines; a per-compile XLA option here, an
   ``XLA_FLAGS`` entry for a user); bytes leaving each device and GB/s;
2. ``exchange``: the token exchange alone (identity expert program: permute, dispatch, return,
   combine) at EP=4 and EP=2 for every (transport, options) pair, the ``ragged`` transport, and
   the previous exchange (``--baseline-exchange``, same run) for comparison;
3. ``layer`` forward: Mixtral-like and DeepSeek-like layers, dense reference and sparse MoE on one
   GPU, then under EP=2 and EP=4 meshes (dense reference partitioned by XLA with the same shardings,
   compiled with the same options, vs ``sharded_sparse_moe`` on the fastest exchange of step 2 and
   on the library default); each sharded output is compared with the single-GPU sparse output;
   plus the grouped GEMMs alone on one device's share of the rows (what EP cannot go below);
4. ``layer`` forward+backward, Mixtral and DeepSeek, 1 GPU and EP=4;
5. ``--gathers``: the FSDP all-gather of the Mixtral expert weights in bf16 / FP8 (unchanged
   code; results of 2026-11-21 in ``EP_NOTES.md``);
6. ``--nccl-env``: step 1 again in subprocesses under NCCL environment variants.

Routing is fixed (random top-k, softmax weights) so every implementation computes the same
function. Rows are written to ``ep_bench_<device>_<date>.json`` after each measurement, so a run cut
off by ``--deadline`` still leaves what it measured. ``--smoke`` runs tiny shapes on 8 host CPU
devices (the ragged transport is skipped there: XLA:CPU does not implement it).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import importlib.util
import json
import logging
import math
import os
import statistics
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests" / "parallel")]

if "--smoke" in sys.argv:  # before JAX starts a backend
    os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import numpy as np  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

from moe_lowering.expert_program import ExpertProgram, RowInput  # noqa: E402
from moe_lowering.parallel import Layout, plan_layout, sharded_sparse_moe  # noqa: E402
from moe_lowering.parallel import sharded_moe as sharded_moe_module  # noqa: E402
from moe_lowering.parallel.exchange import ExchangeConfig, _local_program  # noqa: E402
from moe_lowering.parallel._jax_shim import shard_map  # noqa: E402
from moe_lowering.parallel.quantize import gather_weight  # noqa: E402
from moe_lowering.sparse_moe import sparse_moe  # noqa: E402
from parallel_cases import swiglu_program  # noqa: E402

log = logging.getLogger("ep_bench")


@dataclass(frozen=True)
class LayerConfig:
    name: str
    T: int
    d: int
    f: int
    E: int
    k: int

    def useful_flops(self) -> float:
        """Forward FLOPs of the three expert GEMMs on the ``T * k`` routed rows."""
        return 6.0 * self.T * self.k * self.d * self.f


CONFIGS = {
    "mixtral": LayerConfig("mixtral", T=8192, d=4096, f=14336, E=8, k=2),
    "deepseek": LayerConfig("deepseek", T=4096, d=7168, f=2048, E=256, k=8),
    "smoke": LayerConfig("smoke", T=256, d=128, f=128, E=8, k=2),
}


class Bench:
    """Runs measurements in order until the deadline; each row is saved as soon as it exists."""

    def __init__(self, out_path: Path, deadline_s: float, reps: int):
        self.out_path, self.reps = out_path, reps
        self.stop_at = time.monotonic() + deadline_s
        device = jax.devices()[0]
        self.doc = {"device": f"{jax.device_count()} x {device.device_kind}", "platform": device.platform,
                    "jax": jax.__version__, "date": datetime.datetime.now(datetime.timezone.utc).isoformat(),
                    "rows": [], "skipped": []}
        self.backend = "auto"

    def time_left(self) -> float:
        return self.stop_at - time.monotonic()

    def record(self, row: dict):
        self.doc["rows"].append(row)
        self.out_path.write_text(json.dumps(self.doc, indent=1))
        log.info("%s", {k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()})

    def run(self, name: str, measure, *, min_left: float = 10.0):
        if self.time_left() < min_left:
            self.doc["skipped"].append(name)
            self.out_path.write_text(json.dumps(self.doc, indent=1))
            log.info("skip %s: deadline", name)
            return None
        started = time.monotonic()
        try:
            row = measure()
        except Exception as err:  # a failed variant must not cost the rest of the run
            log.error("%s failed: %s", name, err)
            row = {"name": name, "error": f"{type(err).__name__}: {str(err)[:800]}",
                   "trace": traceback.format_exc()[-1500:]}
        row = {"name": name, **row, "wall_s": time.monotonic() - started}
        self.record(row)
        return row

    def time_ms(self, fn, *args, options: str = "nccl") -> float:
        """Median ms of the jitted ``fn`` compiled with ``COMPILE_OPTIONS[options]``."""
        fn = compiled(fn, args, options)
        jax.block_until_ready(fn(*args))  # warm up
        times = []
        for _ in range(self.reps):
            start = time.perf_counter()
            jax.block_until_ready(fn(*args))
            times.append((time.perf_counter() - start) * 1e3)
        return statistics.median(times)

    def time_back_to_back_ms(self, fn, *args, calls: int = 20) -> float:
        """Median over ``reps`` of the mean ms per call of ``calls`` calls issued back to back.

        No host synchronisation between the calls, so the host's dispatch of one call overlaps the
        device's work on the previous one: the device time per step, as inside a training loop.
        """
        jax.block_until_ready(fn(*args))
        times = []
        for _ in range(self.reps):
            start = time.perf_counter()
            for _ in range(calls):
                out = fn(*args)  # an earlier output is freed only once its computation is done
            jax.block_until_ready(out)
            times.append((time.perf_counter() - start) * 1e3 / calls)
        return statistics.median(times)


# XLA options per compile (a user sets the same through XLA_FLAGS or ``jax.jit(compiler_options=)``).
COMPILE_OPTIONS = {
    "nccl": {},
    "memcpy": {"xla_gpu_use_memcpy_local_p2p": True},  # same-process peers: copy engines, not NCCL kernels
}


def compiled(fn, args, options: str):
    """``fn`` (jitted) compiled for ``args`` with the named XLA options; as is for the defaults."""
    if not COMPILE_OPTIONS[options]:
        return fn
    return fn.lower(*args).compile(compiler_options=COMPILE_OPTIONS[options])


@contextlib.contextmanager
def exchange_from(path: Path | None):
    """``sharded_sparse_moe`` with the exchange module at ``path`` (the previous version), while tracing."""
    if path is None:
        yield
        return
    spec = importlib.util.spec_from_file_location("ep_bench_baseline_exchange", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    fields = {f.name for f in dataclasses.fields(module.ExchangeConfig)}

    def baseline_config(**kwargs):  # an older exchange knows fewer options (e.g. no ``chunks``)
        return module.exchange_config(**{k: v for k, v in kwargs.items() if k in fields})

    names = ("exchange_expert_rows", "exchange_config", "num_rounds")
    saved = tuple(getattr(sharded_moe_module, name) for name in names)
    def baseline_exchange(cfg, rows, payloads, params, group_sizes):
        """Older exchanges take the all-gathered counts matrix, not this rank's group sizes."""
        counts = jax.lax.all_gather(group_sizes, cfg.axis_name)
        return module.exchange_expert_rows(cfg, rows, payloads, params, counts)

    swapped = (baseline_exchange, baseline_config,
               getattr(module, "num_rounds", None) or getattr(module, "_num_rounds"))
    for name, value in zip(names, swapped):
        setattr(sharded_moe_module, name, value)
    try:
        yield
    finally:
        for name, value in zip(names, saved):
            setattr(sharded_moe_module, name, value)


# The physical device of each mesh position (``None``: ``jax.devices()`` in order); a benchmark
# sets it to tell a slow device from a slow rank.
DEVICE_ORDER: list[int] | None = None


def make_mesh(shape, names):
    """Auto axes: the dense reference is partitioned by XLA's propagation, as a user's jit would be."""
    axis_types = (AxisType.Auto,) * len(shape)
    if DEVICE_ORDER:  # jax.make_mesh sorts GPUs by id, so the order is kept by building the Mesh itself
        devices = np.array([jax.devices()[i] for i in DEVICE_ORDER][: math.prod(shape)]).reshape(shape)
        return Mesh(devices, names, axis_types=axis_types)
    devices = jax.devices()[: math.prod(shape)]
    return jax.make_mesh(shape, names, axis_types=axis_types, devices=devices)


def make_layer_data(cfg: LayerConfig, dtype=jnp.bfloat16):
    keys = jax.random.split(jax.random.key(0), 6)
    tokens = jax.random.normal(keys[0], (cfg.T, cfg.d), dtype)
    logits = jax.random.normal(keys[1], (cfg.T, cfg.E), jnp.float32)
    top, indices = jax.lax.top_k(logits, cfg.k)
    weights = jax.nn.softmax(top, axis=-1).astype(dtype)
    w1 = (jax.random.normal(keys[2], (cfg.E, cfg.d, cfg.f), dtype) / math.sqrt(cfg.d)).astype(dtype)
    w3 = (jax.random.normal(keys[3], (cfg.E, cfg.d, cfg.f), dtype) / math.sqrt(cfg.d)).astype(dtype)
    w2 = (jax.random.normal(keys[4], (cfg.E, cfg.f, cfg.d), dtype) / math.sqrt(cfg.f)).astype(dtype)
    cotangent = jax.random.normal(keys[5], (cfg.T, cfg.d), dtype)
    return tokens, indices.astype(jnp.int32), weights, (w1, w3, w2), cotangent


def dense_layer(tokens, indices, weights, params, num_experts):
    """The dense reference: every expert on every token, one-hot gated combine."""
    w1, w3, w2 = params
    gate = jnp.einsum("td,edf->tef", tokens, w1)
    up = jnp.einsum("td,edf->tef", tokens, w3)
    y = jnp.einsum("tef,efd->ted", jax.nn.silu(gate) * up, w2)
    combine = jnp.einsum("tk,tke->te", weights, jax.nn.one_hot(indices, num_experts, dtype=weights.dtype))
    return jnp.einsum("te,ted->td", combine, y)


def rel_err(a, b) -> float:
    a = jax.device_put(a, jax.devices()[0]).astype(jnp.float32)
    b = jax.device_put(b, jax.devices()[0]).astype(jnp.float32)
    return float(jnp.linalg.norm(a - b) / jnp.linalg.norm(b))


def with_grad(fn):
    """Forward + backward: gradients of ``sum(out * cotangent)`` for tokens and expert weights
    (further arguments go to ``fn`` after them, undifferentiated)."""
    def loss(tokens, params, cotangent, *rest):
        return jnp.sum(fn(tokens, params, *rest).astype(jnp.float32) * cotangent.astype(jnp.float32))
    return jax.grad(loss, argnums=(0, 1))


# ---------------------------------------------------------------------------------------------
# 1. FSDP weight gathers


def bench_gather(bench: Bench, cfg: LayerConfig, fsdp: int, quant: str | None, bytes_only: bool = False):
    mesh = make_mesh((fsdp,), ("fsdp",))
    specs = (P(None, "fsdp", None), P(None, "fsdp", None), P(None, None, "fsdp"))
    dims = (1, 1, 2)
    _, _, _, params, _ = make_layer_data(cfg)
    if bytes_only:  # the FP8 bytes alone, as if quantised earlier
        params = tuple(jax.lax.bitcast_convert_type(p.astype(jnp.float8_e4m3fn), jnp.uint8) for p in params)
    params = tuple(jax.device_put(p, NamedSharding(mesh, s)) for p, s in zip(params, specs))

    def body(*shards):
        if bytes_only:
            return tuple(jax.lax.all_gather(s, "fsdp", axis=d, tiled=True) for s, d in zip(shards, dims))
        return tuple(gather_weight(s, "fsdp", d, quant) for s, d in zip(shards, dims))

    fn = jax.jit(shard_map(body, mesh=mesh, in_specs=specs, out_specs=(P(), P(), P())))
    ms = bench.time_ms(fn, *params)
    elements = sum(math.prod(p.shape) for p in params)
    if bytes_only:
        wire = elements
    elif quant is None:
        wire = elements * 2
    elif quant == "fp8_e4m3":
        wire = elements + 4 * sum(cfg.E * max(1, s // 128) * max(1, t // 128) for s, t in
                                  ((cfg.d, cfg.f), (cfg.d, cfg.f), (cfg.f, cfg.d)))
    else:
        wire = elements + elements // 32
    received = wire * (fsdp - 1) / fsdp
    return {"kind": "gather", "config": cfg.name, "fsdp": fsdp,
            "quant": "fp8 bytes only" if bytes_only else (quant or "bf16"), "ms": ms,
            "bytes_received_per_device": received, "GBps": received / (ms * 1e-3) / 1e9}


# ---------------------------------------------------------------------------------------------
# 2. token exchange alone


_ROW = RowInput()
IDENTITY = ExpertProgram(output=_ROW, param_kinds=(), nodes=(_ROW,))


def exchange_layout(mesh, num_experts) -> Layout:
    return Layout(mesh=mesh, num_experts=num_experts, expert_axis="expert", fsdp_axis=None,
                  token_axes=("expert",), expert_param_specs=())


def bench_exchange(bench: Bench, cfg: LayerConfig, ep: int, transport: str, options: str,
                   baseline: Path | None = None):
    mesh = make_mesh((ep,), ("expert",))
    layout = exchange_layout(mesh, cfg.E)
    tokens, indices, weights, _, _ = make_layer_data(cfg)
    sharding = NamedSharding(mesh, P("expert"))
    args = tuple(jax.device_put(a, sharding) for a in (tokens, indices, weights))
    fn = jax.jit(lambda t, i, w: sharded_sparse_moe(t, i, w, (), IDENTITY, num_experts=cfg.E, layout=layout,
                                                    exchange_transport=transport, return_stats=True))
    with exchange_from(baseline):
        fn = compiled(fn, args, options)
        ms = bench.time_ms(fn, *args)
    out, stats = fn(*args)
    local_rows = cfg.T // ep * cfg.k
    capacity = math.ceil(local_rows / ep * 1.25)
    rounds = int(stats.exchange_rounds)
    row_bytes = cfg.d * 2
    padded = 2 * rounds * (ep - 1) * capacity * row_bytes  # dispatch + return, leaving each device
    useful = 2 * local_rows * (ep - 1) / ep * row_bytes  # expected rows to other ranks, both ways
    expected = jnp.einsum("tk,td->td", weights.astype(jnp.float32), tokens.astype(jnp.float32))
    moved = padded if transport != "ragged" else useful
    return {"kind": "exchange", "config": cfg.name, "ep": ep, "transport": transport, "options": options,
            "exchange_code": "previous" if baseline else "current",
            "ms": ms, "rounds": rounds, "bytes_sent_per_device": moved, "useful_bytes_per_device": useful,
            "GBps_wire": moved / (ms * 1e-3) / 1e9, "GBps_useful": useful / (ms * 1e-3) / 1e9,
            "rel_err_identity": rel_err(out, expected)}


def bench_bare_transport(bench: Bench, cfg: LayerConfig, ep: int, transport: str, options: str):
    """One padded dispatch buffer ``[ep, C, d]`` per device through the transport alone: the ceiling."""
    mesh = make_mesh((ep,), ("expert",))
    capacity = math.ceil(cfg.T // ep * cfg.k / ep * 1.25)
    buf = jax.device_put(jax.random.normal(jax.random.key(1), (ep * ep, capacity, cfg.d), jnp.bfloat16),
                         NamedSharding(mesh, P("expert")))

    def shifts(x):
        moved = [x[0]] + [jax.lax.ppermute(x[b], "expert", [(i, (i + b) % ep) for i in range(ep)])
                          for b in range(1, ep)]
        return jnp.stack(moved)

    body = shifts if transport == "ppermute" else (lambda x: jax.lax.all_to_all(x, "expert", 0, 0))
    fn = jax.jit(shard_map(body, mesh=mesh, in_specs=P("expert"), out_specs=P("expert")))
    ms = bench.time_ms(fn, buf, options=options)
    sent = (ep - 1) * capacity * cfg.d * 2
    return {"kind": "bare_transport", "config": cfg.name, "ep": ep, "transport": transport, "options": options,
            "nccl_env": os.environ.get("EP_BENCH_NCCL_ENV", ""), "ms": ms, "bytes_sent_per_device": sent,
            "GBps": sent / (ms * 1e-3) / 1e9}


def bench_gemm_only(bench: Bench, cfg: LayerConfig, ep: int):
    """The grouped GEMMs of one device's balanced share at EP=ep, on one GPU: the floor for the EP layer."""
    local = cfg.E // ep
    rows_per_expert = cfg.T * cfg.k // cfg.E
    capacity = math.ceil(cfg.T // ep * cfg.k / ep * 1.25)
    tokens, _, _, params, _ = make_layer_data(cfg)
    rows = jnp.resize(tokens, (ep * capacity, cfg.d))
    params = tuple(p[:local] for p in params)
    sizes = jnp.full((local,), rows_per_expert, jnp.int32)
    expert_of_row = jnp.minimum(jnp.arange(ep * capacity, dtype=jnp.int32) // rows_per_expert, local - 1)
    program_cfg = ExchangeConfig(program=swiglu_program(), axis_name="expert", ep_size=ep, local_experts=local,
                                 capacity=capacity, backend=bench.backend)
    fn = jax.jit(lambda r, p: _local_program(program_cfg, sizes, expert_of_row, r, (), p))
    ms = bench.time_ms(fn, rows, params)
    flops = cfg.useful_flops() / ep
    return {"kind": "gemm_only", "config": cfg.name, "ep": ep, "fwd_ms": ms,
            "useful_TFLOPs": flops / (ms * 1e-3) / 1e12}


# ---------------------------------------------------------------------------------------------
# 3-5. the layer


class LayerBench:
    """One config's data and the single-GPU sparse output every sharded variant is checked against."""

    def __init__(self, bench: Bench, cfg: LayerConfig):
        self.bench, self.cfg = bench, cfg
        self.tokens, self.indices, self.weights, self.params, self.cotangent = make_layer_data(cfg)
        self.program = swiglu_program()
        self.reference = None
        self.grad_reference = None  # gradients of the first sharded fwd+bwd measured, to compare the others with
        self.dense_ms: dict[str, float] = {}

    def sparse_single(self, backend):
        cfg, program = self.cfg, self.program
        return lambda t, i, w, p: sparse_moe(t, i, w, p, program, num_experts=cfg.E, backend=backend)

    def timed(self, build, args, extra: dict, options: str = "nccl", baseline: Path | None = None):
        """``(ms, fn)`` for ``build(backend)``; if the Triton backend fails here, again on the XLA tile loop."""
        backend = self.bench.backend
        with exchange_from(baseline):
            try:
                fn = compiled(build(backend), args, options)
                ms = self.bench.time_ms(fn, *args)
            except Exception as err:
                if backend == "xla":
                    raise
                log.error("backend %s failed (%s); retrying on xla", backend, str(err)[:300])
                extra["backend_error"] = f"{type(err).__name__}: {str(err)[:300]}"
                backend = "xla"
                fn = compiled(build(backend), args, options)
                ms = self.bench.time_ms(fn, *args)
        extra["backend"] = backend
        return ms, fn

    def row(self, impl: str, mesh_name: str, ms: float, out=None, **extra):
        row = {"kind": "layer", "config": self.cfg.name, "impl": impl, "mesh": mesh_name, "fwd_ms": ms,
               "useful_TFLOPs": self.cfg.useful_flops() / (ms * 1e-3) / 1e12, **extra}
        if out is not None and self.reference is not None:
            row["rel_err_vs_1gpu_sparse"] = rel_err(out, self.reference)
        if impl == "dense":
            self.dense_ms[mesh_name] = ms
        elif mesh_name in self.dense_ms:
            row["speedup_vs_dense_same_mesh"] = self.dense_ms[mesh_name] / ms
        return row

    def single(self, impl: str):
        args = (self.tokens, self.indices, self.weights, self.params)
        if impl == "dense":
            fn = jax.jit(lambda t, i, w, p: dense_layer(t, i, w, p, self.cfg.E))
            ms = self.bench.time_ms(fn, *args)
            return self.row(impl, "1gpu", ms, fn(*args))  # the dense reference against the sparse output
        extra = {}
        ms, fn = self.timed(lambda backend: jax.jit(self.sparse_single(backend)), args, extra)
        self.reference = fn(*args)
        return self.row(impl, "1gpu", ms, **extra)

    def sharded_args(self, mesh, tokens_spec, weight_specs):
        tokens_sharding = NamedSharding(mesh, tokens_spec)
        args = [jax.device_put(a, tokens_sharding) for a in (self.tokens, self.indices, self.weights)]
        params = tuple(jax.device_put(p, NamedSharding(mesh, s)) for p, s in zip(self.params, weight_specs))
        return (*args, params)

    def sharded(self, impl: str, mesh_shape, mesh_names, tokens_spec, weight_specs, *, transport="all_to_all",
                options="nccl", quant=None, baseline: Path | None = None):
        cfg = self.cfg
        mesh = make_mesh(mesh_shape, mesh_names)
        mesh_name = "x".join(f"{n}{s}" for n, s in zip(mesh_names, mesh_shape))
        args = self.sharded_args(mesh, tokens_spec, weight_specs)
        if impl == "dense":
            fn = compiled(jax.jit(lambda t, i, w, p: dense_layer(t, i, w, p, cfg.E),
                                  out_shardings=NamedSharding(mesh, tokens_spec)), args, options)
            ms = self.bench.time_ms(fn, *args)
            return self.row(impl, mesh_name, ms, fn(*args), options=options)
        layout = plan_layout(mesh, tokens_spec, weight_specs, cfg.E)
        program = self.program
        extra = {}
        ms, fn = self.timed(lambda backend: jax.jit(lambda t, i, w, p: sharded_sparse_moe(
            t, i, w, p, program, num_experts=cfg.E, layout=layout, backend=backend, exchange_transport=transport,
            weight_gather_quant=quant, return_stats=True)), args, extra, options, baseline)
        out, stats = fn(*args)
        name = impl + (f"_{quant}" if quant else "") + ("_previous_exchange" if baseline else "")
        return self.row(name, mesh_name, ms, out, transport=transport, options=options,
                        rounds=int(stats.exchange_rounds), layout=layout.describe(), **extra)

    def fwd_bwd(self, impl: str, ep: int | None, transport="all_to_all", options="nccl",
                baseline: Path | None = None):
        cfg = self.cfg
        extra = {}
        if ep is None:
            mesh_name = "1gpu"
            args = (self.tokens, self.params, self.cotangent)
            if impl == "dense":
                def build(backend):
                    return jax.jit(with_grad(lambda t, p: dense_layer(t, self.indices, self.weights, p, cfg.E)))
            else:
                def build(backend):
                    single = self.sparse_single(backend)
                    return jax.jit(with_grad(lambda t, p: single(t, self.indices, self.weights, p)))
        else:
            mesh = make_mesh((ep,), ("expert",))
            mesh_name = f"expert{ep}"
            specs = [P("expert")] * 3
            tokens, indices, weights, params = self.sharded_args(mesh, P("expert"), specs)
            cotangent = jax.device_put(self.cotangent, NamedSharding(mesh, P("expert")))
            layout = plan_layout(mesh, P("expert"), specs, cfg.E)
            program = self.program
            args = (tokens, params, cotangent)

            def build(backend):
                if impl == "dense":
                    return jax.jit(with_grad(lambda t, p: dense_layer(t, indices, weights, p, cfg.E)))
                return jax.jit(with_grad(lambda t, p: sharded_sparse_moe(
                    t, indices, weights, p, program, num_experts=cfg.E, layout=layout, backend=backend,
                    exchange_transport=transport)))
        ms, fn = self.timed(build, args, extra, options, baseline)
        key = f"fwdbwd_{mesh_name}"
        row = {"kind": "layer_fwdbwd", "config": cfg.name, "impl": impl + ("_previous_exchange" if baseline else ""),
               "mesh": mesh_name, "transport": transport, "options": options, "fwdbwd_ms": ms,
               "useful_TFLOPs": 3 * cfg.useful_flops() / (ms * 1e-3) / 1e12, **extra}
        if impl == "dense":
            self.dense_ms[key] = ms
        elif key in self.dense_ms:
            row["speedup_vs_dense_same_mesh"] = self.dense_ms[key] / ms
        if ep is not None and impl != "dense":
            grads = fn(*args)
            if self.grad_reference is not None:
                row["rel_err_grads_vs_first_sharded"] = max(rel_err(a, b) for a, b in zip(
                    jax.tree.leaves(grads), jax.tree.leaves(self.grad_reference)))
            else:
                self.grad_reference = grads
        return row


NCCL_ENV_VARIANTS = (
    {"NCCL_MIN_P2P_NCHANNELS": "32"},
    {"NCCL_MIN_P2P_NCHANNELS": "64"},
    {"NCCL_MIN_P2P_NCHANNELS": "32", "NCCL_P2P_NVL_CHUNKSIZE": "1048576"},
)


def transports_only(bench: Bench, wide: LayerConfig, eps, options_names):
    for ep in eps[::-1]:
        for transport in ("all_to_all", "ppermute"):
            for options in options_names:
                bench.run(f"bare {transport} ep{ep} {options}",
                          lambda: bench_bare_transport(bench, wide, ep, transport, options), min_left=5)


def nccl_env_probes(bench: Bench, out_dir: Path, smoke: bool):
    """Step 1 under each NCCL variant in a fresh process (NCCL reads its environment once)."""
    for variant in NCCL_ENV_VARIANTS:
        label = " ".join(f"{k}={v}" for k, v in variant.items())
        if bench.time_left() < 30:
            bench.doc["skipped"].append(f"nccl env {label}")
            continue
        env = {**os.environ, **variant, "EP_BENCH_NCCL_ENV": label, "NCCL_DEBUG": "VERSION"}
        sub_out = out_dir / "nccl_env_probe"
        command = [sys.executable, __file__, "--transports-only", "--out", str(sub_out),
                   "--deadline", str(min(60.0, bench.time_left() - 10))] + (["--smoke"] if smoke else [])
        done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=bench.time_left())
        version = [line for line in done.stdout.splitlines() if "NCCL version" in line][:1]
        for result in sorted(sub_out.glob("ep_bench_*.json")):
            for row in json.loads(result.read_text())["rows"]:
                bench.record({**row, "name": f"{row['name']} [{label}]", "nccl_version": "".join(version)})
            result.unlink()
        if done.returncode:
            bench.record({"name": f"nccl env {label}", "error": done.stderr[-800:]})


def add_bench_args(parser: argparse.ArgumentParser) -> None:
    """The options every layer benchmark here shares (see :func:`bench_from_args`)."""
    parser.add_argument("--out", default="benchmarks/results", help="folder for the JSON")
    parser.add_argument("--deadline", type=float, default=240.0, help="seconds; later measurements are skipped")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on 8 host CPU devices")


def bench_from_args(name: str, args) -> Bench:
    """Logging to stdout and a ``Bench`` writing ``{name}_[smoke_]{device}_{date}.json`` under ``--out``."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    kind = jax.devices()[0].device_kind.replace(" ", "_")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d")
    return Bench(out_dir / f"{name}_{'smoke_' if args.smoke else ''}{kind}_{stamp}.json", args.deadline, args.reps)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    add_bench_args(parser)
    parser.add_argument("--baseline-exchange", type=Path, help="a previous exchange.py to time beside this one")
    parser.add_argument("--gathers", action="store_true", help="also time the FSDP weight gathers")
    parser.add_argument("--nccl-env", action="store_true", help="also time the bare transports under NCCL variants")
    parser.add_argument("--transports-only", action="store_true", help=argparse.SUPPRESS)  # an --nccl-env child
    args = parser.parse_args(argv)
    bench = bench_from_args("ep_bench", args)
    out_dir = bench.out_path.parent
    big, wide = (CONFIGS["smoke"],) * 2 if args.smoke else (CONFIGS["mixtral"], CONFIGS["deepseek"])
    eps = [e for e in (2, 4) if e <= jax.device_count()]
    ragged_ok = jax.devices()[0].platform != "cpu"
    options_names = tuple(COMPILE_OPTIONS)
    baseline = args.baseline_exchange
    if args.transports_only:
        transports_only(bench, wide, eps, ("nccl",))
        _print_table(bench.doc["rows"])
        return

    transports_only(bench, wide, eps, options_names)
    fastest = {}  # ep -> (transport, options) of the fastest exchange
    for ep in eps[::-1]:
        best = None
        if baseline:
            bench.run(f"exchange ep{ep} previous", lambda: bench_exchange(bench, wide, ep, "all_to_all", "nccl", baseline))
        for transport in ("all_to_all", "ppermute"):
            for options in options_names:
                row = bench.run(f"exchange ep{ep} {transport} {options}",
                                lambda: bench_exchange(bench, wide, ep, transport, options))
                if row and "ms" in row and (best is None or row["ms"] < best[0]):
                    best = (row["ms"], transport, options)
        if ragged_ok and ep == eps[-1]:
            bench.run(f"exchange ep{ep} ragged", lambda: bench_exchange(bench, wide, ep, "ragged", "nccl"))
        fastest[ep] = best[1:] if best else ("all_to_all", "nccl")
    log.info("fastest exchange per ep: %s", fastest)

    layers = {}
    for cfg in (big, wide):
        layer = layers[cfg.name] = LayerBench(bench, cfg)
        row = bench.run(f"{cfg.name} 1gpu sparse", lambda: layer.single("sparse"), min_left=30)
        if row and row.get("backend") == "xla":
            bench.backend = "xla"  # the Triton backend failed here: measure the rest on the XLA tile loop
        bench.run(f"{cfg.name} 1gpu dense", lambda: layer.single("dense"), min_left=30)
        for ep in eps:
            specs = [P("expert")] * 3
            transport, options = fastest[ep]
            bench.run(f"{cfg.name} gemm-only ep{ep}", lambda: bench_gemm_only(bench, cfg, ep), min_left=30)
            bench.run(f"{cfg.name} ep{ep} dense {options}", lambda: layer.sharded(
                "dense", (ep,), ("expert",), P("expert"), specs, options=options), min_left=30)
            bench.run(f"{cfg.name} ep{ep} sparse {transport} {options}", lambda: layer.sharded(
                "sparse", (ep,), ("expert",), P("expert"), specs, transport=transport, options=options), min_left=30)
            if (transport, options) != ("all_to_all", "nccl"):
                bench.run(f"{cfg.name} ep{ep} sparse all_to_all nccl", lambda: layer.sharded(
                    "sparse", (ep,), ("expert",), P("expert"), specs), min_left=30)
            if baseline and ep == eps[-1]:
                bench.run(f"{cfg.name} ep{ep} sparse previous", lambda: layer.sharded(
                    "sparse", (ep,), ("expert",), P("expert"), specs, baseline=baseline), min_left=30)

    ep = eps[-1]
    transport, options = fastest[ep]
    for cfg in (big, wide):
        layer = layers[cfg.name]
        if baseline:
            bench.run(f"{cfg.name} fwdbwd sparse ep{ep} previous",
                      lambda: layer.fwd_bwd("sparse", ep, baseline=baseline), min_left=40)
        for impl, mesh_ep in (("dense", None), ("sparse", None), ("dense", ep)):
            bench.run(f"{cfg.name} fwdbwd {impl} ep{mesh_ep}",
                      lambda: layer.fwd_bwd(impl, mesh_ep, options=options), min_left=40)
        bench.run(f"{cfg.name} fwdbwd sparse ep{ep} {transport} {options}",
                  lambda: layer.fwd_bwd("sparse", ep, transport, options), min_left=40)
        if cfg is wide and wide is not big:
            del layers[cfg.name], layer  # free the DeepSeek-size weights

    if args.gathers:
        for fsdp in eps[::-1]:
            for quant in (None, "fp8_e4m3", "mxfp8"):
                bench.run(f"gather fsdp{fsdp} {quant}", lambda: bench_gather(bench, big, fsdp, quant))
    if args.nccl_env:
        nccl_env_probes(bench, out_dir, args.smoke)
    log.info("wrote %s; skipped: %s", bench.out_path, bench.doc["skipped"])
    _print_table(bench.doc["rows"])


def _print_table(rows):
    keys = ("name", "fwd_ms", "fwdbwd_ms", "ms", "ms_b2b", "GBps", "GBps_wire", "GBps_useful",
            "speedup_vs_dense_same_mesh", "speedup_b2b", "nccl_kernel_ms", "GBps_sync", "GBps_b2b", "GBps_nccl_kernels",
            "rel_err_vs_1gpu_sparse", "rel_err_grads_vs_first_sharded", "rounds", "error")
    for row in rows:
        cells = [f"{k}={row[k]:.4g}" if isinstance(row.get(k), float) else f"{k}={row[k]}"
                 for k in keys if k in row and k != "error"]
        if "error" in row:
            cells.append("ERROR " + row["error"][:120])
        print(" | ".join(cells))


if __name__ == "__main__":
    main()
