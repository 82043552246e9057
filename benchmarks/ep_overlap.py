"""Does the EP layer hide its token exchange under the grouped GEMMs? Chunked exchange on 1, 2 and 4 GPUs.

The sharded sparse layer is ``route + sort -> dispatch -> GEMMs -> return -> combine``; with
``exchange_chunks=c`` each round is ``c`` independent slices, so XLA may run one slice's
all-to-all while another slice's GEMMs run. Whether it does depends on XLA's scheduler and on
the GEMM leaving multiprocessors for NCCL's kernels (the Triton GEMMs are persistent: one
program per multiprocessor). Measured, in one process, per layer (Mixtral-like, DeepSeek-like)
and mesh (1 GPU, EP=4, EP=2):

* the dense reference (XLA-partitioned from the same shardings) and the grouped GEMMs alone on
  one device's balanced share (the floor of the EP layer);
* the sparse layer for chunks x GEMM grid (``all``: one program per multiprocessor; ``margin``:
  ``--margin`` multiprocessors left free; ``tiles``: one program per tile, not persistent) x
  XLA's latency-hiding scheduler as compiled by default / forced on;
* each exchange transport (``--transports``), and for ``"peer"`` its forms (``--peer-variants``:
  as committed, without the GEMM-fused return, or as before round 5 with slack-sized rounds and
  the overflow loop);
* forward + backward at the largest EP for the best forward variants (``--forward-only`` skips it);
* ``--profile``: a ``jax.profiler`` trace of chosen variants, summarised per GPU stream (busy
  time, NCCL time, NCCL time that overlaps a compute kernel) with ``jax.profiler.ProfileData``.

Rows go to ``ep_overlap_<device>_<date>.json`` as they are measured. ``--smoke`` runs tiny shapes
on 8 host CPU devices.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import functools
import logging
import re
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import ep_bench  # noqa: E402  (sets up sys.path and, with --smoke, the host devices)
import jax  # noqa: E402
import numpy as np  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from ep_bench import CONFIGS, Bench, LayerBench, bench_gemm_only, make_mesh, with_grad  # noqa: E402
from moe_lowering.parallel import exchange, plan_layout, sharded_sparse_moe  # noqa: E402
from moe_lowering.parallel import sharded_moe as sharded_moe_module  # noqa: E402
from moe_lowering.kernels.peer_store import api as peer_store_module  # noqa: E402
from moe_lowering.kernels.swiglu_rows import swiglu_rows_reference  # noqa: E402

log = logging.getLogger("ep_overlap")

LHS_OPTIONS = {"xla_gpu_enable_latency_hiding_scheduler": True}


@contextlib.contextmanager
def gemm_grid(mode: str, margin: int):
    """Trace the Triton GEMMs with ``mode``: ``all``, ``margin`` (SMs left free) or ``tiles`` (not persistent)."""
    if mode == "all" or jax.devices()[0].platform != "gpu":
        yield
        return
    from moe_lowering.kernels.grouped_matmul import triton_launch as tgm

    saved = tgm._multiprocessor_count, tgm.gmm_config, tgm.tgmm_config
    if mode == "margin":
        count = saved[0]() - margin
        tgm._multiprocessor_count = lambda: count
    else:
        tgm.gmm_config = lambda *a: dataclasses.replace(saved[1](*a), persistent=False)
        tgm.tgmm_config = lambda *a: dataclasses.replace(saved[2](*a), persistent=False)
    try:
        yield
    finally:
        tgm._multiprocessor_count, tgm.gmm_config, tgm.tgmm_config = saved


@contextlib.contextmanager
def overflow_loop(mode: str):
    """Trace the exchange with its overflow ``while_loop`` as is (``after``), issued before round 0
    (``first``: its state no longer depends on round 0), or left out (``none``: a diagnostic, wrong
    for skewed routing; it measures what the loop costs)."""
    if mode == "after":
        yield
        return
    saved = exchange._forward, exchange._further_rounds
    if mode == "none":
        exchange._further_rounds = lambda counts, cfg, body, init, num_rows: init
    else:
        def forward_loop_first(cfg, rows, payloads, params, group_sizes, token_of_row, keep_vjp):
            del token_of_row  # the loop-first diagnostic dispatches rows, as before deduplication
            out_dtype = exchange._output_rows(cfg, rows, payloads, params).dtype
            counts = jax.lax.all_gather(group_sizes, cfg.axis_name)

            def body(round_index, out):
                more, _ = exchange._round_forward(cfg, counts, round_index, rows, payloads, params, out_dtype, False)
                return out + more
            shape = jax.eval_shape(lambda: exchange._round_forward(cfg, counts, 0, rows, payloads, params, out_dtype,
                                                                   False)[0])
            extra = exchange._further_rounds(counts, cfg, body, jnp.zeros(shape.shape, shape.dtype), rows.shape[0])
            out, vjps = exchange._round_forward(cfg, counts, 0, rows, payloads, params, out_dtype, keep_vjp)
            return out + extra, vjps, counts
        exchange._forward = forward_loop_first
    try:
        yield
    finally:
        exchange._forward, exchange._further_rounds = saved


@contextlib.contextmanager
def peer_variant(name: str):
    """The ``"peer"`` transport as committed (``fused``: one round sized for the worst case, the
    output GEMM storing its rows home), without the GEMM-fused return (``unfused``), or as before
    both (``looped``: slack-sized rounds with the overflow loop, unfused), or with the SwiGLU
    activation as an XLA fusion over the whole worst-case buffer (``all-rows``, before
    ``swiglu_rows``), or sending rows once per expert instead of tokens once per rank (``rows``,
    before the deduplicated dispatch), or with the GEMMs' tail tiles whole (``whole-tail``, before
    ``grouped_matmul.triton_launch.TAIL_APART``), or with the GEMMs' tile shape picked from the receive
    buffer's size (``buffer-tiles``, before ``exchange._expected_rows``). ``push-PxWxS`` is the committed form with the dispatch push launched as ``P`` programs of
    ``W`` warps storing ``S`` rows at a time."""
    saved = (exchange._output_matmul, sharded_moe_module.PEER_SINGLE_ROUND_MAX_RANKS, exchange.swiglu_rows,
             exchange.deduplicates, exchange._expected_rows)
    if name == "buffer-tiles":
        exchange._expected_rows = lambda cfg, num_rows: cfg.ep_size * cfg.capacity
    if name in ("unfused", "looped"):
        exchange._output_matmul = lambda cfg, params: None
    if name == "looped":
        sharded_moe_module.PEER_SINGLE_ROUND_MAX_RANKS = 0
    if name == "rows":
        exchange.deduplicates = lambda cfg, num_rows: False
    if name == "all-rows":
        exchange.swiglu_rows = lambda gate, up, num_rows, backend: swiglu_rows_reference(gate, up, num_rows)
    try:
        with (push_launch(name) if name.startswith("push-") else
              whole_tail() if name == "whole-tail" else contextlib.nullcontext()):
            yield
    finally:
        (exchange._output_matmul, sharded_moe_module.PEER_SINGLE_ROUND_MAX_RANKS, exchange.swiglu_rows,
         exchange.deduplicates, exchange._expected_rows) = saved


@contextlib.contextmanager
def whole_tail():
    """The grouped GEMMs with the tiles past their last full wave left whole (GPU kernels only)."""
    from moe_lowering.kernels.grouped_matmul import triton_launch as triton_grouped_matmul

    saved, triton_grouped_matmul.TAIL_APART = triton_grouped_matmul.TAIL_APART, False
    try:
        yield
    finally:
        triton_grouped_matmul.TAIL_APART = saved


@contextlib.contextmanager
def push_launch(name: str):
    """The dispatch push launched as ``push-PxWxS`` says (GPU only: it patches the Triton wrapper)."""
    from moe_lowering.kernels.peer_store import triton_launch as triton_peer_store

    programs, warps, slots = (int(n) for n in name.removeprefix("push-").split("x"))
    saved = peer_store_module.PUSH_PROGRAMS, triton_peer_store.push
    peer_store_module.PUSH_PROGRAMS = programs
    triton_peer_store.push = functools.partial(saved[1], num_warps=warps, block_slots=slots)
    try:
        yield
    finally:
        peer_store_module.PUSH_PROGRAMS, triton_peer_store.push = saved


def _peer_variant_name(name: str) -> str:
    if (name in ("fused", "unfused", "looped", "all-rows", "rows", "whole-tail", "buffer-tiles")
            or re.fullmatch(r"push-\d+x\d+x\d+", name)):
        return name
    raise argparse.ArgumentTypeError(f"unknown peer variant {name!r}: fused, unfused, looped, all-rows, rows, "
                                     "whole-tail, buffer-tiles or push-PxWxS")


def timed(bench: Bench, fn, args, lhs: bool):
    """``(ms per call with a host sync, ms per call back to back, the compiled fn)``."""
    compiled = fn.lower(*args).compile(compiler_options=LHS_OPTIONS) if lhs else fn.lower(*args).compile()
    return bench.time_ms(compiled, *args), bench.time_back_to_back_ms(compiled, *args), compiled


class Overlap:
    def __init__(self, bench: Bench, cfg, margin: int, out_dir: Path):
        self.bench, self.cfg, self.margin, self.out_dir = bench, cfg, margin, out_dir
        self.layer = LayerBench(bench, cfg)
        self.dense_ms: dict[str, float] = {}

    def mesh_args(self, ep: int):
        mesh = make_mesh((ep,), ("expert",))
        specs = [P("expert")] * 3
        args = self.layer.sharded_args(mesh, P("expert"), specs)
        return mesh, specs, args

    def sparse_fn(self, layout, chunks: int, transport: str = "all_to_all"):
        cfg, program = self.cfg, self.layer.program
        return jax.jit(lambda t, i, w, p: sharded_sparse_moe(
            t, i, w, p, program, num_experts=cfg.E, layout=layout, backend=self.bench.backend,
            exchange_transport=transport, exchange_chunks=chunks))

    def row(self, **row):
        key = (row["mesh"], row["pass"])
        if row["impl"] == "dense":
            self.dense_ms[key] = (row["ms"], row.get("ms_b2b"))
        elif key in self.dense_ms:
            dense_ms, dense_b2b = self.dense_ms[key]
            row["speedup_vs_dense_same_mesh"] = dense_ms / row["ms"]
            if dense_b2b and row.get("ms_b2b"):
                row["speedup_b2b"] = dense_b2b / row["ms_b2b"]
        if row["pass"] == "fwd":
            row["useful_TFLOPs"] = self.cfg.useful_flops() / (row["ms"] * 1e-3) / 1e12
        return {"kind": "overlap", "config": self.cfg.name, **row}

    def single(self, impl: str, fwd_bwd: bool = False, profile: bool = False):
        layer, cfg = self.layer, self.cfg
        if fwd_bwd:
            if impl == "dense":
                fn = jax.jit(with_grad(lambda t, p, i, w: ep_bench.dense_layer(t, i, w, p, cfg.E)))
            else:
                single = layer.sparse_single(self.bench.backend)
                fn = jax.jit(with_grad(lambda t, p, i, w: single(t, i, w, p)))
            args = (layer.tokens, layer.params, layer.cotangent, layer.indices, layer.weights)
        else:
            fn = (jax.jit(lambda t, i, w, p: ep_bench.dense_layer(t, i, w, p, cfg.E)) if impl == "dense"
                  else jax.jit(layer.sparse_single(self.bench.backend)))
            args = (layer.tokens, layer.indices, layer.weights, layer.params)
        ms, ms_b2b, fn = timed(self.bench, fn, args, False)
        if impl == "sparse" and not fwd_bwd:
            layer.reference = fn(*args)
        row = dict(impl=impl, mesh="1gpu", ms=ms, ms_b2b=ms_b2b, **{"pass": "fwdbwd" if fwd_bwd else "fwd"})
        if profile:
            row["profile_b2b"] = _guarded(back_to_back_profile, fn, args,
                                          self.out_dir / f"trace_b2b_{self.cfg.name}_1gpu_{impl}")
        return self.row(**row)

    def dense(self, ep: int, fwd_bwd: bool = False, profile: bool = False):
        cfg, layer = self.cfg, self.layer
        mesh, _, (tokens, indices, weights, params) = self.mesh_args(ep)
        if fwd_bwd:
            cotangent = jax.device_put(layer.cotangent, NamedSharding(mesh, P("expert")))
            fn = jax.jit(with_grad(lambda t, p, i, w: ep_bench.dense_layer(t, i, w, p, cfg.E)))
            args = (tokens, params, cotangent, indices, weights)
        else:
            fn = jax.jit(lambda t, i, w, p: ep_bench.dense_layer(t, i, w, p, cfg.E),
                         out_shardings=NamedSharding(mesh, P("expert")))
            args = (tokens, indices, weights, params)
        ms, ms_b2b, compiled = timed(self.bench, fn, args, False)
        row = dict(impl="dense", mesh=f"ep{ep}", ms=ms, ms_b2b=ms_b2b, **{"pass": "fwdbwd" if fwd_bwd else "fwd"})
        if profile:
            row["profile_b2b"] = _guarded(back_to_back_profile, compiled, args,
                                          self.out_dir / f"trace_b2b_{cfg.name}_ep{ep}_dense")
        return self.row(**row)

    def sparse(self, ep: int, chunks: int, grid: str, lhs: bool, fwd_bwd: bool = False,
               transport: str = "all_to_all", profile: bool = False, loop: str = "after", variant: str = "fused"):
        cfg, layer = self.cfg, self.layer
        mesh, specs, (tokens, indices, weights, params) = self.mesh_args(ep)
        layout = plan_layout(mesh, P("expert"), specs, cfg.E)
        with gemm_grid(grid, self.margin), overflow_loop(loop), peer_variant(variant):
            if fwd_bwd:
                cotangent = jax.device_put(layer.cotangent, NamedSharding(mesh, P("expert")))
                program = layer.program

                def layer_fn(t, p, i, w):
                    return sharded_sparse_moe(t, i, w, p, program, num_experts=cfg.E, layout=layout,
                                              backend=self.bench.backend, exchange_transport=transport,
                                              exchange_chunks=chunks)
                fn = jax.jit(with_grad(layer_fn))  # the routing as arguments, as a multi-process job passes it
                args = (tokens, params, cotangent, indices, weights)
            else:
                fn = self.sparse_fn(layout, chunks, transport)
                args = (tokens, indices, weights, params)
            ms, ms_b2b, compiled = timed(self.bench, fn, args, lhs)
        row = dict(impl="sparse", mesh=f"ep{ep}", ms=ms, ms_b2b=ms_b2b, chunks=chunks, grid=grid, lhs=lhs,
                   loop=loop, transport=transport, **{"pass": "fwdbwd" if fwd_bwd else "fwd"})
        if transport == "peer":
            row["peer_variant"] = variant
        if not fwd_bwd and layer.reference is not None:
            row["rel_err_vs_1gpu_sparse"] = ep_bench.rel_err(compiled(*args), layer.reference)
        if profile:
            row["profile"] = profile_summary(compiled, args, self.out_dir / f"trace_{cfg.name}_ep{ep}_c{chunks}_{grid}")
            row["profile_b2b"] = _guarded(back_to_back_profile, compiled, args,
                                          self.out_dir / f"trace_b2b_{cfg.name}_ep{ep}_c{chunks}_{grid}_{variant}")
        return self.row(**row)

    def gemm_only(self, ep: int):
        row = bench_gemm_only(self.bench, self.cfg, ep)
        return self.row(impl="gemm_only", mesh=f"ep{ep}", ms=row["fwd_ms"], **{"pass": "fwd"})


# ---------------------------------------------------------------------------------------------
# token exchange bandwidth, three ways


def exchange_bandwidth(bench: Bench, cfg, ep: int, what: str, out_dir: Path, dump_hlo: bool = False) -> dict:
    """The exchange alone (``what="exchange"``: identity expert program, permute, dispatch, return,
    combine) or one bare ``all_to_all`` of the same padded dispatch buffer (``"bare"``).

    GB/s are wire bytes leaving each device (padding included, both directions for the exchange)
    over: the wall time of one call with a host sync (includes dispatching the 4-device program),
    the time per call issued back to back, and the NCCL kernels' own time in a profile (which
    still includes any wait for the slowest peer).
    """
    mesh = make_mesh((ep,), ("expert",))
    sharding = NamedSharding(mesh, P("expert"))
    capacity = -(-cfg.T // ep * cfg.k // ep * 5 // 4)
    row_bytes = cfg.d * 2
    if what == "bare":
        buf = jax.device_put(jax.random.normal(jax.random.key(1), (ep * ep, capacity, cfg.d), jnp.bfloat16), sharding)
        fn = jax.jit(ep_bench.shard_map(lambda x: jax.lax.all_to_all(x, "expert", 0, 0), mesh=mesh,
                                        in_specs=P("expert"), out_specs=P("expert")))
        args = (buf,)
        wire = (ep - 1) * capacity * row_bytes
    else:
        layout = ep_bench.exchange_layout(mesh, cfg.E)
        tokens, indices, weights, _, _ = ep_bench.make_layer_data(cfg)
        args = tuple(jax.device_put(a, sharding) for a in (tokens, indices, weights))
        fn = jax.jit(lambda t, i, w: sharded_sparse_moe(t, i, w, (), ep_bench.IDENTITY, num_experts=cfg.E,
                                                        layout=layout))
        wire = 2 * (ep - 1) * capacity * row_bytes
    ms, ms_b2b, compiled = timed(bench, fn, args, False)
    prof = profile_summary(compiled, args, out_dir / f"trace_{what}_{cfg.name}_ep{ep}")
    row = {"kind": "exchange_bw", "config": cfg.name, "ep": ep, "what": what, "wire_bytes_per_device": wire,
           "ms": ms, "ms_b2b": ms_b2b, "nccl_kernel_ms": prof.get("nccl_ms"),
           "GBps_sync": wire / (ms * 1e-3) / 1e9, "GBps_b2b": wire / (ms_b2b * 1e-3) / 1e9,
           "profile": prof}
    if prof.get("nccl_ms"):
        row["GBps_nccl_kernels"] = wire / (prof["nccl_ms"] * 1e-3) / 1e9
    if dump_hlo:
        (out_dir / f"hlo_{what}_{cfg.name}_ep{ep}.txt").write_text(compiled.as_text())
    return row


# ---------------------------------------------------------------------------------------------
# profile summary


def _union(intervals):
    merged = []
    for start, end in sorted(intervals):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _length(intervals) -> float:
    return sum(end - start for start, end in intervals)


def _intersection(a, b) -> float:
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def profile_summary(fn, args, trace_dir: Path, steps: int = 3) -> dict:
    """Per-step GPU:0 kernel time by stream, NCCL vs compute, and how much NCCL time overlaps compute."""
    from jax.profiler import ProfileData

    jax.block_until_ready(fn(*args))
    trace_dir.mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(str(trace_dir)):
        for _ in range(steps):
            jax.block_until_ready(fn(*args))
    paths = sorted(trace_dir.rglob("*.xplane.pb"))
    if not paths:
        return {"error": f"no xplane.pb under {trace_dir}"}
    data = ProfileData.from_file(str(paths[-1]))
    plane = next((p for p in data.planes if p.name.endswith("GPU:0")), None)
    if plane is None:
        return {"error": "no GPU:0 plane", "planes": [p.name for p in data.planes]}
    nccl, compute, streams, kernels = [], [], {}, {}
    first, last = float("inf"), 0.0
    for line in plane.lines:
        if not line.name.startswith("Stream"):
            continue
        for event in line.events:
            start, end = event.start_ns, event.start_ns + event.duration_ns
            first, last = min(first, start), max(last, end)
            is_nccl = "nccl" in event.name.lower()
            (nccl if is_nccl else compute).append((start, end))
            stream = streams.setdefault(line.name, {"busy_ms": 0.0, "nccl_ms": 0.0, "events": 0})
            stream["busy_ms"] += event.duration_ns / 1e6 / steps
            stream["nccl_ms"] += event.duration_ns / 1e6 / steps if is_nccl else 0.0
            stream["events"] += 1
            kernels[event.name[:80]] = kernels.get(event.name[:80], 0.0) + event.duration_ns / 1e6 / steps
    nccl_u, compute_u = _union(nccl), _union(compute)
    top = sorted(kernels.items(), key=lambda kv: -kv[1])[:25]
    return {
        "window_ms_per_step": (last - first) / 1e6 / steps,
        "compute_ms": _length(compute_u) / 1e6 / steps,
        "nccl_ms": _length(nccl_u) / 1e6 / steps,
        "nccl_overlapping_compute_ms": _intersection(nccl_u, compute_u) / 1e6 / steps,
        **_guarded(_idle_gaps, plane, steps),
        "lines": [line.name for line in plane.lines],
        "streams": streams,
        "top_kernels_ms": {name: round(ms, 4) for name, ms in top},
    }


def back_to_back_profile(fn, args, trace_dir: Path, steps: int = 8) -> dict:
    """A trace of ``steps`` calls issued back to back (one sync at the end, as in a training loop),
    summarised for every GPU: kernel time and idle time per step, each wait kernel's time by its
    place in the step (dispatch wait first, then the return's), the kernel time less the waits
    (the work a GPU does: the slowest one sets the step), the widest idle gaps with the kernels
    around them, and how far apart the GPUs start their dispatch push in each step (the skew that
    every wait absorbs)."""
    from jax.profiler import ProfileData

    jax.block_until_ready(fn(*args))
    trace_dir.mkdir(parents=True, exist_ok=True)
    with jax.profiler.trace(str(trace_dir)):
        out = None
        for _ in range(steps):
            out = fn(*args)
        jax.block_until_ready(out)
    paths = sorted(trace_dir.rglob("*.xplane.pb"))
    if not paths:
        return {"error": f"no xplane.pb under {trace_dir}"}
    data = ProfileData.from_file(str(paths[-1]))
    launches = _host_launch_starts(data)
    gpus, push_starts = {}, {}
    for plane in data.planes:
        if "/device:GPU:" not in plane.name:
            continue
        events = sorted((e.start_ns, e.duration_ns, e.name) for line in plane.lines if line.name.startswith("Stream")
                        for e in line.events)
        lags = {(e.start_ns, e.name): e.start_ns - launches[c] for line in plane.lines
                if line.name.startswith("Stream") for e in line.events
                if (c := _stat(e, "correlation_id")) is not None and c in launches}
        if not events:
            continue
        busy = _length(_union([(start, start + length) for start, length, _ in events]))
        window = events[-1][0] + events[-1][1] - events[0][0]
        kernels = {}
        for _, length, name in events:
            kernels[name[:60]] = kernels.get(name[:60], 0.0) + length / 1e6 / steps
        waits = [length / 1e6 for _, length, name in events if name.startswith("wait_kernel")]
        per_step = max(1, len(waits) // steps)
        gaps, reach, before = [], None, None
        for start, length, name in events:
            if reach is not None and start > reach:
                gaps.append((start - reach, before[:40], name[:40]))
            if reach is None or start + length > reach:
                reach, before = start + length, name
        gpu = plane.name.rsplit(":", 1)[-1]
        gpus[gpu] = {
            "busy_ms": busy / 1e6 / steps,
            "idle_ms": (window - busy) / 1e6 / steps,
            "work_ms": (busy / 1e6 - sum(waits)) / steps,
            "wait_ms_by_place": [round(float(np.mean(waits[i::per_step])), 4) for i in range(per_step)],
            "widest_gaps_us": [(round(us / 1e3, 1), after, then) for us, after, then in sorted(gaps, reverse=True)[:8]],
            "top_kernels_ms": {n: round(ms, 4) for n, ms in sorted(kernels.items(), key=lambda kv: -kv[1])[:10]},
            "middle_step": _step_timeline(events, steps, lags),
            "widest_gap_ops": _ops_in_widest_gap(plane, events, steps),
        }
        push_starts[gpu] = [start for start, _, name in events if name.startswith("push_kernel")]
    counts = {len(v) for v in push_starts.values()}
    skew = []
    if len(counts) == 1 and counts != {0}:
        for i in range(counts.pop()):
            starts = [v[i] for v in push_starts.values()]
            skew.append(round((max(starts) - min(starts)) / 1e3, 1))
    return {"steps": steps, "gpus": gpus, "push_start_skew_us": skew}


def _stat(event, name: str):
    try:
        return dict(event.stats).get(name)
    except Exception:  # stats this jaxlib cannot convert: no correlation
        return None


def _host_launch_starts(data) -> dict:
    """``correlation id -> start ns`` of the host's launch calls (CUPTI's API events), where traced."""
    starts = {}
    for plane in data.planes:
        if not plane.name.startswith("/host:"):
            continue
        for line in plane.lines:
            for event in line.events:
                if (c := _stat(event, "correlation_id")) is not None:
                    starts.setdefault(c, event.start_ns)
    return starts


def _step_timeline(events, steps: int, lags: dict) -> list:
    """The middle step's kernels in order: ``(name, start us from the step's first kernel, us,
    us from the host's launch call to the kernel's start or None)``. Every step launches the same
    kernels, so the events split into ``steps`` equal runs; a kernel that starts right after its
    launch call after an idle gap says the host, not the GPU, set the pace there."""
    per_step = len(events) // steps
    if per_step == 0 or len(events) % steps:
        return []
    middle = events[(steps // 2) * per_step:(steps // 2 + 1) * per_step]
    origin = middle[0][0]
    return [(name[:48], round((start - origin) / 1e3, 1), round(length / 1e3, 1),
             None if (lag := lags.get((start, name))) is None else round(lag / 1e3, 1))
            for start, length, name in middle]


def _ops_in_widest_gap(plane, events, steps: int) -> dict:
    """The widest stretch without a kernel from the middle step to the next one's start, and what
    the trace's other lines (XLA's ops and modules on this GPU) show over it: which operation the
    GPU sat in while no kernel ran."""
    per_step = len(events) // steps
    if per_step == 0 or len(events) % steps or steps < 2:
        return {}
    window = events[(steps // 2) * per_step:(steps // 2 + 1) * per_step + 1]
    gaps, reach = [], None
    for start, length, _ in window:
        if reach is not None and start > reach:
            gaps.append((start - reach, reach, start))
        reach = start + length if reach is None else max(reach, start + length)
    if not gaps:
        return {}
    width, begin, end = max(gaps)
    ops = sorted((e.start_ns, e.duration_ns, line.name, e.name) for line in plane.lines
                 if not line.name.startswith("Stream") for e in line.events
                 if e.start_ns < end and e.start_ns + e.duration_ns > begin)
    return {"us": round(width / 1e3, 1),
            "ops": [(line[:24], name[:60], round((start - begin) / 1e3, 1), round(length / 1e3, 1))
                    for start, length, line, name in ops[:12]]}


def _guarded(summary, *args) -> dict:
    try:
        return summary(*args)
    except Exception as err:  # a summary that fails must not lose the timing it belongs to
        return {f"{summary.__name__}_error": f"{type(err).__name__}: {err}"}


def _idle_gaps(plane, steps: int) -> dict:
    """Where GPU:0 runs no kernel at all: the ``steps - 1`` widest gaps split the steps; the rest
    are idle time inside a step, listed with the kernels on either side."""
    events = sorted((e.start_ns, e.start_ns + e.duration_ns, e.name[:60]) for line in plane.lines
                    if line.name.startswith("Stream") for e in line.events)
    gaps, reach, before = [], None, None
    for start, end, name in events:
        if reach is not None and start > reach:
            gaps.append((start - reach, before, name, start))
        if reach is None or end > reach:
            reach, before = end, name
    gaps.sort(reverse=True)
    between, inside = gaps[: steps - 1], gaps[steps - 1:]
    return {
        "idle_between_steps_ms": [g[0] / 1e6 for g in between],
        "idle_inside_steps_ms": sum(g[0] for g in inside) / 1e6 / steps,
        "idle_gaps_over_5us": sum(1 for g in inside if g[0] > 5e3) / steps,
        "widest_inside_gaps": [{"us": round(g[0] / 1e3, 1), "after": g[1], "before": g[2]} for g in inside[:15]],
    }


# ---------------------------------------------------------------------------------------------


def fwd_bwd_rows(bench: Bench, run: "Overlap", cfg, ep: int, args, transport_variants):
    """Forward+backward on one GPU and at ``ep`` (dense, then each sparse transport)."""
    bench.run(f"{cfg.name} 1gpu dense fwdbwd", lambda: run.single("dense", fwd_bwd=True), min_left=60)
    bench.run(f"{cfg.name} 1gpu sparse fwdbwd", lambda: run.single("sparse", fwd_bwd=True), min_left=60)
    bench.run(f"{cfg.name} ep{ep} dense fwdbwd", lambda: run.dense(ep, fwd_bwd=True), min_left=60)
    for transport, variant in transport_variants:
        for loop in args.loops:
            if loop != "first":  # the forward-only variant
                bench.run(f"{cfg.name} ep{ep} sparse {transport}{variant and '-' + variant} fwdbwd c1 loop={loop}",
                          lambda: run.sparse(ep, 1, "all", False, True, loop=loop, transport=transport,
                                             variant=variant or "fused"), min_left=60)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default="benchmarks/results", help="folder for the JSON and traces")
    parser.add_argument("--deadline", type=float, default=420.0, help="seconds; later measurements are skipped")
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--margin", type=int, default=16, help="multiprocessors left free in the 'margin' grid")
    parser.add_argument("--chunks", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--grids", nargs="+", default=["all"], choices=["all", "margin", "tiles"])
    parser.add_argument("--loops", nargs="+", default=["after", "first", "none"], choices=["after", "first", "none"])
    parser.add_argument("--configs", nargs="+", default=["mixtral", "deepseek"])
    parser.add_argument("--eps", type=int, nargs="+", default=[4, 2], choices=[4, 2],
                        help="expert-parallel sizes to run (those the devices allow); forward+backward at the first")
    parser.add_argument("--scheduler", nargs="+", default=["default", "lhs"], choices=["default", "lhs"],
                        help="XLA's default GPU scheduler and/or its latency-hiding scheduler forced on")
    parser.add_argument("--transports", nargs="+", default=["all_to_all"], choices=["all_to_all", "ppermute", "peer"],
                        help="exchange transports of the sparse layer (each with every other variant)")
    parser.add_argument("--peer-variants", nargs="+", default=["fused"], type=_peer_variant_name,
                        help="forms of the peer transport: as committed (one round, the output GEMM storing rows "
                             "home), without that fusion, slack-sized rounds with the overflow loop, or the SwiGLU "
                             "activation over the whole receive buffer; rows: no deduplicated dispatch; whole-tail: GEMM tail "
                             "tiles not split; buffer-tiles: GEMM tiles picked from the receive buffer's size; push-PxWxS: the dispatch push as P programs "
                             "of W warps storing S rows at a time")
    parser.add_argument("--forward-only", action="store_true", help="leave out the forward+backward rows")
    parser.add_argument("--profile", action="store_true", help="trace the chunks=1 and best variants at EP=4")
    parser.add_argument("--profile-baselines", action="store_true",
                        help="also trace the one-GPU sparse and the dense layer at the first EP size back to back")
    parser.add_argument("--exchange-only", action="store_true",
                        help="only the token exchange's bandwidth (and the layer HLO with --dump-hlo)")
    parser.add_argument("--dump-hlo", action="store_true", help="write the compiled HLO of the EP=4 layer")
    parser.add_argument("--device-order", type=int, nargs="+", default=None,
                        help="the physical device of each mesh position (profiles name physical devices): "
                             "tells a slow GPU from a slow rank")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on 8 host CPU devices")
    args = parser.parse_args(argv)
    if args.device_order:
        if sorted(args.device_order) != list(range(jax.device_count())):
            parser.error(f"--device-order must be a permutation of 0..{jax.device_count() - 1}")
        ep_bench.DEVICE_ORDER = args.device_order
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s", stream=sys.stdout)
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    kind = jax.devices()[0].device_kind.replace(" ", "_")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%d")
    bench = Bench(out_dir / f"ep_overlap_{'smoke_' if args.smoke else ''}{kind}_{stamp}.json", args.deadline,
                  args.reps)
    configs = [CONFIGS["smoke"]] if args.smoke else [CONFIGS[c] for c in args.configs]
    transport_variants = [(t, v) for t in args.transports for v in (args.peer_variants if t == "peer" else [""])]
    eps = [e for e in args.eps if e <= jax.device_count()]
    lhs_variants = (False,) if jax.devices()[0].platform != "gpu" else tuple(v == "lhs" for v in args.scheduler)
    trace_root = Path(tempfile.mkdtemp()) if args.smoke else out_dir

    if args.exchange_only:
        wide = CONFIGS["smoke"] if args.smoke else CONFIGS["deepseek"]
        for cfg in ([wide] if args.smoke else [wide, CONFIGS["mixtral"]]):
            for ep in eps:
                for what in ("bare", "exchange"):
                    bench.run(f"{what} {cfg.name} ep{ep}", lambda: exchange_bandwidth(bench, cfg, ep, what, trace_root))
        if args.dump_hlo:
            for cfg in configs:
                run = Overlap(bench, cfg, args.margin, trace_root)
                mesh, specs, layer_args = run.mesh_args(eps[0])
                layout = plan_layout(mesh, P("expert"), specs, cfg.E)
                hlo = run.sparse_fn(layout, 1).lower(*layer_args).compile().as_text()
                (out_dir / f"hlo_layer_{cfg.name}_ep{eps[0]}.txt").write_text(hlo)
                del run
        configs = []
    for cfg in configs:
        run = Overlap(bench, cfg, args.margin, trace_root)
        if "whole-tail" in args.peer_variants and not args.smoke:  # alternated: the first timing of a run reads high
            for repeat in (1, 2):
                with whole_tail():
                    bench.run(f"{cfg.name} 1gpu sparse whole-tail #{repeat}", lambda: run.single("sparse"))
                bench.run(f"{cfg.name} 1gpu sparse #{repeat}", lambda: run.single("sparse"))
        else:
            bench.run(f"{cfg.name} 1gpu sparse", lambda: run.single("sparse", profile=args.profile_baselines))
        bench.run(f"{cfg.name} 1gpu dense", lambda: run.single("dense"))
        for ep in eps:
            bench.run(f"{cfg.name} ep{ep} gemm-only", lambda: run.gemm_only(ep))
            bench.run(f"{cfg.name} ep{ep} dense",
                      lambda: run.dense(ep, profile=args.profile_baselines and ep == eps[0]))
            for transport, variant in transport_variants:
                for loop in args.loops:
                    for chunks in args.chunks:
                        for grid in args.grids:
                            for lhs in lhs_variants:
                                bench.run(f"{cfg.name} ep{ep} sparse {transport}{variant and '-' + variant} c{chunks} "
                                          f"{grid} lhs={lhs} loop={loop}",
                                          lambda: run.sparse(ep, chunks, grid, lhs, loop=loop, transport=transport,
                                                             variant=variant or "fused"))
            if ep != eps[0]:
                continue
            for _ in () if args.forward_only else (1,):
                fwd_bwd_rows(bench, run, cfg, ep, args, transport_variants)
            if args.profile:
                for transport, variant in transport_variants:
                    for loop in args.loops:
                        bench.run(f"{cfg.name} ep{ep} profile {transport}{variant and '-' + variant} c1 loop={loop}",
                                  lambda: run.sparse(ep, 1, "all", False, profile=True, loop=loop,
                                                     transport=transport, variant=variant or "fused"), min_left=40)
        del run
    log.info("wrote %s; skipped: %s", bench.out_path, bench.doc["skipped"])
    ep_bench._print_table(bench.doc["rows"])
    for row in bench.doc["rows"]:
        if "profile" in row:
            prof = row["profile"]
            print(row["name"], {k: (round(v, 3) if isinstance(v, float) else v) for k, v in prof.items()
                                if k not in ("streams", "top_kernels_ms", "widest_inside_gaps", "lines")})
            for gap in prof.get("widest_inside_gaps", [])[:8]:
                print("    ", gap)
            for name, ms in list(prof.get("top_kernels_ms", {}).items())[:12]:
                print("      %.4f %s" % (ms, name))
        b2b = row.get("profile_b2b")
        if b2b and b2b.get("gpus"):
            print(row["name"], "back to back: push start skew (us) per step", b2b["push_start_skew_us"])
            for gpu, summary in sorted(b2b["gpus"].items()):
                timeline = summary.get("middle_step") or [("", 0.0, 0.0, None)]
                span = timeline[-1][1] + timeline[-1][2]
                print("    GPU %s: a step every %.3f ms, the middle one spans %.3f ms of its kernels (%.3f ms idle inside)"
                      % (gpu, summary["busy_ms"] + summary["idle_ms"], span / 1e3,
                         (span - sum(e[2] for e in timeline)) / 1e3))
                print("    GPU %s: kernels %.3f ms (%.3f less waits), idle %.3f ms per step, wait kernels by place %s" % (
                    gpu, summary["busy_ms"], summary["work_ms"], summary["idle_ms"], summary["wait_ms_by_place"]))
            for gap in b2b["gpus"][min(b2b["gpus"])]["widest_gaps_us"]:
                print("     ", gap)
            for gpu, summary in sorted(b2b["gpus"].items()):
                print("    GPU %s middle step (name, start us, us, us since its launch call):" % gpu)
                for entry in summary.get("middle_step", []):
                    print("       ", entry)
                print("    GPU %s widest gap after the middle step's start, and the ops over it:" % gpu,
                      summary.get("widest_gap_ops"))
            for name, ms in list(b2b["gpus"][min(b2b["gpus"])]["top_kernels_ms"].items()):
                print("      %.4f %s" % (ms, name))


if __name__ == "__main__":
    main()
