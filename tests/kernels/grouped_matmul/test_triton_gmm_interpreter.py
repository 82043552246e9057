"""The Triton grouped-GEMM kernels run by Triton's interpreter on the CPU, at tiny tile sizes.

This checks the kernels' on-device scheduling (per-group row tiles, persistent loop, zero rows
outside the local groups, clamped loads, K remainders, the tail kernels' units and K pieces, the
pair's tail kernel doing two products' tails, the push kernels' stores on peers) without a GPU or
jax_triton, in a child process (``interpreter_harness``).
"""

from __future__ import annotations

import numpy as np

import interpreter_harness as harness
from interpreter_harness import CASES, HostTensor, gmm_reference

if __name__ != "__main__":
    import pytest

    harness.skip_without_interpreter(pytest)

BLOCK = dict(BLOCK_M=16, BLOCK_N=16, BLOCK_K=16, GROUP_M=2)
NUM_PROGRAMS = 3


def covering(grid, classes_of):
    """The variants of ``grid`` that run: a few that together reach every class some variant of the
    grid reaches (greedy: the variant adding the most classes not yet reached, the first of equals).
    The interpreter takes seconds a case, and the full grids reach each class many times over."""
    classes = {name: frozenset(classes_of(*variant)) for name, variant in grid.items()}
    left, chosen = set().union(*classes.values()), []
    while left:
        name = max(grid, key=lambda name: len(classes[name] & left))
        chosen.append(name)
        left -= classes[name]
    return {name: grid[name] for name in grid if name in chosen}


def _tgmm_reference(lhs, grad, group_sizes, group_offset, num_groups):
    out = np.zeros((num_groups, lhs.shape[1], grad.shape[1]))
    group_of_row = harness.row_groups(group_sizes, lhs.shape[0])
    for local in range(num_groups):
        rows = group_of_row == local + group_offset
        out[local] = lhs[rows].astype(np.float64).T @ grad[rows].astype(np.float64)
    return out


GMM_VARIANTS = {f"{case}-k{k}-{'rhsT' if t else 'rhs'}": (case, k, t)
                for case in CASES for k in (24, 32) for t in (False, True)}


# Each group pattern with each weight layout; each layout with and without a K remainder.
GMM_RUN = covering(GMM_VARIANTS, lambda case, k, transpose_rhs: {("groups", case, transpose_rhs),
                                                                 ("k", transpose_rhs, k % BLOCK["BLOCK_K"])})


def _run_gmm(kernels, case, k, transpose_rhs):
    group_sizes, num_rows, group_offset, num_local = CASES[case]
    rng = np.random.default_rng(len(group_sizes) * 100 + num_rows + k)
    n = 40
    group_sizes = np.asarray(group_sizes, np.int32)
    lhs = rng.standard_normal((num_rows, k)).astype(np.float32)
    rhs_shape = (num_local, n, k) if transpose_rhs else (num_local, k, n)
    rhs = rng.standard_normal(rhs_shape).astype(np.float32)
    out = np.full((num_rows, n), np.nan, np.float32)
    kernels.gmm_kernel[(NUM_PROGRAMS,)](
        HostTensor(lhs), HostTensor(rhs), HostTensor(group_sizes), HostTensor(np.array([group_offset], np.int32)),
        HostTensor(out), M=num_rows, K=k, N=n, NUM_LOCAL_GROUPS=num_local, NUM_GROUPS=len(group_sizes),
        GROUPS_PAD=8, TRANSPOSE_RHS=transpose_rhs, NUM_PROGRAMS=NUM_PROGRAMS, COMPUTE_F32=True, **BLOCK,
    )
    return out, gmm_reference(lhs, rhs, group_sizes, group_offset, transpose_rhs)


# The weight-gradient kernels: groups reaching past the rows (clamped), groups of several row steps,
# and, for the resident kernel (BLOCK_R 16), groups of at most 16 rows (one resident block), 17-24
# (a second, half-height block) and more (a loop over the rows); program counts that split the work
# unevenly.
TGMM_CASES = {**CASES, "groups-past-rows": ([6, 10, 9], 20, 0, 3), "several-steps": ([40, 3, 33, 0], 76, 0, 4),
              "resident-blocks": ([16, 24, 17, 25, 8], 90, 0, 5)}
TGMM_VARIANTS = {f"{kernel}-{case}-p{programs}": (kernel, case, programs)
                 for kernel in ("tgmm_kernel", "tgmm_resident_kernel") for case in TGMM_CASES for programs in (3, 5)}

# Each kernel with each group pattern and each program count.
TGMM_RUN = covering(TGMM_VARIANTS, lambda kernel, case, programs: {(kernel, case), (kernel, programs)})


