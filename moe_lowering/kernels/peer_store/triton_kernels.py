"""The Triton kernels of the peer store, launched by :mod:`.triton_launch`: ``allocate``,
``push`` and ``wait`` (the row stores between GPUs, their protocol described there), ``ready``
and ``heap_wait`` (the same between processes, through the peer heap: :mod:`.heap`), and
``expand_rows`` (a receiver's tokens expanded into its sorted rows). Only ``triton`` is imported
here, so Triton's interpreter can run them on a CPU.
"""

import triton
import triton.language as tl

from moe_lowering.kernels.peer_address.triton_kernels import join_address, peer_row_pointers, signal_peers, split_address


@triton.jit
def allocate_kernel(allocation_id_ptr, recv_ptr, arrivals_ptr, address_ptr):
    """Publishes the receive buffer's and arrival counters' addresses (both zeroed by the caller).

    Reads no input: the allocation id only keeps XLA from merging two allocations into one."""
    split_address(recv_ptr, address_ptr)
    split_address(arrivals_ptr, address_ptr + 2)


@triton.jit
def push_kernel(rows_ptr, source_row_ptr, dest_device_ptr, dest_row_ptr, peer_address_ptr, rank_ptr, done_ptr,
                NUM_SLOTS: tl.constexpr, D: tl.constexpr, NUM_PEERS: tl.constexpr, BLOCK_SLOTS: tl.constexpr,
                BLOCK_D: tl.constexpr, NUM_PROGRAMS: tl.constexpr):
    """Slot ``j``: stores ``rows[source_row[j]]`` at row ``dest_row[j]`` of device ``dest_device[j]``
    (a negative device skips the slot), then bumps this program's arrival counter on every peer."""
    pid = tl.program_id(0)
    rank = tl.load(rank_ptr)
    in_slots = tl.arange(0, BLOCK_SLOTS)
    in_d = tl.arange(0, BLOCK_D)
    for tile in range(pid, tl.cdiv(NUM_SLOTS, BLOCK_SLOTS), NUM_PROGRAMS):
        slots = tile * BLOCK_SLOTS + in_slots
        device = tl.load(dest_device_ptr + slots, mask=slots < NUM_SLOTS, other=-1)
        valid = device >= 0
        device = tl.maximum(device, 0)
        source_row = tl.load(source_row_ptr + slots, mask=valid, other=0)
        dest_row = tl.load(dest_row_ptr + slots, mask=valid, other=0)
        dest = peer_row_pointers(rows_ptr, peer_address_ptr, device, dest_row, D)
        src = rows_ptr + source_row.to(tl.int64) * D
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + in_d
            mask = valid[:, None] & (cols < D)[None, :]
            values = tl.load(src[:, None] + cols[None, :], mask=mask)
            tl.store(dest[:, None] + cols[None, :], values, mask=mask)
    signal_peers(peer_address_ptr, rank, NUM_PEERS)
    if pid == 0:
        tl.store(done_ptr, rank)


