"""The sorted, dropless sparse MoE that every rewrite emits.

Token copies are sorted by expert (stable), gathered into contiguous groups, pushed through the
expert program with grouped GEMMs, and scattered back with the routing weights applied. Group
sizes are computed on device; nothing here synchronises with the host.

Each step is a primitive (:mod:`moe_lowering.primitives`) whose transpose is again a permutation
or a grouped GEMM: autodiff of ``lax.ragged_dot`` lowers the weight gradient to a dense dot over
all groups, so the backward is written out instead of derived. Being primitives with JVP rules
(not ``custom_vjp`` functions), they also take forward-mode autodiff: ``jax.jvp``, ``jacfwd``,
``hessian``, ``linearize``.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple, Sequence

import jax
import jax.numpy as jnp

from moe_lowering import primitives
from moe_lowering.expert_program import ExpertProgram, RowContext, evaluate, last_product_weight
from moe_lowering.kernels import Backend, get_backend


class SortedRouting(NamedTuple):
    """Token copies sorted by expert. ``N = tokens * top_k`` rows; dropped copies sort last."""

    order: jax.Array  # [N] sorted row -> flat (token * top_k + choice)
    inverse: jax.Array  # [T, k] (token, choice) -> sorted row
    token_of_row: jax.Array  # [N]
    expert_of_row: jax.Array  # [N], num_experts for dropped copies
    group_sizes: jax.Array  # [num_experts] int32, dropped copies not counted


# Up to this many (copy, expert) pairs the copies are sorted by counting (a cumulative sum over
# their one-hot experts, one scatter) instead of a comparison sort: on an H200, XLA's sort of the
# 4096 copies of an EP=4 Mixtral step alone took 31 us, a third of the step's routing.
COUNTING_SORT_MAX_PAIRS = 1 << 20


@functools.partial(jax.jit, static_argnums=1)  # a named call, so dumps and golden checks can find the sort
def _counting_sort_positions(flat, num_buckets: int):
    """Each copy's place in the stable sort of ``flat`` (values in ``[0, num_buckets)``), by counting."""
    one_hot = (flat[:, None] == jnp.arange(num_buckets, dtype=flat.dtype)[None, :]).astype(jnp.int32)
    seen = jnp.cumsum(one_hot, axis=0)  # [N, buckets]: copies of each bucket up to and including this one
    rank_in_bucket = jnp.take_along_axis(seen, flat[:, None], axis=1)[:, 0] - 1
    sizes = seen[-1]
    return (jnp.cumsum(sizes) - sizes)[flat] + rank_in_bucket


