"""The peer heap: receive buffers that GPUs of *other processes* of this host can store into.

In one process the ``"peer"`` exchange stores into XLA buffers whose addresses it all-gathers
(:mod:`.triton_launch`): with unified addressing every local GPU can use them. An XLA buffer's
address means nothing in another process, so a job of one process per GPU (``jax.distributed``,
how clusters run) needs memory the other processes have mapped. The heap is that memory:

* **One allocation per process**, made once with ``cudaMalloc`` on the process's one GPU (size:
  ``MOE_LOWERING_PEER_HEAP_MB``, default ``DEFAULT_HEAP_MB``) and zeroed. Its CUDA IPC handle is
  published in JAX's distributed key-value store under the GPU's device id; every process opens
  the heaps of the other GPUs of the mesh (``cudaIpcOpenMemHandle``, peer access enabled lazily),
  which gives a table *device id -> that heap's base address in this process*. Nothing is freed:
  the heap lives as long as the process.
* **One region per exchange site**, reserved at trace time by bump allocation (:class:`RegionAllocator`):
  the receive rows, then a control block of int32 words: ``arrivals[ranks]`` (each sender's
  programs bump their word after their stores), ``consumed[ranks]`` (each receiver bumps its word
  in the *sender's* region once it has read the sender's rows), the region's ``epoch`` (uses
  completed here) and a grid counter for the wait kernel's last-program handshake.
  Regions outlive a call, so running out raises :class:`PeerHeapExhausted` (naming the knob) at
  trace time, never overwriting a live region. Re-tracing (a new jit cache entry) reserves anew.
* **Addresses**: a rank publishes ``[device id, rows offset, control offset, 0]`` (offsets in
  ``REGION_ALIGN`` units), which the layer all-gathers with its counts as before; each process
  turns every rank's words into addresses valid here, (its mapped heap base) + (its offset)
  (:func:`peer_address_words`). The base table is one ``[viewer, target]`` constant, the same in
  every process (each publishes where it mapped every heap): the row read is the rank's own, at
  run time; and the device id is read at run time too, from the rank's position in the mesh
  (:func:`placement`, :func:`device_id_here`). A constant that differed between processes would
  make their programs differ, and XLA's multi-process compilation (autotuning results shared by
  program fingerprint) then waits forever, as measured on 2 x H200. Region offsets are constants:
  every process must trace the same exchange sites in the same order (SPMD programs do).
  The words then have the one-process layout (rows address, arrival counters address), so the
  ``push`` and ``gmm_push`` kernels run unchanged.

The protocol of one use (epoch ``e``, counted on the device, so any number of calls, loop trips
and programs sharing a site work, as long as every rank runs the site's uses in the same order
and one use ends before the next starts):

1. ``ready`` (before ``push``/``gmm_push``, its output their address operand, so XLA keeps it
   first): waits until every peer's ``consumed`` word here is ``>= e`` (the peer has read my
   rows of use ``e - 1``), so no store overwrites rows still to be read.
2. ``push``: stores rows and bumps ``arrivals[me]`` in every peer's region (release, system scope).
3. ``wait``: waits until every ``arrivals`` word is ``>= (e + 1) * signals_per_peer``
   (:func:`arrival_target`; counters are monotonic), copies the arrived rows into its XLA output,
   then (where the site needs zeros) zeroes the region's rows again, each program only after it
   has read all of its rows (zeroing a tile before reading the next returned zeroed sectors on
   H200), then its last program bumps ``consumed[me]`` in every peer's region (release, system
   scope) and the epoch to ``e + 1``.

As in one process, a site that needs zeros relies on every store landing below the receiver's
count of rows: only those rows are read, and zeroed again for the next use.
Counters are int32 and compared wrap-safely, so a site can run about ``2**31 / signals`` times.
Across hosts CUDA IPC cannot map memory: there the exchange uses NCCL (``"all_to_all"``).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import functools
import glob
import itertools
import json
import logging
import os
import socket
import threading
from dataclasses import dataclass
from typing import Callable, Iterable, Mapping

import numpy as np

from moe_lowering import _compat

logger = logging.getLogger(__name__)

HEAP_SIZE_ENV = "MOE_LOWERING_PEER_HEAP_MB"
DEFAULT_HEAP_MB = 2048
REGION_ALIGN = 256  # bytes; region offsets are published in these units (int32: heaps up to 512 GiB)
KV_TIMEOUT_MS = 300_000  # every process of the mesh publishes before it waits, so this only catches a missing one
_KEY_PREFIX = "moe_lowering/peer_heap"


class PeerHeapExhausted(ValueError):
    """The exchange sites of the traced programs need more heap than ``MOE_LOWERING_PEER_HEAP_MB``."""


def control_words(num_peers: int) -> int:
    """int32 words of a region's control block: arrivals, consumed, epoch, grid counter."""
    return 2 * num_peers + 2


