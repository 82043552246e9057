"""A call's arguments as the traced program sees them, and the state the call writes, carried out.

``moe_optimize`` traces the decorated function once per call signature and then runs the rewritten
program on the arguments' arrays; everything else is baked in. A function that *writes* to its
arguments would lose those writes that way (the trace writes into copies), so:

* Flax NNX objects (modules, variables, RNG streams) are split into their state (``nnx.split``),
  whose arrays are inputs of the program like any other; the trace merges them back into objects,
  calls the function, and returns the state it wrote (a counter, an RNG stream's count, a batch
  statistic) as extra outputs, which are written into the caller's objects (``nnx.update``), as
  the undecorated method would have written them. Shared variables stay shared.
* Writes that cannot be carried are found and named (``StateWrites.uncarried``): a container
  argument changed in place, an array attribute of a plain Python object rebound, an NNX object's
  structure changed, a non-array value written into an NNX variable. A call whose MoE is rewritten
  then raises ``StateNotCarriedError``; one with nothing to rewrite runs the function itself.
"""

from __future__ import annotations

import dataclasses
import types
from typing import Any

import jax
import numpy as np

from moe_lowering import _compat


class StateNotCarriedError(TypeError):
    """The decorated function writes state that the rewritten program cannot carry back to the caller.

    Raised at the call that first traces it, before anything runs, so no write is lost silently.
    A ``TypeError``: the arguments are of a kind the decorator does not support. Flax NNX modules
    and optimizers among the arguments are carried (their variable writes and RNG advances come
    out of the rewritten call); a dict or list argument changed in place, or an array attribute of
    a plain Python object rebound, is not.

    Examples:
        >>> import jax
        >>> from moe_lowering import StateNotCarriedError, moe_optimize
        >>> from moe_lowering.testing.zoo import Sizes, build_mixtral
        >>> model = build_mixtral(Sizes(T=8, d=4, f=6, E=4, k=2))
        >>> params, x = model.args(jax.random.key(0))
        >>> @moe_optimize
        ... def layer(params, x, cache):
        ...     cache["x"] = x  # a write into the caller's dict: it cannot leave the rewritten program
        ...     return model.fn(params, x)
        >>> try:
        ...     layer(params, x, {})
        ... except StateNotCarriedError as err:
        ...     print(type(err).__name__)
        StateNotCarriedError
    """


def is_array(value) -> bool:
    """What the program takes as an input (as ``jax.jit`` would), everything else is baked in:
    arrays, NumPy scalars and ``jax.ShapeDtypeStruct`` (an array known by its type)."""
    return isinstance(value, (jax.Array, np.ndarray, np.generic, jax.ShapeDtypeStruct))


@dataclasses.dataclass(frozen=True)
class CallArguments:
    """One call's ``(args, kwargs)`` flattened: ``leaves`` are the tree's leaves with each NNX
    object replaced by ``None``, then the leaves of those objects' state; ``dynamic`` says which
    of them are program inputs."""

    leaves: tuple
    dynamic: tuple[bool, ...]
    tree: Any  # (args, kwargs) with NNX objects as leaves
    node_positions: tuple[int, ...]  # where the NNX objects stand among the tree's leaves
    nodes: tuple  # the caller's NNX objects, written back after the call
    graphdef: Any  # nnx.split's graph of ``nodes`` (None without any)
    state_tree: Any

    @property
    def num_tree_leaves(self) -> int:
        return len(self.leaves) - self.num_state_leaves

    @property
    def num_state_leaves(self) -> int:
        return 0 if self.state_tree is None else self.state_tree.num_leaves

    def dynamic_values(self) -> list:
        return [leaf for leaf, d in zip(self.leaves, self.dynamic) if d]

    def structure(self) -> tuple:
        """What beside the leaves one traced program depends on."""
        return self.tree, self.graphdef, self.state_tree

    def rebuild(self, dynamic_values) -> tuple[tuple, dict, tuple]:
        """``(args, kwargs, nodes)`` from the program's inputs: the NNX objects merged anew."""
        it = iter(dynamic_values)
        full = [next(it) if d else leaf for leaf, d in zip(self.leaves, self.dynamic)]
        tree_leaves, state_leaves = full[: self.num_tree_leaves], full[self.num_tree_leaves:]
        nodes = ()
        if self.nodes:
            nnx = _compat.flax_nnx()
            nodes = nnx.merge(self.graphdef, jax.tree_util.tree_unflatten(self.state_tree, state_leaves))
            for position, node in zip(self.node_positions, nodes):
                tree_leaves[position] = node
        args, kwargs = jax.tree_util.tree_unflatten(self.tree, tree_leaves)
        return args, kwargs, tuple(nodes)


