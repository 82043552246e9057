"""Every assumption the sparse replacement makes, and how each one is discharged.

The sparse MoE computes ``y[t] = sum over chosen experts e of w[t, e] * program_e(x[t])``. That is
the dense reference only under the assumptions below. Each is either **proven** from the program
by the matcher (``match.py``; where the proof fails the pass declines, and ``explain`` names the
assumption), or **checked on the device** at run time, with the region's original dense
computation as the fallback (``rewrite.py``), or not assumed at all because the replacement reads
the program's own value. A ``FailedMatch`` that declines for one of these carries its ``name``.
"""

from __future__ import annotations

from dataclasses import dataclass

PROVEN = "proven"
CHECKED = "checked on device"
READ = "read from the program"

GATE_ON_TOKENS = "gate on tokens"  # the routing weights scale the tokens before the experts (x * G[t, e])
SEPARATE_EXPERTS = "separate expert weights"  # E modules' weights, stacked by the rewrite on every call
ONE_HOT_DISPATCH = "one-hot dispatch"  # the tokens masked per expert (x * one_hot), the gate at the combine
TILED_CHOICES = "tokens tiled per choice"  # [T*k, d] copies, every expert on every copy, each copy's own kept
SORTED_RANGE_MASK = "sorted range mask"  # copies sorted by expert, every expert on each, start_e <= i < end_e kept
TOP_K_STYLES = ("one-hot gate", "gather combine", "per-expert loop", "gathered weights", GATE_ON_TOKENS,
                SEPARATE_EXPERTS, ONE_HOT_DISPATCH, SORTED_RANGE_MASK, TILED_CHOICES)
CAPACITY = ("capacity", "grouped capacity")
ALL_STYLES = TOP_K_STYLES + CAPACITY


@dataclass(frozen=True)
class Assumption:
    """One fact the replacement relies on: ``statement``, for ``styles``, discharged by ``how``."""

    name: str
    styles: tuple[str, ...]
    statement: str
    discharge: str  # PROVEN, CHECKED or READ
    how: str


