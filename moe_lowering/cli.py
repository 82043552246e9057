"""``moe-rewrite``: rewrite the dense MoE layers of StableHLO/HLO modules into sorted grouped-GEMM MoE."""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import stat
import sys
import tempfile
import traceback

DESCRIPTION = """\
Find dense-reference Mixture-of-Experts layers in a compiled JAX program and rewrite them to
the sorted, dropless grouped-GEMM MoE -- the same recognition and rewrite as the
@moe_optimize decorator, for programs you only have as IR.

INPUT is one of:
  * StableHLO text       jax.jit(f).lower(...).as_text(), or a JAX IR dump (*.mlir)
  * MLIR bytecode        (*.mlirbc, serialized StableHLO)
  * HLO text             an XLA dump's *.before_optimizations.txt
  * a dump directory     (--xla_dump_to); every module in it is rewritten into -o DIR
"""

EPILOG = """\
outputs:
  -o and --report are checked before any work and written together at the end: each to a
  temporary file beside it, renamed into place once all are written, with the mode a plain
  write gives (0666 less the umask; a file being replaced keeps its mode). On an error none is
  written (none replaced). In a dump directory, a module that cannot be read, is invalid or uses
  an unsupported construct is copied unchanged; the report's "skipped" says why.

exit status:
  0  rewritten, or nothing to rewrite (the module is written unchanged; the report says which)
  1  --verify found the rewritten module disagreeing with the original, or could not compile
     and run it (outputs are written; the summary says why)
  2  unreadable or invalid input (also input that crashes jaxlib's parser: it is parsed in a
     child process), an unsupported construct, an unwritable output or a bad option
     (one line on stderr, nothing written)
  3  internal error: a bug in moe-rewrite (one line on stderr; rerun with -v for the
     traceback; nothing written)

examples:
  moe-rewrite model.mlir -o model.moe.mlir --report regions.json --verify
  moe-rewrite dump/module_0001.jit_step.before_optimizations.txt --emit hlo -o step.txt
  moe-rewrite dump/ -o dump_rewritten/
"""

log = logging.getLogger("moe_lowering.cli")


class CliError(Exception):
    """A user-facing failure: printed as one line, exit 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="moe-rewrite", description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("input", metavar="INPUT", help="StableHLO text, MLIR bytecode, HLO text, or a dump directory")
    parser.add_argument(
        "-o", "--output", metavar="OUTPUT",
        help="where to write the result (a directory for a directory INPUT); default or '-': stdout",
    )
    parser.add_argument(
        "--emit", choices=("stablehlo", "hlo"),
        help="output format (default: HLO text for HLO input, StableHLO text otherwise; "
        "an unchanged module is copied byte for byte unless --emit is given)",
    )
    parser.add_argument("--report", metavar="PATH", help='write a JSON report {"regions": [...], "near_misses": [...], "modules": [...]}')
    parser.add_argument(
        "--verify", action="store_true",
        help="compile original and rewritten modules on the local backend, run both on random "
        "routing-realistic inputs and compare (exit 1 on mismatch)",
    )
    parser.add_argument(
        "--backend", default="auto", choices=("auto", "xla", "triton"),
        help="grouped-GEMM kernels for the rewritten MoE (auto: Triton on a CUDA GPU, else XLA)",
    )
    parser.add_argument("-q", "--quiet", action="store_true", help="no summary on stderr")
    parser.add_argument(
        "-v", "--verbose", action="store_true",
        help="log what the importer and matcher do; print the traceback of an internal error",
    )
    return parser


class _Parser(argparse.ArgumentParser):
    """Usage errors are one line too (``moe-rewrite: error: ...``), exit 2."""

    def error(self, message):
        self.exit(2, f"moe-rewrite: error: {message} (see moe-rewrite --help)\n")


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="moe-rewrite: %(message)s")
    try:
        return _run(args)
    except CliError as err:
        print(f"moe-rewrite: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("moe-rewrite: interrupted; nothing written", file=sys.stderr)
        return 130
    except Exception as err:  # a bug in the importer or the rewrite, not in the input
        if args.verbose:
            traceback.print_exc()
        first_line = (str(err).strip().splitlines() or [""])[0]
        hint = "" if args.verbose else " (rerun with -v for the traceback)"
        print(f"moe-rewrite: internal error: {type(err).__name__}: {first_line}{hint}", file=sys.stderr)
        return 3


def _run(args) -> int:
    from moe_lowering.hlo.importer import UnsupportedModuleError
    from moe_lowering.hlo.reader import ModuleReadError, dump_modules

    if os.path.isdir(args.input):
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
        inputs, outputs, skip_unsupported = [args.input], [args.output], False
    targets = _check_targets(outputs + ([args.report] if args.report else []))  # before any work: fail fast

    from moe_lowering.hlo.isolated import Worker

    results = []
    with Worker() as worker:  # untrusted bytes meet jaxlib's native code there, not here
        for path in inputs:
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
    if not args.quiet:
        for outcome in results:
            print(outcome.summary(), file=sys.stderr)
    failed = [o for o in results if o.verify is not None and not o.verify.ok]
    return 1 if failed else 0


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