def split_call(args, kwargs) -> CallArguments:
    """``(args, kwargs)`` as the program's inputs (see ``CallArguments``)."""
    is_node = _compat.nnx_is_graph_node
    tree_leaves, tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=is_node)
    node_positions = tuple(i for i, leaf in enumerate(tree_leaves) if is_node(leaf))
    nodes = tuple(tree_leaves[i] for i in node_positions)
    graphdef = state_tree = None
    state_leaves = []
    if nodes:
        graphdef, state = _compat.flax_nnx().split(nodes)
        state_leaves, state_tree = jax.tree_util.tree_flatten(state)
        tree_leaves = [None if i in node_positions else leaf for i, leaf in enumerate(tree_leaves)]
    leaves = (*tree_leaves, *state_leaves)
    return CallArguments(leaves, tuple(map(is_array, leaves)), tree, node_positions, nodes, graphdef, state_tree)


def unbind(fn) -> tuple[Any, tuple]:
    """``(function, leading arguments)``: an NNX module called as a function, or a method bound to
    one, becomes its function with the module as first argument, so that its state is an input
    of the program (read anew at every call) and its writes are carried out, as for ``self``."""
    owner = getattr(fn, "__self__", None) if isinstance(fn, types.MethodType) else None
    if owner is not None and _compat.nnx_is_graph_node(owner):
        return fn.__func__, (owner,)
    if _compat.nnx_is_graph_node(fn):
        return type(fn).__call__, (fn,)
    return fn, ()


@dataclasses.dataclass(frozen=True)
class StateWrites:
    """What a call's trace wrote: the indices of the NNX state leaves (the program returns their new
    values after the function's own outputs), and ``uncarried``, why some write cannot be carried
    out (``None`` when all can)."""

    written: tuple[int, ...]
    uncarried: str | None = None

    def write_back(self, call: CallArguments, values) -> None:
        """Writes ``values`` (the program's extra outputs) into the caller's NNX objects."""
        if not self.written:
            return
        state_leaves = list(call.leaves[call.num_tree_leaves:])
        for index, value in zip(self.written, values):
            state_leaves[index] = value
        _compat.flax_nnx().update(call.nodes, jax.tree_util.tree_unflatten(call.state_tree, state_leaves))


def traced_function(fn, call: CallArguments, name: str):
    """``(flat_fn, writes)``: ``flat_fn(*call.dynamic_values())`` returns ``(fn's outputs, the
    NNX state it wrote)``; ``writes``, a one-element list, holds the ``StateWrites`` once traced.
    The trace writes into copies only: a plain Python object's rebound array attributes are put
    back (a method's ``self`` is watched like an argument)."""
    writes: list[StateWrites] = []

    def flat_fn(*dynamic_values):
        args, kwargs, nodes = call.rebuild(dynamic_values)
        rebuilt_leaves, rebuilt_tree = jax.tree_util.tree_flatten((args, kwargs), is_leaf=_compat.nnx_is_graph_node)
        objects = _ArrayAttributes.of([leaf for leaf, d in zip(call.leaves, call.dynamic) if not d]
                                      + _bound_owner(fn))
        out = fn(*args, **kwargs)
        uncarried = objects.restore(name) or _containers_changed((args, kwargs), rebuilt_leaves, rebuilt_tree, name)
        written, values, state_uncarried = _state_written(call, nodes, dynamic_values, name)
        writes.append(StateWrites(written, uncarried or state_uncarried))
        return out, values

    return flat_fn, writes


def _bound_owner(fn) -> list:
    return [fn.__self__] if isinstance(fn, types.MethodType) else []


def _containers_changed(tree, before_leaves, before_tree, name) -> str | None:
    after, after_tree = jax.tree_util.tree_flatten_with_path(tree, is_leaf=_compat.nnx_is_graph_node)
    if after_tree != before_tree:
        return (f"{name} changed the structure of its arguments in place (an item added to or removed from a list "
                f"or dict argument); the rewritten program runs on a copy of them and cannot carry that change "
                f"back: return the new value instead")
    for (path, leaf), before in zip(after, before_leaves):
        if leaf is not before:
            return (f"{name} replaced its argument {_describe_path(path)} in place; the rewritten program runs on "
                    f"a copy of its arguments and cannot carry that write back: return the new value instead")
    return None


def _describe_path(path) -> str:
    (args_or_kwargs, *rest) = path
    head = "args" if getattr(args_or_kwargs, "idx", 0) == 0 else "kwargs"
    return head + jax.tree_util.keystr(tuple(rest))


