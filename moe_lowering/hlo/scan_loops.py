"""A ``stablehlo.while`` that is a ``lax.scan``, recognised before the importer traces it.

JAX lowers ``lax.scan`` to a while loop: a counter carried from 0, ``counter < length`` as the
condition, ``counter + 1`` as its update; each ``xs`` array carried unchanged and read with
``dynamic_slice`` at the iteration's row; each stacked output carried as a buffer that the body
writes with ``dynamic_update_slice`` at that row and nothing else reads (the row is the counter, or
``length - 1 - counter`` for a reverse scan; a ``dynamic_index_in_dim`` call around the slice). A
dump of a training step whose layers are scanned holds two such loops, the forward and the backward
autodiff transposed from it; the pass joins and proves them only as scans
(``passes/scan_derivative.py``), so the importer turns a while loop that is one back into
``lax.scan``, the op JAX lowered it from, as it restores ``argmax`` or ``cumsum``.

This is a canonicalization, separate from matching: :func:`recognise` proves from the loop alone that
it computes what the scan computes, or says why not (a falsy :class:`FailedMatch`), and the loop
then stays a while loop. The proof: the condition reads one carried integer, the counter, and
constants; the counter starts at a constant and its update reads itself and constants, so the
iterations' counter values are computed (at most :data:`MAX_TRIP_COUNT`); every value the body
computes from the counter only indexes rows (its uses end at a row read's or write's index, or at the
counter's update); each row index, computed at every iteration, visits the rows ``0 .. length - 1``
in order, or in reverse order, the same for all; a row is read from an array the loop does not change,
and a buffer is written one row per iteration (the whole row, at the leading axis) with nothing else
reading it, so its initial contents do not matter. Every other carried value is a carry.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

import numpy as np
from jaxlib.mlir import ir

from moe_lowering.passes.match_core import FailedMatch

# Iterations computed to prove the trip count; a longer loop stays a while loop.
MAX_TRIP_COUNT = 1 << 16
# Side-effect-free scalar ops a row index may be computed by from the counter (they are not evaluated in
# the scan's body: every use of their results must be a row index, or the counter's update).
_INDEX_OPS = frozenset({
    "constant", "add", "subtract", "multiply", "negate", "divide", "remainder", "maximum", "minimum", "abs",
    "sign", "compare", "select", "clamp", "convert", "reshape", "broadcast_in_dim", "and", "or", "xor", "not",
    "shift_left", "shift_right_arithmetic", "shift_right_logical"})


@dataclass(frozen=True)
class RowRead:
    """A row of ``array`` (a value the loop does not change) read at the iteration's row: ``value`` is that
    row, or the row with a leading dimension of 1 where the module keeps the slice's shape."""

    value: ir.Value
    array: ir.Value  # a body block argument the loop returns unchanged, or a value from above the loop


@dataclass(frozen=True)
class StackedOutput:
    """The carried buffer at ``position``, written one row per iteration: the row written is ``row``
    (the value before its reshape to a leading dimension of 1), or ``unit`` reshaped when only that
    form exists."""

    position: int
    written: ir.Value  # the write's result, returned at ``position``
    row: ir.Value | None
    unit: ir.Value | None


@dataclass(frozen=True)
class ScanLoop:
    """A while loop proven to be ``lax.scan(length=length, reverse=reverse)``: its carried values by role."""

    length: int
    reverse: bool
    counter: int
    final_counter: np.ndarray
    carries: tuple[int, ...]
    invariant: tuple[int, ...]  # returned unchanged: the scan's consts (closed over) and xs arrays
    stacked: tuple[StackedOutput, ...]
    reads: tuple[RowRead, ...]
    skipped: frozenset  # body values not evaluated: the counter's, the row indices, the slices replaced


def _owner(value):
    owner = value.owner
    return None if isinstance(owner, ir.Block) else getattr(owner, "operation", owner)


def _short(op) -> str:
    return op.name.split(".", 1)[1] if op.name.startswith(("stablehlo.", "mhlo.")) else op.name


def _cast(cls, obj):
    try:
        return cls(obj)
    except (ValueError, TypeError):
        return None


def _shape(value) -> tuple[int, ...] | None:
    tensor = _cast(ir.RankedTensorType, value.type)
    return tuple(tensor.shape) if tensor is not None and tensor.has_static_shape else None


