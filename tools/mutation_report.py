"""Run semantic mutants of the zoo through the pass and print, per mutation kind, how many were
rewritten exactly, declined (with the top reasons ``explain`` gave), rewritten WRONG (with ids)
or crashed (with the exception). Same as ``python -m moe_lowering.testing.mutate``:

    python tools/mutation_report.py                        # 3 mutants per (model, kind): ~600
    python tools/mutation_report.py --per-kind 6 --seed 1 --json /tmp/mutants.jsonl
    python tools/mutation_report.py --models switch gshard_top2 --kinds substitute int_shift -v
    python tools/mutation_report.py --id 'switch/eqn26:replace_op(eq->gt)'    # one mutant, in full
    python tools/mutation_report.py --list                 # the ids only

Exit status 1 when any mutant is rewritten wrongly or crashes the pass.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":
    sys.path.insert(0, os.path.normpath(os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)))
    from moe_lowering.testing.mutate import main

    sys.exit(main())
