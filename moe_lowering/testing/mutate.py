"""Semantic mutation testing of the MoE pass: small wrong-looking changes to the zoo's programs.

Each zoo model is traced at tiny sizes and flattened exactly as the matcher sees it
(``passes.graph.build_graph``: ``jit`` bodies such as ``one_hot`` and ``cumsum`` inlined). A
*mutant* re-emits that flat program with ``bind``, eqn by eqn, except at one site, where the eqn
is replaced by a changed computation of the same output shapes and dtypes: a constant changed,
the operands of a non-commutative op swapped, an op replaced by a sibling, a cast round trip, a
clamp, an index shifted, a tensor scaled, a ``stop_gradient``, a slice moved, a factor applied
twice, an axis flipped or rolled, a term of value zero (written with ``neg``, ``-1 *``, a negated
contraction or a cancelling straight-through pair) added to a capacity layer's combine. Sites inside ``scan`` bodies and ``custom_jvp`` functions are
reachable too (a mutated ``custom_jvp`` body is inlined, so its derivative becomes autodiff's).

The oracle: whatever the mutant computes, ``optimize_jaxpr`` must either decline (rewrite
nothing) or produce a program equal to *the mutant's own* dense evaluation, outputs and
gradients alike (a VJP with random cotangents, w.r.t. every param and ``x``; float32; relative
error <= 1e-5 in norm, NaNs and infinities in the same places). A mutant that makes the routing
mean something else and is still rewritten as if it did not is a matcher bug that the zoo alone
cannot reveal. Three allowances keep float32 rounding from reading as a bug, each reported:
an output or gradient whose norm is below a tenth of the program's largest is compared against
that tenth (``NOISE_FLOOR``); a rewrite within the dense mutant's own change under a 1-ulp
nudge of its inputs is numerical; an error below 1e-3 must show on a second data seed too
(``CONFIRM_BELOW``). Both programs run op by op (``jax.disable_jit``): each primitive compiles
once per shape for all mutants, where ``jit`` would compile every mutant afresh.

Training steps are mutated too (``TRAIN_STEP``, ``STEP_OF``: ``train-mixtral``, ``step-mixtral``): the
traced ``value_and_grad`` step, its backward included, or the step of a mutated layer; the oracle
compares the step's outputs (loss and gradients) with the mutant's own dense step.

Every mutant has a readable, reproducible id ``model/eqn<path>:<kind>(<what>)``, e.g.
``switch/eqn17:swap_operands(sub)`` or ``scan_layers/eqn0.13:int_shift(top_k.out1,+1)``
(``<path>``: eqn indices of the flat graph, dotted into ``scan`` / ``custom_jvp`` bodies);
``mutant_from_id`` rebuilds it and ``check_mutant`` runs the oracle on it.

    python -m moe_lowering.testing.mutate --per-kind 3           # the report table
    python -m moe_lowering.testing.mutate --id 'switch/eqn17:swap_operands(sub)'
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import functools
import math
import re
import sys
import time
import traceback
import zlib
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import source_info_util

from moe_lowering import _compat
from moe_lowering.passes.graph import Const, Eqn, JaxprGraph, Value, build_graph
from moe_lowering.testing.zoo import NEGATIVE, POSITIVE, ZOO, ZooModel

# --------------------------------------------------------------------------------------------
# Models at tiny sizes


TINY = dict(T=16, d=8, f=16, E=4)
"""Sizes of every mutated model (``k`` and the routing hyperparameters stay the zoo's). ``E=4``
keeps the sparse path's grouped-GEMM visits few (it runs op by op) and makes the capacity
models drop tokens (Switch: ``C=4``)."""

MODELS: tuple[str, ...] = tuple(POSITIVE) + tuple(NEGATIVE)

TRAIN_STEP = "train-"
"""``train-<model>``: the traced training step of a zoo model (``value_and_grad`` of a loss over
it, w.r.t. params and x), mutated anywhere, its backward included: a cotangent scaled, a
transpose given the wrong operand, an interior value used once more. Checked on its outputs
(the loss and the gradients)."""
STEP_OF = "step-"
"""``step-<model>``: the training step of a mutated zoo model: the mutation (a stop_gradient on one
path, a scale, ...) is in the forward, and the backward JAX emits for it follows it."""


def base_model(name: str) -> str:
    """The zoo model a (training-step) mutation context is built from."""
    for prefix in (TRAIN_STEP, STEP_OF):
        if name.startswith(prefix):
            return name[len(prefix):]
    return name


def tiny_model(name: str) -> ZooModel:
    model = ZOO[base_model(name)]
    return model.sized(**TINY)


def train_loss(fn):
    """The loss of the training-step contexts: every float output's ``mean(sin(out) ** 2)``."""

    def loss(*args):
        outs = [o for o in jax.tree.leaves(fn(*args)) if _is_float(o.dtype)]
        return sum(jnp.mean(jnp.sin(o.astype(jnp.float32)) ** 2) for o in outs)

    return loss


def _train_step(flat_fn, count: int):
    """``value_and_grad`` of ``train_loss(flat_fn)`` w.r.t. all ``count`` flat arguments, as a flat list."""

    def step(*flat):
        value, grads = jax.value_and_grad(train_loss(flat_fn), argnums=tuple(range(count)))(*flat)
        return [value, *grads]

    return step


@dataclass(frozen=True)
class Site:
    """One eqn that may be mutated: ``path`` indexes the flat graph (then nested bodies)."""

    path: tuple[int, ...]
    eqn: Eqn
    routing: bool  # on the routing side of the program (router, top-k, masks, gates, dispatch)
    graph: JaxprGraph = field(repr=False, compare=False, default=None)

    @property
    def name(self) -> str:
        return str(self.eqn.primitive)


_NESTED_PARAM = {"custom_jvp_call": "call_jaxpr", "scan": "jaxpr"}


def _nested_body(eqn: Eqn):
    param = _NESTED_PARAM.get(str(eqn.primitive))
    return None if param is None else eqn.params[param]


@functools.lru_cache(maxsize=None)
def _body_graph(model_name: str, path: tuple[int, ...]) -> JaxprGraph:
    """The flat graph at ``path`` (``()``: the model's program; else a nested body)."""
    if not path:
        return model_context(model_name).graph
    parent = _body_graph(model_name, path[:-1])
    return build_graph(_compat.as_closed(_nested_body(parent.eqns[path[-1]])))


@dataclass(frozen=True)
class ModelContext:
    """A tiny zoo model traced once: its flat graph, argument and output trees, mutation sites."""

    name: str
    model: ZooModel
    closed: Any
    graph: JaxprGraph
    in_tree: Any
    out_tree: Any
    leaf_names: tuple[str, ...]
    sites: tuple[Site, ...] = field(repr=False)
    step: str = ""  # TRAIN_STEP or STEP_OF for a training-step context: checked on its outputs only

    def args(self, seed: int):
        return self.model.args(jax.random.key(seed))


@functools.lru_cache(maxsize=None)
def model_context(name: str) -> ModelContext:
    model = tiny_model(name)
    params, x = model.args(jax.random.key(0))
    flat, in_tree = jax.tree.flatten((params, x))
    forward = lambda *a: model.fn(*jax.tree.unflatten(in_tree, a))  # noqa: E731
    step = next((prefix for prefix in (TRAIN_STEP, STEP_OF) if name.startswith(prefix)), "")
    traced = _train_step(forward, len(flat)) if step == TRAIN_STEP else forward
    closed, out_shape = jax.make_jaxpr(traced, return_shape=True)(*flat)
    graph = build_graph(closed)
    names = tuple(jax.tree_util.keystr(p) for p, _ in jax.tree_util.tree_flatten_with_path((params, x))[0])
    names = tuple(n.replace("[0]", "params", 1) if n.startswith("[0]") else "x" for n in names)
    context = ModelContext(name, model, closed, graph, in_tree, jax.tree.structure(out_shape), names, (), step)
    sites = tuple(_sites(graph, ()))
    if step == TRAIN_STEP:  # weigh the ops on dense values (the layer and its derivative) as routing sites are
        sites = tuple(dataclasses.replace(s, routing=s.routing or _on_dense_values(s.eqn)) for s in sites)
    return dataclasses.replace(context, sites=sites)


def _on_dense_values(eqn: Eqn) -> bool:
    return any(len(a.shape) >= 3 for a in (*eqn.inputs, *eqn.outputs))


def _routing_eqns(graph: JaxprGraph) -> set[int]:
    """Eqns on the routing side: ancestors of a top_k / argmax, and its descendants that do not
    depend on an expert weight (an input of rank >= 3)."""
    anchors = [e for e in graph.eqns if str(e.primitive) in ("top_k", "approx_top_k", "argmax", "argmin")]
    routing: set[int] = set()
    for anchor in anchors:
        for value in graph.ancestors(anchor.inputs[0]):
            if value in graph.producer:
                routing.add(graph.producer[value].index)
        routing.add(anchor.index)
    tainted = set(anchor_out for a in anchors for anchor_out in a.outputs)
    weighty = {v for v in graph.inputs if len(v.shape) >= 3}
    for eqn in graph.eqns:
        ins = [a for a in eqn.inputs if isinstance(a, Value)]
        if any(a in weighty for a in ins):
            weighty.update(eqn.outputs)
        if any(a in tainted for a in ins):
            tainted.update(eqn.outputs)
            if not any(o in weighty for o in eqn.outputs):
                routing.add(eqn.index)
    return routing


def _sites(graph: JaxprGraph, prefix: tuple[int, ...]) -> Iterable[Site]:
    routing = _routing_eqns(graph)
    for eqn in graph.eqns:
        path = prefix + (eqn.index,)
        yield Site(path, eqn, eqn.index in routing, graph)
        body = _nested_body(eqn)
        if body is not None:
            inner = build_graph(_compat.as_closed(body))
            inner_routing = eqn.index in routing
            for site in _sites(inner, path):
                yield dataclasses.replace(site, routing=site.routing or inner_routing)


# --------------------------------------------------------------------------------------------
# Mutation kinds: candidates(eqn) -> list of "what" strings; apply(eqn, inputs, what) -> outputs


def _bind(eqn: Eqn, inputs, primitive=None, **overrides):
    primitive = primitive or eqn.primitive
    params = {**eqn.params, **overrides}
    out = primitive.bind(*inputs, **primitive.get_bind_params(params))
    return list(out) if primitive.multiple_results else [out]


def _at_source(eqn: Eqn):
    """Eqns emitted in this context carry ``eqn``'s user source location (so ``explain`` points
    at the zoo's code, not at this interpreter)."""
    info = getattr(eqn.source, "source_info", None)
    if info is None:
        return contextlib.nullcontext()
    return source_info_util.user_context(info.traceback, name_stack=info.name_stack)


def _is_float(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.floating)


def _is_int(dtype) -> bool:
    return jnp.issubdtype(dtype, jnp.integer)


def _prim(name: str):
    return getattr(lax, f"{name}_p")


def _outputs(eqn: Eqn, predicate) -> list[tuple[int, str]]:
    """``(index, label)`` of the eqn's outputs whose dtype satisfies ``predicate``."""
    multi = len(eqn.outputs) > 1
    return [(j, f"{eqn.primitive}.out{j}" if multi else str(eqn.primitive))
            for j, out in enumerate(eqn.outputs) if predicate(out.dtype)]


def _parse_output(eqn: Eqn, label: str) -> int:
    match = re.fullmatch(r"[\w-]+(?:\.out(\d+))?", label)
    if match is None or not label.startswith(str(eqn.primitive)):
        raise ValueError(f"mutation target {label!r} does not name eqn `{eqn.primitive}`")
    return int(match.group(1) or 0)


def _output_mutation(predicate, variants, transform):
    """A kind that changes one output of the eqn: ``transform(value, variant) -> value``."""

    def candidates(eqn: Eqn) -> list[str]:
        return [f"{label},{v}" for j, label in _outputs(eqn, predicate) for v in variants(eqn.outputs[j])]

    def apply(eqn: Eqn, inputs, what: str, lookup=None):
        label, variant = what.split(",", 1)
        j = _parse_output(eqn, label)
        outs = _bind(eqn, inputs)
        outs[j] = transform(outs[j], variant)
        return outs

    return candidates, apply


# --- constant: a literal or closed-over constant operand changed


_FLOAT_CONST_OPS = {"+1": lambda v: v + 1, "x2": lambda v: v * 2, "x0.5": lambda v: v * 0.5, "neg": lambda v: -v,
                    "zero": np.zeros_like}
_INT_CONST_OPS = {"+1": lambda v: v + 1, "-1": lambda v: v - 1, "neg": lambda v: -v, "zero": np.zeros_like}
_BOOL_CONST_OPS = {"not": lambda v: ~v}


def _const_ops(dtype):
    if _is_float(dtype):
        return _FLOAT_CONST_OPS
    if _is_int(dtype):
        return _INT_CONST_OPS
    if dtype == np.bool_:
        return _BOOL_CONST_OPS
    return {}


def _changed_const(atom: Const, op: str):
    dtype = np.dtype(atom.dtype)
    old = np.asarray(atom.value)
    with np.errstate(all="ignore"):
        new = np.asarray(_const_ops(dtype)[op](old.astype(np.float64) if _is_float(dtype) else old)).astype(dtype)
    return old, new


def _constant_candidates(eqn: Eqn) -> list[str]:
    found = []
    for i, atom in enumerate(eqn.inputs):
        if not isinstance(atom, Const):
            continue
        for op in _const_ops(np.dtype(atom.dtype)):
            old, new = _changed_const(atom, op)
            if not np.array_equal(old, new, equal_nan=True):
                found.append(f"{eqn.primitive}.in{i},{op}")
    return found


def _constant_apply(eqn: Eqn, inputs, what: str, lookup=None):
    label, op = what.split(",", 1)
    i = int(re.fullmatch(r"[\w-]+\.in(\d+)", label).group(1))
    atom = eqn.inputs[i]
    if not isinstance(atom, Const):
        raise ValueError(f"input {i} of `{eqn.primitive}` is not a constant")
    _, new = _changed_const(atom, op)
    inputs = list(inputs)
    value = atom.value
    inputs[i] = new.item() if isinstance(value, (bool, int, float, np.generic)) and not isinstance(value, np.ndarray) \
        else (jnp.asarray(new) if isinstance(value, jax.Array) else new)
    if isinstance(value, np.generic):
        inputs[i] = new.astype(value.dtype)[()]
    return _bind(eqn, inputs)


# --- swap_operands: non-commutative binary ops, select_n's cases, dot_general, concatenate

_NON_COMMUTATIVE = {"sub", "div", "pow", "lt", "le", "gt", "ge", "rem", "atan2", "nextafter", "shift_left",
                    "shift_right_logical", "shift_right_arithmetic"}


def _swap_candidates(eqn: Eqn) -> list[str]:
    name = str(eqn.primitive)
    if name in _NON_COMMUTATIVE and len(eqn.inputs) == 2:
        return [name]
    if name == "select_n" and len(eqn.inputs) == 3:
        return [name]
    if name == "concatenate" and len(eqn.inputs) >= 2 and eqn.inputs[0].shape == eqn.inputs[1].shape:
        return [name]
    if name == "dot_general":
        return ["dot_general", "dot_general,transposed"]
    return []


def _swap_apply(eqn: Eqn, inputs, what: str, lookup=None):
    name = str(eqn.primitive)
    inputs = list(inputs)
    if what != name and what != "dot_general,transposed":
        raise ValueError(f"cannot swap the operands of `{name}` as {what!r}")
    if name == "select_n":
        return _bind(eqn, [inputs[0], inputs[2], inputs[1]])
    if what == "dot_general,transposed":  # the same product with its free axes swapped in the output
        (lc, rc), (lb, rb) = eqn.params["dimension_numbers"]
        return _bind(eqn, [inputs[1], inputs[0]], dimension_numbers=((rc, lc), (rb, lb)))
    inputs[0], inputs[1] = inputs[1], inputs[0]
    return _bind(eqn, inputs)


# --- replace_op: a sibling primitive

_ARITH = ("add", "sub", "mul", "max", "min", "div")
_COMPARE = ("lt", "le", "gt", "ge", "eq", "ne")
_LOGIC = ("and", "or", "xor")
_REDUCE = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod")
_UNARY = {
    "exp": ("log", "exp2", "expm1"), "log": ("exp", "log1p"), "logistic": ("tanh", "exp"), "tanh": ("logistic",),
    "erf": ("erfc",), "erfc": ("erf",), "neg": ("abs",), "abs": ("neg",), "sqrt": ("rsqrt",), "rsqrt": ("sqrt",),
    "sin": ("cos",), "cos": ("sin",), "square": ("abs",), "expm1": ("exp",), "log1p": ("log",),
}
_CUMULATIVE = ("cumsum", "cummax", "cummin", "cumprod", "cumlogsumexp")


def _replace_candidates(eqn: Eqn) -> list[str]:
    name = str(eqn.primitive)
    for family in (_ARITH, _COMPARE, _LOGIC, _REDUCE):
        if name in family:
            return [f"{name}->{other}" for other in family if other != name]
    if name in _UNARY:
        return [f"{name}->{other}" for other in _UNARY[name]]
    if name in ("argmax", "argmin"):
        return [f"{name}->{'argmin' if name == 'argmax' else 'argmax'}"]
    if name in _CUMULATIVE:
        others = [o for o in ("cumsum", "cummax", "cumprod") if o != name]
        return [f"{name}->{name}_rev"] + [f"{name}->{o}" for o in others]
    if name == "integer_pow":
        y = eqn.params["y"]
        return [f"integer_pow->integer_pow(y={z})" for z in (y - 1, y + 1) if z not in (0, 1)]
    return []


_SAMPLES: dict[str, Callable] = {
    **{name: (lambda f: lambda a, b: f(a, b))(getattr(lax, name)) for name in _ARITH + _COMPARE},
    "and": lambda a, b: lax.bitwise_and(a > 0, b > 0), "or": lambda a, b: lax.bitwise_or(a > 0, b > 0),
    "xor": lambda a, b: lax.bitwise_xor(a > 0, b > 0),
    "reduce_sum": lambda a, b: jnp.sum(a, 1), "reduce_max": lambda a, b: jnp.max(a, 1),
    "reduce_min": lambda a, b: jnp.min(a, 1), "reduce_prod": lambda a, b: jnp.prod(a, 1),
    "argmax": lambda a, b: jnp.argmax(a, 1), "argmin": lambda a, b: jnp.argmin(a, 1),
    **{name: (lambda f: lambda a, b: f(a, 0))(getattr(lax, name)) for name in ("cumsum", "cummax", "cummin", "cumprod")},
}


@functools.lru_cache(maxsize=None)
def _param_names(name: str) -> tuple[str, ...]:
    """The params a primitive's eqns carry (binary ops differ: ``mul`` has ``out_dtype``)."""
    sample = _SAMPLES.get(name) or (lambda a, b: getattr(lax, name)(a))
    closed = jax.make_jaxpr(sample)(jnp.ones((2, 3)), jnp.ones((2, 3)))

    def find(jaxpr):
        for eqn in jaxpr.eqns:
            if str(eqn.primitive) == name:
                return eqn
            for sub in eqn.params.values():
                inner = getattr(sub, "jaxpr", None)
                found = find(inner) if inner is not None and hasattr(inner, "eqns") else None
                if found is not None:
                    return found
        return None

    eqn = find(closed.jaxpr)
    if eqn is None:
        raise ValueError(f"no sample eqn of `{name}`")
    return tuple(eqn.params)


def _replace_apply(eqn: Eqn, inputs, what: str, lookup=None):
    name = str(eqn.primitive)
    source, target = what.split("->")
    if source != name:
        raise ValueError(f"{what!r} does not replace `{name}`")
    if target == f"{name}_rev":
        return _bind(eqn, inputs, reverse=not eqn.params["reverse"])
    match = re.fullmatch(r"integer_pow\(y=(-?\d+)\)", target)
    if match:
        return _bind(eqn, inputs, y=int(match.group(1)))
    primitive = _prim(target)
    defaults = {"accuracy": None, "out_dtype": None, "out_sharding": None}
    params = {k: eqn.params.get(k, defaults.get(k)) for k in _param_names(target)}
    out = primitive.bind(*inputs, **params)
    return list(out) if primitive.multiple_results else [out]


# --- output-level kinds

_FLOAT_CASTS = ("bfloat16", "float16", "int8", "bool")
_INT_CASTS = ("int8", "bool", "float16")


def _cast_variants(out):
    return _FLOAT_CASTS if _is_float(out.dtype) else _INT_CASTS


def _cast_roundtrip(value, dtype_name):
    dtype = value.dtype
    return lax.convert_element_type(lax.convert_element_type(value, jnp.dtype(dtype_name)), dtype)


_FLOAT_CLAMPS = ("[-0.5,0.5]", "[0,inf]", "[-inf,0.1]")
_INT_CLAMPS = ("[0,1]", "[1,inf]", "[-inf,2]")


def _clamp(value, bounds: str):
    lo, hi = (float(b) for b in bounds.strip("[]").split(","))
    if math.isfinite(lo):
        value = jnp.maximum(value, jnp.asarray(lo, value.dtype))
    if math.isfinite(hi):
        value = jnp.minimum(value, jnp.asarray(hi, value.dtype))
    return value


_INT_SHIFTS = {"+1": lambda v: v + jnp.asarray(1, v.dtype), "-1": lambda v: v - jnp.asarray(1, v.dtype),
               "neg": lambda v: -v, "not": lax.bitwise_not}


def _is_bool(dtype) -> bool:
    return dtype == np.bool_


def _shift_variants(out):
    return ("not",) if _is_bool(out.dtype) else ("+1", "-1", "neg")
_SCALES = {"x0.5": 0.5, "x2": 2.0, "x-1": -1.0}


def _scale(value, variant):
    return value * jnp.asarray(_SCALES[variant], value.dtype)


def _axes_variants(out):
    return [f"{op},axis{a}" for a, size in enumerate(out.shape) if size > 1 for op in ("flip", "roll")]


def _permute_axis(value, variant):
    op, axis = variant.split(",")
    axis = int(axis.removeprefix("axis"))
    return jnp.flip(value, axis) if op == "flip" else jnp.roll(value, 1, axis)


# --- slice_shift: a slice moved by one, a split's pieces swapped


def _slice_candidates(eqn: Eqn) -> list[str]:
    name = str(eqn.primitive)
    found = []
    if name == "slice":
        shape = eqn.inputs[0].shape
        for d, (start, limit) in enumerate(zip(eqn.params["start_indices"], eqn.params["limit_indices"])):
            for delta in (+1, -1):
                if start + delta >= 0 and limit + delta <= shape[d] and (start, limit) != (0, shape[d]):
                    found.append(f"slice,dim{d}{delta:+d}")
    elif name == "dynamic_slice":
        shape = eqn.inputs[0].shape
        for d, size in enumerate(eqn.params["slice_sizes"]):
            if size < shape[d]:
                found += [f"dynamic_slice,dim{d}+1", f"dynamic_slice,dim{d}-1"]
    elif name == "split":
        shapes = [o.shape for o in eqn.outputs]
        if len(shapes) >= 2 and shapes[0] == shapes[1]:
            found.append("split,swap")
    return found


def _slice_apply(eqn: Eqn, inputs, what: str, lookup=None):
    name, variant = what.split(",", 1)
    if name != str(eqn.primitive):
        raise ValueError(f"{what!r} does not move `{eqn.primitive}`")
    if name == "split":
        outs = _bind(eqn, inputs)
        outs[0], outs[1] = outs[1], outs[0]
        return outs
    match = re.fullmatch(r"dim(\d+)([+-]\d+)", variant)
    d, delta = int(match.group(1)), int(match.group(2))
    if name == "slice":
        start = list(eqn.params["start_indices"])
        limit = list(eqn.params["limit_indices"])
        start[d] += delta
        limit[d] += delta
        return _bind(eqn, inputs, start_indices=tuple(start), limit_indices=tuple(limit))
    inputs = list(inputs)
    inputs[1 + d] = inputs[1 + d] + jnp.asarray(delta, inputs[1 + d].dtype)
    return _bind(eqn, inputs)


# --- apply_twice: a value squared, a product's factor applied again


def _twice_candidates(eqn: Eqn) -> list[str]:
    found = [f"{label},square" for _, label in _outputs(eqn, _is_float)]
    if str(eqn.primitive) == "mul" and _is_float(eqn.outputs[0].dtype):
        found += [f"mul,in{i}" for i in (0, 1)]
    return found


def _twice_apply(eqn: Eqn, inputs, what: str, lookup=None):
    label, variant = what.split(",", 1)
    j = _parse_output(eqn, label)
    outs = _bind(eqn, inputs)
    if variant == "square":
        outs[j] = outs[j] * outs[j]
    else:
        factor = inputs[int(variant.removeprefix("in"))]
        outs[j] = lax.mul_p.bind(outs[j], factor) if isinstance(factor, (int, float)) else outs[j] * factor
    return outs


# --- substitute: an operand replaced by another value of the same shape and dtype


def _value_refs(graph: JaxprGraph, before: int) -> list[tuple[str, Value]]:
    """``(ref, value)`` of the graph's inputs and of the outputs of the eqns before ``before``."""
    refs = [(f"arg{n}", v) for n, v in enumerate(graph.inputs)]
    for eqn in graph.eqns[:before]:
        multi = len(eqn.outputs) > 1
        refs += [(f"eqn{eqn.index}.out{j}" if multi else f"eqn{eqn.index}", v) for j, v in enumerate(eqn.outputs)]
    return refs


def resolve_ref(graph: JaxprGraph, ref: str) -> Value:
    match = re.fullmatch(r"arg(\d+)|eqn(\d+)(?:\.out(\d+))?", ref)
    if match is None:
        raise ValueError(f"not a value reference: {ref!r}")
    if match.group(1) is not None:
        return graph.inputs[int(match.group(1))]
    return graph.eqns[int(match.group(2))].outputs[int(match.group(3) or 0)]


def _substitute_candidates(site: Site) -> list[str]:
    eqn = site.eqn
    refs = _value_refs(site.graph, eqn.index)
    found = []
    for i, atom in enumerate(eqn.inputs):
        if not isinstance(atom, Value):
            continue
        found += [f"{eqn.primitive}.in{i},{ref}" for ref, v in refs
                  if v is not atom and v.shape == atom.shape and v.dtype == atom.dtype]
    return found


def _substitute_apply(eqn: Eqn, inputs, what: str, lookup=None):
    label, ref = what.split(",", 1)
    i = int(re.fullmatch(r"[\w-]+\.in(\d+)", label).group(1))
    inputs = list(inputs)
    inputs[i] = lookup(ref)
    return _bind(eqn, inputs)


# --- extra_use: an output plus a multiple of the mean of an earlier dense value (an interior value of
# the MoE used once more, outside its own derivative)


def _extra_use_candidates(site: Site) -> list[str]:
    eqn = site.eqn
    refs = [ref for ref, v in _value_refs(site.graph, eqn.index) if len(v.shape) >= 3 and _is_float(v.dtype)]
    return [f"{label},{ref}" for _, label in _outputs(eqn, _is_float) for ref in refs]


def _extra_use_apply(eqn: Eqn, inputs, what: str, lookup=None):
    label, ref = what.split(",", 1)
    j = _parse_output(eqn, label)
    outs = _bind(eqn, inputs)
    outs[j] = outs[j] + (0.5 * jnp.mean(lookup(ref))).astype(outs[j].dtype)
    return outs


# --- negation / cancelling_pair: a term of value zero whose derivative need not be, added to a
# capacity layer's combine tensor (issue 38: a bound on its derivative must never cancel)


def _combine_candidates(variants):
    """At the eqn that computes a capacity layer's combine tensor, as the matcher finds it in the
    unmutated program."""

    def candidates(site: Site) -> list[str]:
        if not any(out in _combine_values(site.graph) for out in site.eqn.outputs):
            return []
        return [f"{site.eqn.primitive},{v}" for v in variants]

    return candidates


def _combine_values(graph: JaxprGraph) -> frozenset:
    from moe_lowering.passes.match import analyse

    if "_mutate_combines" not in graph.__dict__:
        regions, _ = analyse(graph)
        graph.__dict__["_mutate_combines"] = frozenset(r.combine[0] for r in regions if r.combine is not None)
    return graph.__dict__["_mutate_combines"]


def _st(value):
    """Zero in value, the derivative of ``value``: the straight-through idiom's residue."""
    return value - lax.stop_gradient(value)


def _zero_valued_terms(value):
    """``(off, q, rolled)``: a derivative-free 0/1 mask of where ``value`` is zero (slots the token
    does not occupy, some held by other tokens), and two values that vary there and that no bound
    can confine (``tanh``): ``value`` summed over its last axis and broadcast back (a token's gate
    on every slot of its expert), and that rolled by one along the axis before (the next expert)."""
    off = (value == 0).astype(value.dtype)
    q = jnp.tanh(jnp.broadcast_to(jnp.sum(value, axis=-1, keepdims=True), value.shape))
    return off, q, jnp.roll(q, 1, axis=-2)


def _negated_identity_contraction(value):
    """``value`` contracted over its last axis with ``-I``: ``-value`` through a dot_general whose
    derivative-free operand is negative."""
    minus_identity = -jnp.eye(value.shape[-1], dtype=value.dtype)
    return lax.dot_general(value, minus_identity, (((value.ndim - 1,), (0,)), ((), ())))


_NEGATIONS = {
    "neg_neg": lambda v, off, q, r: -(-v),
    "plus_neg_of_twice_minus_stop": lambda v, off, q, r: v + off * q + (-(off * (2 * q - lax.stop_gradient(q)))),
    "times_minus_one": lambda v, off, q, r: v + off * _st(q) + -1.0 * (off * _st(r)),
}
_CANCELLING_PAIRS = {
    "straight_through_minus_rolled": lambda v, off, q, r: v + off * _st(q) + (-(off * _st(r))),
    "twice_minus_once": lambda v, off, q, r: v + (off * (2 * _st(q)) - off * _st(q)),
    "minus_identity_contraction":
        lambda v, off, q, r: v + off * _st(q) + _negated_identity_contraction(off * _st(r)),
}


def _zero_term_apply(table):
    def apply(eqn: Eqn, inputs, what: str, lookup=None):
        (value,) = _bind(eqn, inputs)
        return [table[what.split(",", 1)[1]](value, *_zero_valued_terms(value))]

    return apply


@dataclass(frozen=True)
class Kind:
    """A mutation kind: where it applies and what it does. ``typed``: the change keeps types by
    construction; otherwise each candidate is checked by abstract evaluation before it is used."""

    name: str
    candidates: Callable[[Eqn], list[str]]
    apply: Callable[..., list]  # (eqn, inputs, what, lookup) -> outputs; lookup(ref) reads another value
    typed: bool = True
    doc: str = ""
    routing_only: Callable[[str], bool] = lambda what: False  # variants used at routing sites only
    in_context: bool = False  # candidates(site) instead of candidates(eqn): needs the site's graph

    def at(self, site: Site) -> list[str]:
        """The variants of this kind at ``site``."""
        found = self.candidates(site) if self.in_context else self.candidates(site.eqn)
        return [w for w in found if site.routing or not self.routing_only(w)]


def _output_kind(name, predicate, variants, transform, doc, routing_only=lambda what: False):
    candidates, apply = _output_mutation(predicate, variants, transform)
    return Kind(name, candidates, apply, True, doc, routing_only)


def _lossy_float_cast(what: str) -> bool:
    """A float rounded to bfloat16 / float16 inside the expert computation: the sparse path's
    other summation order (grouped GEMMs) moves a value across a rounding boundary now and then,
    a 1-ulp-of-float16 change that no exact rewrite can avoid. Routing values are read, not
    recomputed, by the rewrite, so there the round trip stays."""
    return what.endswith((",bfloat16", ",float16"))


KINDS: dict[str, Kind] = {k.name: k for k in (
    Kind("constant", _constant_candidates, _constant_apply, True,
         "a literal or closed-over constant operand: +1, x2, x0.5, -v, 0 (ints +-1, -v, 0; bools not)"),
    Kind("swap_operands", _swap_candidates, _swap_apply, False,
         "operands of sub/div/pow/lt/gt/..., select_n's two cases, dot_general, concatenate swapped"),
    Kind("replace_op", _replace_candidates, _replace_apply, False,
         "add/sub/mul/max/min/div, lt/le/gt/ge/eq/ne, reductions, argmax<->argmin, cumsum reversed or "
         "cummax/cumprod, exp/log/logistic/tanh siblings, integer_pow's exponent"),
    _output_kind("cast_roundtrip", lambda dt: _is_float(dt) or _is_int(dt), _cast_variants, _cast_roundtrip,
                 "an output cast to bfloat16/float16/int8/bool (floats) or int8/bool/float16 (ints) and back",
                 lambda what: _lossy_float_cast(what)),
    _output_kind("clamp", lambda dt: _is_float(dt) or _is_int(dt),
                 lambda out: _FLOAT_CLAMPS if _is_float(out.dtype) else _INT_CLAMPS, _clamp,
                 "an output clipped to a range"),
    _output_kind("int_shift", lambda dt: _is_int(dt) or _is_bool(dt), _shift_variants, lambda v, s: _INT_SHIFTS[s](v),
                 "an integer output (indices, positions, counts) +1, -1 or negated; a boolean mask inverted"),
    _output_kind("scale", _is_float, lambda out: tuple(_SCALES), _scale, "a float output x0.5, x2 or negated"),
    _output_kind("stop_gradient", _is_float, lambda out: ("",), lambda v, _: lax.stop_gradient(v),
                 "stop_gradient on a float output"),
    Kind("slice_shift", _slice_candidates, _slice_apply, False,
         "a slice's window moved by one along one axis; a split's first two pieces swapped"),
    Kind("apply_twice", _twice_candidates, _twice_apply, True,
         "a float output squared; a product multiplied again by one of its factors (a weight applied twice)"),
    _output_kind("permute_axis", lambda dt: True, _axes_variants, _permute_axis,
                 "an output reversed (flip) or rotated by one (roll) along one axis"),
    Kind("substitute", _substitute_candidates, _substitute_apply, True,
         "an operand replaced by another value of the same shape and dtype computed earlier "
         "(e.g. router probabilities for a one-hot mask, dispatch for combine)", in_context=True),
    Kind("extra_use", _extra_use_candidates, _extra_use_apply, True,
         "a float output plus half the mean of an earlier value of rank >= 3 (in a training step: an interior "
         "value of the MoE read once more)", in_context=True),
    Kind("negation", _combine_candidates(_NEGATIONS), _zero_term_apply(_NEGATIONS), True,
         "a capacity layer's combine tensor v gets -(-v), or a zero term written with neg "
         "with a derivative where v is zero (m): v + m*q + (-(m*(2q - stop_gradient(q)))), v + m*st(q) + "
         "-1.0*(m*st(q'))",
         in_context=True),
    Kind("cancelling_pair", _combine_candidates(_CANCELLING_PAIRS), _zero_term_apply(_CANCELLING_PAIRS), True,
         "the same, a pair whose values cancel: v + m*st(q) + (-(m*st(roll(q)))), v + (m*(2*st(q)) - m*st(q)), "
         "v + m*st(q) + (m*st(roll(q))) @ -I; st(q) = q - stop_gradient(q)", in_context=True),
)}
STEP_KINDS: tuple[str, ...] = ("extra_use",)  # meant for training steps (tests/passes/test_train_step.py)
KIND_NAMES: tuple[str, ...] = tuple(k for k in KINDS if k not in STEP_KINDS)


# --------------------------------------------------------------------------------------------
# Mutants


@dataclass(frozen=True)
class Mutant:
    """One mutation of one zoo model. ``path == ()`` is the unmutated program (kind ``identity``)."""

    model: str
    path: tuple[int, ...]
    kind: str
    what: str

    @property
    def id(self) -> str:
        if not self.path:
            return f"{self.model}/identity"
        return f"{self.model}/eqn{'.'.join(map(str, self.path))}:{self.kind}({self.what})"

    @property
    def context(self) -> ModelContext:
        return model_context(self.model)

    @property
    def site(self) -> Eqn | None:
        if not self.path:
            return None
        return _body_graph(self.model, self.path[:-1]).eqns[self.path[-1]]

    def describe(self) -> str:
        if not self.path:
            return "the unmutated program"
        eqn = self.site
        ins = ", ".join(_atom_str(a) for a in eqn.inputs)
        outs = ", ".join(_atom_str(o) for o in eqn.outputs)
        where = eqn.where()
        if not where or where == "?":
            where = "inside " + _enclosing_jits(self.model).get(id(eqn.source), "?")
        return f"{self.kind}({self.what}) at `{outs} = {eqn.primitive}({ins})` (source {where})"

    def flat_fn(self, *flat_args):
        """The mutated program on flat arguments; a list of flat outputs."""
        if self.context.step == STEP_OF:  # the mutated forward, then its training step
            return _train_step(lambda *a: _run(self.model, (), a, self), len(flat_args))(*flat_args)
        return _run(self.model, (), flat_args, self)

    def fn(self, params, x):
        """``mutant_fn(params, x)``: the zoo model's call signature."""
        context = self.context
        flat = jax.tree.leaves((params, x))
        return jax.tree.unflatten(context.out_tree, self.flat_fn(*flat))

    def args(self, seed: int = 0):
        return self.context.args(seed)


@functools.lru_cache(maxsize=None)
def _enclosing_jits(model: str) -> dict[int, str]:
    """``id(JaxprEqn) -> "jit(one_hot)"`` for eqns of the model's program that sit inside a jit
    the graph inlined (they carry no user source location of their own)."""
    found: dict[int, str] = {}

    def walk(jaxpr, name):
        for eqn in jaxpr.eqns:
            if name:
                found[id(eqn)] = name
            for param in eqn.params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    inner = getattr(sub, "jaxpr", sub)
                    if hasattr(inner, "eqns"):
                        is_jit = eqn.primitive in (_compat.jit_p, _compat.closed_call_p)
                        walk(inner, f"jit({eqn.params.get('name', '?')})" if is_jit else name)

    walk(model_context(model).closed.jaxpr, "")
    return found


def _atom_str(atom) -> str:
    if isinstance(atom, Const):
        value = np.asarray(atom.value)
        shown = value.item() if value.size == 1 else f"const{list(value.shape)}"
        return f"{shown}:{atom.dtype}"
    return f"{np.dtype(atom.dtype).name}{list(atom.shape)}"


def _run(model: str, prefix: tuple[int, ...], args, mutant: Mutant | None):
    """Evaluates the graph at ``prefix`` with ``bind``; the eqn at ``mutant.path`` is mutated."""
    graph = _body_graph(model, prefix)
    env = dict(zip(graph.inputs, args))
    depth = len(prefix)
    target = mutant.path[depth] if mutant is not None and len(mutant.path) > depth \
        and mutant.path[:depth] == prefix else None

    def read(atom):
        return atom.value if isinstance(atom, Const) else env[atom]

    for eqn in graph.eqns:
        inputs = [read(a) for a in eqn.inputs]
        with _at_source(eqn):
            if eqn.index != target:
                outputs = _bind(eqn, inputs)
            elif len(mutant.path) == depth + 1:
                outputs = KINDS[mutant.kind].apply(eqn, inputs, mutant.what,
                                                   lambda ref: env[resolve_ref(graph, ref)])
            else:
                outputs = _run_nested(model, prefix + (eqn.index,), eqn, inputs, mutant)
        env.update(zip(eqn.outputs, outputs))
    return [read(a) for a in graph.outputs]


def _run_nested(model, path, eqn: Eqn, inputs, mutant: Mutant):
    name = str(eqn.primitive)
    if name == "custom_jvp_call":  # the mutated body, inlined: its derivative becomes autodiff's
        return _run(model, path, inputs, mutant)
    if name == "scan":
        body = _body_graph(model, path)
        avals = [jax.ShapeDtypeStruct(v.shape, v.dtype) for v in body.inputs]
        new_body = jax.make_jaxpr(lambda *a: _run(model, path, a, mutant))(*avals)
        return list(eqn.primitive.bind(*inputs, **{**eqn.params, "jaxpr": new_body}))
    raise ValueError(f"cannot mutate inside `{name}`")


def _well_typed(mutant: Mutant) -> bool:
    """The mutated eqn evaluates abstractly to its original output shapes and dtypes."""
    eqn = mutant.site
    kind = KINDS[mutant.kind]
    values = [i for i, a in enumerate(eqn.inputs) if not isinstance(a, Const)]

    def mutated(*abstract):
        inputs = [a.value if isinstance(a, Const) else None for a in eqn.inputs]
        for i, v in zip(values, abstract):
            inputs[i] = v
        return kind.apply(eqn, inputs, mutant.what)

    try:
        outs = jax.eval_shape(mutated, *[jax.ShapeDtypeStruct(eqn.inputs[i].shape, eqn.inputs[i].dtype) for i in values])
    except Exception:  # noqa: BLE001 - a sibling op that does not take these operands: not a site
        return False
    return len(outs) == len(eqn.outputs) and all(
        tuple(o.shape) == tuple(v.shape) and o.dtype == v.dtype for o, v in zip(outs, eqn.outputs))


def _stable_seed(*parts) -> int:
    return zlib.crc32("/".join(map(str, parts)).encode())


def candidates(model: str, kind: str) -> list[tuple[Mutant, float]]:
    """Every ``(mutant, weight)`` of ``kind`` in ``model`` (not yet checked for types);
    routing-side sites weigh 4, others 1."""
    found = []
    for site in model_context(model).sites:
        for what in KINDS[kind].at(site):
            found.append((Mutant(model, site.path, kind, what), 4.0 if site.routing else 1.0))
    return found


def sample(model: str, kind: str, count: int, seed: int = 0) -> list[Mutant]:
    """``count`` distinct well-typed mutants of ``kind`` in ``model`` (fewer if there are not as
    many), drawn by weight without replacement; deterministic in ``seed``."""
    rng = np.random.default_rng(_stable_seed(model, kind, seed))
    pool = candidates(model, kind)
    if not pool:
        return []
    weights = np.array([w for _, w in pool])
    order = np.argsort(-rng.random(len(pool)) ** (1.0 / weights))  # weighted sampling without replacement
    chosen = []
    for i in order:
        mutant = pool[i][0]
        if KINDS[kind].typed or _well_typed(mutant):
            chosen.append(mutant)
            if len(chosen) == count:
                break
    return chosen


def generate(per_kind: int = 3, seed: int = 0, models: Sequence[str] = MODELS,
             kinds: Sequence[str] = KIND_NAMES, identity: bool = True) -> list[Mutant]:
    """``per_kind`` mutants of every kind in every model, plus each model's unmutated program."""
    out = []
    for model in models:
        if identity:
            out.append(Mutant(model, (), "identity", ""))
        for kind in kinds:
            out.extend(sample(model, kind, per_kind, seed))
    return out


_ID = re.compile(r"^(?P<model>[\w-]+)/(?:identity|eqn(?P<path>\d+(?:\.\d+)*):(?P<kind>\w+)\((?P<what>.*)\))$")


def mutant_from_id(mutant_id: str) -> Mutant:
    """The mutant named by ``mutant_id`` (as ``Mutant.id`` writes it)."""
    match = _ID.match(mutant_id.strip())
    if match is None:
        raise ValueError(f"not a mutant id: {mutant_id!r}")
    if match.group("path") is None:
        return Mutant(match.group("model"), (), "identity", "")
    mutant = Mutant(match.group("model"), tuple(int(p) for p in match.group("path").split(".")), match.group("kind"),
                    match.group("what"))
    if mutant.kind not in KINDS:
        raise ValueError(f"unknown mutation kind {mutant.kind!r}; kinds are {', '.join(KINDS)}")
    site = next((s for s in model_context(mutant.model).sites if s.path == mutant.path), None)
    if site is None:
        raise ValueError(f"{mutant_id}: {mutant.model} has no eqn at {mutant.path}")
    if mutant.what not in KINDS[mutant.kind].at(site):
        raise ValueError(f"{mutant_id}: `{mutant.site.primitive}` has no mutation {mutant.kind}({mutant.what})")
    return mutant


# --------------------------------------------------------------------------------------------
# The oracle


TOLERANCE = 1e-5
NOISE_FLOOR = 0.1
"""Each output's and gradient's error is relative to its own norm, floored at ``NOISE_FLOOR`` times
the largest output or gradient norm of the program: a gradient that is all float32 rounding noise
(say 3e-7 next to gradients of norm 10, where a mutation makes it vanish mathematically) is then
compared absolutely at ``1e-6`` of the program's scale, not relatively at ``1e-5`` of itself."""


def finite_relative_error(ref, new, floor: float = 0.0) -> float:
    """``relative_error`` over the entries finite in both, ignoring where NaNs and infinities are."""
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    new = np.asarray(jnp.asarray(new, jnp.float32), np.float64)
    both = np.isfinite(ref) & np.isfinite(new)
    scale = max(float(np.linalg.norm(ref[both])), floor)
    diff = float(np.linalg.norm(ref[both] - new[both]))
    return diff / scale if scale > 0 else diff


def relative_error(ref, new, floor: float = 0.0) -> float:
    """``|new - ref| / max(|ref|, floor)`` in norm over the finite entries (absolute if both are
    zero); ``inf`` when NaNs or infinities are not in the same places with the same values."""
    ref = np.asarray(jnp.asarray(ref, jnp.float32), np.float64)
    new = np.asarray(jnp.asarray(new, jnp.float32), np.float64)
    if ref.shape != new.shape:
        return math.inf
    if not np.array_equal(np.isnan(ref), np.isnan(new)):
        return math.inf
    infinite = np.isinf(ref)
    if not np.array_equal(infinite, np.isinf(new)) or not np.array_equal(ref[infinite], new[infinite]):
        return math.inf
    finite = np.isfinite(ref)
    diff = float(np.linalg.norm(ref[finite] - new[finite]))
    scale = max(float(np.linalg.norm(ref[finite])), floor)
    return diff / scale if scale > 0 else diff


def _finite_norm(value) -> float:
    value = np.asarray(jnp.asarray(value, jnp.float32), np.float64)
    return float(np.linalg.norm(value[np.isfinite(value)]))


@dataclass
class Outcome:
    """What the pass did with one mutant.

    ``status``: ``exact`` (rewritten, outputs and gradients within tolerance), ``declined``
    (nothing rewritten), ``wrong`` (rewritten, and some output or gradient differs), ``crashed``
    (the pass or the rewritten program raised) or ``invalid`` (the mutant itself cannot be traced
    or evaluated: not the pass's fault).
    """

    mutant: Mutant
    status: str
    regions: tuple[str, ...] = ()
    near_misses: tuple[str, ...] = ()
    errors: dict = field(default_factory=dict)
    exception: str = ""
    seconds: float = 0.0
    nonfinite_only: bool = False  # wrong only in where NaNs / infinities are; finite entries agree
    sensitivity: float | None = None  # for wrong outcomes: the dense mutant's change under 1-ulp input noise
    note: str = ""  # a small error's second look (``check_mutant``'s confirm)

    @property
    def label(self) -> str:
        """``status``, with ``wrong`` split into ``wrong`` and ``wrong-nan`` (NaN placement only)."""
        return "wrong-nan" if self.status == "wrong" and self.nonfinite_only else self.status

    @property
    def worst(self) -> tuple[str, float]:
        if not self.errors:
            return ("", 0.0)
        return max(self.errors.items(), key=lambda item: (item[1], item[0]))

    @property
    def reasons(self) -> tuple[str, ...]:
        return self.near_misses

    def message(self) -> str:
        m = self.mutant
        what = self.label.upper() + (" (only where NaNs / infinities are: the finite entries agree)"
                                     if self.nonfinite_only and self.status == "wrong" else "")
        lines = [f"mutant {m.id}: {what}", f"  mutation: {m.describe()}"]
        if self.regions:
            lines.append("  region(s) rewritten:")
            lines += ["    " + line for r in self.regions for line in r.splitlines()]
        if self.near_misses:
            lines.append("  near misses:")
            lines += ["    " + line for r in self.near_misses for line in r.splitlines()]
        if self.errors:
            bad = {k: v for k, v in self.errors.items() if not v <= TOLERANCE}
            shown = bad or self.errors
            lines.append(f"  relative errors {'over ' + str(TOLERANCE) if bad else ''}: " + ", ".join(
                f"{k}={v:.3g}" for k, v in sorted(shown.items(), key=lambda kv: -kv[1] if kv[1] == kv[1] else 0)))
        if self.sensitivity is not None:
            lines.append(f"  (the dense mutant itself moves by {self.sensitivity:.2g} when its inputs move by one "
                         "float32 ulp: errors far above that are not rounding)")
        if self.note:
            lines.append("  " + self.note)
        if self.exception:
            lines.append("  exception: " + self.exception)
        lines.append(f"  reproduce: python -m moe_lowering.testing.mutate --id '{m.id}'")
        return "\n".join(lines)


def _vjp_program(fn, jit: bool):
    """``(flat_args, cotangents) -> (outputs, gradients)`` of ``fn`` on flat arguments.

    ``jit=False`` evaluates op by op with ``jax.disable_jit()`` (the sparse MoE's inner ``jit``
    included): every primitive's kernel is compiled once per shape and reused by later mutants,
    where a ``jit`` compiles each mutant's program afresh (several times slower on a CPU).
    """

    def run(flat, cotangents):
        outs, pullback = jax.vjp(lambda *a: list(fn(*a)), *flat)
        return outs, pullback(list(cotangents))

    if jit:
        return jax.jit(run)

    def eager(flat, cotangents):
        with jax.disable_jit():
            return jax.block_until_ready(run(flat, cotangents))

    return eager


def _short_exception(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()
    frames = traceback.extract_tb(error.__traceback__)
    where = next((f"{f.filename.split('moe_lowering/')[-1]}:{f.lineno} ({f.name})" for f in reversed(frames)
                  if "moe_lowering" in f.filename and "testing/mutate" not in f.filename), "")
    return (text[0][:300] if text else type(error).__name__) + (f" [at {where}]" if where else "")


CONFIRM_BELOW = 1e-3
"""A rewrite off by less than this (finite entries) on the first data seed is checked again on a
second one before it is called wrong: mutants such as ``exp(l - m) / m`` (a softmax divided by its
max logit) are ill-conditioned where ``m`` is near 0, and there a correct rewrite's other summation
order shows as 1e-5..1e-4 on one seed only. A real bug, even a small one (a bfloat16 rounding
skipped: 2e-3; a float16 one: 4e-5), shows on every seed."""


def check_mutant(mutant: Mutant, seed: int = 1, jit: bool = False, confirm: bool = True) -> Outcome:
    """Runs the oracle on ``mutant`` with random arguments drawn from ``seed``: the mutant is traced,
    handed to ``optimize_jaxpr`` (what ``moe_optimize`` runs), and when a region is rewritten, the
    rewritten program's outputs and gradients (a VJP with random cotangents, w.r.t. every param
    and ``x``) are compared with the mutant's own dense evaluation. A small error (below
    ``CONFIRM_BELOW``) must show on a second data seed too to count (``confirm``)."""
    outcome = _check_once(mutant, seed, jit)
    if not (confirm and outcome.status == "wrong" and not outcome.nonfinite_only):
        return outcome
    if not all(e < CONFIRM_BELOW for e in outcome.errors.values()):
        return outcome
    second = _check_once(mutant, seed + 1000, jit)
    name, err = outcome.worst
    noise = f", the dense mutant's own 1-ulp noise {outcome.sensitivity:.2g}" if outcome.sensitivity is not None else ""
    if second.status == "exact":
        outcome.status = "exact"
        outcome.note = (f"numerical: {name}={err:.2g} on data seed {seed}{noise}, exact on seed {seed + 1000} "
                        f"(worst {second.worst[1]:.2g})")
    else:
        outcome.note = f"confirmed on data seed {seed + 1000}: worst {second.worst[0]}={second.worst[1]:.3g}"
    outcome.seconds += second.seconds
    return outcome


def _check_once(mutant: Mutant, seed: int, jit: bool) -> Outcome:
    from moe_lowering.api import optimize_jaxpr

    start = time.perf_counter()
    context = mutant.context
    params, x = context.args(seed)
    flat = jax.tree.leaves((params, x))

    def done(status, **kw):
        return Outcome(mutant, status, seconds=time.perf_counter() - start, **kw)

    try:
        closed = jax.make_jaxpr(mutant.flat_fn)(*flat)
    except Exception as error:  # noqa: BLE001
        return done("invalid", exception=_short_exception(error))
    try:
        run, report = optimize_jaxpr(closed, backend="xla")
    except Exception as error:  # noqa: BLE001
        return done("crashed", exception="optimize_jaxpr: " + _short_exception(error))
    regions = tuple(r.summary() for r in report.regions)
    misses = tuple(f"{n.reason} (routing {n.routing}; at {n.location})" for n in report.near_misses)
    if not report.regions:
        return done("declined", near_misses=misses)
    if context.step:
        return _check_step_outputs(mutant, flat, run, jit, done, regions, misses)
    rng = np.random.default_rng(_stable_seed("cotangents", seed))
    cotangents = [rng.standard_normal(a.shape).astype(a.dtype) if _is_float(a.dtype)
                  else np.zeros(a.shape, jax.dtypes.float0) for a in closed.out_avals]
    try:
        ref_outs, ref_grads = _vjp_program(mutant.flat_fn, jit)(flat, cotangents)
    except Exception as error:  # noqa: BLE001
        return done("invalid", regions=regions, near_misses=misses, exception="dense mutant: " + _short_exception(error))
    try:
        new_outs, new_grads = _vjp_program(run, jit)(flat, cotangents)
    except Exception as error:  # noqa: BLE001
        return done("crashed", regions=regions, near_misses=misses, exception="rewritten: " + _short_exception(error))
    floor = NOISE_FLOOR * max(_finite_norm(v) for v in [*ref_outs, *ref_grads])
    errors = {}
    for j, (a, b) in enumerate(zip(ref_outs, new_outs)):
        errors[f"out{j}" if len(ref_outs) > 1 else "output"] = relative_error(a, b, floor)
    # A step whose dense outputs are not finite has diverged: its outputs must agree (NaN for NaN), but
    # where its gradients hold NaNs is not kept (README, "Limits worth knowing": non-finite values).
    diverged = not all(np.isfinite(np.asarray(a)).all() for a in ref_outs if _is_float(a.dtype))
    for name, a, b in zip(context.leaf_names, ref_grads, new_grads):
        if not diverged:
            errors[f"d/d{name}"] = relative_error(a, b, floor)
    ok = all(e <= TOLERANCE for e in errors.values())
    finite = [finite_relative_error(a, b, floor) for a, b in zip([*ref_outs, *ref_grads], [*new_outs, *new_grads])]
    sensitivity = None
    if not ok:  # how much the dense mutant itself moves when its inputs move by one float32 ulp
        try:
            sensitivity = _ulp_sensitivity(mutant, flat, cotangents, ref_outs, ref_grads, floor, jit, seed)
        except Exception:  # noqa: BLE001 - a diagnostic only
            sensitivity = None
    if not ok and sensitivity is not None and all(e <= max(TOLERANCE, sensitivity) for e in errors.values()):
        worst = max(errors.items(), key=lambda item: item[1])
        return done("exact", regions=regions, near_misses=misses, errors=errors, sensitivity=sensitivity,
                    note=f"numerical: {worst[0]}={worst[1]:.2g} is within the dense mutant's own change under "
                         f"1-ulp input noise ({sensitivity:.2g})")
    return done("exact" if ok else "wrong", regions=regions, near_misses=misses, errors=errors,
                nonfinite_only=not ok and all(e <= TOLERANCE for e in finite), sensitivity=sensitivity)


def _check_step_outputs(mutant, flat, run, jit, done, regions, misses) -> Outcome:
    """A training-step context: the rewritten step's outputs (loss and gradients) against the
    mutant's own dense step; no derivative of the step is taken."""

    def evaluate(fn):
        if jit:
            return jax.jit(lambda *a: list(fn(*a)))(*flat)
        with jax.disable_jit():
            return jax.block_until_ready(list(fn(*flat)))

    try:
        ref_outs = evaluate(mutant.flat_fn)
    except Exception as error:  # noqa: BLE001
        return done("invalid", regions=regions, near_misses=misses, exception="dense mutant: " + _short_exception(error))
    try:
        new_outs = evaluate(run)
    except Exception as error:  # noqa: BLE001
        return done("crashed", regions=regions, near_misses=misses, exception="rewritten: " + _short_exception(error))
    floor = NOISE_FLOOR * max(_finite_norm(v) for v in ref_outs)
    names = ("loss",) + tuple(f"d/d{n}" for n in mutant.context.leaf_names)
    # a diverged step (its loss not finite): the loss must agree, where its gradients hold NaNs is not kept
    count = 1 if not np.isfinite(np.asarray(ref_outs[0])).all() else len(ref_outs)
    errors = {name: relative_error(a, b, floor) for name, a, b in zip(names[:count], ref_outs, new_outs)}
    ok = all(e <= TOLERANCE for e in errors.values())
    finite = [finite_relative_error(a, b, floor) for a, b in zip(ref_outs, new_outs)]
    return done("exact" if ok else "wrong", regions=regions, near_misses=misses, errors=errors,
                nonfinite_only=not ok and all(e <= TOLERANCE for e in finite))


def _ulp_sensitivity(mutant, flat, cotangents, ref_outs, ref_grads, floor, jit, seed) -> float:
    """The largest relative change (finite entries, same floor) of the dense mutant's outputs and
    gradients when every input is multiplied by ``1 +- 2**-23``: an estimate of the float32 noise
    a correct rewrite may show. Errors far above it are not rounding."""
    rng = np.random.default_rng(_stable_seed("ulp", seed))
    nudged = [np.asarray(a) * (1 + rng.choice([-1.0, 1.0], np.shape(a)) * 2.0 ** -23).astype(np.asarray(a).dtype)
              for a in flat]
    outs, grads = _vjp_program(mutant.flat_fn, jit)(nudged, cotangents)
    return max(finite_relative_error(a, b, floor) for a, b in zip([*ref_outs, *ref_grads], [*outs, *grads]))


# --------------------------------------------------------------------------------------------
# The report


_STATUSES = ("exact", "declined", "wrong", "wrong-nan", "crashed", "invalid")


def report_table(outcomes: Sequence[Outcome], top_reasons: int = 3) -> str:
    """Per mutation kind: rewritten-and-exact / declined (top reasons) / WRONG (ids) / crashed.

    ``wrong-nan`` counts mutants whose rewrite is wrong only in where NaNs or infinities appear."""
    by_kind: dict[str, list[Outcome]] = collections.defaultdict(list)
    for o in outcomes:
        by_kind[o.mutant.kind].append(o)
    header = f"{'kind':<16}{'total':>6}" + "".join(f"{s.upper() if s.startswith('wrong') else s:>11}" for s in _STATUSES)
    lines = [header]
    for kind in ["identity", *KIND_NAMES, "all"]:
        group = outcomes if kind == "all" else by_kind.get(kind, [])
        if not group:
            continue
        count = collections.Counter(o.label for o in group)
        lines.append(f"{kind:<16}{len(group):>6}" + "".join(f"{count[s]:>11}" for s in _STATUSES))
    for kind in ["identity", *KIND_NAMES]:
        group = by_kind.get(kind, [])
        declined = [o for o in group if o.status == "declined"]
        wrong = [o for o in group if o.status == "wrong"]
        crashed = [o for o in group if o.status == "crashed"]
        if not (declined or wrong or crashed or any(o.note for o in group)):
            continue
        lines.append(f"\n== {kind}")
        if declined:
            reasons = collections.Counter(_reason_key(o) for o in declined)
            lines.append(f"  declined ({len(declined)}), top reasons:")
            lines += [f"    {n:>3} x {r}" for r, n in reasons.most_common(top_reasons)]
        for o in sorted(wrong, key=lambda o: o.nonfinite_only):
            name, err = o.worst
            tag = "WRONG-NAN" if o.nonfinite_only else "WRONG"
            noise = f" (ulp noise {o.sensitivity:.1g})" if o.sensitivity is not None and not o.nonfinite_only else ""
            lines.append(f"  {tag:<9} {o.mutant.id}  worst {name}={err:.3g}{noise}")
        for o in crashed:
            lines.append(f"  CRASHED   {o.mutant.id}  {o.exception}")
        for o in group:
            if o.status == "exact" and o.note:
                lines.append(f"  (exact)   {o.mutant.id}  {o.note}")
    invalid = [o for o in outcomes if o.status == "invalid"]
    if invalid:
        lines.append(f"\n{len(invalid)} invalid mutant(s) (the mutant itself fails): "
                     + ", ".join(o.mutant.id for o in invalid[:5]) + (" ..." if len(invalid) > 5 else ""))
    return "\n".join(lines)


def _reason_key(outcome: Outcome) -> str:
    if not outcome.near_misses:
        return "(no near miss: no routing decision, or one whose indices select nothing)"
    return re.sub(r" \(routing .*$", "", outcome.near_misses[0])


def outcome_record(o: Outcome) -> dict:
    """A JSON-able record of one outcome."""
    return {"id": o.mutant.id, "model": o.mutant.model, "kind": o.mutant.kind, "status": o.label,
            "mutation": o.mutant.describe(), "regions": list(o.regions), "near_misses": list(o.near_misses),
            "errors": {k: (v if math.isfinite(v) else str(v)) for k, v in o.errors.items()},
            "exception": o.exception, "seconds": round(o.seconds, 3), "ulp_sensitivity": o.sensitivity,
            "note": o.note}


def run_mutants(mutants: Sequence[Mutant], seed: int = 1, progress: Callable[[Outcome], None] | None = None,
                jit: bool = False) -> list[Outcome]:
    outcomes = []
    for mutant in mutants:
        outcome = check_mutant(mutant, seed, jit)
        outcomes.append(outcome)
        if progress:
            progress(outcome)
    return outcomes


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m moe_lowering.testing.mutate", description=__doc__.split("\n\n")[0])
    parser.add_argument("--per-kind", type=int, default=3, help="mutants per (model, kind) (default 3)")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed (default 0)")
    parser.add_argument("--data-seed", type=int, default=1, help="seed of the random params and inputs (default 1)")
    parser.add_argument("--models", nargs="*", default=list(MODELS), help="zoo models (default: all)")
    parser.add_argument("--kinds", nargs="*", default=list(KIND_NAMES), help="mutation kinds (default: all)")
    parser.add_argument("--id", action="append", default=[], help="check these mutant ids only (repeatable)")
    parser.add_argument("--list", action="store_true", help="list the mutant ids and exit")
    parser.add_argument("--verbose", "-v", action="store_true", help="print every WRONG/CRASHED outcome in full")
    parser.add_argument("--json", metavar="PATH", help="also write one JSON record per mutant to PATH")
    parser.add_argument("--jit", action="store_true", help="jit each program instead of running it op by op (slower)")
    args = parser.parse_args(argv)
    if args.id:
        mutants = [mutant_from_id(i) for i in args.id]
    else:
        mutants = generate(args.per_kind, args.seed, args.models, args.kinds)
    if args.list:
        print("\n".join(m.id for m in mutants))
        return 0
    start = time.perf_counter()

    def progress(o: Outcome):
        if args.id or args.verbose and o.status in ("wrong", "crashed"):
            print(o.message(), flush=True)
        elif o.status in ("wrong", "crashed"):
            print(f"{o.label.upper():9} {o.mutant.id}", file=sys.stderr, flush=True)

    outcomes = run_mutants(mutants, args.data_seed, progress, jit=args.jit)
    if args.json:
        import json

        with open(args.json, "w") as f:
            for o in outcomes:
                f.write(json.dumps(outcome_record(o)) + "\n")
    print(report_table(outcomes))
    print(f"\n{len(outcomes)} mutants in {time.perf_counter() - start:.0f} s")
    return 1 if any(o.status in ("wrong", "crashed") for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