def _ints(op, name) -> list[int]:
    if name not in op.attributes:
        return []
    attr = op.attributes[name]
    array = _cast(ir.DenseI64ArrayAttr, attr)
    if array is not None:
        return [int(v) for v in array]
    dense = _cast(ir.DenseIntElementsAttr, attr)
    return [] if dense is None else [int(v) for v in np.asarray(dense).reshape(-1)]


class _Evaluator:
    """Scalar values computed from bound block arguments and constants alone (``None`` otherwise), through
    ``_INDEX_OPS``: ``outer(value)`` is a value from above the loop when concrete (``None`` when not; a
    ``KeyError`` for a value of the loop or of a function it calls); ``fold(op, operands)`` an op's results
    on concrete operands."""

    def __init__(self, outer: Callable, fold: Callable):
        self.outer, self.fold = outer, fold

    def __call__(self, value, bound: dict, cache: dict):
        if value in bound:
            return bound[value]
        if value not in cache:
            try:
                cache[value] = self.outer(value)
            except KeyError:
                cache[value] = self._computed(value, bound, cache)
        return cache[value]

    def _computed(self, value, bound, cache):
        op = _owner(value)
        if op is None or _short(op) not in _INDEX_OPS or not all(map(_scalar, op.results)):
            return None
        operands = [self(v, bound, cache) for v in op.operands]
        results = None if any(v is None for v in operands) else self.fold(op, operands)
        return None if results is None else results[list(op.results).index(value)]


def _zeros(values, evaluate) -> bool:
    """Every value is the constant 0 (the start of every axis but the leading one)."""
    for value in values:
        number = evaluate(value, {}, {})
        if number is None or np.size(number) != 1 or int(np.asarray(number).reshape(())) != 0:
            return False
    return True


def _callee_body(call, functions):
    """The one block of the function ``call`` (a ``func.call``) calls, or None."""
    if call.name != "func.call":
        return None
    func = functions.get(ir.FlatSymbolRefAttr(call.attributes["callee"]).value)
    return func.regions[0].blocks[0] if func is not None and len(func.regions[0].blocks) else None


def _row_slice(op, evaluate):
    """``(array, row index)`` of a ``dynamic_slice`` of one whole row at the leading axis, else None."""
    if _short(op) != "dynamic_slice" or len(op.operands) < 2:
        return None
    array, shape = op.operands[0], _shape(op.operands[0])
    if not shape or _ints(op, "slice_sizes") != [1, *shape[1:]] or not _zeros(op.operands[2:], evaluate):
        return None
    return array, op.operands[1]


def _row_update(op, evaluate):
    """``(buffer, update, row index)`` of a ``dynamic_update_slice`` of one whole row at the leading axis."""
    if _short(op) != "dynamic_update_slice" or len(op.operands) < 3:
        return None
    buffer, update = op.operands[0], op.operands[1]
    shape = _shape(buffer)
    if not shape or _shape(update) != (1, *shape[1:]) or not _zeros(op.operands[3:], evaluate):
        return None
    return buffer, update, op.operands[2]


def _unit_row(update):
    """The row that ``update`` (a leading dimension of 1) reshapes or broadcasts, else None."""
    op = _owner(update)
    if op is None or len(list(update.uses)) != 1 or _short(op) not in ("reshape", "broadcast_in_dim"):
        return None
    source = op.operands[0]
    shape = _shape(update)
    if _shape(source) != shape[1:]:
        return None
    if _short(op) == "broadcast_in_dim" and _ints(op, "broadcast_dimensions") != list(range(1, len(shape))):
        return None
    return source


def _scalar(value) -> bool:
    shape = _shape(value)
    return shape is not None and math.prod(shape) == 1


def _callee_index(block, kept: tuple, position: int, index):
    """``(argument, index)`` when ``block`` (a callee) computes ``index`` from its argument ``position`` and
    constants by scalar ops (``dynamic_index_in_dim``'s wrap of negative indices), and its other ops are
    ``kept`` or constants; else None."""
    argument = block.arguments[position]
    if _depends(index, set(block.arguments), {}) - {argument}:
        return None
    for op in (o.operation for o in block.operations):
        if op.name == "func.return" or op in kept or _short(op) == "constant":
            continue
        if _short(op) not in _INDEX_OPS or not all(_scalar(v) for v in list(op.results) + list(op.operands)):
            return None
    return argument, index


