"""``moe-rewrite``: rewrite the dense MoE layers of StableHLO/HLO modules into sorted grouped-GEMM MoE."""

from __future__ import annotations

import argparse
import json
import logging
import os
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
exit status:
  0  rewritten, or nothing to rewrite (the module is written unchanged; the report says which)
  1  --verify found the rewritten module disagreeing with the original
  2  unreadable or invalid input, or an unsupported construct (one-line message, nothing written)
  3  internal error in the rewrite (one-line message; -v prints the traceback; nothing written)

examples:
  moe-rewrite model.mlir -o model.moe.mlir --report regions.json --verify
  moe-rewrite dump/module_0001.jit_step.before_optimizations.txt --emit hlo -o step.txt
  moe-rewrite dump/ -o dump_rewritten/
"""

log = logging.getLogger("moe_lowering.cli")


class CliError(Exception):
    """A user-facing failure: printed as one line, exit 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="moe-rewrite", description=DESCRIPTION, epilog=EPILOG, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("input", metavar="INPUT", help="StableHLO text, MLIR bytecode, HLO text, or a dump directory")
    parser.add_argument(
        "-o", "--output", metavar="OUTPUT",
        help="where to write the result (a directory for a directory INPUT); default: stdout",
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
    parser.add_argument("-v", "--verbose", action="store_true", help="log what the importer and matcher do")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.WARNING, format="moe-rewrite: %(message)s")
    try:
        return _run(args)
    except CliError as err:
        print(f"moe-rewrite: error: {err}", file=sys.stderr)
        return 2
    except Exception as err:  # a bug in the importer or the rewrite, not in the input
        if args.verbose:
            traceback.print_exc()
        first_line = (str(err).strip().splitlines() or [""])[0]
        print(f"moe-rewrite: internal error: {type(err).__name__}: {first_line} (rerun with -v for the traceback)",
              file=sys.stderr)
        return 3


def _run(args) -> int:
    from moe_lowering.hlo.importer import UnsupportedModuleError
    from moe_lowering.hlo.reader import ModuleReadError, dump_modules

    if os.path.isdir(args.input):
        if not args.output:
            raise CliError(f"{args.input} is a directory: give -o OUTPUT_DIR")
        inputs = dump_modules(args.input)
        if not inputs:
            raise CliError(f"{args.input}: no *.before_optimizations.txt, *.mlir or *.mlirbc modules")
        outputs = [os.path.join(args.output, os.path.basename(p)) for p in inputs]
        skip_unsupported = True
    else:
        inputs, outputs, skip_unsupported = [args.input], [args.output], False

    results = []
    for path in inputs:
        try:
            results.append(_rewrite_one(path, args))
        except (ModuleReadError, UnsupportedModuleError) as err:
            message = str(err) if str(err).startswith(path) else f"{path}: {err}"
            if not skip_unsupported:
                raise CliError(message) from None
            log.warning("%s; copied unchanged", message)
            results.append(_Outcome(path, None, _read_bytes(path), False, [], [], None))

    for outcome, target in zip(results, outputs):
        _write(target, outcome.payload)
    if args.report:
        _write(args.report, json.dumps(_report_json(results), indent=2).encode() + b"\n")
    if not args.quiet:
        for outcome in results:
            print(outcome.summary(), file=sys.stderr)
    failed = [o for o in results if o.verify is not None and not o.verify.ok]
    return 1 if failed else 0


class _Outcome:
    def __init__(self, path, report, payload: bytes, changed: bool, regions, near_misses, verify):
        self.path, self.report, self.payload, self.changed = path, report, payload, changed
        self.regions, self.near_misses, self.verify = regions, near_misses, verify

    def summary(self) -> str:
        head = f"{self.path}: {'rewritten' if self.changed else 'unchanged'}"
        lines = [head] + (["  " + line for line in str(self.report).splitlines()] if self.report is not None else [])
        if self.verify is not None:
            lines.append(f"  verify: {'ok' if self.verify.ok else 'MISMATCH'}: {self.verify.detail}")
        return "\n".join(lines)


def _rewrite_one(path: str, args) -> _Outcome:
    from moe_lowering.hlo import _compat, reader
    from moe_lowering.hlo.rewrite import rewrite_module
    from moe_lowering.hlo.verify import verify

    source = reader.load_source(path)
    context = _compat.make_ir_context()
    module = reader.parse(source, context)
    result = rewrite_module(module, context, backend=args.backend)
    emit = args.emit or ("hlo" if source.kind == "hlo" else "stablehlo")
    if result.changed:
        text = result.stablehlo
        payload = (_compat.stablehlo_to_hlo_text(text) if emit == "hlo" else text).encode()
    elif args.emit is None or (emit, source.kind) in (("hlo", "hlo"), ("stablehlo", "stablehlo")):
        payload = source.raw
    else:
        with context:
            text = str(module)
        payload = (_compat.stablehlo_to_hlo_text(text) if emit == "hlo" else text).encode()
    verdict = None
    if args.verify and result.changed:
        with context:
            original_text = str(module)
        verdict = verify(original_text, result.stablehlo, result.program.in_avals)
    report = result.report
    return _Outcome(
        path, report, payload, result.changed,
        [dict(r.to_dict(), module=path) for r in report.regions],
        [dict(n.to_dict(), module=path) for n in report.near_misses],
        verdict,
    )


def _report_json(results) -> dict:
    return {
        "regions": [r for o in results for r in o.regions],
        "near_misses": [n for o in results for n in o.near_misses],
        "modules": [
            {
                "input": o.path,
                "rewritten": o.changed,
                "regions": len(o.regions),
                **({"verify": {"ok": o.verify.ok, "max_abs_error": o.verify.max_abs_error, "detail": o.verify.detail}}
                   if o.verify is not None else {}),
            }
            for o in results
        ],
    }


def _read_bytes(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _write(target: str | None, payload: bytes) -> None:
    """Write ``payload`` to ``target`` atomically (temp file + rename); None means stdout."""
    if target is None or target == "-":
        sys.stdout.buffer.write(payload)
        sys.stdout.flush()
        return
    directory = os.path.dirname(os.path.abspath(target))
    try:
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=".moe-rewrite-", dir=directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(payload)
            os.replace(tmp, target)
        except BaseException:
            os.unlink(tmp)
            raise
    except OSError as err:
        raise CliError(f"cannot write {target}: {err.strerror or err}") from None


if __name__ == "__main__":
    sys.exit(main())
