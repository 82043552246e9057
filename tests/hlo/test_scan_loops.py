"""While loops that are ``lax.scan`` come back from the importer as ``lax.scan`` (``hlo/scan_loops.py``);
loops that are not stay while loops, with the reason logged. Either way the imported program computes
what the module computes (compared with the JAX function it was lowered from, on random data)."""

from __future__ import annotations

import logging

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jaxlib.mlir import ir

from moe_lowering.hlo import _compat
from moe_lowering.hlo.importer import import_module

ROWS, WIDTH = 4, 3


def _import(text_or_bytes):
    with _compat.make_ir_context():
        return import_module(ir.Module.parse(text_or_bytes))


def _routes(fn, *args) -> dict:
    lowered = jax.jit(fn).lower(*args)
    return {"stablehlo": lowered.as_text(),
            "hlo": _compat.hlo_text_to_stablehlo_bytecode(lowered.compiler_ir("hlo").as_hlo_text())}


def _loops(program) -> list:
    """``(primitive name, reverse)`` of each loop of the imported program's jaxpr, sub-jaxprs included."""
    found = []
    stack = [jax.make_jaxpr(program.fn)(*program.in_avals).jaxpr]
    while stack:
        for eqn in stack.pop().eqns:
            if eqn.primitive in (lax.scan_p, lax.while_p):
                found.append((eqn.primitive.name, eqn.params.get("reverse")))
            stack.extend(v.jaxpr if hasattr(v, "jaxpr") else v for v in eqn.params.values()
                         if hasattr(v, "eqns") or hasattr(v, "jaxpr"))
    return found


def _imported(fn, route, caplog, *args):
    """The imported program of ``fn`` lowered (checked to compute ``fn``), its loops, and the reasons logged."""
    program = _import(_routes(fn, *args)[route])
    with caplog.at_level(logging.DEBUG, logger="moe_lowering.hlo.importer"):
        loops = _loops(program)  # the module is interpreted as it is traced
    reasons = [r.getMessage() for r in caplog.records if "stays a while loop" in r.getMessage()]
    want = jax.tree.leaves(fn(*args))
    got = jax.jit(program.fn)(*args)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-6, atol=1e-6)
    return loops, reasons


def _data(seed=0):
    rng = np.random.default_rng(seed)
    return rng.standard_normal((WIDTH,), np.float32), rng.standard_normal((ROWS, WIDTH), np.float32)


def _layer(h, x):
    return jnp.tanh(h * x + 1.0), h * 2.0  # a carry and a stacked output per row


ROUTES = ["stablehlo", "hlo"]


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("reverse, unroll", [(False, 1), (True, 1), (False, 2)])
def test_a_scan_comes_back_as_a_scan(route, reverse, unroll, caplog):
    """``unroll=2``: a scan over pairs of rows (the xs reshaped), two layers per iteration."""
    def fn(h, xs):
        return lax.scan(_layer, h, xs, reverse=reverse, unroll=unroll)

    loops, reasons = _imported(fn, route, caplog, *_data())
    assert loops == [("scan", reverse)] and not reasons


def _counting_down(h, xs):
    """A reverse scan written as a loop counting down: ``i = ROWS - 1 .. 0`` while ``i >= 0``."""
    def body(state):
        i, h, ys = state
        h, y = _layer(h, lax.dynamic_index_in_dim(xs, i, keepdims=False))
        return i - 1, h, lax.dynamic_update_index_in_dim(ys, y, i, 0)

    _, h, ys = lax.while_loop(lambda s: s[0] >= 0, body, (jnp.int32(ROWS - 1), h, jnp.zeros_like(xs)))
    return h, ys


@pytest.mark.parametrize("route", ROUTES)
def test_a_loop_counting_down_is_a_reverse_scan(route, caplog):
    loops, reasons = _imported(_counting_down, route, caplog, *_data())
    assert loops == [("scan", True)] and not reasons


def _data_dependent(h, xs):
    """Runs until the carry grows: the trip count is the data's."""
    def body(state):
        i, h = state
        return i + 1, h + jnp.abs(lax.dynamic_index_in_dim(xs, i % ROWS, keepdims=False))

    return lax.while_loop(lambda s: (jnp.sum(s[1]) < 10.0) & (s[0] < 100), body, (jnp.int32(0), h))


def _written_twice(h, xs):
    """Each iteration writes its row and the next one (clamped): a row written twice, not a stacked output."""
    def body(state):
        i, h, ys = state
        h, y = _layer(h, lax.dynamic_index_in_dim(xs, i, keepdims=False))
        ys = lax.dynamic_update_index_in_dim(ys, y, i, 0)
        ys = lax.dynamic_update_index_in_dim(ys, -y, jnp.minimum(i + 1, ROWS - 1), 0)
        return i + 1, h, ys

    _, h, ys = lax.while_loop(lambda s: s[0] < ROWS, body, (jnp.int32(0), h, jnp.ones_like(xs)))
    return h, ys


def _every_other_row(h, xs):
    """The counter goes up by 2: rows 0 and 2 are visited, 1 and 3 keep the buffer's initial ones."""
    def body(state):
        i, h, ys = state
        h, y = _layer(h, lax.dynamic_index_in_dim(xs, i, keepdims=False))
        return i + 2, h, lax.dynamic_update_index_in_dim(ys, y, i, 0)

    _, h, ys = lax.while_loop(lambda s: s[0] < ROWS, body, (jnp.int32(0), h, jnp.ones_like(xs)))
    return h, ys


def _counter_in_the_layer(h, xs):
    """The body computes with the counter (not only to index rows): the scan's body would need it."""
    def body(state):
        i, h, ys = state
        h, y = _layer(h * i.astype(jnp.float32), lax.dynamic_index_in_dim(xs, i, keepdims=False))
        return i + 1, h, lax.dynamic_update_index_in_dim(ys, y, i, 0)

    _, h, ys = lax.while_loop(lambda s: s[0] < ROWS, body, (jnp.int32(0), h, jnp.zeros_like(xs)))
    return h, ys


NOT_SCANS = {
    "data_dependent_trip_count": (_data_dependent, "not one counter"),
    "stacked_buffer_written_twice": (_written_twice, "into a buffer that is not written once per iteration"),
    "counter_incremented_by_two": (_every_other_row, "rows [0, 2] over 2 iterations"),
    "counter_read_by_the_body": (_counter_in_the_layer, "its counter is read by `stablehlo.broadcast_in_dim`"),
}


@pytest.mark.parametrize("route", ROUTES)
@pytest.mark.parametrize("case", list(NOT_SCANS))
def test_a_loop_that_is_not_a_scan_stays_a_while_loop(case, route, caplog):
    fn, reason = NOT_SCANS[case]
    loops, reasons = _imported(fn, route, caplog, *_data())
    assert loops == [("while", None)], loops
    assert len(reasons) == 1 and reason in reasons[0], reasons
