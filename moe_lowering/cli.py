"""``moe-rewrite``: rewrite the dense MoE layers of StableHLO/HLO modules into sorted grouped-GEMM MoE.

Also ``python -m moe_lowering``. Progress and diagnostics go through :mod:`logging` (logger
``moe_lowering.cli``, under ``moe_lowering``): the summary at INFO, per-module detail of a dump
directory and the importer's and matcher's messages at DEBUG (``-v``), warnings and the one-line
errors always; ``-q`` keeps warnings and errors only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import shutil
import stat
import sys
import tempfile

PROG = "moe-rewrite"

DESCRIPTION = """\
Rewrite the dense Mixture-of-Experts layers of a compiled JAX program into the sorted,
dropless grouped-GEMM MoE: the recognition and rewrite of the @moe_optimize decorator, for
programs you only have as IR.

INPUT is one of:
  * StableHLO text       jax.jit(f).lower(...).as_text(), or a JAX IR dump (*.mlir)
  * MLIR bytecode        (*.mlirbc, serialized StableHLO)
  * HLO text             an XLA dump's *.before_optimizations.txt
  * a dump directory     (--xla_dump_to); every module in it is rewritten into -o DIR
"""

EPILOG = """\
stderr:
  For one module: each MoE region found (where, sizes, FLOPs before and after) and each routing
  decision that was not rewritten, with the reason. For a dump directory: one line per
  rewritten module and one line for the others (per-module detail with -v). A region's place is
  the module's own source location -- file:line:column (function), from StableHLO loc(...) or
  the metadata of an XLA dump, else the op name -- or "(no location in the module)"; lower with
  .as_text(debug_info=True) to keep locations in StableHLO text.