@triton.jit
def wait_kernel(recv_ptr, arrivals_ptr, num_rows_ptr, done_ptr, out_ptr, NUM_ROWS: tl.constexpr,
                D: tl.constexpr, NUM_PEERS: tl.constexpr, SIGNALS_PER_PEER: tl.constexpr,
                BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                ZERO_TAIL: tl.constexpr = True):
    """Waits until every peer's push has signalled, then writes zeros from row ``num_rows`` on
    (without ``ZERO_TAIL`` those rows are left as they are).

    ``out`` is ``recv`` itself (aliased): the rows are already where the peers stored them, and
    the kernels that read them next start after this one ends, so they see the peers' stores."""
    pid = tl.program_id(0)
    for peer in range(NUM_PEERS):
        while tl.atomic_add(arrivals_ptr + peer, 0, sem="acquire", scope="sys") < SIGNALS_PER_PEER:
            pass
    if ZERO_TAIL:
        num_rows = tl.load(num_rows_ptr)
        in_rows = tl.arange(0, BLOCK_ROWS)
        in_d = tl.arange(0, BLOCK_D)
        zeros = tl.zeros((BLOCK_ROWS, BLOCK_D), out_ptr.dtype.element_ty)
        for tile in range(num_rows // BLOCK_ROWS + pid, tl.cdiv(NUM_ROWS, BLOCK_ROWS), NUM_PROGRAMS):
            rows = tile * BLOCK_ROWS + in_rows
            tail = (rows >= num_rows) & (rows < NUM_ROWS)
            offsets = rows.to(tl.int64)[:, None] * D
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + in_d
                tl.store(out_ptr + offsets + cols[None, :], zeros, mask=tail[:, None] & (cols < D)[None, :])


@triton.jit
def _control_block(address_ptr, rank):
    """This rank's region control words (int32): arrivals, consumed, epoch, grid counter."""
    return join_address(address_ptr + rank * 4 + 2).to(tl.pointer_type(tl.int32))


@triton.jit
def ready_kernel(address_ptr, rank_ptr, out_ptr, NUM_PEERS: tl.constexpr):
    """Waits until every peer has read this rank's rows of the region's previous use (its
    ``consumed`` word here reached the epoch). ``out`` is ``address`` (aliased): the push that
    takes it as its address operand starts after this kernel."""
    rank = tl.load(rank_ptr)
    control = _control_block(address_ptr, rank)
    epoch = tl.load(control + 2 * NUM_PEERS, volatile=True)
    for peer in range(NUM_PEERS):
        while tl.atomic_add(control + NUM_PEERS + peer, 0, sem="acquire", scope="sys") - epoch < 0:
            pass


@triton.jit
def heap_wait_kernel(address_ptr, rank_ptr, num_rows_ptr, done_ptr, out_ptr, NUM_ROWS: tl.constexpr,
                     D: tl.constexpr, NUM_PEERS: tl.constexpr, SIGNALS_PER_PEER: tl.constexpr,
                     BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr, NUM_PROGRAMS: tl.constexpr,
                     ZEROED: tl.constexpr, ZERO_TAIL: tl.constexpr):
    """Waits for every peer's push of this use, copies rows ``[0, num_rows)`` of this rank's heap
    region into ``out`` (zeros after them with ``ZERO_TAIL``, else those rows are not written),
    then, with ``ZEROED``, zeroes the region's rows again; the last program to finish then tells every
    peer the rows are consumed and advances the region's epoch (see :mod:`.heap`)."""
    pid = tl.program_id(0)
    rank = tl.load(rank_ptr)
    region = join_address(address_ptr + rank * 4).to(tl.pointer_type(out_ptr.dtype.element_ty))
    region = tl.multiple_of(region, 16)  # REGION_ALIGN-aligned: vector loads and stores
    control = _control_block(address_ptr, rank)
    epoch = tl.load(control + 2 * NUM_PEERS, volatile=True)
    target = (epoch + 1) * SIGNALS_PER_PEER
    for peer in range(NUM_PEERS):
        while tl.atomic_add(control + peer, 0, sem="acquire", scope="sys") - target < 0:
            pass
    tl.debug_barrier()  # the acquiring thread's view, for every thread of the program
    num_rows = tl.minimum(tl.maximum(tl.load(num_rows_ptr), 0), NUM_ROWS)
    if ZERO_TAIL:
        last_tile = tl.cdiv(NUM_ROWS, BLOCK_ROWS)
    else:
        last_tile = tl.cdiv(num_rows, BLOCK_ROWS)
    in_rows = tl.arange(0, BLOCK_ROWS)
    in_d = tl.arange(0, BLOCK_D)
    for tile in range(pid, last_tile, NUM_PROGRAMS):
        rows = tile * BLOCK_ROWS + in_rows
        arrived = rows < num_rows
        offsets = rows.to(tl.int64)[:, None] * D
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + in_d
            in_cols = (cols < D)[None, :]
            values = tl.load(region + offsets + cols[None, :], mask=arrived[:, None] & in_cols, other=0,
                             volatile=True)
            tl.store(out_ptr + offsets + cols[None, :], values, mask=(rows < NUM_ROWS)[:, None] & in_cols)
    if ZEROED:
        # Only once the program has read all of its rows: zero stores interleaved with the reads
        # (a tile zeroed, the next read) returned rows with zeroed 32-byte sectors in 3-30% of calls
        # on 2 x H200 (2026-11-28), in rows read after the first zeroed tile; read-all-then-zero
        # gave none in 144 calls per rank, 90 of them this kernel's
        # (benchmarks/results/peer_heap_zeroing_H200x2_2026-11-28.log).
        tl.debug_barrier()
        zeros = tl.zeros((BLOCK_ROWS, BLOCK_D), out_ptr.dtype.element_ty)
        for tile in range(pid, tl.cdiv(num_rows, BLOCK_ROWS), NUM_PROGRAMS):
            rows = tile * BLOCK_ROWS + in_rows
            offsets = rows.to(tl.int64)[:, None] * D
            for d0 in range(0, D, BLOCK_D):
                cols = d0 + in_d
                tl.store(region + offsets + cols[None, :], zeros,
                         mask=(rows < num_rows)[:, None] & (cols < D)[None, :])
    tl.debug_barrier()
    finished = tl.atomic_add(control + 2 * NUM_PEERS + 1, 1, sem="acq_rel", scope="gpu")
    if finished == NUM_PROGRAMS - 1:  # every program has read (and re-zeroed) its rows
        tl.atomic_xchg(control + 2 * NUM_PEERS + 1, 0, sem="relaxed", scope="gpu")
        for peer in range(NUM_PEERS):
            consumed = _control_block(address_ptr, peer) + NUM_PEERS + rank
            tl.atomic_add(consumed, 1, sem="release", scope="sys")
        tl.store(control + 2 * NUM_PEERS, epoch + 1)


@triton.jit
def expand_rows_kernel(table_ptr, index_ptr, num_rows_ptr, out_ptr, NUM_ROWS: tl.constexpr,
                       TABLE_ROWS: tl.constexpr, D: tl.constexpr, BLOCK_ROWS: tl.constexpr, BLOCK_D: tl.constexpr,
                       NUM_PROGRAMS: tl.constexpr, ZERO_TAIL: tl.constexpr):
    """``out[i] = table[index[i]]`` for ``i < num_rows``; zeros after them with ``ZERO_TAIL``, else
    those rows are not touched (persistent programs over the row tiles that count)."""
    num_rows = tl.minimum(tl.maximum(tl.load(num_rows_ptr), 0), NUM_ROWS)
    if ZERO_TAIL:
        last_tile = tl.cdiv(NUM_ROWS, BLOCK_ROWS)
    else:
        last_tile = tl.cdiv(num_rows, BLOCK_ROWS)
    in_rows = tl.arange(0, BLOCK_ROWS)
    in_d = tl.arange(0, BLOCK_D)
    for tile in range(tl.program_id(0), last_tile, NUM_PROGRAMS):
        rows = tile * BLOCK_ROWS + in_rows
        arrived = rows < num_rows
        source = tl.load(index_ptr + rows, mask=arrived, other=0)
        source = tl.minimum(tl.maximum(source, 0), TABLE_ROWS - 1).to(tl.int64)
        offsets = rows.to(tl.int64)[:, None] * D
        for d0 in range(0, D, BLOCK_D):
            cols = d0 + in_d
            in_cols = (cols < D)[None, :]
            values = tl.load(table_ptr + source[:, None] * D + cols[None, :], mask=arrived[:, None] & in_cols, other=0)
            tl.store(out_ptr + offsets + cols[None, :], values, mask=(rows < NUM_ROWS)[:, None] & in_cols)