def sort_by_expert(expert_indices, num_experts: int) -> SortedRouting:
    """Stable sort of the ``[T, k]`` expert choices; indices outside ``[0, E)`` mean dropped."""
    top_k = expert_indices.shape[-1]
    flat = expert_indices.reshape(-1).astype(jnp.int32)
    flat = jnp.where((flat >= 0) & (flat < num_experts), flat, num_experts)
    num_rows = flat.shape[0]
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    if num_rows == 0:  # no tokens: nothing to sort (the counting sort reads the last row's counts)
        order = inverse = rows
    elif num_rows * (num_experts + 1) <= COUNTING_SORT_MAX_PAIRS:
        inverse = _counting_sort_positions(flat, num_experts + 1).astype(jnp.int32)
        order = jnp.zeros((num_rows,), jnp.int32).at[inverse].set(rows, unique_indices=True)
    else:
        order = jnp.argsort(flat, stable=True).astype(jnp.int32)
        inverse = jnp.zeros((num_rows,), jnp.int32).at[order].set(rows, unique_indices=True)
    inverse = inverse.reshape(expert_indices.shape)
    expert_of_row = flat[order]
    return SortedRouting(order, inverse, order // top_k, expert_of_row, _group_sizes(expert_of_row, num_experts))


def _group_sizes(expert_of_row, num_experts: int):
    """Rows per expert, from where each expert's run of sorted rows starts: one write per expert,
    where counting by scatter-add sends every row to one of ``E`` counters (on an H100, 63 us for the
    327,680 copies of SonicMoE's 1.4B-n256 layer, contended atomics)."""
    num_rows = expert_of_row.shape[0]
    if num_rows == 0:
        return jnp.zeros((num_experts,), jnp.int32)
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    starts_run = jnp.concatenate([jnp.ones((1,), bool), expert_of_row[1:] != expert_of_row[:-1]])
    # a row that starts no run goes past the end (not written), each to its own place: distinct indices
    bucket = jnp.where(starts_run, expert_of_row, num_experts + 1 + rows)
    first_row = jnp.full((num_experts + 1,), num_rows, jnp.int32).at[bucket].set(rows, mode="drop",
                                                                               unique_indices=True)
    # an expert without rows starts where the next one does
    bounds = jnp.append(jax.lax.cummin(first_row, reverse=True), num_rows)
    return (bounds[1:] - bounds[:-1])[:num_experts]


def permute(tokens, routing: SortedRouting):
    """``rows[r] = tokens[token_of_row[r]]``: one copy of each token per chosen expert.

    Its transpose adds each token's copies (accumulated in float32 or wider): ``permute`` and
    ``combine`` transpose into each other (:mod:`moe_lowering.primitives`)."""
    return primitives.permute(tokens, routing.token_of_row, routing.inverse)


def combine(rows, weights, routing: SortedRouting):
    """``out[t] = sum_j weights[t, j] * rows[inverse[t, j]]``, accumulated in float32 (or wider);
    dropped copies (the rows after the groups) contribute nothing, whatever their rows hold."""
    return primitives.combine(rows, weights, routing.inverse, routing.token_of_row, routing.order,
                              routing.group_sizes.sum())


def grouped_matmul(lhs, rhs, group_sizes, backend: str = "auto", group_offset: int = 0, preferred_element_type=None,
                   zero_outside: bool = True, expected_rows: int | None = None):
    """``lhs[r] @ rhs[group(r)]`` for rows sorted by group; backward is two more grouped products.

    Rows outside the groups are zero, or unspecified with ``zero_outside=False`` (for callers that
    never read them, e.g. the unused tail of a receive buffer sized for the worst case).
    ``expected_rows``: how many rows such a buffer's groups should hold (the kernels' tile shape
    is picked for them); ``None``: all of ``lhs``. A primitive (:mod:`moe_lowering.primitives`):
    its transpose is ``gmm`` with transposed weights (rows) and ``tgmm`` (weights), never XLA's
    ``ragged_dot`` autodiff; forward mode differentiates it into itself."""
    return primitives.gmm(lhs, rhs, group_sizes, get_backend(backend), group_offset=group_offset,
                          preferred_element_type=preferred_element_type, zero_outside=zero_outside,
                          expected_rows=expected_rows)


def grouped_matmul_cotangents(lhs, rhs, group_sizes, d_out, backend: str = "auto", group_offset: int = 0,
                              expected_rows: int | None = None):
    """``(d_lhs, d_rhs)`` of ``grouped_matmul(lhs, rhs, group_sizes)`` for the output cotangent ``d_out``."""
    kernels = get_backend(backend)
    d_lhs = primitives.gmm(d_out, rhs, group_sizes, kernels, group_offset=group_offset, transpose_rhs=True,
                           preferred_element_type=lhs.dtype, expected_rows=expected_rows)
    d_rhs = primitives.tgmm(lhs, d_out, group_sizes, kernels, num_groups=rhs.shape[0], group_offset=group_offset,
                            preferred_element_type=rhs.dtype, expected_rows=expected_rows)
    return d_lhs, d_rhs


def expert_matmul(lhs, rhs, group_sizes, backend: str = "auto", group_offset: int = 0, preferred_element_type=None,
                  zero_outside: bool = True, expected_rows: int | None = None):
    """``grouped_matmul``, or the weight's own product for a weight kept in another form.

    A weight object with a ``grouped_matmul(lhs, group_sizes, backend, group_offset,
    preferred_element_type, expected_rows)`` method multiplies itself: the FP8-gathered expert weights of
    :mod:`moe_lowering.parallel.quantize` do, so that no dequantised copy needs to exist.
    """
    own_product = getattr(rhs, "grouped_matmul", None)
    if own_product is not None:
        return own_product(lhs, group_sizes, backend, group_offset, preferred_element_type, expected_rows)
    return grouped_matmul(lhs, rhs, group_sizes, backend, group_offset, preferred_element_type, zero_outside,
                          expected_rows)


def grouped_matmul_pair(lhs, rhs_a, rhs_b, group_sizes, backend: str = "auto", group_offset: int = 0,
                        preferred_element_type=None, zero_outside: bool = True, expected_rows: int | None = None):
    """``(grouped_matmul(lhs, rhs_a, ...), grouped_matmul(lhs, rhs_b, ...))`` through the backend's
    ``gmm_pair`` (one tail launch for both on the Triton kernels; two ``gmm`` calls where it has
    none); the backward is the two products' own, their ``lhs`` cotangents added in float32."""
    return primitives.gmm_pair(lhs, rhs_a, rhs_b, group_sizes, get_backend(backend), group_offset=group_offset,
                               preferred_element_type=preferred_element_type, zero_outside=zero_outside,
                               expected_rows=expected_rows)


def expert_matmul_pair(lhs, rhs_a, rhs_b, group_sizes, backend: str = "auto", group_offset: int = 0,
                       preferred_element_type=None, zero_outside: bool = True, expected_rows: int | None = None):
    """``(expert_matmul(lhs, rhs_a, ...), expert_matmul(lhs, rhs_b, ...))``, as ``grouped_matmul_pair``
    where both weights are plain arrays of one shape and dtype (else the two products apart)."""
    plain = not any(hasattr(rhs, "grouped_matmul") for rhs in (rhs_a, rhs_b))
    if plain and rhs_a.shape == rhs_b.shape and rhs_a.dtype == rhs_b.dtype:
        return grouped_matmul_pair(lhs, rhs_a, rhs_b, group_sizes, backend, group_offset, preferred_element_type,
                                   zero_outside, expected_rows)
    return tuple(expert_matmul(lhs, rhs, group_sizes, backend, group_offset, preferred_element_type, zero_outside,
                               expected_rows)
                 for rhs in (rhs_a, rhs_b))


def grouped_swiglu_matmul(lhs, gate_rhs, up_rhs, group_sizes, backend: str = "auto", group_offset: int = 0,
                          preferred_element_type=None):
    """``silu(lhs[r] @ gate[g]) * (lhs[r] @ up[g])`` in one grouped pass; backward on ``gmm``/``tgmm``.

    The backend's fused kernel, or the jnp reference where the backend has none (e.g. CPU tests).
    The forward under differentiation also writes the two ``[M, N]`` pre-activations for the
    backward: recomputing them instead (two more grouped products) measured 18-35% slower
    forward+backward on an H200 and saved no peak memory (``benchmarks/NOTES.md``).
    """
    return primitives.swiglu_gmm(lhs, gate_rhs, up_rhs, group_sizes, get_backend(backend), group_offset=group_offset,
                                 preferred_element_type=preferred_element_type)


def swiglu_rows(gate, up, num_rows, backend: str = "auto"):
    """``silu(gate) * up`` on rows ``[0, num_rows)``, later rows unspecified (forward and derivatives).

    For buffers sized for the worst case whose tail nothing reads: on the Triton backend it costs
    the rows that arrived, not the buffer (``kernels/swiglu_rows/``), forward and backward. A
    primitive (:mod:`moe_lowering.primitives`): reverse mode runs the backend's ``swiglu_rows_grads``,
    forward mode and higher orders (Hessian-vector products) work as well.
    """
    return primitives.swiglu_rows(gate, up, num_rows, get_backend(backend))


def run_expert_program(program: ExpertProgram, params: Sequence, rows, routing: SortedRouting, *, backend="auto",
                       group_sizes=None, group_offset=0, expert_of_row=None, output_matmul=None, tokens=None):
    """The expert program on sorted ``rows``; the expert-parallel path passes its local groups.
    ``output_matmul``: see :func:`moe_lowering.expert_program.evaluate`. With ``tokens`` (``rows`` None),
    a fused SwiGLU up-projection of the rows reads them from the tokens where the backend can
    (``gather_swiglu_gmm``), and ``permute(tokens, routing)`` is made only if something else reads them."""
    num_experts = routing.group_sizes.shape[0]
    context = RowContext(
        rows=rows,
        make_rows=None if rows is not None else functools.partial(permute, tokens, routing),
        group_sizes=routing.group_sizes if group_sizes is None else group_sizes,
        expert_of_row=jnp.minimum(routing.expert_of_row, num_experts - 1) if expert_of_row is None else expert_of_row,
        token_of_row=routing.token_of_row,
        group_offset=group_offset,
    )

    def matmul(lhs, rhs, sizes, offset, preferred_element_type):
        return expert_matmul(lhs, rhs, sizes, backend, offset, preferred_element_type)

    def swiglu_matmul(lhs, gate_rhs, up_rhs, sizes, offset, preferred_element_type):
        return grouped_swiglu_matmul(lhs, gate_rhs, up_rhs, sizes, backend, offset, preferred_element_type)

    kernels = get_backend(backend)
    fused = swiglu_matmul if kernels.swiglu_gmm is not None else None
    row_swiglu = None
    if (tokens is not None and fused is not None and kernels.gather_swiglu_gmm is not None and group_sizes is None
            and group_offset == 0):

        def row_swiglu(gate_rhs, up_rhs, sizes, offset, preferred_element_type):
            return primitives.gather_swiglu_gmm(tokens, gate_rhs, up_rhs, sizes, routing.token_of_row, routing.inverse,
                                                kernels, preferred_element_type=preferred_element_type)

    return evaluate(program, params, context, matmul, swiglu_matmul=fused, swiglu_max_width=kernels.swiglu_gmm_max_n,
                    output_matmul=output_matmul, row_swiglu_matmul=row_swiglu)


def sparse_moe(tokens: jax.Array, expert_indices: jax.Array, expert_weights: jax.Array, params: Sequence[Any],
               program: ExpertProgram, *, num_experts: int, backend: Backend = "auto") -> jax.Array:
    """Dropless sorted MoE: ``out[t] = sum_j w[t, j] * program(tokens[t]; expert idx[t, j])``.

    The layer every rewrite emits, for code that already has its routing: the token copies are
    sorted by expert, run through the expert program with grouped GEMMs over only the routed rows,
    and combined with their weights (in float32 or wider). Differentiable (forward and reverse
    mode) and traceable under ``jax.jit`` and ``jax.vmap``; nothing synchronises with the host.

    Args:
        tokens: ``[T, D]`` token rows.
        expert_indices: ``[T, k]`` integer expert choices; an index outside ``[0, num_experts)``
            drops that copy (it is not computed and contributes nothing).
        expert_weights: ``[T, k]`` routing weights, one per choice.
        params: The program's inputs, in order: ``[E, K, N]`` expert weights, ``[E, F]`` per-expert
            and ``[T, F]`` per-token operands, constants (``program.param_kinds`` says which).
        program: The per-row expert computation, an ``ExpertProgram`` (the matcher lifts it from a
            dense layer; by hand, build it from :mod:`moe_lowering.expert_program`'s nodes).
        num_experts: ``E``.
        backend: The grouped-GEMM kernels: ``"auto"``, ``"xla"`` or ``"triton"`` (see
            ``moe_optimize``).

    Returns:
        ``[T, D_out]``, in ``tokens``' dtype where the program keeps it.

    Raises:
        ValueError: An unknown ``backend``.
        BackendUnavailable: ``backend="triton"`` without a CUDA GPU, Triton or ``jax_triton``.

    Examples:
        >>> import jax.numpy as jnp
        >>> from moe_lowering.expert_program import ExpertMatmul, ExpertProgram, ParamKind, RowInput, topological_nodes
        >>> from moe_lowering.sparse_moe import sparse_moe
        >>> linear = ExpertMatmul(RowInput(), 0)  # a row times its expert's weight (input 0)
        >>> program = ExpertProgram(linear, (ParamKind.EXPERT_WEIGHT,), topological_nodes(linear))
        >>> w = jnp.stack([jnp.eye(3), 2 * jnp.eye(3)])  # expert 0 keeps a row, expert 1 doubles it
        >>> tokens = jnp.arange(12.0).reshape(4, 3)
        >>> indices = jnp.array([[0, 1], [1, 1], [0, -1], [1, 0]])  # -1: a dropped copy
        >>> sparse_moe(tokens, indices, jnp.full((4, 2), 0.5), [w], program, num_experts=2)
        Array([[ 0. ,  1.5,  3. ],
               [ 6. ,  8. , 10. ],
               [ 3. ,  3.5,  4. ],
               [13.5, 15. , 16.5]], dtype=float32)
    """
    routing = sort_by_expert(expert_indices, num_experts)
    kernels = get_backend(backend)
    if _combines_in_last_product(program, params, kernels, num_experts):

        def last_product_and_combine(lhs, rhs, sizes, offset, preferred_element_type):
            return primitives.expert_combine(lhs, rhs, expert_weights, routing.inverse, routing.token_of_row,
                                             routing.order, sizes, kernels,
                                             preferred_element_type=preferred_element_type)

        return run_expert_program(program, params, None, routing, backend=backend,
                                  output_matmul=last_product_and_combine, tokens=tokens)
    out_rows = run_expert_program(program, params, None, routing, backend=backend, tokens=tokens)
    return combine(out_rows, expert_weights, routing)


COMBINE_IN_LAST_PRODUCT_MAX_WIDTH = 256
"""The widest last product (its contraction: the expert's hidden width) run with the combine as one
``expert_combine`` (0: never, to measure the two apart). On an H100 (``benchmarks/NOTES.md``) the
gathered backward products saved 5-7% forward+backward at width 256, where the ``[T*K, d]`` copies
they avoid are a large part of the step, and cost 7% at width 1024, where the products dominate."""


def _combines_in_last_product(program: ExpertProgram, params, kernels, num_experts: int) -> bool:
    """Whether the program's last product and the combine run as one piece: the program ends in a
    product by a plain ``[E, K, N]`` weight (not one that multiplies itself, e.g. FP8) at most
    ``COMBINE_IN_LAST_PRODUCT_MAX_WIDTH`` deep, and the backend has the gathered products that
    piece's backward runs on."""
    weight = last_product_weight(program, params)
    return (kernels.gather_gmm is not None and kernels.gather_tgmm is not None and weight is not None
            and not hasattr(weight, "grouped_matmul") and jnp.ndim(weight) == 3
            and jnp.shape(weight)[0] == num_experts and jnp.shape(weight)[1] <= COMBINE_IN_LAST_PRODUCT_MAX_WIDTH)