outputs:
  -o and --report are checked before any work and written together at the end: each to a
  temporary file beside it, renamed into place once all are written, with the mode a plain
  write gives (0666 less the umask; a file being replaced keeps its mode). On an error none is
  written (none replaced). In a dump directory, a module that cannot be read, is invalid or uses
  an unsupported construct is copied unchanged (a warning, and the report's "skipped", say why).

exit status:
  0    rewritten, or nothing to rewrite (the module is written unchanged; the report says which)
  1    --verify found the rewritten module disagreeing with the original, or could not compile
       and run it (outputs are written; the summary says why)
  2    unreadable or invalid input (also input that crashes jaxlib's parser: it is parsed in a
       child process), an unsupported construct, an unwritable output, a bad option or a
       --backend that cannot run here (one line on stderr, nothing written)
  3    internal error: a bug in moe-rewrite (one line on stderr; rerun with -v for the
       traceback; nothing written)
  130  interrupted (nothing written)

examples:
  moe-rewrite model.mlir -o model.moe.mlir --report regions.json --verify
  moe-rewrite dump/module_0001.jit_step.before_optimizations.txt --emit hlo -o step.txt
  moe-rewrite model.mlir -o rewritten/                    # writes rewritten/model.mlir
  moe-rewrite dump/ -o dump_rewritten/
  python -m moe_lowering model.mlir -o model.moe.mlir     # the same tool
"""

log = logging.getLogger("moe_lowering.cli")


class CliError(Exception):
    """A user-facing failure: printed as one line, exit 2."""


def version_string() -> str:
    """``moe-rewrite (moe_lowering) 0.1.0, jax X, jaxlib Y`` -- without importing jax."""
    from importlib import metadata

    try:
        version = metadata.version("moe_lowering")
    except metadata.PackageNotFoundError:  # run from a source tree that is not installed
        import moe_lowering

        version = getattr(moe_lowering, "__version__", "unknown")
    parts = [f"{PROG} (moe_lowering) {version}"]
    for dependency in ("jax", "jaxlib"):
        try:
            parts.append(f"{dependency} {metadata.version(dependency)}")
        except metadata.PackageNotFoundError:
            parts.append(f"{dependency} not installed")
    return ", ".join(parts)


def build_parser(prog: str = PROG) -> argparse.ArgumentParser:
    parser = _Parser(
        prog=prog, description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("input", metavar="INPUT", help="StableHLO text, MLIR bytecode, HLO text, or a dump directory")
    parser.add_argument(
        "-o", "--output", metavar="OUTPUT",
        help="where to write the result: a file, or a directory (one that exists, or ending in '/': "
        "made) that receives it under INPUT's name; a directory for a directory INPUT; default or '-': stdout",
    )
    parser.add_argument(
        "--emit", choices=("stablehlo", "hlo"),
        help="output format (default: HLO text for HLO input, StableHLO text otherwise; "
        "an unchanged module is copied byte for byte unless --emit is given)",
    )
    parser.add_argument(
        "--report", metavar="PATH",
        help='also write a JSON report {"regions": [...], "near_misses": [...], "modules": [...]}: '
        "each region's location, sizes and FLOPs, each near miss's reason, each module's outcome",
    )
    parser.add_argument(
        "--verify", action="store_true",
        help="compile original and rewritten modules on the local backend, run both on random "
        "routing-realistic inputs and compare (exit 1 on mismatch)",
    )
    parser.add_argument(
        "--backend", default="auto", choices=("auto", "xla", "triton"),
        help="grouped-GEMM kernels for the rewritten MoE (auto: Triton on a CUDA GPU, else XLA)",
    )
    loudness = parser.add_mutually_exclusive_group()
    loudness.add_argument("-q", "--quiet", action="store_true", help="warnings and errors only, no summary (log level WARNING)")
    loudness.add_argument(
        "-v", "--verbose", action="store_true",
        help="also per-module detail, what the importer and matcher do, and the traceback of an "
        "internal error (log level DEBUG; the default is INFO)",
    )
    parser.add_argument("--version", action=_VersionAction, help="print the version (and jax's) and exit")
    return parser


class _VersionAction(argparse.Action):
    """``--version``: looked up only when asked for."""

    def __init__(self, option_strings, dest=argparse.SUPPRESS, default=argparse.SUPPRESS, help=None):
        super().__init__(option_strings, dest=dest, default=default, nargs=0, help=help)

    def __call__(self, parser, namespace, values, option_string=None):
        sys.stdout.write(version_string() + "\n")
        parser.exit(0)


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line too (``moe-rewrite: error: ...``), exit 2."""

    def error(self, message):
        self.exit(2, f"{PROG}: error: {message} (see {self.prog} --help)\n")


class _Formatter(logging.Formatter):
    """The summary (INFO from this module) as is; anything else ``moe-rewrite: <level>: ...``.

    A record's ``label`` (``extra={"label": ...}``) replaces the level word; an empty one drops it.
    """

    def format(self, record):
        text = super().format(record)
        if record.levelno == logging.INFO and record.name == log.name:
            return text
        label = getattr(record, "label", record.levelname.lower())
        source = f"{record.name}: " if record.levelno < logging.WARNING and record.name != log.name else ""
        return f"{PROG}: {label + ': ' if label else ''}{source}{text}"


@contextlib.contextmanager
def _console_logging(args):
    """``moe_lowering``'s records to stderr for one run: -q WARNING, default INFO, -v DEBUG.

    The package logger stops propagating meanwhile (a host application's root handlers would
    print everything twice); levels, handlers and propagation are restored afterwards.
    """
    package = logging.getLogger("moe_lowering")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(_Formatter("%(message)s"))
    saved = package.level, package.propagate, log.level
    package.addHandler(handler)
    package.propagate = False
    package.setLevel(logging.DEBUG if args.verbose else logging.WARNING)
    log.setLevel(logging.DEBUG if args.verbose else logging.WARNING if args.quiet else logging.INFO)
    try:
        yield
    finally:
        package.removeHandler(handler)
        package.setLevel(saved[0])
        package.propagate = saved[1]
        log.setLevel(saved[2])


def main(argv=None, prog: str = PROG) -> int:
    """Run ``moe-rewrite`` on ``argv`` (default ``sys.argv[1:]``); returns the exit status."""
    args = build_parser(prog).parse_args(argv)
    with _console_logging(args):
        try:
            return _run(args)
        except CliError as err:
            log.error("%s", err)
            return 2
        except KeyboardInterrupt:
            log.error("interrupted; nothing written", extra={"label": ""})
            return 130
        except Exception as err:  # a bug in the importer or the rewrite, not in the input
            log.debug("the internal error's traceback:", exc_info=True)
            first_line = (str(err).strip().splitlines() or [""])[0]
            hint = "" if args.verbose else " (rerun with -v for the traceback)"
            log.error("%s: %s%s", type(err).__name__, first_line, hint, extra={"label": "internal error"})
            return 3


def _run(args) -> int:
    from moe_lowering.hlo.importer import UnsupportedModuleError
    from moe_lowering.hlo.reader import ModuleReadError, dump_modules

    directory = os.path.isdir(args.input)
    if directory:
        if not args.output or args.output == "-":
            raise CliError(f"{args.input} is a directory: give -o OUTPUT_DIR")
        if os.path.exists(args.output) and not os.path.isdir(args.output):
            raise CliError(f"cannot write {args.output}: not a directory (INPUT is a directory)")
        try:
            inputs = dump_modules(args.input)
        except OSError as err:
            raise CliError(f"{args.input}: cannot list: {err.strerror or err}") from None
        if not inputs:
            raise CliError(f"{args.input}: no *.before_optimizations.txt, *.mlir or *.mlirbc modules")
        outputs = [os.path.join(args.output, os.path.basename(p)) for p in inputs]
        skip_unsupported = True
    else:
        inputs, outputs, skip_unsupported = [args.input], [_module_output(args.input, args.output)], False
        if not _is_stdout(outputs[0]) and os.path.realpath(outputs[0]) == os.path.realpath(args.input):
            raise CliError(f"cannot write {outputs[0]}: it is INPUT (give -o another path)")
    if args.report:
        _module_output(None, args.report)
    targets = _check_targets(outputs + ([args.report] if args.report else []))  # before any work: fail fast
    _check_backend(args.backend)

    from moe_lowering.hlo.isolated import Worker

    results = []
    with Worker() as worker:  # untrusted bytes meet jaxlib's native code there, not here
        for number, path in enumerate(inputs, 1):
            if directory:
                log.debug("[%d/%d] %s", number, len(inputs), path)
            try:
                results.append(_rewrite_one(path, args, worker))
            except (ModuleReadError, UnsupportedModuleError) as err:
                message = str(err) if str(err).startswith(path) else f"{path}: {err}"
                if not skip_unsupported:
                    raise CliError(message) from None
                log.warning("%s; copied unchanged", message)
                results.append(_Outcome(path, None, _read_bytes(path), False, [], [], None, reason=message))

    payloads = [outcome.payload for outcome in results]
    if args.report:
        payloads.append(json.dumps(_report_json(results), indent=2).encode() + b"\n")
    shown = outputs + ([args.report] if args.report else [])
    _write_all(list(zip(targets, shown, payloads)))
    _log_summary(results, directory)
    failed = [o for o in results if o.verify is not None and not o.verify.ok]
    return 1 if failed else 0


def _check_backend(name: str) -> None:
    """``--backend triton`` where it cannot run is a bad option (exit 2), found before any work."""
    if name == "auto":
        return
    from moe_lowering.kernels import BackendUnavailable, get_backend

    try:
        get_backend(name)
    except BackendUnavailable as err:
        raise CliError(f"--backend {name}: {' '.join(str(err).split())}") from None


def _log_summary(results, directory: bool) -> None:
    """One module: its full summary. A directory: a line per rewritten module (or failed
    verification), one line for all the others; every module's full summary at DEBUG."""
    if not directory:
        for outcome in results:
            log.info("%s", outcome.summary())
        return
    unchanged = []
    for outcome in results:
        log.debug("%s", outcome.summary())
        if outcome.changed or outcome.verify is not None:
            log.info("%s", outcome.one_line())
        else:
            unchanged.append(outcome)
    if unchanged:
        log.info("%s", _unchanged_line(unchanged))


def _unchanged_line(outcomes) -> str:
    """``15 modules without a MoE layer copied unchanged`` (with what else kept them unchanged)."""
    unread = sum(o.reason is not None for o in outcomes)
    near = sum(o.reason is None and bool(o.near_misses) for o in outcomes)
    plain = len(outcomes) - unread - near
    kinds = []
    if plain:
        kinds.append(f"{plain} without a MoE layer")
    if near:
        kinds.append(f"{near} whose routing did not match a MoE layer (-v or --report says why)")
    if unread:
        kinds.append(f"{unread} that could not be rewritten (warned above)")
    if len(kinds) == 1 and plain:
        return f"{_count(plain, 'module')} without a MoE layer copied unchanged"
    return f"{_count(len(outcomes), 'module')} copied unchanged: {', '.join(kinds)}"


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}{'' if n == 1 else 's'}"


