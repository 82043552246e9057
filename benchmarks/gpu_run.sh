#!/usr/bin/env bash
# One call on the GPU machine: install the carried wheels, then run the steps named as arguments,
# each logging under $OUT. Run from the repository root with .whl (jax-triton, tokamax and its needs)
# and .gpu_stubs (the xprof stand-in tokamax imports) carried; for the EP steps, NCCL_NVLS_ENABLE=0.
# Each step remakes result files that benchmarks/README.md lists (the step is named there). On one H100,
# `tests` (tests/gpu without the SwiGLU files) takes about 8 minutes, `swiglu-tests` (those files) 2.5
# and `kernel-tests` (tests/kernels without the interpreter cases, which CI runs) about 3: `tests` in a
# call of its own within the 10-minute limit.
#   one GPU:  tests kernel-tests sweep bench bench-small swiglu swiglu-tests swiglu-rows fp8 fp8-weight-tests
#             gathered-rows gluon-tests gluon-layers (the Hopper weight gradient: its GPU tests; every
#             TGMM_CONFIGS entry at the benchmark layers' shapes, then the layer as routed, streaming both
#             operands at every group size, and with Triton's kernels) gluon-tgmm-ab (the weight-gradient
#             kernels against another revision's, carried as .baseline_tgmm.py: see the step)
#             gluon-forward-tests gluon-forward-ab gluon-forward (the forward and input-gradient products on the
#             Gluon kernels: their GPU tests; each product form against gmm_kernel; the layer with them and
#             with Triton's gmm_kernel, and a profile)
#             sonic-small sonic-large (SonicMoE itself and ours side by side, six shapes a call: carry the
#             shared harness as .sonic, `cp -r ../shared/sonic .sonic`, beside .whl without tokamax)
#   4 GPUs:   fp8-layer peer peer-tests issue4-rows dedup push-sweep swiglu-final tiles tiles-fwdbwd
#             tiles-final resident-ep (the next multi-GPU run, in a call of its own: the dense one-GPU
#             forward+backward row alone takes ~100 s; benchmarks/EP_NOTES.md, "What is left")
#             ep-multiprocess (one process per GPU against one process, issue 36: EP=4; EP_SIZES=2 in a
#             second call for EP=2, each call's two jobs within the 10 minutes)
#   2+ GPUs:  first-call (the sharded forward+backward's first call in fresh processes: no stall, EP=2)
# The one-off steps of earlier EP rounds are in git history (git show 3ea3258:benchmarks/gpu_run.sh), the
# tma-probe step with its probe (git show ebaf5b2:benchmarks/gpu_run.sh).
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD/.gpu_stubs:$PWD
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
nvidia-smi --query-gpu=name,memory.total,clocks.sm,driver_version --format=csv | tee "$OUT/device.txt"
side_by_side() {  # SonicMoE itself, then ours, on six shapes: sonic_side_by_side.py's one result
  timeout 580 python3 benchmarks/sonic_side_by_side.py --shapes $2 --sonic-budget-s 370 --reps 5 --tag "$1" \
    --out "$OUT" 2>&1 | tee "$OUT/side_by_side_$1.log" | grep -v "INFO\|Unable" | tail -20
}
for step in "$@"; do
  echo "=== $step $(date -u +%H:%M:%S)"
  case "$step" in
    first-call) timeout 560 python3 benchmarks/ep_first_call.py --runs 2 --timeout 120 --out "$OUT" 2>&1 \
      | tee "$OUT/ep_first_call.log" | grep -v "INFO\|Unable" | tail -12 ;;
    tests) python3 -m pytest tests/gpu --ignore-glob "tests/gpu/test_triton_swiglu_*.py" -v -rs -p no:cacheprovider 2>&1 \
      | tee "$OUT/gpu_tests.log" | tail -15 ;;
    kernel-tests) python3 -m pytest tests/kernels -m "not triton_interpreter" -v -rs -p no:cacheprovider 2>&1 \
      | tee "$OUT/gpu_kernel_tests.log" | tail -8 ;;
    sweep) timeout 330 python3 benchmarks/gmm_sweep.py --out "$OUT/gmm_sweep.json" 2>&1 | tee "$OUT/gmm_sweep.log" | tail -22 ;;
    bench) python3 benchmarks/moe_layer.py --out "$OUT" 2>&1 | tee "$OUT/moe_layer.log" | tail -16 ;;
    bench-small) python3 benchmarks/moe_layer.py --configs small --reps 3 --out "$OUT/small" 2>&1 | tail -8 ;;
    swiglu) timeout 420 python3 benchmarks/swiglu_fusion.py --out "$OUT" 2>&1 | tee "$OUT/swiglu_fusion.log" | tail -16 ;;
    swiglu-tests) timeout 240 python3 -m pytest tests/gpu/test_triton_swiglu_gmm.py tests/gpu/test_triton_swiglu_rows.py -v -rs \
        -p no:cacheprovider 2>&1 \
      | tee "$OUT/gpu_swiglu_tests.log" | tail -8 ;;
    swiglu-rows) timeout 400 python3 benchmarks/swiglu_rows_sweep.py --out "$OUT" 2>&1 | tee "$OUT/swiglu_rows_sweep.log" | grep -v "^20.*INFO.*Unable" | tail -70 ;;
    fp8) timeout 110 python3 -m pytest tests/gpu/test_triton_fp8_gmm.py -v -rs -p no:cacheprovider 2>&1 \
      | tee "$OUT/gpu_fp8_tests.log" | tail -12
      timeout 110 python3 benchmarks/fp8_gmm_bench.py --out "$OUT" --shapes mixtral-4096-rows-2-groups deepseek-8192-rows-64-groups 2>&1 | tee "$OUT/fp8_gmm_bench.log" | tail -30 ;;
    gathered-rows) timeout 200 python3 -m pytest tests/gpu/test_triton_grouped_matmul.py tests/gpu/test_triton_swiglu_gmm.py \
        -k gather -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/gpu_gathered_rows_tests.log" | tail -6
      timeout 380 python3 benchmarks/sonic_ab.py --shapes 1.4B-n256 7B-n256 1.4B-n512 \
        --variants keptcopy new gradstages --pipelined --profile --out "$OUT/ab" 2>&1 | tee "$OUT/sonic_ab_gathered_rows.log" | grep -v "INFO\|Unable" | tail -40
      rm -rf "$OUT"/ab/trace_* ;;
    fp8-weight-tests) timeout 150 python3 -m pytest tests/gpu/test_fp8_weight_matmul.py -v -rs -p no:cacheprovider 2>&1 \
      | tee "$OUT/gpu_fp8_weight_tests.log" | tail -10 ;;
    fp8-layer) timeout 300 python3 benchmarks/fp8_layer_bench.py --out "$OUT" --deadline 260 2>&1 \
      | tee "$OUT/fp8_layer.log" | tail -14 ;;
    peer) timeout 240 python3 benchmarks/peer_exchange_probe.py --out "$OUT" 2>&1 | tee "$OUT/peer_exchange_probe.log" | tail -30 ;;
    peer-tests) timeout 200 python3 -m pytest tests/gpu/test_peer_exchange.py -v -rs -p no:cacheprovider 2>&1 \
      | tee "$OUT/gpu_peer_tests.log" | tail -25 ;;
    issue4-rows) timeout 170 python3 -m pytest tests/gpu/test_peer_exchange.py tests/gpu/test_triton_swiglu_rows.py -v -rs \
        -p no:cacheprovider 2>&1 | tee "$OUT/gpu_peer_rows_tests.log" | tail -8
      timeout 400 python3 benchmarks/ep_overlap.py --out "$OUT" --loops after --chunks 1 --scheduler default \
        --configs mixtral deepseek --transports all_to_all peer --peer-variants fused all-rows --reps 10 --forward-only \
        --deadline 370 2>&1 | tee "$OUT/ep_issue4_rows.log" | tail -30 ;;
    dedup) timeout 190 python3 -m pytest tests/gpu/test_peer_exchange.py -v -rs -p no:cacheprovider 2>&1 \
        | tee "$OUT/gpu_peer_dedup_tests.log" | tail -8
      timeout 380 python3 benchmarks/ep_overlap.py --out "$OUT" --loops after --chunks 1 --scheduler default \
        --configs deepseek mixtral --transports peer --peer-variants fused rows --reps 10 --forward-only --profile \
        --deadline 350 2>&1 | tee "$OUT/ep_dedup.log" | tail -40 ;;
    push-sweep) timeout 280 python3 benchmarks/ep_overlap.py --out "$OUT" --loops after --chunks 1 --scheduler default \
        --configs mixtral deepseek --transports peer --peer-variants fused push-264x4x8 push-528x4x8 push-132x8x16 \
        push-264x8x16 push-132x4x32 --reps 10 --forward-only --deadline 250 2>&1 | tee "$OUT/ep_push_sweep.log" | tail -30 ;;
    swiglu-final) timeout 100 python3 -m pytest tests/gpu/test_triton_swiglu_rows.py -q -rs -p no:cacheprovider 2>&1 \
        | tee "$OUT/gpu_swiglu_rows_tests.log" | tail -3
      timeout 300 python3 benchmarks/ep_overlap.py --out "$OUT" --loops after --chunks 1 --scheduler default \
        --configs mixtral deepseek --transports peer --reps 10 --forward-only --profile --deadline 280 2>&1 \
        | tee "$OUT/ep_swiglu_final.log" | grep "^name=\|GPU .: kernels"
      rm -rf "$OUT"/trace_*; mkdir -p "$OUT/fwdbwd"
      timeout 180 python3 benchmarks/ep_overlap.py --out "$OUT/fwdbwd" --loops after --chunks 1 --scheduler default \
        --configs mixtral --eps 4 --transports peer --reps 10 --deadline 165 2>&1 \
        | tee "$OUT/ep_swiglu_final_fwdbwd.log" | grep "^name=" ;;
    tiles) timeout 230 python3 -m pytest tests/gpu/test_triton_grouped_matmul.py tests/gpu/test_peer_exchange.py -q -rs \
        -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tiles_tests.log" | tail -8
      timeout 330 python3 benchmarks/ep_overlap.py --out "$OUT" --loops after --chunks 1 --scheduler default \
        --configs deepseek --transports peer --peer-variants buffer-tiles fused --reps 10 --forward-only --profile \
        --deadline 300 2>&1 | tee "$OUT/ep_tiles.log" | grep "^name=\|GPU .: kernels"
      rm -rf "$OUT"/trace_* ;;
    tiles-fwdbwd) mkdir -p "$OUT/fwdbwd"; timeout 420 python3 benchmarks/ep_overlap.py --out "$OUT/fwdbwd" --loops after \
        --chunks 1 --scheduler default --configs deepseek --transports peer --peer-variants buffer-tiles fused \
        --reps 10 --deadline 390 2>&1 | tee "$OUT/ep_tiles_fwdbwd.log" | grep "^name=" ;;
    tiles-final) timeout 300 python3 benchmarks/ep_overlap.py --out "$OUT" --loops after --chunks 1 --scheduler default \
        --configs mixtral deepseek --transports peer --reps 10 --forward-only --profile --deadline 280 2>&1 \
        | tee "$OUT/ep_tiles_final.log" | grep "^name=\|GPU .: kernels"
      rm -rf "$OUT"/trace_*; mkdir -p "$OUT/ep2"
      timeout 150 python3 benchmarks/ep_overlap.py --out "$OUT/ep2" --loops after --chunks 1 --scheduler default \
        --configs mixtral --eps 2 --transports peer --reps 10 --forward-only --profile --deadline 135 2>&1 \
        | tee "$OUT/ep_tiles_final_mixtral_ep2.log" | grep "^name=\|GPU .: kernels"
      rm -rf "$OUT"/ep2/trace_* ;;
    resident-ep) mkdir -p "$OUT/fwdbwd"; timeout 580 python3 benchmarks/ep_overlap.py --out "$OUT/fwdbwd" --loops after \
        --chunks 1 --scheduler default --configs deepseek mixtral --transports peer --reps 10 --deadline 550 2>&1 \
        | tee "$OUT/ep_resident_fwdbwd.log" | grep "^name=" ;;
    ep-multiprocess) mkdir -p "$OUT/ep_multiprocess"; timeout 590 python3 benchmarks/ep_multiprocess.py \
        --ep ${EP_SIZES:-4} --reps 5 --timeout 290 --out "$OUT/ep_multiprocess" 2>&1 \
        | tee "$OUT/ep_multiprocess${EP_SIZES:-4}.log" | tail -60 ;;
    gluon-tests) timeout 300 python3 -m pytest tests/gpu/test_gluon_grouped_matmul_jax.py tests/gpu/test_triton_grouped_matmul.py \
        -k "tgmm or gluon or expected_rows" -q -rs -p no:cacheprovider 2>&1 | tee "$OUT/gpu_gluon_tgmm_tests.log" | tail -4 ;;
    gluon-layers) timeout 300 python3 benchmarks/gluon_gmm_probe.py --ops tgmm --out "$OUT" \
        --shapes deepseek deepseek-equal deepseek-skewed qwen3 mixtral 2>&1 | grep -v "INFO\|Unable" | tee "$OUT/gluon_probe_layers.log" | tail -50
      for variant in auto streamed triton; do
        timeout 200 python3 benchmarks/moe_layer.py --impls moe_optimize --back-to-back --weight-gradient $variant \
          --out "$OUT/layer_$variant" 2>&1 | grep "^[a-z].*moe_optimize"
      done ;;
    gluon-forward-tests) timeout 560 python3 -m pytest tests/gpu/test_gluon_grouped_matmul_jax.py \
        tests/gpu/test_triton_grouped_matmul.py tests/gpu/test_triton_gather_rows.py -q -rs -p no:cacheprovider 2>&1 \
        | tee "$OUT/gpu_gluon_forward_tests.log" | tail -6 ;;
    gluon-forward-ab) timeout 300 python3 benchmarks/gluon_forward_ab.py --out "$OUT" 2>&1 | grep -v "INFO\|Unable" \
        | tee "$OUT/gluon_forward_ab.log" | tail -14 ;;
    gluon-forward) for variant in auto triton; do
        timeout 200 python3 benchmarks/moe_layer.py --impls moe_optimize --back-to-back --forward-products $variant \
          --out "$OUT/layer_fwd_$variant" 2>&1 | grep "^[a-z].*moe_optimize"
      done
      timeout 150 python3 benchmarks/layer_profile.py --configs deepseek mixtral qwen3 --out "$OUT/profile" 2>&1 \
        | grep -v "INFO\|Unable" | tee "$OUT/layer_profile_gluon_forward.log" | grep -A8 "^=="
      rm -rf "$OUT"/profile/trace_* ;;
    # the baseline: git show REV:moe_lowering/kernels/grouped_matmul_sm90/gluon_tgmm_kernels.py > .baseline_tgmm.py
    gluon-tgmm-ab) timeout 300 python3 benchmarks/gluon_tgmm_ab.py --baseline "${BASELINE_TGMM:-.baseline_tgmm.py}" \
        --out "$OUT" 2>&1 | tee "$OUT/gluon_tgmm_ab.log" | tail -40 ;;
    sonic-small) side_by_side small "1.4B-n256 1.4B-n512 1.4B-n1024 7B-n256 7B-n512 7B-n1024" ;;
    sonic-large) side_by_side large "30B-n256 30B-n512 30B-n1024 120B-n512 120B-n1024 120B-n2048" ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
echo "=== done $(date -u +%H:%M:%S)"
