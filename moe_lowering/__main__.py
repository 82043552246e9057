"""``python -m moe_lowering``: the ``moe-rewrite`` command line tool (see ``--help``)."""

from __future__ import annotations

import sys

from moe_lowering.cli import main

if __name__ == "__main__":
    sys.exit(main(prog="python -m moe_lowering"))