class _Outcome:
    def __init__(self, path, report, payload: bytes, changed: bool, regions, near_misses, verify, reason=None):
        self.path, self.report, self.payload, self.changed = path, report, payload, changed
        self.regions, self.near_misses, self.verify = regions, near_misses, verify
        self.reason = reason  # why a module of a dump directory was copied without being looked at

    def summary(self) -> str:
        head = f"{self.path}: {'rewritten' if self.changed else 'unchanged'}"
        lines = [head] + (["  " + line for line in str(self.report).splitlines()] if self.report is not None else [])
        if self.reason is not None:
            lines.append(f"  not rewritten: {self.reason}")
        if self.verify is not None:
            lines.append(f"  verify: {'ok' if self.verify.ok else 'MISMATCH'}: {self.verify.detail}")
        return "\n".join(lines)

    def one_line(self) -> str:
        """``path: rewritten: 2 MoE regions at model.py:42:7 (moe); verify: ok: ...``, one line."""
        places = list(dict.fromkeys(r["location"] for r in self.regions))  # a scan repeats one place
        shown = ", ".join(places[:3]) + (f", and {len(places) - 3} more" if len(places) > 3 else "")
        line = f"{self.path}: {'rewritten' if self.changed else 'unchanged'}"
        if self.regions:
            line += f": {_count(len(self.regions), 'MoE region')} at {shown}"
        if self.verify is not None:
            verdict = "ok" if self.verify.ok else "MISMATCH"
            line += f"; verify: {verdict}: {' '.join(str(self.verify.detail).split())}"
        return line