def _read_call(op, functions, evaluate):
    """``(array, row index, (argument, index in the callee))`` of a call whose callee returns
    ``reshape(dynamic_slice(a, i, 0..))``: a row of its first argument at its second."""
    block = _callee_body(op, functions)
    if block is None or len(block.arguments) != 2 or len(op.results) != 1:
        return None
    ret = [o.operation for o in block.operations][-1]
    reshape = _owner(ret.operands[0]) if len(ret.operands) == 1 else None
    sliced = _owner(reshape.operands[0]) if reshape is not None and _short(reshape) == "reshape" else None
    found = _row_slice(sliced, evaluate) if sliced is not None else None
    if found is None or found[0] != block.arguments[0] or _shape(reshape.results[0]) != _shape(found[0])[1:]:
        return None
    inner = _callee_index(block, (reshape, sliced), 1, found[1])
    return None if inner is None else (op.operands[0], op.operands[1], inner)


def _write_call(op, functions, evaluate):
    """``(buffer, row, row index, (argument, index in the callee))`` of a call whose callee writes its second
    argument as a row of its first at its third (``dynamic_update_slice(b, broadcast_in_dim(r), i, 0..)``)."""
    block = _callee_body(op, functions)
    if block is None or len(block.arguments) != 3 or len(op.results) != 1:
        return None
    ret = [o.operation for o in block.operations][-1]
    write = _owner(ret.operands[0]) if len(ret.operands) == 1 else None
    found = _row_update(write, evaluate) if write is not None else None
    if found is None:
        return None
    buffer, update, index = found
    row = _unit_row(update)
    if row is None or buffer != block.arguments[0] or row != block.arguments[1]:
        return None
    inner = _callee_index(block, (write, _owner(update)), 2, index)
    return None if inner is None else (op.operands[0], op.operands[1], op.operands[2], inner)


def _depends(value, on: set, cache: dict) -> set:
    """The values of ``on`` (one block's arguments) that ``value`` is computed from within that block."""
    if value in on:
        return {value}
    if value not in cache:
        op = _owner(value)
        scope = next(iter(on)).owner.owner if on else None  # the op owning the block
        inside = op is not None and scope is not None and op.parent == scope
        cache[value] = set().union(*(_depends(v, on, cache) for v in op.operands)) if inside else set()
    return cache[value]