def _state_written(call: CallArguments, nodes, dynamic_values, name) -> tuple[tuple[int, ...], list, str | None]:
    """The NNX state leaves the function wrote (their indices), their new values, and why a write
    cannot be carried (or ``None``)."""
    if not nodes:
        return (), [], None
    nnx = _compat.flax_nnx()
    graphdef, state = nnx.split(nodes)
    if graphdef != call.graphdef:
        return (), [], (f"{name} changed the structure of an NNX object it was given (an attribute or variable "
                        f"added, removed or replaced by another kind); the rewritten program carries out writes to "
                        f"existing variables only: create the attribute in __init__")
    before = _state_inputs(call, dynamic_values)
    after, paths = jax.tree_util.tree_leaves(state), _state_paths(state)
    written, values = [], []
    for index, (old, new) in enumerate(zip(before, after)):
        if new is old:
            continue
        if not call.dynamic[call.num_tree_leaves + index] or not isinstance(new, jax.Array):
            return (), [], (f"{name} wrote {type(new).__name__} {new!r:.60} into the NNX variable at {paths[index]}; "
                            f"the rewritten program carries out array values only: keep that variable's value a jax "
                            f"array")
        written.append(index)
        values.append(new)
    return tuple(written), values, None


def _state_inputs(call: CallArguments, dynamic_values) -> list:
    it = iter(dynamic_values)
    full = [next(it) if d else leaf for leaf, d in zip(call.leaves, call.dynamic)]
    return full[call.num_tree_leaves:]


def _state_paths(state) -> list[str]:
    return [jax.tree_util.keystr(path) for path, _ in jax.tree_util.tree_flatten_with_path(state)[0]]


@dataclasses.dataclass(frozen=True)
class _ArrayAttributes:
    """The array-valued attributes of the plain Python objects a call was given (baked into the
    program as they are), to find the ones the function rebinds: a write the program would lose."""

    snapshot: tuple  # (object, {attribute: value})

    @classmethod
    def of(cls, values) -> "_ArrayAttributes":
        found, seen = [], set()
        pending = [(value, 0) for value in values]
        while pending:
            value, depth = pending.pop()
            if id(value) in seen or depth > 3 or not _is_plain_object(value):
                continue
            seen.add(id(value))
            attributes = dict(vars(value))
            found.append((value, attributes))
            pending.extend((v, depth + 1) for v in attributes.values())
        return cls(tuple(found))

    def restore(self, name: str) -> str | None:
        """Puts back every array attribute the function rebound; says which (``None``: none)."""
        reason = None
        for owner, before in self.snapshot:
            now = vars(owner)
            changed = [attr for attr, value in now.items()
                       if (attr not in before and isinstance(value, jax.Array))
                       or (attr in before and before[attr] is not value
                           and (isinstance(value, jax.Array) or isinstance(before[attr], jax.Array)))]
            if changed:
                for attr in changed:  # no tracer of the trace is left behind in the caller's object
                    if attr in before:
                        setattr(owner, attr, before[attr])
                    else:
                        delattr(owner, attr)
                reason = reason or (
                    f"{name} wrote the array attribute {changed[0]!r} of the {type(owner).__name__} object it was "
                    f"given; the rewritten program is traced once and cannot carry writes to a plain Python object "
                    f"back: return the new value instead, or hold the state in a Flax NNX module (whose variable "
                    f"writes are carried)")
        return reason


def _is_plain_object(value) -> bool:
    if isinstance(value, (type, types.FunctionType, types.BuiltinFunctionType, types.MethodType,
                          types.ModuleType, jax.Array, np.ndarray)):
        return False
    return hasattr(value, "__dict__") and not _compat.nnx_is_graph_node(value)


def is_bound_linen_module(value) -> bool:
    """Whether ``value`` is a Flax Linen module bound to a scope: ``self`` inside ``init``/``apply``."""
    linen = _compat.flax_linen()
    return linen is not None and isinstance(value, linen.Module) and getattr(value, "scope", None) is not None


def linen_lifted(method, decorate):
    """A Linen module's ``method`` as a Linen lifted transform, built as ``nn.jit`` and ``nn.remat``
    are: its module's variables and RNGs enter ``decorate(pure)`` as arguments, and the variables it
    writes (parameters made at ``init``, mutable collections) come out as outputs. Traced directly,
    the method would write the trace's values into the module's scope (``UnexpectedTracerError``
    later, at best) and bake the parameters it reads into the program."""
    from flax.core import lift
    from flax.linen import transforms

    def transform(fn):
        def inner(scope_fn, repack_fn, variable_groups, rng_groups, *args, **kwargs):
            def pure(variable_groups, rng_groups, *args, **kwargs):
                scope = scope_fn(variable_groups, rng_groups)
                return fn(scope, *args, **kwargs), repack_fn(scope)

            pure.__name__ = pure.__qualname__ = getattr(method, "__qualname__", "linen_method")
            return decorate(pure)(variable_groups, rng_groups, *args, **kwargs)

        return lift.pack(inner, (True,), (True,), (True,), name="moe_optimize", enable_kwargs=True)

    return transforms.decorator_lift_transform(transform, method)