def _rewrite_one(path: str, args, worker) -> _Outcome:
    from moe_lowering.hlo import _compat, reader
    from moe_lowering.hlo.rewrite import rewrite_module

    # Parsing and converting untrusted bytes can abort the process inside jaxlib: the worker does
    # it first, and the module is parsed here only once it survived that.
    source = reader.load_source(path, worker=worker)
    context = _compat.make_ir_context()
    module = reader.parse(source, context)
    result = rewrite_module(module, context, backend=args.backend)
    emit = args.emit or ("hlo" if source.kind == "hlo" else "stablehlo")
    if result.changed:
        text = result.stablehlo
        payload = (_to_hlo(worker, text, path, ours=True) if emit == "hlo" else text).encode()
    elif args.emit is None or (emit, source.kind) in (("hlo", "hlo"), ("stablehlo", "stablehlo")):
        payload = source.raw
    else:
        with context:
            text = str(module)
        payload = (_to_hlo(worker, text, path, ours=False) if emit == "hlo" else text).encode()
    verdict = None
    if args.verify and result.changed:
        with context:
            original_text = str(module)
        verdict = worker.verify(original_text, result.stablehlo, result.program.in_avals)
    report = result.report
    return _Outcome(
        path, report, payload, result.changed,
        [dict(r.to_dict(), module=path) for r in report.regions],
        [dict(n.to_dict(), module=path) for n in report.near_misses],
        verdict,
    )