ASSUMPTIONS = (
    Assumption(
        "routing-indices", ALL_STYLES,
        "the masks, scatters and gathers are built from the routing decision's indices, value for value",
        PROVEN,
        "only layout changes and casts whose type holds every index in [0, E) lie between top_k / argmax and "
        "the one-hot, scatter or gather"),
    Assumption(
        "gate-support", ("one-hot gate", "per-expert loop", GATE_ON_TOKENS, SEPARATE_EXPERTS, ONE_HOT_DISPATCH),
        "the [tokens, E] gate, and its derivative, is zero off each token's chosen experts",
        PROVEN,
        "the gate is a one-hot mask, or a scatter into zeros, of the indices, changed only by products, "
        "quotients, casts and selects against zero; a NaN or infinite entry off the choice (0 * NaN) reaches "
        "the token's output, as it does in the reference"),
    Assumption(
        "gate-values", TOP_K_STYLES,
        "the routing weights",
        READ,
        "the gate the program multiplies into the expert outputs, read at the chosen experts: casts, fake "
        "quantisation and per-position factors included"),
    Assumption(
        "linear-after-gate", tuple(s for s in ALL_STYLES if s != GATE_ON_TOKENS),
        "whatever follows the routing weights in the expert computation is linear",
        PROVEN,
        "only casts, layout changes, the down-projection and the sum over experts may follow the gate"),
    Assumption(
        "gate-moves-into-rows", (GATE_ON_TOKENS,),
        "the routing weights scale each token before its experts, and each expert begins with a product by "
        "its weight",
        PROVEN,
        "the tokens broadcast over E times the [tokens, E] gate reach a product by an expert weight before "
        "anything else; the rewrite scales each routed copy of the token by its weight before the expert "
        "program (not at the combine, which would be wrong for a nonlinear body), so the body may be anything "
        "the expert program allows"),
    Assumption(
        "unrouted-experts-vanish", (GATE_ON_TOKENS,),
        "an expert given a zero row returns zero, with a finite derivative (the dense layer runs every "
        "expert on x * G[t, e], zero off the chosen experts, and sums all E outputs)",
        PROVEN,
        "the expert program evaluated on a zero row: a product of a zero row by a weight is zero (weights "
        "assumed finite), an elementwise step of zero rows and literals is evaluated there (value and partial "
        "derivatives finite), a product with a zero factor is zero; a bias or another per-expert value on "
        "the way declines"),
    Assumption(
        "expert-program", ALL_STYLES,
        "each expert computes the same per-row program from its own weights",
        PROVEN,
        "the body between the projections is elementwise (custom_jvp functions keep their derivative rules); "
        "the loop style covers every expert once, each with its own slice of one stacked weight; E separate "
        "computations stacked along an axis are expert e's at position e, one program, each reading its own "
        "weight arrays of one shape (which the rewrite stacks)"),
    Assumption(
        "unrouted-experts-finite", (ONE_HOT_DISPATCH,),
        "an expert given a zero row returns finite values, with finite derivatives (the dense layer runs every "
        "expert on the token masked to zero off its chosen experts and multiplies those outputs by a zero gate; "
        "0 * inf would be NaN)",
        PROVEN,
        "the expert program evaluated on a zero row as for unrouted-experts-vanish, its value finite (not "
        "necessarily zero); the mask is a one-hot of the indices summed over distinct choices, so it is 1 at the "
        "chosen experts and the routed rows are the tokens themselves"),
    Assumption(
        "sorted-copy-own-expert", (SORTED_RANGE_MASK,),
        "at sorted position i the range mask keeps exactly the expert of the copy sorted there, and the un-sort "
        "returns every copy's output to its own (token, choice) place",
        PROVEN,
        "the copies' expert indices are the routing's indices with the last token axis and k merged (copy n = "
        "token * k + choice); the copies are sorted ascending by exactly those indices along that axis (stable or "
        "not: the mask reads only the sorted keys), and gathered from the tokens at order // k (or from the "
        "tokens tiled per choice at order); the counts are a one-hot of those same indices summed over that axis, "
        "per sorted row (or their bincount, for one row); end = cumsum(counts) over E, start = end - counts; the "
        "mask is start_e <= i and i < end_e against an iota over the sorted positions (indices in [0, E), so "
        "positions start_e..end_e - 1 hold the copies of expert e and no other); only the E sum and casts follow "
        "the mask; the un-sort gathers by argsort of the sort order, its inverse permutation (or, for one row, "
        "sets each sorted output into zeros at the order). As with a one-hot gate, an expert's non-finite output "
        "on a copy it did not get (0 * inf) reaches the reference only"),
    Assumption(
        "copy-selects-own-expert", (TILED_CHOICES,),
        "each copy of a token keeps the output of the expert the routing chose for that same (token, choice), "
        "and the copies are split back into (token, choice) as the routing indices were merged",
        PROVEN,
        "the tiled tokens are x broadcast along a new axis of size k right after the last token axis and "
        "merged with it (copy n = token * k + choice, jnp.repeat's order), as the flattened indices of the "
        "one-hot are; the selection contracts E against that one-hot with no factor (0/1), batched over the "
        "same copies; every expert product after a selection is selected again by it; the chosen rows' copy "
        "axis is only split back into (token, k)"),
    Assumption(
        "finite-before-selection", (TILED_CHOICES,),
        "a step between an expert's product and the selection of each copy's own expert is finite, with "
        "finite partial derivatives, at every finite input (the dense layer multiplies every other expert's "
        "value there by the one-hot's 0, and 0 * inf is NaN: exp, log, a quotient or sqrt there could put a "
        "NaN into the reference that the sparse layer does not compute)",
        PROVEN,
        "only add, sub, mul, neg, max, min, abs, select, tanh, logistic, erf, sin, cos, integer powers >= 0 "
        "and casts to a type that holds every value of the input's (not float32 to float16), of a per-expert "
        "bias or constants too, may precede the selection; anything else declines. "
        "After the selection the body is on the chosen rows only: an activation after a one-hot selection "
        "is the selection of the activation"),
    Assumption(
        "private-interior", ALL_STYLES,
        "nothing outside the layer reads its dense intermediates, but the layer's own derivative",
        PROVEN,
        "every user of an interior value is inside the region, or is an op of its reverse-mode derivative "
        "(a training step): the program's ops, hash-consed over the region's operands and its output's "
        "cotangent, are jax.vjp of the dense region, and the values leaving them are cotangents of its "
        "operands (derivative_match.py); they are replaced by the sparse layer's VJP (not for capacity layers)"),
    Assumption(
        "dispatch-has-no-derivative", CAPACITY,
        "the dispatch tensor has no derivative (rows are moved by index)",
        PROVEN,
        "the dispatch tensor is computed from integers, booleans and constants only"),
    Assumption(
        "combine-derivative-in-slots", CAPACITY,
        "a bound on where the combine tensor's derivative can be non-zero exists in the program",
        PROVEN,
        "the program's own ops replayed on 0/1 indicators of its derivative-free values (derivative_support.py): "
        "a product with such a value intersects, a sum unites, a dot_general multiplies out (GShard's "
        "'GSE,GSC->GSEC' outer product), casts, annotations, layout ops, slices, sums and selects move the "
        "bound; an op outside these bounds nothing, and a bound of such unknowns alone is no proof"),
    Assumption(
        "dispatch-is-0-1", CAPACITY, "every dispatch entry is 0 or 1", CHECKED,
        "any(dispatch not in {0, 1})"),
    Assumption(
        "one-token-per-slot", CAPACITY, "no (expert, slot) receives two tokens (of one group, where token "
        "axes batched through dispatch and combine give each group its own slots)", CHECKED,
        "any(sum over each group's tokens of (dispatch != 0) > 1)"),
    Assumption(
        "at-most-k-experts", CAPACITY, "each token reaches at most the routing's k experts", CHECKED,
        "any(experts reached per token > k)"),
    Assumption(
        "empty-slots-finite", CAPACITY,
        "an expert with an empty slot gives finite values on it (the dense layer multiplies that slot's "
        "output by 0 for every token, and 0 * inf is NaN)", CHECKED,
        "the expert program on one zero row per expert (its products of zero rows are zero without reading "
        "the weights, which are assumed finite), for the experts that have an empty slot"),
    Assumption(
        "combine-within-dispatch", CAPACITY,
        "combine, and the bound on its derivative, are zero wherever the token was not dispatched",
        CHECKED, "any((combine != 0) & (dispatch == 0)), likewise for the bound; also catches NaN routing"),
)

BY_NAME = {a.name: a for a in ASSUMPTIONS}


def device_checks(style: str) -> tuple[str, ...]:
    """Names of the assumptions a region of ``style`` checks on the device."""
    return tuple(a.name for a in ASSUMPTIONS if a.discharge == CHECKED and style in a.styles)


def describe() -> str:
    """The table as text: what ``explain`` users and the README point to."""
    lines = []
    for a in ASSUMPTIONS:
        lines.append(f"{a.name} ({', '.join(a.styles)}): {a.statement}. {a.discharge}: {a.how}.")
    return "\n".join(lines)
