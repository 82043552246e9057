#!/usr/bin/env bash
# The --no-deps half of the real-world test dependencies (the other half is the `realworld` extra).
#
#   pip install -e ".[test,realworld]" && bash tools/install_realworld.sh
#
# Each package below declares requirements that cannot be installed as they stand beside jax 0.11.2
# on a CPU machine, so it is installed alone; what it actually imports is pinned in the extra:
#   tokamax   (MaxText's megablox kernels import it): requires xprof, which pulls gcsfs and cloud clients
#   xprof     (tokamax imports xprof.cli.tools at import): requires gcsfs, duckdb, cheroot, ...
#   easydel   requires ray[default], flax==0.12.3, transformers~=5.5, wandb, datasets, uvloop, ...
#   eformer   requires ray[default], tensorstore, optax, ...
#   ejkernel  requires jax~=0.9.0
# EasyDeL's import also touches six Hugging Face modeling modules that need torch; the tests stand in
# for them (tests/realworld/rw_hf_stubs.py) rather than install torch.
set -euo pipefail
python -c 'import sys; sys.exit(0 if sys.version_info >= (3, 12) else "install_realworld.sh: MaxText 0.2.5 needs Python >= 3.12")'
pip install -q --no-deps \
  "tokamax==0.0.17" \
  "xprof==2.24.2" \
  "easydel==0.3.0" \
  "eformer==0.0.99.12" \
  "ejkernel==0.0.78"
