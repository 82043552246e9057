"""The peer heap's host side (no GPU): region bookkeeping and its exhaustion, the size knob, the
epoch arithmetic, heap offsets turned into addresses, which meshes can use the heap, and the
transport ``"auto"`` picks for GPUs of one process each."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from moe_lowering.kernels.peer_store import allocate_buffer
from moe_lowering.kernels.peer_store import heap
from moe_lowering.parallel import exchange


def test_regions_are_aligned_disjoint_and_hold_their_control_words():
    allocator = heap.RegionAllocator(1 << 16)
    first = allocator.reserve(1000, 4)
    second = allocator.reserve(1, 2)
    assert (first.rows_offset, first.control_offset, first.end) == (0, 1024, 1280)
    assert first.end - first.control_offset >= 4 * heap.control_words(4)
    assert (second.rows_offset, second.control_offset, second.end) == (1280, 1536, 1792)
    assert allocator.used == second.end


def test_exhausted_heap_raises_naming_the_knob_and_keeps_its_regions():
    allocator = heap.RegionAllocator(4096)
    allocator.reserve(2000, 2)
    with pytest.raises(heap.PeerHeapExhausted, match=heap.HEAP_SIZE_ENV):
        allocator.reserve(2000, 2)
    assert allocator.used == 2304  # the failed reservation took nothing
    assert allocator.reserve(1000, 2).end == 3584  # what is left still serves a smaller site


def test_heap_size_knob():
    assert heap.heap_bytes({}) == heap.DEFAULT_HEAP_MB << 20
    assert heap.heap_bytes({heap.HEAP_SIZE_ENV: "64"}) == 64 << 20
    assert heap.heap_bytes({heap.HEAP_SIZE_ENV: "0.5"}) == 1 << 19
    with pytest.raises(ValueError, match="not a number"):
        heap.heap_bytes({heap.HEAP_SIZE_ENV: "lots"})
    with pytest.raises(ValueError, match="between"):
        heap.heap_bytes({heap.HEAP_SIZE_ENV: "0"})


def test_epoch_arithmetic_survives_int32_wrap():
    signals = 132
    assert heap.arrival_target(0, signals) == signals
    assert heap.reached(signals, heap.arrival_target(0, signals))
    assert not heap.reached(signals - 1, heap.arrival_target(0, signals))
    epoch = 2**31 // signals  # the target wraps past int32's top
    target = heap.arrival_target(epoch, signals)
    assert target < 0
    assert heap.reached(target, target) and heap.reached(heap.wrap_int32(target + 5), target)
    assert not heap.reached(heap.arrival_target(epoch - 1, signals), target)


def test_offsets_become_addresses_with_carries():
    bases = {0: 0x7F00_FFFF_FF00, 3: 0x0001_2345_6700, 5: 0x7F12_0000_0000}
    regions = {0: heap.HeapRegion(0x100, 0x1_0000_0000, 0), 3: heap.HeapRegion(0x300, 0x400, 0),
               5: heap.HeapRegion(256 * (2**31 - 1), 512, 0)}
    ranks = [3, 0, 5]
    words = jnp.asarray([heap.offset_words(d, regions[d]) for d in ranks], jnp.int32)
    # each viewer mapped the heaps elsewhere; the table is the same in every process, the row its own
    views = {viewer: {d: base + 0x1000_0000 * viewer for d, base in bases.items()} for viewer in bases}
    for rank, viewer in enumerate(ranks):
        got = np.asarray(jax.jit(lambda w, rank: heap.peer_address_words(w, views, rank))(words, rank))
        for row, device in zip(got, ranks):
            rows = views[viewer][device] + regions[device].rows_offset
            control = views[viewer][device] + regions[device].control_offset
            assert tuple(row) == (*heap.split_words(rows), *heap.split_words(control))


def test_ipc_handles_travel_whole():
    """A CUDA IPC handle is 64 raw bytes, zeros among them: every one must reach the other process."""
    data = bytes([0, 7, 0, 0, 255] + list(range(59)))
    handle = heap.handle_from_text(data.hex())
    assert heap.handle_text(handle) == data.hex() and bytes(handle.reserved) == data
    with pytest.raises(RuntimeError, match="not 64"):
        heap.handle_from_text("00ff")


@dataclass(frozen=True)
class FakeGpu:
    id: int
    process_index: int
    platform: str = "gpu"


def _obstacle(devices, per_process=None, hosts=None):
    per_process = per_process or {d.process_index: 1 for d in devices}
    hosts = hosts or {}
    return heap.cross_process_obstacle(devices, per_process, lambda p: hosts.get(p, "here"), "here")


def test_which_meshes_the_heap_can_carry():
    gpus = [FakeGpu(i, i) for i in range(4)]
    assert _obstacle(gpus) is None
    assert "another host" in _obstacle(gpus, hosts={2: "there"})
    assert "one GPU per process" in _obstacle(gpus, per_process={0: 2, 1: 1, 2: 1, 3: 1})
    assert "one GPU per process" in _obstacle([FakeGpu(0, 0), FakeGpu(1, 0)], per_process={0: 2})
    assert "GPU" in _obstacle([FakeGpu(0, 0), jax.devices("cpu")[0]])
    shared = heap.cross_process_obstacle(gpus, {p: 1 for p in range(4)}, lambda p: "here", "here", True)
    assert "jax_share_binary_between_hosts" in shared


@pytest.fixture
def gpus_one_per_process(monkeypatch):
    """This process is process 0 of four, one GPU each; the Triton kernels load."""
    gpus = [FakeGpu(i, i) for i in range(4)]
    monkeypatch.setattr(exchange.jax, "local_devices", lambda: gpus[:1])
    monkeypatch.setattr(jax, "devices", lambda *backend: gpus)
    monkeypatch.setattr(exchange, "get_backend", lambda name: SimpleNamespace(name="triton"))
    hosts = {p: "here" for p in range(4)}
    monkeypatch.setattr(heap, "_published_host", lambda: "here")
    monkeypatch.setattr(heap, "process_host", hosts.__getitem__)
    monkeypatch.setattr(heap, "agreed_open", lambda device_ids: None)
    return gpus, hosts


def test_every_process_traces_the_same_program(monkeypatch):
    """Inside a placement a region names its device by the rank's run-time position, so two
    processes (heaps of devices 5 and 7) lower the same program: XLA's sharded autotuning, on by
    default, waits forever for processes whose programs differ (measured on 2 x H200)."""
    from jax.sharding import AxisType, PartitionSpec as P

    from moe_lowering.parallel._jax_shim import shard_map

    mesh = jax.make_mesh((2,), ("x",), axis_types=(AxisType.Auto,), devices=jax.devices("cpu")[:2])

    def program_of(device_id, placed):
        monkeypatch.setattr(heap, "_heap", SimpleNamespace(device_id=device_id, regions=heap.RegionAllocator(8192)))

        def body(x):
            words = allocate_buffer(4, (2,), jnp.float32, axis_size=2, zeroed=True).addresses
            return words[None] + x

        def traced(x):
            if not placed:
                return shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))(x)
            with heap.placement((5, 7), ("x",)):
                return shard_map(body, mesh=mesh, in_specs=P("x"), out_specs=P("x"))(x)

        zeros = jnp.zeros((2, 4), jnp.int32)
        return jax.jit(traced).lower(zeros).as_text(), np.asarray(jax.jit(traced)(zeros))

    (text_5, words), (text_7, _) = program_of(5, True), program_of(7, True)
    assert text_5 == text_7
    assert words[:, 0].tolist() == [5, 7]  # each rank's own device, read at run time
    assert program_of(5, False)[0] != program_of(7, False)[0]  # a constant device id: programs differ


def test_auto_picks_peer_for_one_gpu_per_process_on_this_host(gpus_one_per_process):
    gpus, hosts = gpus_one_per_process
    assert exchange.resolve_transport("auto", gpus, "auto") == "peer"
    hosts[3] = "another"
    assert exchange.resolve_transport("auto", gpus, "auto") == "all_to_all"
    with pytest.raises(ValueError, match="another host.*all_to_all"):
        exchange.prepare_peer_transport(gpus, "auto")


def test_auto_falls_back_with_a_warning_where_a_heap_failed(gpus_one_per_process, monkeypatch):
    gpus, _ = gpus_one_per_process
    monkeypatch.setattr(heap, "agreed_open", lambda device_ids: "process 1: cudaIpcOpenMemHandle failed")
    with pytest.warns(UserWarning, match="process 1: cudaIpcOpenMemHandle.*all_to_all"):
        assert exchange.resolve_transport("auto", gpus, "auto") == "all_to_all"


def test_heap_buffers_are_regions(monkeypatch):
    fake = SimpleNamespace(device_id=5, regions=heap.RegionAllocator(8192), bases={5: 0})
    monkeypatch.setattr(heap, "_heap", fake)
    first = allocate_buffer(10, (3, 4), jnp.bfloat16, axis_size=2, zeroed=True)
    second = allocate_buffer(7, (1,), jnp.bool_, axis_size=2, zeroed=False)
    assert first.recv.shape == (10, 12) and first.recv.dtype == jnp.bfloat16 and first.arrivals is None
    assert first.heap_zeroed is True and second.heap_zeroed is False
    assert second.recv.dtype == jnp.int8
    assert np.asarray(first.addresses).tolist() == [5, 0, 1, 0]  # 240 bytes of rows: control at 256
    assert np.asarray(second.addresses).tolist() == [5, 2, 3, 0]
    with pytest.raises(heap.PeerHeapExhausted):
        allocate_buffer(10_000, (1,), jnp.float32, axis_size=2, zeroed=True)


class FakeStore:
    """``jax.distributed``'s key-value store as a dict; a missing key times out at once."""

    def __init__(self, values=None):
        self.values = dict(values or {})

    def key_value_set(self, key, value):
        assert key not in self.values, key
        self.values[key] = value

    def blocking_key_value_get(self, key, timeout_ms):
        if key not in self.values:
            raise TimeoutError(f"DEADLINE_EXCEEDED: {key}")
        return self.values[key]