def recognise(while_op, operands, *, outer: Callable, fold: Callable, functions: dict) -> ScanLoop | FailedMatch:
    """``while_op`` as a scan (module docstring), or why it is not one. ``operands`` are the loop's initial
    values as the importer holds them; ``outer(value)`` a concrete value from above the loop or None;
    ``fold(op, operands)`` an op's scalar results on concrete operands or None; ``functions`` the
    module's functions by name."""
    evaluate = _Evaluator(outer, fold)
    cond_block, body_block = while_op.regions[0].blocks[0], while_op.regions[1].blocks[0]
    cond_args, body_args = list(cond_block.arguments), list(body_block.arguments)
    condition = [o.operation for o in cond_block.operations][-1].operands[0]
    read = _depends(condition, set(cond_args), {})
    if len(read) != 1:
        return FailedMatch(f"its condition reads {len(read)} carried values, not one counter (a data-dependent trip count)")
    counter = cond_args.index(next(iter(read)))
    start = operands[counter]
    if not isinstance(start, (np.ndarray, np.generic)) or np.size(start) != 1 or np.asarray(start).dtype.kind not in "iu":
        return FailedMatch("its counter does not start at an integer constant")
    ret = [o.operation for o in body_block.operations][-1]
    returned = list(ret.operands)
    values, value = [], np.asarray(start)
    while True:
        going = evaluate(condition, {cond_args[counter]: value}, {})
        if going is None:
            return FailedMatch("its condition is not computed from the counter and constants alone")
        if not bool(np.asarray(going).reshape(())):
            break
        if len(values) == MAX_TRIP_COUNT:
            return FailedMatch(f"it runs more than {MAX_TRIP_COUNT} iterations")
        values.append(value)
        value = evaluate(returned[counter], {body_args[counter]: value}, {})
        if value is None:
            return FailedMatch("its counter's update is not computed from the counter and constants alone")
    if not values:
        return FailedMatch("it never runs its body")
    length, final = len(values), value

    # Row indices: the values computed from the counter by scalar ops; each may only index rows.
    tops = [o.operation for o in body_block.operations]
    derived = {body_args[counter]}
    for op in tops:
        if _short(op) in _INDEX_OPS and any(v in derived for v in op.operands) and all(map(_scalar, op.results)):
            derived.update(op.results)
    invariant = tuple(k for k, (arg, out) in enumerate(zip(body_args, returned)) if arg == out)
    unchanged = {body_args[k] for k in invariant}
    scope_args = set(body_args)

    def loop_invariant(array) -> bool:
        return array in unchanged or (array not in scope_args and _owner(array) not in tops)

    reads: list[RowRead] = []
    indexing: dict = {}  # each op reading or writing a row -> its row index
    replaced: set = set()  # ops whose results the scan replaces (the rows read, the writes) or drops
    for op in tops:
        found = None if op is ret or len(op.results) != 1 else (
            _row_slice(op, evaluate) or _read_call(op, functions, evaluate))
        if found is None or found[1] not in derived or not loop_invariant(found[0]):
            continue
        indexing[op] = (found[1], found[2] if len(found) > 2 else None)
        replaced.add(op)
        value = op.results[0]
        users = [u.owner.operation for u in value.uses]
        if _short(op) == "dynamic_slice" and len(users) == 1 and _short(users[0]) == "reshape" and (
                _shape(users[0].results[0]) == _shape(value)[1:]):  # the row with a leading 1, reshaped to the row
            replaced.add(users[0])
            value = users[0].results[0]
        reads.append(RowRead(value, found[0]))
    stacked: list[StackedOutput] = []
    for position, (arg, out) in enumerate(zip(body_args, returned)):
        write = _owner(out)
        if write is None or position == counter or len(list(arg.uses)) != 1 or len(list(out.uses)) != 1:
            continue
        found = _row_update(write, evaluate)
        if found is not None:
            buffer, update, index = found
            row = _unit_row(update)
            unit, inner = (None if row is not None else update), None
        else:
            found = _write_call(write, functions, evaluate)
            if found is None:
                continue
            buffer, row, index, inner = found
            unit = update = None
        if buffer != arg or index not in derived:
            continue
        stacked.append(StackedOutput(position, out, row, unit))
        indexing[write] = (index, inner)
        replaced.add(write)
        if update is not None and row is not None:
            replaced.add(_owner(update))
    for value in derived:
        for use in value.uses:
            user = use.owner.operation
            if user == ret and use.operand_number == counter:
                continue
            if user.parent != while_op:
                return FailedMatch(f"its counter is read inside a region of `{user.name}`, not only to index rows")
            if user.results and user.results[0] in derived or user in indexing and indexing[user][0] == value:
                continue
            if _row_update(user, evaluate) or _write_call(user, functions, evaluate):
                return FailedMatch(f"its counter indexes a row written by `{user.name}` into a buffer that is not "
                                   "written once per iteration and otherwise unread")
            if _row_slice(user, evaluate) or _read_call(user, functions, evaluate):
                return FailedMatch(f"its counter indexes a row read by `{user.name}` from an array the loop changes")
            return FailedMatch(f"its counter is read by `{user.name}`, not only to index rows")
    # Each row index at every iteration: the rows in order (or reverse order), the same for all.
    rows_of: dict = {}
    for index, inner in set(indexing.values()):
        rows = []
        for value in values:
            row = evaluate(index, {body_args[counter]: value}, {})
            if row is not None and inner is not None:  # the callee's own index computation
                row = evaluate(inner[1], {inner[0]: row}, {})
            if row is None:
                return FailedMatch("a row index is not computed from the counter and constants alone")
            rows.append(int(np.asarray(row).reshape(())))
        rows_of[index, inner] = tuple(rows)
    orders = set(rows_of.values())
    forward, backward = tuple(range(length)), tuple(reversed(range(length)))
    if not orders <= {forward, backward} or len(orders) > 1:
        odd = next((rows for rows in orders if rows not in (forward, backward)), backward)
        return FailedMatch(f"its rows are not each visited once in order: rows {list(odd)} over {length} iterations")
    for array in [r.array for r in reads] + [body_args[s.position] for s in stacked]:
        if _shape(array)[0] != length:
            return FailedMatch(f"an array of {_shape(array)[0]} rows is indexed over {length} iterations")
    carries = tuple(k for k in range(len(body_args))
                    if k != counter and k not in invariant and k not in {s.position for s in stacked})
    skipped = frozenset(derived | {v for op in replaced for v in op.results})
    return ScanLoop(length, orders == {backward} and length > 1, counter, np.asarray(final), carries, invariant,
                    tuple(stacked), tuple(reads), skipped)