def _to_hlo(worker, stablehlo_text: str, path: str, *, ours: bool) -> str:
    """HLO text of a module, translated by the worker (the translation can abort on odd input)."""
    from moe_lowering.hlo import isolated

    try:
        return worker.stablehlo_to_hlo_text(stablehlo_text)
    except isolated.IsolatedError as err:
        if ours:  # the rewritten module is ours: failing to translate it is a bug
            raise RuntimeError(f"{path}: the rewritten module does not translate to HLO: {err}") from None
        raise CliError(f"{path}: cannot emit HLO: {err}") from None


def _report_json(results) -> dict:
    return {
        "regions": [r for o in results for r in o.regions],
        "near_misses": [n for o in results for n in o.near_misses],
        "modules": [
            {
                "input": o.path,
                "rewritten": o.changed,
                "regions": len(o.regions),
                **({"skipped": o.reason} if o.reason is not None else {}),
                **({"verify": {"ok": o.verify.ok, "max_abs_error": o.verify.max_abs_error, "detail": o.verify.detail}}
                   if o.verify is not None else {}),
            }
            for o in results
        ],
    }


def _read_bytes(path: str) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError as err:
        raise CliError(f"{path}: cannot read: {err.strerror or err}") from None


# --------------------------------------------------------------------------------------------
# Output: every target checked before any work, every file staged before any is replaced.


def _is_stdout(target) -> bool:
    return target is None or target == "-"


def _module_output(input_path, target):
    """Where one module (``input_path``; None: the report) is written, for ``-o target``.

    A directory, one that exists or a name ending in a separator (made if missing), receives the
    module under the input's own name. A file's directory must exist: a mistyped path fails here
    rather than growing a new tree.
    """
    if _is_stdout(target):
        return target
    separators = tuple(sep for sep in (os.sep, os.altsep) if sep)
    if input_path is not None and (target.endswith(separators) or os.path.isdir(target)):
        return os.path.join(target, os.path.basename(input_path))
    parent = os.path.dirname(target)
    if parent and not os.path.lexists(parent):
        hint = " (end -o with '/' to write into a new directory)" if input_path is not None else ""
        raise CliError(f"cannot write {target}: no directory {parent}{hint}")
    return target


def _check_targets(targets: list) -> list:
    """``targets`` with symlinks resolved, once each writable looks possible; else :class:`CliError`.

    Checks what can be known up front (a directory in the way, a missing or read-only parent, the
    same file named twice), so a doomed run fails before the rewrite rather than after it.
    """
    resolved, seen = [], {}
    for target in targets:
        if _is_stdout(target):
            if None in seen:
                raise CliError("two outputs to stdout: give -o or --report a file")
            seen[None] = target
            resolved.append(None)
            continue
        real = os.path.realpath(target)
        if real in seen:
            raise CliError(f"cannot write {target}: it would be written twice (also {seen[real]})")
        seen[real] = target
        if os.path.isdir(real):
            raise CliError(f"cannot write {target}: is a directory")
        ancestor = os.path.dirname(real)
        while not os.path.lexists(ancestor):
            ancestor = os.path.dirname(ancestor)
        if not os.path.isdir(ancestor):
            raise CliError(f"cannot write {target}: {ancestor} is not a directory")
        if not os.access(ancestor, os.W_OK | os.X_OK):
            raise CliError(f"cannot write {target}: {ancestor}: permission denied")
        resolved.append(real)
    return resolved