def test_processes_agree_on_every_exchange_site_or_it_raises(monkeypatch):
    """Region offsets are constants of the program: a process that traced other sites first
    would compile another program, which XLA's sharded autotuning waits on forever."""
    gpus = [FakeGpu(0, 0), FakeGpu(1, 1)]
    monkeypatch.setattr(jax, "devices", lambda *backend: gpus)
    monkeypatch.setattr(jax, "process_index", lambda: 0)
    monkeypatch.setattr(heap, "_site_counts", {})
    fake = SimpleNamespace(regions=heap.RegionAllocator(1 << 16))
    prefix = "moe_lowering/peer_heap/site/0-1"
    store = FakeStore({f"{prefix}/0/1": "0,1024", f"{prefix}/1/1": "2048,2304"})
    with heap.placement((0, 1), ("x",)):
        assert heap.reserve_site(fake, 1000, 2, store).rows_offset == 0  # process 1 has the same site 0
        with pytest.raises(RuntimeError, match="site 1 has heap region 1280,2304 in process 0 but 2048,2304"):
            heap.reserve_site(fake, 1000, 2, store)
        with pytest.raises(RuntimeError, match="process 1 did not trace exchange site 2.*same order"):
            heap.reserve_site(fake, 1000, 2, store)
    assert store.values[f"{prefix}/0/0"] == "0,1024"
    outside = heap.reserve_site(fake, 8, 2, FakeStore())  # no placement (one process): nothing to agree on
    assert outside.rows_offset == 3840
