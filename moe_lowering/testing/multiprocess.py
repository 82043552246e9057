"""Multi-process JAX jobs on one host, for tests and benchmarks: a launcher and its workers' setup.

:func:`launch` starts ``num_processes`` copies of a command, each told through the environment who
it is and where the coordinator listens (a free port on 127.0.0.1); the worker calls
:func:`initialize` before touching JAX, which runs ``jax.distributed.initialize`` with that
identity. On CPUs each process gets ``devices_per_process`` host devices and gloo collectives
(XLA:CPU's cross-process implementation); on GPUs process ``i`` gets GPUs
``[i * devices_per_process, (i + 1) * devices_per_process)`` by ``local_device_ids`` (every GPU
stays visible to CUDA, as JAX's SLURM setup leaves them).

A process that dies takes the job down: the others would wait in a collective until the
coordination service's heartbeat gives up, so the launcher kills every process group and raises
:class:`MultiprocessFailure` naming the process and its output. So it does for a job past its
timeout, naming the processes still running.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

_COORDINATOR = "MOE_MP_COORDINATOR"
_NUM_PROCESSES = "MOE_MP_NUM_PROCESSES"
_PROCESS_ID = "MOE_MP_PROCESS_ID"
_PLATFORM = "MOE_MP_PLATFORM"
_DEVICES_PER_PROCESS = "MOE_MP_DEVICES_PER_PROCESS"

# After the first process fails, how long the others get to fail on their own (their messages
# are often the clearer ones, e.g. the coordinator's view of who left) before they are killed.
FAILURE_GRACE_S = 5.0
_OUTPUT_TAIL_CHARS = 6000


@dataclass(frozen=True)
class ProcessOutcome:
    """One process of a finished job: its exit status and what it printed."""

    process_id: int
    returncode: int
    stdout: str
    stderr: str


class MultiprocessFailure(RuntimeError):
    """A process of the job failed, or the job ran past its timeout; the message names which."""


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now (the coordinator binds it next)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(command: Sequence[str], *, num_processes: int, platform: str = "cpu", devices_per_process: int = 1,
           timeout_s: float, env: Mapping[str, str] | None = None, cwd: str | os.PathLike | None = None
           ) -> tuple[ProcessOutcome, ...]:
    """Runs ``command`` as ``num_processes`` processes of one JAX job and waits for all of them.

    ``platform``: ``"cpu"`` (``devices_per_process`` host devices each) or ``"gpu"``
    (``devices_per_process`` GPUs each, by ``local_device_ids``). ``env`` is added to this
    process's environment.
    Returns every process's outcome when all exit 0; raises :class:`MultiprocessFailure` otherwise.
    """
    if platform not in ("cpu", "gpu"):
        raise ValueError(f"platform must be 'cpu' or 'gpu', got {platform!r}")
    if num_processes < 1 or devices_per_process < 1:
        raise ValueError(f"need at least one process and one device each, got {num_processes} x {devices_per_process}")
    coordinator = f"127.0.0.1:{free_port()}"
    with tempfile.TemporaryDirectory(prefix="moe_mp_") as logs:
        processes, files = [], []
        try:
            for process_id in range(num_processes):
                process_env = dict(os.environ, **(env or {}))
                process_env.update({_COORDINATOR: coordinator, _NUM_PROCESSES: str(num_processes),
                                    _PROCESS_ID: str(process_id), _PLATFORM: platform,
                                    _DEVICES_PER_PROCESS: str(devices_per_process)})
                out = open(Path(logs) / f"{process_id}.out", "w+")
                err = open(Path(logs) / f"{process_id}.err", "w+")
                files.append((out, err))
                processes.append(subprocess.Popen(list(command), cwd=cwd, env=process_env, stdout=out, stderr=err,
                                                  stdin=subprocess.DEVNULL, start_new_session=True))
            codes, timed_out = _wait(processes, timeout_s)
        finally:
            for process in processes:
                _kill_group(process)
        outcomes = tuple(ProcessOutcome(i, code, *(_read(f) for f in pair))
                         for i, (code, pair) in enumerate(zip(codes, files)))
        for out, err in files:
            out.close()
            err.close()
    failed = [o for o in outcomes if o.returncode != 0]
    if failed:
        raise MultiprocessFailure(_failure_message(failed, timeout_s if timed_out else None))
    return outcomes


_STILL_RUNNING = -1000  # the exit status recorded for a process killed when the job ended


def _wait(processes, timeout_s: float) -> tuple[list[int], bool]:
    """``(every process's exit status, whether the timeout ended the job)``; after the first
    failure the rest get ``FAILURE_GRACE_S``."""
    timeout = grace = time.monotonic() + timeout_s
    while True:
        codes = [p.poll() for p in processes]
        if all(c is not None for c in codes):
            return codes, False
        now = time.monotonic()
        if any(c not in (None, 0) for c in codes):
            grace = min(grace, now + FAILURE_GRACE_S)
        if now >= min(timeout, grace):
            return [_STILL_RUNNING if c is None else c for c in codes], now >= timeout
        time.sleep(0.05)


def _kill_group(process: subprocess.Popen) -> None:
    """Kills the process and whatever it started that still runs (its own session:
    ``start_new_session``; the group outlives a leader that exited first)."""
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:  # the whole group has exited
        pass
    process.wait()


def _read(file) -> str:
    file.flush()
    file.seek(0)
    return file.read()


def _failure_message(failed: Sequence[ProcessOutcome], timed_out_after_s: float | None) -> str:
    parts = []
    ended = (f"after {timed_out_after_s:.0f} s" if timed_out_after_s is not None
             else f"{FAILURE_GRACE_S:.0f} s after another process failed")
    for outcome in failed:
        what = (f"was still running {ended} (killed)" if outcome.returncode == _STILL_RUNNING
                else f"exited with status {outcome.returncode}")
        parts.append(f"process {outcome.process_id} {what}\n--- its stderr (tail) ---\n"
                     f"{outcome.stderr[-_OUTPUT_TAIL_CHARS:]}\n--- its stdout (tail) ---\n"
                     f"{outcome.stdout[-_OUTPUT_TAIL_CHARS:]}")
    return "multi-process job failed: " + "\n".join(parts)


@dataclass(frozen=True)
class ProcessIdentity:
    """Who this worker is in the job :func:`launch` started."""

    process_id: int
    num_processes: int
    platform: str


def initialize() -> ProcessIdentity:
    """Joins the job :func:`launch` started: device count, collectives, ``jax.distributed.initialize``.

    Call it before anything else touches JAX (a backend made earlier has no peers).
    """
    import jax

    identity = ProcessIdentity(int(os.environ[_PROCESS_ID]), int(os.environ[_NUM_PROCESSES]),
                               os.environ[_PLATFORM])
    kwargs = {}
    if identity.platform == "cpu":
        jax.config.update("jax_platforms", "cpu")
        jax.config.update("jax_num_cpu_devices", int(os.environ[_DEVICES_PER_PROCESS]))
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    else:
        per_process = int(os.environ[_DEVICES_PER_PROCESS])
        kwargs["local_device_ids"] = list(range(identity.process_id * per_process,
                                                (identity.process_id + 1) * per_process))
    jax.distributed.initialize(coordinator_address=os.environ[_COORDINATOR], num_processes=identity.num_processes,
                               process_id=identity.process_id, **kwargs)
    return identity


def shard_entries(prefix: str, tree) -> dict:
    """The shards of ``tree``'s arrays that this process holds (one replica of each), as ``np.savez``
    entries: ``{prefix}|{leaf path}|{process}.{n}|data`` (float32) and ``...|bounds`` (``[ndim, 2]``).
    The entries of every process together hold each array once: :func:`assemble` puts them together."""
    import jax
    import numpy as np

    entries = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(tree)[0]:
        held = (s for s in leaf.addressable_shards if s.replica_id == 0)
        for number, shard in enumerate(held):
            name = f"{prefix}|{jax.tree_util.keystr(path)}|{jax.process_index()}.{number}"
            entries[name + "|data"] = np.asarray(shard.data).astype(np.float32)
            bounds = [index.indices(size)[:2] for index, size in zip(shard.index, leaf.shape)]
            entries[name + "|bounds"] = np.array(bounds, np.int64).reshape(leaf.ndim, 2)
    return entries


def assemble(entries: Mapping, prefix: str, shapes: Mapping[str, tuple] | None = None) -> dict:
    """``{leaf path: float64 array}`` from the :func:`shard_entries` of every process under ``prefix``.

    ``shapes`` (by leaf path) sizes each array; without it, the shards' extent does. Elements no
    shard holds are NaN."""
    import numpy as np

    pieces: dict = {}
    for name, data in entries.items():
        head, _, rest = name.rpartition("|")
        start = f"{prefix}|"
        if rest != "data" or not head.startswith(start):
            continue
        leaf = head[len(start):].rpartition("|")[0]
        pieces.setdefault(leaf, []).append((entries[head + "|bounds"], data))
    arrays = {}
    for leaf, parts in pieces.items():
        shape = tuple(shapes[leaf]) if shapes else tuple(int(max(b[d, 1] for b, _ in parts))
                                                         for d in range(parts[0][0].shape[0]))
        full = np.full(shape, np.nan, np.float64)
        for bounds, data in parts:
            full[tuple(slice(int(a), int(b)) for a, b in bounds)] = data
        arrays[leaf] = full
    return arrays