def _run_tgmm(kernels, kernel, case, programs):
    group_sizes, num_rows, group_offset, num_local = TGMM_CASES[case]
    rng = np.random.default_rng(len(group_sizes) * 100 + num_rows)
    k, n = 24, 40
    group_sizes = np.asarray(group_sizes, np.int32)
    lhs = rng.standard_normal((num_rows, k)).astype(np.float32)
    grad = rng.standard_normal((num_rows, n)).astype(np.float32)
    out = np.full((num_local, k, n), np.nan, np.float32)
    swizzle = {"GROUP_M": 2} if kernel == "tgmm_kernel" else {}
    getattr(kernels, kernel)[(programs,)](
        HostTensor(lhs), HostTensor(grad), HostTensor(group_sizes), HostTensor(np.array([group_offset], np.int32)),
        HostTensor(out), M=num_rows, K=k, N=n, NUM_LOCAL_GROUPS=num_local, NUM_GROUPS=len(group_sizes), GROUPS_PAD=8,
        BLOCK_K=16, BLOCK_N=16, BLOCK_R=16, NUM_PROGRAMS=programs, COMPUTE_F32=True, **swizzle,
    )
    return out, _tgmm_reference(lhs, grad, group_sizes, group_offset, num_local)


TAIL_VARIANTS = {f"{case}-k{k}-{'rhsT' if t else 'rhs'}-p{programs}": (case, k, t, programs, BLOCK)
                 for case in CASES for k in (24, 136) for t in (False, True) for programs in (3, 4, 6, 8)}

# 128-row tiles, whose tail the tail kernel does in 64-row halves: (group sizes, rows, group_offset,
# local groups), programs. A group's last row tile of 31 rows (one half active) after full ones (two);
# tails over two groups, of 64 and 65 rows (one half and two) or, in a window of the groups, of 200
# and 31; groups past M (the last tile's second half starts past M though not past its group).
HALF_BLOCK = dict(BLOCK_M=128, BLOCK_N=16, BLOCK_K=16, GROUP_M=2)
HALF_CASES = {
    "last-tile-31-rows": (([300, 159], 459, 0, 2), (6, 12, 13, 14)),
    "tail-over-two-groups": (([129, 64, 65], 258, 0, 3), (8, 11)),
    "window-tail-over-two-groups": (([10, 97, 200, 31], 338, 1, 3), (8, 10, 24)),
    "groups-past-rows": (([200, 100], 250, 0, 2), (4, 6, 8)),
}
HALF_VARIANTS = {f"{case}-k{k}-{'rhsT' if t else 'rhs'}-p{programs}": (case, k, t, programs, HALF_BLOCK)
                 for case, (_, all_programs) in HALF_CASES.items() for k in (24, 128, 136) for t in (False, True)
                 for programs in all_programs}
PUSH_CASES = [*((case, (4, 6), BLOCK) for case in ("empty-group", "group-offset-window")),
              *((case, all_programs, HALF_BLOCK) for case, (_, all_programs) in HALF_CASES.items())]
PUSH_VARIANTS = {f"{case}-k{k}-p{programs}": (case, k, False, programs, block)
                 for case, all_programs, block in PUSH_CASES for k in (24, 128) for programs in all_programs}
# The pair's tail (two products' units numbered together): whole units, some programs doing two
# of them when the pair has more units than programs (the 128-row cases), and 2, 4 and 8 pieces.
# One tail tile of 16 rows past a wave of 16 or 32 programs: 2 units, 8 pieces each.
PAIR_CASES = {"one-tail-tile": ([90, 70], 160, 0, 2)}
PAIR_VARIANTS = {
    **{f"{case}-k{k}-p{programs}": (case, k, False, programs, BLOCK)
       for case in ("empty-group", "group-offset-window") for k in (24, 128, 136) for programs in (6, 8, 12, 13, 14)},
    **{f"{case}-k{k}-p{programs}": (case, k, False, programs, BLOCK)
       for case in PAIR_CASES for k in (128, 136) for programs in (16, 32)},
    **{f"{case}-k{k}-p{programs}": (case, k, False, programs, HALF_BLOCK)
       for case, (_, all_programs) in HALF_CASES.items() for k in (24, 136) for programs in all_programs},
}
PUSH_RANKS = 2
N = 40


def _case(case):
    return CASES[case] if case in CASES else PAIR_CASES[case] if case in PAIR_CASES else HALF_CASES[case][0]


def _unit_rows(block):
    """The tail kernels' ``UNIT_M``."""
    return block["BLOCK_M"] // 2 if block["BLOCK_M"] >= 128 else block["BLOCK_M"]


