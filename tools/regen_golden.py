"""Write the golden-test input modules (and, with --rewritten, the tool's output) to a directory.

The golden tests build these same inputs at test time from the zoo (StableHLO text differs
between JAX versions, so inputs are not committed); this script is for looking at them and for
writing CHECK lines:

    PYTHONPATH=. python tools/regen_golden.py /tmp/golden --rewritten
    moe-rewrite /tmp/golden/mixtral.mlir | filecheck tests/golden/mixtral.check   # after ${..} substitution
"""

from __future__ import annotations

import argparse
import os
import sys


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("out_dir")
    parser.add_argument("--models", nargs="*", help="zoo model names (default: all)")
    parser.add_argument("--rewritten", action="store_true", help="also write <name>.rewritten.mlir")
    args = parser.parse_args(argv)

    from moe_lowering.hlo import _compat, reader
    from moe_lowering.hlo.rewrite import rewrite_module
    from moe_lowering.testing import hlo_examples as examples
    from moe_lowering.testing.zoo import ZOO

    os.makedirs(args.out_dir, exist_ok=True)
    for name in args.models or list(ZOO):
        stablehlo = examples.zoo_module_text(name, "stablehlo")
        hlo = examples.zoo_module_text(name, "hlo")
        _write(os.path.join(args.out_dir, f"{name}.mlir"), stablehlo)
        _write(os.path.join(args.out_dir, f"{name}.before_optimizations.txt"), hlo)
        if args.rewritten:
            context = _compat.make_ir_context()
            module = reader.parse(reader.source_from_bytes(stablehlo.encode(), name), context)
            result = rewrite_module(module, context, backend="xla")
            _write(os.path.join(args.out_dir, f"{name}.rewritten.mlir"), result.stablehlo or stablehlo)
        print(name, file=sys.stderr)
    return 0


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


if __name__ == "__main__":
    sys.exit(main())
