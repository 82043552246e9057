"""Parse, convert and compile untrusted modules in a child process, where a native crash is survivable.

jaxlib's HLO parser, its HLO -> StableHLO converter, the MLIR verifier, the StableHLO -> HLO
translation and XLA's compiler abort the process (a fatal ``CHECK``, an ``LLVM ERROR``, an uncaught
C++ exception) on some malformed inputs instead of raising: a ``parameter(3)`` in a one-parameter
computation, a ``get-tuple-element`` past the end of its tuple, a ``reshape`` of the wrong element
count on older jaxlibs. ``moe-rewrite`` reads untrusted files and promises exit status 2 with one
line for bad input, so those steps run in a :class:`Worker`, a child process
(``python -m moe_lowering.hlo.isolated``, no accelerator needed except for ``verify``):

* ``check_module`` -- parse (and verify) MLIR text/bytecode, or parse HLO text and convert it to
  StableHLO bytecode, which the parent then parses itself: the same bytes in the same jaxlib, so
  once the child survived them the parent will too;
* ``stablehlo_to_hlo_text`` -- StableHLO text -> HLO text for ``--emit hlo``;
* ``verify`` -- ``--verify``: compile both modules on the local backend and run them.

One worker serves a whole ``moe-rewrite`` run (started early, so its ``import jax`` overlaps the
parent's); a request that kills it is reported as :class:`IsolatedError` with the most telling
line of its stderr (``error: ...``, ``Check failed: ...``) and the signal's name, and the next
request starts a fresh one.

Protocol, both ways: ``<word> <length>\\n<length bytes>``. Requests are ``<kind> ...``; answers
``OK ...`` (the result) or ``ERR ...`` (a one-line message: the input is invalid). The child's
stdout (fd 1) is pointed at its stderr, so native code printing cannot garble the answers.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import tempfile

KINDS = ("hlo", "stablehlo", "bytecode", "portable", "exported", "to-hlo", "verify")

# Lines of a crashed child's stderr that say what went wrong, best first.
_TELLING = (
    re.compile(r"(?:^|\s)error: (.*)", re.IGNORECASE),  # also "LLVM ERROR: ..."
    re.compile(r"Check failed: (.*)"),
    re.compile(r"what\(\):\s*(.*)"),
    re.compile(r"(?:Fatal Python error|Segmentation fault|Aborted)(.*)"),
)


class IsolatedError(Exception):
    """The child rejected the input (``crashed`` False) or died on it (``crashed`` True)."""

    def __init__(self, message: str, *, crashed: bool = False):
        super().__init__(message)
        self.crashed = crashed


class Worker:
    """A child process serving requests one at a time; restarted after a crash.

    Use as a context manager (``with Worker() as worker:``), or call :meth:`close`.
    """

    def __init__(self, *, start: bool = True):
        self._process = None
        self._stderr = None
        if start:
            self._start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- requests --------------------------------------------------------------------------------

    def check_module(self, raw: bytes | str, kind: str) -> bytes:
        """Parse ``raw`` (``kind`` "stablehlo", "bytecode", "hlo", "portable" or "exported") in the child.

        Returns the StableHLO bytecode for HLO text, StableHLO text (UTF-8) for ``jax.export``'s
        modules, ``b""`` for MLIR (parse it yourself: it verified). Raises :class:`IsolatedError`
        with a one-line message when the input is invalid.
        """
        if kind not in ("hlo", "stablehlo", "bytecode", "portable", "exported"):
            raise ValueError(f"unknown module kind {kind!r}")
        return self.request(kind, raw)

    def stablehlo_to_hlo_text(self, stablehlo_text: str) -> str:
        """StableHLO text -> HLO text, translated in the child."""
        return self.request("to-hlo", stablehlo_text).decode("utf-8")

    def verify(self, original_stablehlo: str, rewritten_stablehlo: str, in_avals):
        """:func:`moe_lowering.hlo.verify.verify` in the child. A module the backend rejects, or
        one that crashes it, is a failed verification (``ok`` False, the reason in ``detail``)."""
        import json

        import numpy as np

        from moe_lowering.hlo.verify import VerifyResult

        request = json.dumps({
            "original": original_stablehlo,
            "rewritten": rewritten_stablehlo,
            "avals": [[list(a.shape), np.dtype(a.dtype).name] for a in in_avals],
        })
        try:
            answer = json.loads(self.request("verify", request))
        except IsolatedError as err:
            return VerifyResult(False, float("inf"), f"could not compile and run the modules: {err}")
        return VerifyResult(bool(answer["ok"]), float(answer["max_abs_error"]), str(answer["detail"]))

    def request(self, kind: str, payload: bytes | str) -> bytes:
        data = payload.encode("utf-8") if isinstance(payload, str) else payload
        if self._process is None or self._process.poll() is not None:
            self._start()
        process = self._process
        stderr_offset = os.fstat(self._stderr.fileno()).st_size
        try:
            _write_frame(process.stdin, kind, data)
            word, answer = _read_frame(process.stdout)
        except (OSError, EOFError, ValueError):
            word, answer = None, b""
        if word == "OK":
            return answer
        if word == "ERR":
            raise IsolatedError(answer.decode("utf-8", "replace").strip() or "invalid module")
        returncode = self._reap()
        self._stderr.seek(stderr_offset)
        stderr = self._stderr.read().decode("utf-8", "replace")
        self._close_stderr()
        raise IsolatedError(_crash_message(returncode, stderr), crashed=True)

    # -- the process ---------------------------------------------------------------------------------

    def _start(self) -> None:
        self._close_stderr()
        env = dict(os.environ)
        # The child imports this very package, not whichever copy its working directory would give.
        env["PYTHONPATH"] = os.pathsep.join(p for p in (_package_root(), env.get("PYTHONPATH")) if p)
        # ``verify`` initialises the backend beside the parent's: on a GPU, do not grab 75% of it.
        env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        self._stderr = tempfile.TemporaryFile(prefix="moe-rewrite-worker-")
        try:
            self._process = subprocess.Popen(
                [sys.executable, "-m", "moe_lowering.hlo.isolated"],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._stderr, env=env,
            )
        except OSError as err:
            raise RuntimeError(f"cannot start a worker process ({sys.executable}): {err.strerror or err}") from None

    def _reap(self, *, kill: bool = False) -> int:
        process, self._process = self._process, None
        if kill and process.poll() is None:  # idle between requests: nothing of its own to lose
            process.kill()
        for stream in (process.stdin, process.stdout):
            try:
                stream.close()
            except OSError:
                pass
        try:
            return process.wait(timeout=30)
        except subprocess.TimeoutExpired:  # alive but not answering: it is of no further use
            process.kill()
            return process.wait()

    def _close_stderr(self) -> None:
        if self._stderr is not None:
            self._stderr.close()
            self._stderr = None

    def close(self) -> None:
        if self._process is not None:
            self._reap(kill=True)
        self._close_stderr()


def _package_root() -> str:
    import moe_lowering

    return os.path.dirname(os.path.dirname(os.path.abspath(moe_lowering.__file__)))


def _write_frame(stream, word: str, data: bytes) -> None:
    stream.write(f"{word} {len(data)}\n".encode("ascii") + data)
    stream.flush()


def _read_frame(stream) -> tuple[str, bytes]:
    header = stream.readline()
    if not header.endswith(b"\n"):
        raise EOFError
    word, length = header.decode("ascii").split()
    data = stream.read(int(length))
    if len(data) != int(length):
        raise EOFError
    return word, data


def _crash_message(returncode: int, stderr: str) -> str:
    """``<what the native code said> (jaxlib crashed: SIGABRT)``, one line."""
    if returncode < 0:
        try:
            how = f"crashed: {signal.Signals(-returncode).name}"
        except ValueError:
            how = f"crashed: signal {-returncode}"
    else:
        how = f"crashed: exit status {returncode}"
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    for pattern in _TELLING:
        for line in lines:
            match = pattern.search(line)
            if match and match.group(1).strip():
                reason = " ".join(match.group(1).split())
                if len(reason) > 200:
                    reason = reason[:197] + "..."
                return f"{reason} (jaxlib {how})"
    return f"jaxlib {how}"


# ---------------------------------------------------------------------------------------------
# The child.


class _Rejected(Exception):
    pass


def _child_main() -> int:
    # Answers go to the original stdout; anything native code prints goes to stderr instead.
    answers = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    requests = sys.stdin.buffer
    from moe_lowering.hlo import _compat, reader  # noqa: F401  (import jax while the parent works)
    while True:
        try:
            kind, payload = _read_frame(requests)
        except EOFError:
            return 0
        try:
            result = _serve(kind, payload)
        except _Rejected as err:
            _write_frame(answers, "ERR", str(err).encode("utf-8", "replace"))
            continue
        _write_frame(answers, "OK", result)


def _serve(kind: str, payload: bytes) -> bytes:
    from moe_lowering.hlo import _compat, reader

    if kind in reader.CONVERTED_KINDS:
        try:
            mlir = reader.convert(payload, kind)
        except ValueError as err:
            raise _Rejected(str(err)) from None
        _parse_or_reject(mlir)
        return mlir if isinstance(mlir, bytes) else mlir.encode("utf-8")
    if kind in ("stablehlo", "bytecode"):
        try:
            _parse_or_reject(payload if kind == "bytecode" else payload.decode("utf-8"))
        except UnicodeDecodeError as err:
            raise _Rejected(f"not UTF-8 text: {err}") from None
        return b""
    if kind == "to-hlo":
        try:
            return _compat.stablehlo_to_hlo_text(payload.decode("utf-8")).encode("utf-8")
        except Exception as err:  # the translation raises XlaRuntimeError / ValueError on bad input
            raise _Rejected(_first_line(err)) from None
    if kind == "verify":
        return _serve_verify(payload)
    raise _Rejected(f"unknown request {kind!r}")


def _parse_or_reject(mlir) -> None:
    from moe_lowering.hlo import _compat, reader

    source = reader.ModuleSource("<input>", "stablehlo", b"", mlir)
    try:
        reader.parse(source, _compat.make_ir_context())
    except reader.ModuleReadError as err:
        message = str(err)
        raise _Rejected(message[len("<input>: "):] if message.startswith("<input>: ") else message) from None


def _serve_verify(payload: bytes) -> bytes:
    import json

    import jax
    import jax.numpy as jnp

    from moe_lowering.hlo.verify import verify

    request = json.loads(payload)
    avals = [jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype)) for shape, dtype in request["avals"]]
    try:
        result = verify(request["original"], request["rewritten"], avals)
    except Exception as err:  # a module the local backend rejects: verification failed, not a crash
        raise _Rejected(_first_line(err)) from None
    return json.dumps({"ok": result.ok, "max_abs_error": result.max_abs_error, "detail": result.detail}).encode()


def _first_line(err: BaseException) -> str:
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[0] if lines else type(err).__name__


if __name__ == "__main__":
    sys.exit(_child_main())