def tail_units(case, k, programs, block):
    """The tail kernel's work, from the sizes as the kernels schedule it: ``(active units, pieces
    per unit)``, a unit ``(tail tile, group, first row, group end)``; ``([], None)`` when the main
    kernel keeps its tail (none past the last full wave, more than half a wave, or one K step)."""
    group_sizes, num_rows, group_offset, num_local = _case(case)
    block_m, group_m, unit_m = block["BLOCK_M"], block["GROUP_M"], _unit_rows(block)
    n_tiles, k_steps = -(-N // block["BLOCK_N"]), -(-k // block["BLOCK_K"])
    ends = np.cumsum(group_sizes)
    tiles = []  # (group, first row, group end), in the kernels' order
    for group in range(group_offset, group_offset + num_local):
        m_tiles = -(-group_sizes[group] // block_m)
        for index in range(m_tiles * n_tiles):
            band_first = index // (group_m * n_tiles) * group_m
            pm = band_first + index % (group_m * n_tiles) % min(m_tiles - band_first, group_m)
            tiles.append((group, int(ends[group]) - group_sizes[group] + pm * block_m, min(int(ends[group]), num_rows)))
    full = len(tiles) // programs * programs
    if full == len(tiles) or 2 * (len(tiles) - full) > programs or k_steps < 2:
        return [], None
    units = [(tile, group, row0 + unit_m * half, end) for tile, (group, row0, end) in enumerate(tiles[full:], full)
             for half in range(block_m // unit_m) if row0 + unit_m * half < end]
    return units, next(p for p in (8, 4, 2, 1) if p * len(units) <= programs and k_steps >= p)


def expected_counters(case, k, programs, block):
    """The tail kernel's per-unit counters after it ran: a split unit's counts its pieces, a unit
    done whole by one program leaves its own 0."""
    units, pieces = tail_units(case, k, programs, block)
    counted = len(units) if pieces and pieces > 1 else 0
    return [pieces] * counted + [0] * (programs - counted)


def pair_units(case, k, programs, block):
    """The pair's tail kernel's work: ``(units of both products, a's then b's, pieces per unit)``."""
    units, _ = tail_units(case, k, programs, block)
    if not units:
        return [], None
    k_steps = -(-k // block["BLOCK_K"])
    both = [("a", *unit) for unit in units] + [("b", *unit) for unit in units]
    return both, next(p for p in (8, 4, 2, 1) if p == 1 or (p * len(both) <= programs and k_steps >= p))


def expected_pair_counters(case, k, programs, block):
    """The pair's tail kernel's counters after it ran: a split unit's counts its pieces, whole units 0."""
    units, pieces = pair_units(case, k, programs, block)
    counted = len(units) if pieces and pieces > 1 else 0
    return [pieces] * counted + [0] * (programs - counted)


def variant_tail_kinds(case, k, transpose_rhs, programs, block):
    """What the tail of one variant exercises, from the sizes (nothing where the main kernel keeps it)."""
    units, pieces = tail_units(case, k, programs, block)
    if not units:
        return frozenset()
    kinds = {f"pieces-{pieces}"}
    if _unit_rows(block) < block["BLOCK_M"]:
        halves = [sum(unit[0] == tile for unit in units) for tile in {unit[0] for unit in units}]
        kinds.update({"one-half" if count == 1 else "two-halves" for count in halves})
    kinds.update({"over-groups"} if len({unit[1] for unit in units}) > 1 else set())
    kinds.update({"k-remainder"} if k % block["BLOCK_K"] else {"k-whole"})
    kinds.update({"rhsT"} if transpose_rhs else set())
    return frozenset(kinds)


def tail_kinds(variants):
    """What the tails of ``variants`` exercise, from the sizes."""
    return set().union(*(variant_tail_kinds(*variant) for variant in variants.values()))


def pair_kinds(case, k, programs, block):
    """What the pair's tail of one variant exercises: its cut, and a program doing two units."""
    units, pieces = pair_units(case, k, programs, block)
    if not units:
        return frozenset()
    return frozenset({f"pieces-{pieces}"} | ({"more-units-than-programs"} if len(units) > programs else set()))


def _tail_classes(case, k, transpose_rhs, programs, block):
    """Each group pattern with a tail kernel's share and without one; each tail schedule (cut,
    halves, units over two groups) at each tile height; each weight layout and K kind at each tile
    height with no tail, a tail done whole and a tail cut into K pieces (its loads from a K offset)."""
    kinds = variant_tail_kinds(case, k, transpose_rhs, programs, block)
    schedule = kinds - {"rhsT", "k-remainder", "k-whole"}
    tail = "none" if not kinds else "whole" if "pieces-1" in kinds else "pieces"
    return {("groups", case, bool(kinds)), ("schedule", block["BLOCK_M"], schedule),
            ("layout", block["BLOCK_M"], transpose_rhs, bool(k % block["BLOCK_K"]), tail)}


def _pair_classes(case, k, transpose_rhs, programs, block):
    """As ``_tail_classes``, with the pair's own cut (its units are both products')."""
    kinds = pair_kinds(case, k, programs, block) | {
        kind for kind in variant_tail_kinds(case, k, transpose_rhs, programs, block) if not kind.startswith("pieces-")}
    return {("groups", case, bool(kinds)), ("schedule", block["BLOCK_M"], bool(k % block["BLOCK_K"]), kinds)}


TAIL_RUN = covering({**TAIL_VARIANTS, **HALF_VARIANTS}, _tail_classes)
PUSH_RUN = covering(PUSH_VARIANTS, _tail_classes)
PAIR_RUN = covering(PAIR_VARIANTS, _pair_classes)


def _tail_launch(programs, block, **shapes):
    """Scratch and constants of the tail kernels, as ``grouped_matmul.triton_launch`` gives them."""
    partials = np.full(programs * _unit_rows(block) * block["BLOCK_N"], np.nan, np.float32)
    counters = np.zeros(programs, np.int32)
    return partials, counters, dict(TAIL_PAD=1 << max(0, (programs // 2 - 1).bit_length()), **shapes)


def _run_gmm_with_tail(kernels, case, k, transpose_rhs, programs, block):
    """``gmm_kernel`` leaving its tail apart, then ``gmm_tail_kernel`` into the same output."""
    group_sizes, num_rows, group_offset, num_local = _case(case)
    rng = np.random.default_rng(len(group_sizes) * 1000 + num_rows + k)
    group_sizes = np.asarray(group_sizes, np.int32)
    lhs = rng.standard_normal((num_rows, k)).astype(np.float32)
    rhs = rng.standard_normal((num_local, N, k) if transpose_rhs else (num_local, k, N)).astype(np.float32)
    out = np.full((num_rows, N), np.nan, np.float32)
    operands = [HostTensor(lhs), HostTensor(rhs), HostTensor(group_sizes), HostTensor(np.array([group_offset], np.int32))]
    common = dict(M=num_rows, K=k, N=N, NUM_LOCAL_GROUPS=num_local, NUM_GROUPS=len(group_sizes), GROUPS_PAD=8,
                  TRANSPOSE_RHS=transpose_rhs, NUM_PROGRAMS=programs, COMPUTE_F32=True, **block)
    kernels.gmm_kernel[(programs,)](*operands, HostTensor(out), TAIL_APART=True, **common)
    partials, counters, tail_common = _tail_launch(programs, block, **common)
    kernels.gmm_tail_kernel[(programs,)](*operands, HostTensor(out), HostTensor(out), HostTensor(partials),
                                         HostTensor(counters), **tail_common)
    result = harness.summary(out, gmm_reference(lhs, rhs, group_sizes, group_offset, transpose_rhs))
    return dict(result, counters=counters.tolist())


def _run_gmm_pair_with_tail(kernels, case, k, transpose_rhs, programs, block):
    """``gmm_kernel`` leaving its tail apart for ``rhs_a``, then for ``rhs_b``, then
    ``gmm_pair_tail_kernel`` doing both tails into the two outputs."""
    assert not transpose_rhs, "the pair takes weights [G, K, N]"
    group_sizes, num_rows, group_offset, num_local = _case(case)
    rng = np.random.default_rng(len(group_sizes) * 1000 + num_rows + k + 2)
    group_sizes = np.asarray(group_sizes, np.int32)
    lhs = rng.standard_normal((num_rows, k)).astype(np.float32)
    rhs_a, rhs_b = (rng.standard_normal((num_local, k, N)).astype(np.float32) for _ in range(2))
    out_a, out_b = (np.full((num_rows, N), np.nan, np.float32) for _ in range(2))
    sizes_and_offset = [HostTensor(group_sizes), HostTensor(np.array([group_offset], np.int32))]
    common = dict(M=num_rows, K=k, N=N, NUM_LOCAL_GROUPS=num_local, NUM_GROUPS=len(group_sizes), GROUPS_PAD=8,
                  NUM_PROGRAMS=programs, COMPUTE_F32=True, **block)
    for rhs, out in ((rhs_a, out_a), (rhs_b, out_b)):
        kernels.gmm_kernel[(programs,)](HostTensor(lhs), HostTensor(rhs), *sizes_and_offset, HostTensor(out),
                                        TRANSPOSE_RHS=False, TAIL_APART=True, **common)
    partials, counters, tail_common = _tail_launch(programs, block, **common)
    kernels.gmm_pair_tail_kernel[(programs,)](
        HostTensor(lhs), HostTensor(rhs_a), HostTensor(rhs_b), *sizes_and_offset, HostTensor(out_a), HostTensor(out_b),
        HostTensor(out_a), HostTensor(out_b), HostTensor(partials), HostTensor(counters), **tail_common
    )
    results = {name: harness.summary(out, gmm_reference(lhs, rhs, group_sizes, group_offset, False))
               for name, out, rhs in (("a", out_a, rhs_a), ("b", out_b, rhs_b))}
    return dict(results, counters=counters.tolist())


def _address_words(array):
    """An array's address as the two int32 words (low, high) ``peer_address.triton_kernels`` reads."""
    return np.array([array.ctypes.data], np.int64).view(np.int32)


def _run_push_with_tail(kernels, case, k, transpose_rhs, programs, block):
    """``gmm_push_kernel`` leaving its tail apart, then ``gmm_push_tail_kernel``, storing into the
    receive buffers of ``PUSH_RANKS`` peers (host arrays here) as rank 1."""
    assert not transpose_rhs, "gmm_push has no transposed weights"
    group_sizes, num_rows, group_offset, num_local = _case(case)
    rng = np.random.default_rng(len(group_sizes) * 1000 + num_rows + k + 1)
    group_sizes = np.asarray(group_sizes, np.int32)
    lhs = rng.standard_normal((num_rows, k)).astype(np.float32)
    rhs = rng.standard_normal((num_local, k, N)).astype(np.float32)
    dest_device = rng.integers(-1, PUSH_RANKS, num_rows).astype(np.int32)  # -1: the row goes nowhere
    dest_row = rng.permutation(num_rows).astype(np.int32)
    receive = np.full((PUSH_RANKS, num_rows, N), np.nan, np.float32)
    arrivals = np.zeros((PUSH_RANKS, PUSH_RANKS), np.int32)
    peer_addresses = np.concatenate([np.concatenate([_address_words(receive[peer]), _address_words(arrivals[peer])])
                                     for peer in range(PUSH_RANKS)])
    rank = 1
    operands = [HostTensor(a) for a in (lhs, rhs, group_sizes, np.array([group_offset], np.int32), dest_device,
                                        dest_row, peer_addresses, np.array([rank], np.int32))]
    main_done, tail_done = np.zeros(4, np.float32), np.zeros(4, np.float32)
    common = dict(M=num_rows, K=k, N=N, NUM_LOCAL_GROUPS=num_local, NUM_GROUPS=len(group_sizes), GROUPS_PAD=8,
                  NUM_PEERS=PUSH_RANKS, NUM_PROGRAMS=programs, COMPUTE_F32=True, **block)
    kernels.gmm_push_kernel[(programs,)](*operands, HostTensor(main_done), TAIL_APART=True, **common)
    partials, counters, tail_common = _tail_launch(programs, block, **common)
    kernels.gmm_push_tail_kernel[(programs,)](*operands, HostTensor(main_done), HostTensor(tail_done),
                                              HostTensor(partials), HostTensor(counters), **tail_common)

    product = gmm_reference(lhs, rhs, group_sizes, group_offset, False)
    expected = np.full(receive.shape, np.nan)
    group_of_row = harness.row_groups(group_sizes, num_rows)
    for row in np.flatnonzero((group_of_row >= group_offset) & (group_of_row < group_offset + num_local)
                              & (dest_device >= 0)):
        expected[dest_device[row], dest_row[row]] = product[row]
    stored = ~np.isnan(expected)
    result = harness.summary(np.where(stored, receive, 0.0), np.where(stored, expected, 0.0))
    signalled = np.zeros_like(arrivals)
    signalled[:, rank] = 2 * programs  # every program of both kernels, on every peer
    return dict(result, stray=int((~np.isnan(receive) & ~stored).sum()), counters=counters.tolist(),
                signals_ok=bool((arrivals == signalled).all()))


# gmm_sum_kernel: both contractions in one loop, K with and without a remainder, every row case.
SUM_VARIANTS = {f"{case}-k{k}-p{programs}": (case, k, programs) for case in CASES for k in (24, 32) for programs in (3, 5)}
SUM_RUN = covering(SUM_VARIANTS, lambda case, k, programs: {("groups", case), ("k", k, programs)})


def _run_gmm_sum(kernels, case, k, programs):
    group_sizes, num_rows, group_offset, num_local = CASES[case]
    rng = np.random.default_rng(len(group_sizes) * 100 + num_rows + k + programs)
    group_sizes = np.asarray(group_sizes, np.int32)
    lhs_a, lhs_b = (rng.standard_normal((num_rows, k)).astype(np.float32) for _ in range(2))
    rhs_a, rhs_b = (rng.standard_normal((num_local, N, k)).astype(np.float32) for _ in range(2))
    out = np.full((num_rows, N), np.nan, np.float32)
    kernels.gmm_sum_kernel[(programs,)](
        HostTensor(lhs_a), HostTensor(lhs_b), HostTensor(rhs_a), HostTensor(rhs_b), HostTensor(group_sizes),
        HostTensor(np.array([group_offset], np.int32)), HostTensor(out), M=num_rows, K=k, N=N,
        NUM_LOCAL_GROUPS=num_local, NUM_GROUPS=len(group_sizes), GROUPS_PAD=8, NUM_PROGRAMS=programs,
        COMPUTE_F32=True, **BLOCK,
    )
    expected = (gmm_reference(lhs_a, rhs_a, group_sizes, group_offset, True)
                + gmm_reference(lhs_b, rhs_b, group_sizes, group_offset, True))
    return out, expected


# The gathered products (the combine's backward through the last product): rows gathered from a
# source with fewer rows than the product (indices repeat, and some point outside: clamped), scaled
# per row; gather_gmm's per-column-tile dots (N = 40: three 16-column tiles, the last partial).
GATHER_VARIANTS = {f"{case}-{'dots' if dots else 'nodots'}": (case, dots)
                   for case in ("empty-group", "trailing-rows-outside", "group-offset-window")
                   for dots in (True, False)}
GATHER_TGMM_VARIANTS = {f"{kernel}-{case}": (kernel, case) for kernel in ("gather_tgmm_kernel",
                                                                          "gather_tgmm_resident_kernel")
                        for case in ("empty-group", "several-steps", "resident-blocks")}
# The up projection's weight gradient read from the tokens: unscaled gathered rows, tiles stored transposed.
GATHER_LHS_TGMM_VARIANTS = {f"{kernel}-{case}": (kernel, case) for kernel in ("gather_lhs_tgmm_kernel",
                                                                              "gather_lhs_tgmm_resident_kernel")
                            for case in ("empty-group", "several-steps", "resident-blocks")}


def _gather_operands(rng, num_rows, width):
    sources = max(num_rows // 2, 1)
    source = rng.standard_normal((sources, width)).astype(np.float32)
    index = rng.integers(0, sources, num_rows).astype(np.int32)
    index[::7] = sources + 3  # out of range: read clamped to the last source row
    scale = rng.uniform(0.5, 1.5, num_rows).astype(np.float32)
    gathered = source[np.minimum(index, sources - 1)].astype(np.float64) * scale[:, None]
    return source, index, scale, gathered


def _run_gather_gmm(kernels, case, with_dots):
    group_sizes, num_rows, group_offset, num_local = CASES[case]
    rng = np.random.default_rng(len(group_sizes) * 10 + num_rows)
    k = 24
    group_sizes = np.asarray(group_sizes, np.int32)
    source, index, scale, _ = _gather_operands(rng, num_rows, k)
    rhs = rng.standard_normal((num_local, N, k)).astype(np.float32)
    dot_with = rng.standard_normal((num_rows, N)).astype(np.float32)
    n_tiles = -(-N // BLOCK["BLOCK_N"])
    out = np.full((num_rows, N), np.nan, np.float32)
    dots = np.full((n_tiles, num_rows), np.nan, np.float32)
    kernels.gather_gmm_kernel[(NUM_PROGRAMS,)](
        HostTensor(source), HostTensor(rhs), HostTensor(index), HostTensor(scale), HostTensor(dot_with),
        HostTensor(group_sizes), HostTensor(np.array([group_offset], np.int32)), HostTensor(out), HostTensor(dots),
        M=num_rows, K=k, N=N, LHS_SOURCE_ROWS=source.shape[0], NUM_LOCAL_GROUPS=num_local,
        NUM_GROUPS=len(group_sizes), GROUPS_PAD=8, TRANSPOSE_RHS=True, NUM_PROGRAMS=NUM_PROGRAMS, COMPUTE_F32=True,
        WITH_DOTS=with_dots, **BLOCK,
    )
    product = gmm_reference(source[np.minimum(index, source.shape[0] - 1)], rhs, group_sizes, group_offset, True)
    in_groups = harness.row_groups(group_sizes, num_rows) - group_offset
    in_groups = (in_groups >= 0) & (in_groups < num_local) & (harness.row_groups(group_sizes, num_rows) >= 0)
    result = harness.summary(out, product * scale[:, None])
    if with_dots:
        got = np.where(in_groups, np.nan_to_num(dots).sum(axis=0), 0.0)
        result["dots_unwritten"] = int(np.isnan(dots[:, in_groups]).sum())
        result["dots_error"] = float(np.abs(got - (product * dot_with).sum(axis=1)).max(initial=0.0))
    else:
        result["dots_untouched"] = bool(np.isnan(dots).all())
    return result


def _run_gather_tgmm(kernels, kernel, case):
    group_sizes, num_rows, group_offset, num_local = TGMM_CASES[case]
    rng = np.random.default_rng(len(group_sizes) * 10 + num_rows)
    k, n = 24, 40
    group_sizes = np.asarray(group_sizes, np.int32)
    lhs = rng.standard_normal((num_rows, k)).astype(np.float32)
    source, index, scale, gathered = _gather_operands(rng, num_rows, n)
    out = np.full((num_local, k, n), np.nan, np.float32)
    swizzle = {"GROUP_M": 2} if kernel == "gather_tgmm_kernel" else {}
    getattr(kernels, kernel)[(3,)](
        HostTensor(lhs), HostTensor(source), HostTensor(index), HostTensor(scale), HostTensor(group_sizes),
        HostTensor(np.array([group_offset], np.int32)), HostTensor(out), M=num_rows, K=k, N=n,
        GRAD_SOURCE_ROWS=source.shape[0], NUM_LOCAL_GROUPS=num_local, NUM_GROUPS=len(group_sizes), GROUPS_PAD=8,
        BLOCK_K=16, BLOCK_N=16, BLOCK_R=16, NUM_PROGRAMS=3, COMPUTE_F32=True, **swizzle,
    )
    return harness.summary(out, _tgmm_reference(lhs, gathered, group_sizes, group_offset, num_local))


def _run_gather_lhs_tgmm(kernels, kernel, case):
    group_sizes, num_rows, group_offset, num_local = TGMM_CASES[case]
    rng = np.random.default_rng(len(group_sizes) * 10 + num_rows + 1)
    k, n = 24, 40
    group_sizes = np.asarray(group_sizes, np.int32)
    lhs = rng.standard_normal((num_rows, k)).astype(np.float32)
    source, index, _, _ = _gather_operands(rng, num_rows, n)
    gathered = source[np.minimum(index, source.shape[0] - 1)]
    out = np.full((num_local, n, k), np.nan, np.float32)
    swizzle = {"GROUP_M": 2} if kernel == "gather_lhs_tgmm_kernel" else {}
    getattr(kernels, kernel)[(3,)](
        HostTensor(lhs), HostTensor(source), HostTensor(index), HostTensor(group_sizes),
        HostTensor(np.array([group_offset], np.int32)), HostTensor(out), M=num_rows, K=k, N=n,
        GRAD_SOURCE_ROWS=source.shape[0], NUM_LOCAL_GROUPS=num_local, NUM_GROUPS=len(group_sizes), GROUPS_PAD=8,
        BLOCK_K=16, BLOCK_N=16, BLOCK_R=16, NUM_PROGRAMS=3, COMPUTE_F32=True, **swizzle,
    )
    expected = _tgmm_reference(gathered, lhs, group_sizes, group_offset, num_local)  # [G, N, K]
    return harness.summary(out, expected)


def _jobs():
    """Every case as a job for the interpreter child (see ``interpreter_harness``)."""
    from moe_lowering.kernels.grouped_matmul import triton_kernels as kernels

    jobs = {f"gmm-{name}": (lambda v=variant: harness.summary(*_run_gmm(kernels, *v)))
            for name, variant in GMM_RUN.items()}
    jobs.update({f"tgmm-{name}": (lambda v=variant: harness.summary(*_run_tgmm(kernels, *v)))
                 for name, variant in TGMM_RUN.items()})
    jobs.update({f"tail-{name}": (lambda v=variant: _run_gmm_with_tail(kernels, *v))
                 for name, variant in TAIL_RUN.items()})
    jobs.update({f"push-{name}": (lambda v=variant: _run_push_with_tail(kernels, *v))
                 for name, variant in PUSH_RUN.items()})
    jobs.update({f"pair-{name}": (lambda v=variant: _run_gmm_pair_with_tail(kernels, *v))
                 for name, variant in PAIR_RUN.items()})
    jobs.update({f"sum-{name}": (lambda v=variant: harness.summary(*_run_gmm_sum(kernels, *v)))
                 for name, variant in SUM_RUN.items()})
    jobs.update({f"gather-{name}": (lambda v=variant: _run_gather_gmm(kernels, *v))
                 for name, variant in GATHER_VARIANTS.items()})
    jobs.update({f"gather-tgmm-{name}": (lambda v=variant: _run_gather_tgmm(kernels, *v))
                 for name, variant in GATHER_TGMM_VARIANTS.items()})
    jobs.update({f"gather-lhs-tgmm-{name}": (lambda v=variant: _run_gather_lhs_tgmm(kernels, *v))
                 for name, variant in GATHER_LHS_TGMM_VARIANTS.items()})
    return jobs


JOB_KEYS = ([f"gmm-{n}" for n in GMM_RUN] + [f"tgmm-{n}" for n in TGMM_RUN]
            + [f"tail-{n}" for n in TAIL_RUN] + [f"push-{n}" for n in PUSH_RUN]
            + [f"pair-{n}" for n in PAIR_RUN] + [f"sum-{n}" for n in SUM_RUN]
            + [f"gather-{n}" for n in GATHER_VARIANTS] + [f"gather-tgmm-{n}" for n in GATHER_TGMM_VARIANTS]
            + [f"gather-lhs-tgmm-{n}" for n in GATHER_LHS_TGMM_VARIANTS])


if __name__ == "__main__":
    harness.run_as_child(_jobs)
else:
    interpreter_report = harness.report_fixture(__file__, JOB_KEYS)

    @pytest.mark.parametrize("name", sorted(GMM_RUN))
    def test_gmm_kernel_matches_reference(interpreter_report, name):
        result = interpreter_report[f"gmm-{name}"]
        assert result["unwritten"] == 0, f"{result['unwritten']} output elements were never written"
        assert result["max_error"] < 1e-5, result

    @pytest.mark.parametrize("name", sorted(SUM_RUN))
    def test_gmm_sum_kernel_matches_reference(interpreter_report, name):
        """Both products in one accumulator, every row written (zeros outside the local groups)."""
        result = interpreter_report[f"sum-{name}"]
        assert result["unwritten"] == 0, f"{result['unwritten']} output elements were never written"
        assert result["max_error"] < 1e-5, result

    @pytest.mark.parametrize("name", sorted(GATHER_VARIANTS))
    def test_gather_gmm_kernel_matches_reference(interpreter_report, name):
        """Gathered, scaled rows; the dots' column-tile partials cover every row of the local groups
        and add up to the unscaled product's dots; without dots the partials are not written."""
        result = interpreter_report[f"gather-{name}"]
        assert result["unwritten"] == 0, f"{result['unwritten']} output elements were never written"
        assert result["max_error"] < 1e-5, result
        if name.endswith("-dots"):
            assert result["dots_unwritten"] == 0 and result["dots_error"] < 1e-4, result
        else:
            assert result["dots_untouched"], result

    @pytest.mark.parametrize("name", sorted(GATHER_TGMM_VARIANTS))
    def test_gather_tgmm_kernels_match_reference(interpreter_report, name):
        result = interpreter_report[f"gather-tgmm-{name}"]
        assert result["unwritten"] == 0, f"{result['unwritten']} output elements were never written"
        assert result["max_error"] < 1e-5, result

    @pytest.mark.parametrize("name", sorted(GATHER_LHS_TGMM_VARIANTS))
    def test_gather_lhs_tgmm_kernels_match_reference(interpreter_report, name):
        """Token rows gathered by index (repeated, clamped), tiles stored transposed: every element
        of the ``[G, N, K]`` output written, empty groups zero."""
        result = interpreter_report[f"gather-lhs-tgmm-{name}"]
        assert result["unwritten"] == 0, f"{result['unwritten']} output elements were never written"
        assert result["max_error"] < 1e-5, result

    @pytest.mark.parametrize("name", sorted(TGMM_RUN))
    def test_tgmm_kernel_matches_reference(interpreter_report, name):
        result = interpreter_report[f"tgmm-{name}"]
        assert result["unwritten"] == 0, f"{result['unwritten']} output elements were never written"
        assert result["max_error"] < 1e-5, result

    @pytest.mark.parametrize("name", sorted(TAIL_RUN))
    def test_gmm_with_its_tail_apart_matches_reference(interpreter_report, name):
        """The main kernel's full waves plus the tail kernel's K pieces of the active units write every
        output once, and the tail kernel numbered and cut the units as ``tail_units`` says."""
        case, k, _, programs, block = TAIL_RUN[name]
        result = interpreter_report[f"tail-{name}"]
        assert result["unwritten"] == 0, f"{result['unwritten']} output elements were never written"
        assert result["max_error"] < 1e-5, result
        assert result["counters"] == expected_counters(case, k, programs, block)

    @pytest.mark.parametrize("name", sorted(PUSH_RUN))
    def test_gmm_push_with_its_tail_apart_stores_every_row_on_its_peer(interpreter_report, name):
        """Every row of a local group lands at its place on its peer, nothing else is written, and
        every program of both kernels signals every peer once."""
        case, k, _, programs, block = PUSH_RUN[name]
        result = interpreter_report[f"push-{name}"]
        assert result["unwritten"] == 0 and result["stray"] == 0, result
        assert result["max_error"] < 1e-5, result
        assert result["signals_ok"], result
        assert result["counters"] == expected_counters(case, k, programs, block)

    @pytest.mark.parametrize("name", sorted(PAIR_RUN))
    def test_gmm_pair_with_its_tail_apart_matches_reference(interpreter_report, name):
        """Both main kernels' full waves plus the pair's tail kernel write every element of both
        outputs once, each its own product, and the pair's units were cut as ``pair_units`` says."""
        case, k, _, programs, block = PAIR_RUN[name]
        result = interpreter_report[f"pair-{name}"]
        for product in ("a", "b"):
            assert result[product]["unwritten"] == 0, (product, result)
            assert result[product]["max_error"] < 1e-5, (product, result)
        assert result["counters"] == expected_pair_counters(case, k, programs, block)

    def test_pair_cases_reach_every_cut_and_more_units_than_programs():
        """Whole units with a program doing two of them, and 2, 4 and 8 pieces."""
        reached = set().union(*(pair_kinds(case, k, programs, block)
                                for case, k, _, programs, block in PAIR_RUN.values()))
        expected = {"pieces-1", "pieces-2", "pieces-4", "pieces-8", "more-units-than-programs"}
        assert reached >= expected, expected - reached

    @pytest.mark.parametrize("variants, kinds", [
        (TAIL_RUN, {"rhsT"}),
        (PUSH_RUN, set()),
    ], ids=["gmm", "push"])
    def test_tail_cases_reach_every_cut_and_unit(variants, kinds):
        """Whole units and 2, 4 and 8 pieces; tail tiles with one and with two active halves; tails
        over two groups; K with and without a remainder."""
        expected = {"pieces-1", "pieces-2", "pieces-4", "pieces-8", "one-half", "two-halves", "over-groups",
                    "k-remainder", "k-whole"} | kinds
        assert tail_kinds(variants) >= expected, expected - tail_kinds(variants)
