"""The peer heap's protocol (``ready``, ``push``, ``heap_wait``) run by Triton's interpreter on the
CPU, in a child process (``interpreter_harness``): two ranks whose heaps are host arrays, their
regions at different offsets, several uses of one site in a row. Every use must deliver exactly
its own rows (the region's previous rows zeroed again where the site needs zeros), and leave the
control words as the protocol says: epoch and consumed counts one up, arrivals one push's
signals up, the grid counter back at zero.
"""

from __future__ import annotations

import numpy as np

import interpreter_harness as harness
from interpreter_harness import HostTensor

if __name__ != "__main__":
    import pytest

    harness.skip_without_interpreter(pytest)

RANKS, SLOTS, RECV_ROWS, WIDTH, USES = 2, 12, 16, 40, 3
PUSH_PROGRAMS, WAIT_PROGRAMS = 3, 2
# (zeroed site, rows counted by the receiver: None for every stored row, zero the tail)
CASES = {"zeroed": (True, RECV_ROWS, True), "unzeroed-packed": (False, None, True),
         "unzeroed-untouched-tail": (False, None, False)}


def _routes(rng, zeroed):
    """``(source_row, dest_device, dest_row)`` ``[RANKS, SLOTS]``: unique rows per receiver, all
    of them below its count; unzeroed sites get rows ``0, 1, ...`` (every counted row stored)."""
    dest_device = rng.integers(-1, RANKS, size=(RANKS, SLOTS)).astype(np.int32)
    dest_row = np.zeros((RANKS, SLOTS), np.int32)
    for rank in range(RANKS):
        mine = np.argwhere(dest_device == rank)
        rows = rng.permutation(RECV_ROWS)[: len(mine)] if zeroed else np.arange(len(mine))
        dest_row[tuple(mine.T)] = rows
    return rng.integers(0, SLOTS, size=(RANKS, SLOTS)).astype(np.int32), dest_device, dest_row


def _run(zeroed, counted, zero_tail):
    from moe_lowering.kernels.peer_store import heap
    from moe_lowering.kernels.peer_store.triton_kernels import heap_wait_kernel, push_kernel, ready_kernel

    rng = np.random.default_rng(7 + zeroed + 2 * zero_tail)
    heaps = [np.zeros(64 * 1024 + heap.REGION_ALIGN, np.uint8) for _ in range(RANKS)]
    offsets = [(-h.ctypes.data) % heap.REGION_ALIGN for h in heaps]  # the base: aligned as cudaMalloc's
    bases = {rank: heaps[rank].ctypes.data + offsets[rank] for rank in range(RANKS)}
    regions = []
    for rank in range(RANKS):
        allocator = heap.RegionAllocator(64 * 1024)
        for _ in range(rank):  # another site first: the ranks' regions sit at different offsets
            allocator.reserve(1000, RANKS)
        regions.append(allocator.reserve(RECV_ROWS * WIDTH * 4, RANKS))
    words = np.array([heap.offset_words(rank, regions[rank]) for rank in range(RANKS)], np.int32)
    table = np.asarray(heap.peer_address_words(words, {rank: bases for rank in range(RANKS)}, 0)).reshape(-1)

    def control(rank):
        start = offsets[rank] + regions[rank].control_offset
        return heaps[rank][start: start + 4 * heap.control_words(RANKS)].view(np.int32)

    def region_rows(rank):
        start = offsets[rank] + regions[rank].rows_offset
        return heaps[rank][start: start + RECV_ROWS * WIDTH * 4].view(np.float32).reshape(RECV_ROWS, WIDTH)

    errors, protocol_ok = [], True
    for use in range(USES):
        values = rng.standard_normal((RANKS, SLOTS, WIDTH)).astype(np.float32)
        source_row, dest_device, dest_row = _routes(rng, zeroed)
        want = np.zeros((RANKS, RECV_ROWS, WIDTH), np.float32)
        for sender in range(RANKS):
            for slot in range(SLOTS):
                if dest_device[sender, slot] >= 0:
                    want[dest_device[sender, slot], dest_row[sender, slot]] = values[sender, source_row[sender, slot]]
        arrived = [int((dest_device == r).sum()) if counted is None else counted for r in range(RANKS)]
        for rank in range(RANKS):
            ready_kernel[(1,)](HostTensor(table), HostTensor(np.array([rank], np.int32)), HostTensor(table),
                               NUM_PEERS=RANKS)
        for rank in range(RANKS):
            done = np.zeros(1, np.int32)
            push_kernel[(PUSH_PROGRAMS,)](*map(HostTensor, (values[rank], source_row[rank], dest_device[rank],
                                                            dest_row[rank], table, np.array([rank], np.int32), done)),
                                         NUM_SLOTS=SLOTS, D=WIDTH, NUM_PEERS=RANKS, BLOCK_SLOTS=4, BLOCK_D=16,
                                         NUM_PROGRAMS=PUSH_PROGRAMS)
        for rank in range(RANKS):
            out = np.full((RECV_ROWS, WIDTH), np.nan, np.float32)
            heap_wait_kernel[(WAIT_PROGRAMS,)](*map(HostTensor, (table, np.array([rank], np.int32),
                                                                  np.array([arrived[rank]], np.int32),
                                                                  np.zeros(1, np.int32), out)),
                                               NUM_ROWS=RECV_ROWS, D=WIDTH, NUM_PEERS=RANKS,
                                               SIGNALS_PER_PEER=PUSH_PROGRAMS, BLOCK_ROWS=4, BLOCK_D=16,
                                               NUM_PROGRAMS=WAIT_PROGRAMS, ZEROED=zeroed, ZERO_TAIL=zero_tail)
            n = arrived[rank]
            errors.append(float(np.max(np.abs(out[:n] - want[rank, :n]), initial=0.0)))
            tail = out[n:]
            protocol_ok &= bool(np.all(tail == 0) if zero_tail else np.all(np.isnan(tail[4:])))
            if zeroed:
                protocol_ok &= bool(np.all(region_rows(rank)[:n] == 0))
        for rank in range(RANKS):
            words_now = control(rank)
            expected = [(use + 1) * PUSH_PROGRAMS] * RANKS + [use + 1] * RANKS + [use + 1, 0]
            protocol_ok &= words_now.tolist() == expected
    return {"max_error": max(errors), "protocol_ok": protocol_ok}


def _jobs():
    """Every case as a job for the interpreter child (see ``interpreter_harness``)."""
    return {name: (lambda v=case: _run(*v)) for name, case in CASES.items()}


if __name__ == "__main__":
    harness.run_as_child(_jobs)
else:
    interpreter_report = harness.report_fixture(__file__, CASES)

    @pytest.mark.parametrize("name", sorted(CASES))
    def test_every_use_delivers_its_own_rows(interpreter_report, name):
        result = interpreter_report[name]
        assert result["max_error"] == 0.0
        assert result["protocol_ok"]