@dataclass(frozen=True)
class HeapRegion:
    """One exchange site's part of the heap (byte offsets from the heap's base)."""

    rows_offset: int
    control_offset: int
    end: int


def _aligned(size: int) -> int:
    return -(-size // REGION_ALIGN) * REGION_ALIGN


class RegionAllocator:
    """Bump allocation of regions in a heap of ``capacity`` bytes; thread-safe (tracing may be)."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.used = 0
        self._lock = threading.Lock()

    def reserve(self, rows_bytes: int, num_peers: int) -> HeapRegion:
        with self._lock:
            control = self.used + _aligned(rows_bytes)
            end = control + _aligned(4 * control_words(num_peers))
            if end > self.capacity:
                raise PeerHeapExhausted(
                    f"peer exchange: the peer heap ({self.capacity / 2**20:.0f} MiB) has {self.capacity - self.used} "
                    f"bytes left, an exchange site needs {end - self.used}; every exchange site of every traced "
                    f"program keeps its own region. Set {HEAP_SIZE_ENV} (MiB, before the first sharded layer is "
                    f"traced) higher, or use exchange_transport='all_to_all'")
            region = HeapRegion(self.used, control, end)
            self.used = end
            return region


def heap_bytes(environ: Mapping[str, str] = os.environ) -> int:
    """The heap size asked for by ``MOE_LOWERING_PEER_HEAP_MB`` (default ``DEFAULT_HEAP_MB``)."""
    text = environ.get(HEAP_SIZE_ENV, "").strip()
    try:
        megabytes = float(text) if text else DEFAULT_HEAP_MB
    except ValueError:
        raise ValueError(f"{HEAP_SIZE_ENV}={text!r} is not a number of MiB") from None
    size = int(megabytes * 2**20)
    if not REGION_ALIGN <= size <= (2**31 - 1) * REGION_ALIGN:
        raise ValueError(f"{HEAP_SIZE_ENV}={text!r}: the heap must be between 1 KiB and 512 GiB")
    return _aligned(size)


# ------------------------------------------------------------------ the epoch protocol's arithmetic
# The kernels (``ready_kernel``, ``heap_wait_kernel``) compute the same in int32; these are its
# definition, and what the CPU tests check the protocol with.


def wrap_int32(value: int) -> int:
    return (value + 2**31) % 2**32 - 2**31


def arrival_target(epoch: int, signals_per_peer: int) -> int:
    """A sender's arrival count once it has pushed use ``epoch`` (0-based): ``(epoch + 1) * signals``."""
    return wrap_int32((epoch + 1) * signals_per_peer)


def reached(count: int, target: int) -> bool:
    """``count >= target`` for monotonic int32 counters that may wrap."""
    return wrap_int32(count - target) >= 0


# ------------------------------------------------------------------ addresses


def split_words(address: int) -> tuple[int, int]:
    """An address as the (low, high) int32 words the kernels join."""
    return wrap_int32(address & 0xFFFFFFFF), wrap_int32(address >> 32)


def peer_address_words(offset_words, views: Mapping[int, Mapping[int, int]], rank):
    """``[ranks, 4]`` address words valid in this process from every rank's gathered
    ``[device id, rows offset, control offset, _]`` words (offsets in ``REGION_ALIGN`` units):
    ``[rows lo, rows hi, control lo, control hi]`` with the base of each target's heap as mapped
    by the viewer, ``views[viewer][target]``, added; the viewer is ``rank``'s own device, read at
    run time, so the program is the same in every process (jnp; uint32 arithmetic with carry, so
    it needs no 64-bit integers)."""
    import jax
    import jax.numpy as jnp

    size = max(max(views), *(max(targets) for targets in views.values())) + 1
    table = np.zeros((size, size), np.uint64)
    for viewer, targets in views.items():
        for target, base in targets.items():
            table[viewer, target] = base
    low = jnp.asarray((table & 0xFFFFFFFF).astype(np.uint32))
    high = jnp.asarray((table >> 32).astype(np.uint32))
    words = jax.lax.bitcast_convert_type(offset_words.astype(jnp.int32), jnp.uint32)
    key = jnp.clip(words[:, 0], 0, size - 1)
    viewer = key[rank]
    base_low, base_high = low[viewer, key], high[viewer, key]

    def add(units):
        lo = base_low + (units << 8)
        carry = (lo < base_low).astype(jnp.uint32)
        return lo, base_high + (units >> 24) + carry

    rows, control = add(words[:, 1]), add(words[:, 2])
    out = jnp.stack([rows[0], rows[1], control[0], control[1]], axis=1)
    return jax.lax.bitcast_convert_type(out, jnp.int32)


def offset_words(device_id, region: HeapRegion):
    """What a rank publishes for ``region`` (see :func:`peer_address_words`): ``[4]`` int32;
    ``device_id`` may be a traced value (:func:`device_id_here`)."""
    import jax.numpy as jnp

    offsets = jnp.asarray([region.rows_offset // REGION_ALIGN, region.control_offset // REGION_ALIGN, 0], jnp.int32)
    return jnp.concatenate([jnp.reshape(jnp.asarray(device_id, jnp.int32), (1,)), offsets])


@dataclass(frozen=True)
class Placement:
    """Where the program being traced runs: the mesh's device ids in its flat order and its axis
    names (the ``shard_map`` around the exchange has them all manual)."""

    device_ids: tuple[int, ...]
    mesh_axes: tuple[str, ...]


_placement: contextvars.ContextVar[Placement | None] = contextvars.ContextVar("peer_heap_placement", default=None)


@contextlib.contextmanager
def placement(device_ids, mesh_axes):
    """Exchange sites traced inside reserve heap regions that name their device at run time
    (:func:`device_id_here`), so that every process traces the same program."""
    token = _placement.set(Placement(tuple(int(i) for i in device_ids), tuple(mesh_axes)))
    try:
        yield
    finally:
        _placement.reset(token)


_site_counts: dict[tuple[int, ...], "itertools.count[int]"] = {}
_site_lock = threading.Lock()


def reserve_site(heap: "PeerHeap", rows_bytes: int, num_peers: int, client=None) -> HeapRegion:
    """A region for the exchange site being traced; inside a :func:`placement` spanning processes,
    checked against the other processes' region for the same site (the ``n``-th one traced on
    this mesh): the offsets are constants of the program, so processes that traced different
    sites would compile different programs, which XLA's sharded autotuning waits on forever. A
    mismatch raises here, naming the cause, instead."""
    import jax

    region = heap.regions.reserve(rows_bytes, num_peers)
    where = _placement.get()
    if where is None:
        return region
    mesh = set(where.device_ids)
    processes = sorted({d.process_index for d in jax.devices() if d.id in mesh})
    me = jax.process_index()
    if len(processes) < 2:
        return region
    client = client or _compat.distributed_client()
    mesh_key = "-".join(map(str, sorted(mesh)))
    with _site_lock:
        site = next(_site_counts.setdefault(tuple(sorted(mesh)), itertools.count()))
    mine = f"{region.rows_offset},{region.control_offset}"
    client.key_value_set(f"{_KEY_PREFIX}/site/{mesh_key}/{site}/{me}", mine)
    for process in processes:
        if process == me:
            continue
        try:
            theirs = client.blocking_key_value_get(f"{_KEY_PREFIX}/site/{mesh_key}/{site}/{process}", KV_TIMEOUT_MS)
        except Exception as error:  # the client raises its own status errors
            raise RuntimeError(
                f"peer exchange: process {process} did not trace exchange site {site} within "
                f"{KV_TIMEOUT_MS / 1000:.0f} s; every process must trace the same sharded layers in the same "
                f"order (a layer traced on one process only, e.g. eval_shape on rank 0, breaks that): {error}"
            ) from error
        if theirs != mine:
            raise RuntimeError(
                f"peer exchange: exchange site {site} has heap region {mine} in process {me} but {theirs} in "
                f"process {process}: the processes traced different exchange sites before it, so they would "
                f"compile different programs (XLA's sharded autotuning then waits forever). Trace the same "
                f"sharded layers in the same order on every process, or use exchange_transport='all_to_all'")
    return region


def device_id_here(heap: "PeerHeap"):
    """This rank's device id as the program computes it: the mesh's ids indexed by the rank's
    position over every mesh axis (:func:`placement`), a value read at run time.

    A constant would differ from process to process, and so would the programs; XLA's sharded
    autotuning (on by default in multi-process jobs) shares results between the processes'
    compilations by program fingerprint, and then waits forever (measured on 2 x H200). Outside a
    :func:`placement` (a one-process program, tests) it is ``heap``'s constant."""
    import jax
    import jax.numpy as jnp

    where = _placement.get()
    if where is None:
        return heap.device_id
    return jnp.asarray(where.device_ids, jnp.int32)[jax.lax.axis_index(where.mesh_axes)]


# ------------------------------------------------------------------ which meshes can use it


def host_identity() -> str:
    """This host as processes of one kernel see it: hostname and boot id."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}|{boot}"


def cross_process_obstacle(devices: Iterable, devices_per_process: Mapping[int, int],
                           host_of_process: Callable[[int], str], my_host: str,
                           shares_binaries: bool = False) -> str | None:
    """Why the heap cannot carry an exchange over ``devices`` that span processes, or ``None``.

    Needs every device a GPU, each process of the mesh holding exactly one GPU of the job (a
    process makes one heap, on its one GPU), and all of them on this host (CUDA IPC).
    ``devices_per_process``: devices every process holds (``jax.devices()``, known to all);
    ``host_of_process``: a process's :func:`host_identity` (asked only if the rest holds);
    ``shares_binaries``: JAX hands one process's compiled program to the others
    (``jax_share_binary_between_hosts``), which then run it without tracing it: their heaps, made
    and mapped while tracing, would not exist.
    """
    devices = list(devices)
    if shares_binaries:
        return ("jax_share_binary_between_hosts is on (the other processes would run the program without "
                "tracing it, so without making their heaps)")
    if any(getattr(d, "platform", None) != "gpu" for d in devices):
        return "not every mesh device is a GPU"
    processes = [getattr(d, "process_index", None) for d in devices]
    if None in processes:
        return "a mesh device of no known process"
    if len(set(processes)) != len(processes) or any(devices_per_process.get(p) != 1 for p in processes):
        return ("the peer heap needs one GPU per process across processes (a process here holds several; "
                "mixed layouts use NCCL)")
    others = sorted({p for p in processes if host_of_process(p) != my_host})
    if others:
        return f"processes {others} run on another host (CUDA IPC maps memory within one host)"
    return None


@functools.cache
def _published_host() -> str:
    client = _compat.distributed_client()
    identity = host_identity()
    if client is not None:
        import jax

        client.key_value_set(f"{_KEY_PREFIX}/host/{jax.process_index()}", identity)
    return identity


@functools.cache
def process_host(process_index: int) -> str:
    """A process's :func:`host_identity` from the distributed key-value store (waits for it)."""
    _published_host()
    client = _compat.distributed_client()
    if client is None:
        raise RuntimeError("peer exchange: devices of several processes but no jax.distributed client")
    try:
        return client.blocking_key_value_get(f"{_KEY_PREFIX}/host/{process_index}", KV_TIMEOUT_MS)
    except Exception as error:  # the client raises its own status errors
        raise RuntimeError(f"peer exchange: process {process_index} did not publish its host within "
                           f"{KV_TIMEOUT_MS / 1000:.0f} s (does every process trace the same sharded layers?): "
                           f"{error}") from error


def job_obstacle(devices) -> str | None:
    """:func:`cross_process_obstacle` for this job (every process of the mesh must call it: it
    exchanges host identities through the key-value store)."""
    import jax

    per_process: dict[int, int] = {}
    for device in jax.devices():
        per_process[device.process_index] = per_process.get(device.process_index, 0) + 1
    return cross_process_obstacle(devices, per_process, process_host, _published_host(),
                                  bool(getattr(jax.config, "jax_share_binary_between_hosts", False)))


# ------------------------------------------------------------------ CUDA


@functools.cache
def cudart():
    """``libcudart`` from the CUDA runtime wheel JAX's CUDA plugin depends on, else the system's."""
    candidates = []
    try:
        import nvidia.cuda_runtime as runtime_pkg

        for root in runtime_pkg.__path__:
            candidates += sorted(glob.glob(os.path.join(root, "lib", "libcudart.so*")))
    except ImportError:
        pass
    candidates += ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    for name in candidates:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    raise RuntimeError("peer exchange: libcudart not found (install the nvidia-cuda-runtime wheel)")


class _IpcHandle(ctypes.Structure):
    _fields_ = [("reserved", ctypes.c_ubyte * 64)]  # cudaIpcMemHandle_t (bytes, zeros among them)


def handle_text(handle: _IpcHandle) -> str:
    """An IPC handle as the text published in the key-value store (all 64 bytes, as hex)."""
    return bytes(handle.reserved).hex()


def handle_from_text(text: str) -> _IpcHandle:
    data = bytes.fromhex(text)
    if len(data) != ctypes.sizeof(_IpcHandle):
        raise RuntimeError(f"peer exchange: a published heap handle has {len(data)} bytes, not 64")
    handle = _IpcHandle()
    ctypes.memmove(ctypes.addressof(handle), data, len(data))
    return handle


_IPC_LAZY_ENABLE_PEER_ACCESS = 1  # cudaIpcMemLazyEnablePeerAccess


def _check(status: int, what: str) -> None:
    if status != 0:
        name = cudart().cudaGetErrorString
        name.restype = ctypes.c_char_p
        raise RuntimeError(f"peer exchange: {what} failed: CUDA error {status} ({name(status).decode()})")


class PeerHeap:
    """This process's heap on its one GPU, and the other processes' heaps it has mapped."""

    def __init__(self, device, size: int):
        runtime = cudart()
        self.device_id = device.id
        self.ordinal = device.local_hardware_id
        previous = ctypes.c_int(0)
        runtime.cudaGetDevice(ctypes.byref(previous))
        try:
            _check(runtime.cudaSetDevice(self.ordinal), f"cudaSetDevice({self.ordinal})")
            pointer = ctypes.c_void_p()
            _check(runtime.cudaMalloc(ctypes.byref(pointer), ctypes.c_size_t(size)),
                   f"cudaMalloc of the {size / 2**20:.0f} MiB peer heap (XLA preallocates most GPU memory: lower "
                   f"{HEAP_SIZE_ENV} or XLA_PYTHON_CLIENT_MEM_FRACTION)")
            _check(runtime.cudaMemset(pointer, 0, ctypes.c_size_t(size)), "cudaMemset of the peer heap")
            _check(runtime.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
            handle = _IpcHandle()
            _check(runtime.cudaIpcGetMemHandle(ctypes.byref(handle), pointer), "cudaIpcGetMemHandle")
        finally:
            runtime.cudaSetDevice(previous.value)
        self.base = pointer.value
        self.handle = handle_text(handle)
        self.regions = RegionAllocator(size)
        self.bases = {self.device_id: self.base}  # device id -> that device's heap, mapped here
        self.views: dict[int, dict[int, int]] = {}  # viewer device id -> its ``bases`` (every process's)
        self._lock = threading.Lock()
        if self.base % REGION_ALIGN:
            raise RuntimeError(f"peer exchange: heap at {self.base:#x} is not {REGION_ALIGN}-byte aligned")
        logger.info("peer heap: %d MiB at %#x on GPU %d (device %d)", size >> 20, self.base, self.ordinal,
                    self.device_id)

    def publish(self, client) -> None:
        client.key_value_set(f"{_KEY_PREFIX}/handle/{self.device_id}", self.handle)

    def open_peers(self, client, device_ids: Iterable[int]) -> None:
        """Maps the heaps of ``device_ids`` (their processes publish them) into this process."""
        runtime = cudart()
        runtime.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcHandle, ctypes.c_uint]
        with self._lock:
            for device_id in sorted(set(device_ids) - set(self.bases)):
                text = client.blocking_key_value_get(f"{_KEY_PREFIX}/handle/{device_id}", KV_TIMEOUT_MS)
                handle = handle_from_text(text)
                pointer = ctypes.c_void_p()
                previous = ctypes.c_int(0)
                runtime.cudaGetDevice(ctypes.byref(previous))
                try:
                    _check(runtime.cudaSetDevice(self.ordinal), f"cudaSetDevice({self.ordinal})")
                    _check(runtime.cudaIpcOpenMemHandle(ctypes.byref(pointer), handle, _IPC_LAZY_ENABLE_PEER_ACCESS),
                           f"cudaIpcOpenMemHandle of device {device_id}'s heap on GPU {self.ordinal}")
                finally:
                    runtime.cudaSetDevice(previous.value)
                if pointer.value % REGION_ALIGN:
                    raise RuntimeError(f"peer exchange: device {device_id}'s heap mapped at {pointer.value:#x}, "
                                       f"not {REGION_ALIGN}-byte aligned")
                self.bases[device_id] = pointer.value
                logger.info("peer heap: device %d's heap mapped at %#x", device_id, pointer.value)


@functools.cache
def agreed_open(device_ids: tuple[int, ...]) -> str | None:
    """:func:`open_heap` on every process of the mesh, and their agreement: ``None`` if each one
    made and mapped its heaps, else what failed where (so that every process then picks the same
    transport, never ``"peer"`` on some and NCCL on others). Every process of the mesh calls it."""
    import jax

    client = _compat.distributed_client()
    devices = [d for d in jax.devices() if d.id in device_ids]
    mesh_key = "-".join(map(str, device_ids))
    try:
        heap = open_heap(devices)
        mapped = {target: heap.bases[target] for target in device_ids}
        client.key_value_set(f"{_KEY_PREFIX}/mapped/{mesh_key}/{heap.device_id}", json.dumps(mapped))
        status = "ok"
    except Exception as error:  # CUDA IPC unavailable here (a container without it, memory): tell the others
        status = f"process {jax.process_index()}: {error}"
    client.key_value_set(f"{_KEY_PREFIX}/opened/{mesh_key}/{jax.process_index()}", status)
    statuses = [client.blocking_key_value_get(f"{_KEY_PREFIX}/opened/{mesh_key}/{process}", KV_TIMEOUT_MS)
                for process in sorted({d.process_index for d in devices})]
    failures = [text for text in statuses if text != "ok"]
    if failures:
        return "; ".join(failures)
    for viewer in device_ids:  # every heap as every process mapped it: the table each program holds
        text = client.blocking_key_value_get(f"{_KEY_PREFIX}/mapped/{mesh_key}/{viewer}", KV_TIMEOUT_MS)
        _heap.views[viewer] = {int(target): base for target, base in json.loads(text).items()}
    return None


_heap: PeerHeap | None = None
_heap_lock = threading.Lock()


def current_heap() -> PeerHeap | None:
    """The heap, once :func:`open_heap` has made it (exchange sites then reserve regions in it)."""
    return _heap


def open_heap(devices) -> PeerHeap:
    """Makes this process's heap (once), publishes it, and maps the heaps of ``devices``' other
    processes. Every process of the mesh calls it (as every one prepares the same layer)."""
    global _heap
    import jax

    client = _compat.distributed_client()
    if client is None:
        raise RuntimeError("peer exchange across processes needs jax.distributed.initialize")
    with _heap_lock:
        if _heap is None:
            (device,) = jax.local_devices()
            heap = PeerHeap(device, heap_bytes())
            heap.publish(client)
            _heap = heap
    _heap.open_peers(client, [d.id for d in devices])
    return _heap