def _new_file_mode() -> int:
    """The mode ``open(path, "w")`` gives a new file: 0666 less the umask."""
    mask = os.umask(0)
    os.umask(mask)
    return 0o666 & ~mask


class _Staged:
    """One file written to a temporary name beside its target, renamed onto it at commit."""

    def __init__(self, target: str, tmp: str):
        self.target, self.tmp = target, tmp
        self.backup = None  # a hard link to (or copy of) the file it replaces, for rollback
        self.committed = False


def _write_all(items: list) -> None:
    """Write every ``(target, shown_as, payload)`` (target None: stdout), all or nothing.

    Regular files are written to temporary files beside their targets first (created with the
    mode a plain write would give them) and renamed into place only once all are written and
    stdout has taken its part; a failure removes the temporaries, restores what was replaced and
    removes the directories it made. Devices and FIFOs (``-o /dev/null``) are written directly.
    """
    def stageable(target):
        return target is not None and (os.path.isfile(target) or not os.path.exists(target))

    files = [item for item in items if stageable(item[0])]
    direct = [item for item in items if not stageable(item[0])]
    staged, created, current = [], [], None
    new_mode = _new_file_mode()
    try:
        for target, shown, payload in files:
            current = shown
            staged.append(_stage(target, payload, new_mode, created))
        for target, shown, payload in direct:
            current = shown
            if target is None:
                _write_stdout(payload)
            else:
                with open(target, "wb") as f:
                    f.write(payload)
        for entry, (_, shown, _) in zip(staged, files):
            current = shown
            _commit(entry)
    except OSError as err:
        _rollback(staged, created)
        raise CliError(f"cannot write {current or 'stdout'}: {err.strerror or err}") from None
    except BaseException:
        _rollback(staged, created)
        raise
    for entry in staged:
        if entry.backup is not None:
            _unlink_quietly(entry.backup)


def _stage(target: str, payload: bytes, new_mode: int, created: list) -> _Staged:
    directory = os.path.dirname(target)
    missing = []
    probe = directory
    while not os.path.lexists(probe):
        missing.append(probe)
        probe = os.path.dirname(probe)
    for path in reversed(missing):
        os.mkdir(path)
        created.append(path)
    fd, tmp = tempfile.mkstemp(prefix=".moe-rewrite-", dir=directory)
    entry = _Staged(target, tmp)
    try:
        mode = stat.S_IMODE(os.stat(target).st_mode) if os.path.exists(target) else new_mode
        os.fchmod(fd, mode)  # mkstemp makes 0600; a plain write would not
        with os.fdopen(fd, "wb") as f:
            f.write(payload)
    except BaseException:
        _unlink_quietly(tmp)
        raise
    return entry


def _commit(entry: _Staged) -> None:
    if os.path.exists(entry.target):
        backup = entry.tmp + ".orig"
        try:
            os.link(entry.target, backup)
        except OSError:
            shutil.copy2(entry.target, backup)
        entry.backup = backup
    os.replace(entry.tmp, entry.target)
    entry.committed = True


def _rollback(staged: list, created: list) -> None:
    for entry in reversed(staged):
        try:
            if entry.committed:
                if entry.backup is not None:
                    os.replace(entry.backup, entry.target)
                    entry.backup = None
                else:
                    os.unlink(entry.target)
            else:
                _unlink_quietly(entry.tmp)
        except OSError:
            log.warning("could not restore %s", entry.target)
        if entry.backup is not None:
            _unlink_quietly(entry.backup)
    for path in reversed(created):
        try:
            os.rmdir(path)
        except OSError:
            pass


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


def _write_stdout(payload: bytes) -> None:
    try:
        sys.stdout.buffer.write(payload)
        sys.stdout.flush()
    except BrokenPipeError:
        # Python would complain again when it flushes stdout at exit: point it at /dev/null.
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        raise


if __name__ == "__main__":
    sys.exit(main())
