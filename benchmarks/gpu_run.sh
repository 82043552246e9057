#!/usr/bin/env bash
# One call on the GPU machine: install the carried wheels, then run the steps named as arguments
# (tests, sweep, bench, bench-small, swiglu, swiglu-tests, overlap, exchange-bw, fp8, final-ep, peer, fp8-layer,
# fp8-weight-tests, peer-tests, peer-ep, peer-ep-after, peer-ep-quick, ep2-base, cmdbuf, fused-tests, ep2-fused, ep2-fused-fwdbwd, ep2-final, issue4, issue4-rows, issue4-fwdbwd, push-sweep, dedup, b2b-profile, splitk, splitk-land, ranks, swiglu-rows, swiglu-final, tiles, tiles-fwdbwd, tiles-final, resident-ep), each logging under $OUT. Run from the repository root with
# .whl (jax-triton, tokamax and its needs) and .gpu_stubs (the xprof stand-in tokamax imports) carried.
set -uo pipefail
OUT=${OUT:-/tmp/out}
mkdir -p "$OUT"
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl \
  || exit 1
export PYTHONPATH=/tmp/site:$PWD/.gpu_stubs:$PWD
export PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.92
nvidia-smi --query-gpu=name,memory.total,clocks.sm,driver_version --format=csv | tee "$OUT/device.txt"
for step in "$@"; do
  echo "=== $step $(date -u +%H:%M:%S)"
  case "$step" in
    tests) python3 -m pytest tests/gpu tests/kernels -v -rs -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" | tail -15 ;;
    sweep) timeout 330 python3 benchmarks/gmm_sweep.py --out "$OUT/gmm_sweep.json" 2>&1 | tee "$OUT/gmm_sweep.log" | tail -22 ;;
    bench) python3 benchmarks/moe_layer.py --out "$OUT" 2>&1 | tee "$OUT/moe_layer.log" | tail -16 ;;
    swiglu-final) timeout 100 python3 -m pytest tests/gpu/test_triton_swiglu_rows.py -q -rs -p no:cacheprovider 2>&1 \
        | tee "$OUT/gpu_swiglu_rows_tests.log" | tail -3
      timeout 300 python3 benchmarks/ep_overlap.py --out "$OUT" --loops after --chunks 1 --scheduler default \
        --configs mixtral deepseek --transports peer --reps 10 --forward-only --profile --deadline 280 2>&1 \
        | tee "$OUT/ep_swiglu_final.log" | grep "^name=\|GPU .: kernels"
      rm -rf "$OUT"/trace_*; mkdir -p "$OUT/fwdbwd"
      timeout 180 python3 benchmarks/ep_overlap.py --out "$OUT/fwdbwd" --loops after --chunks 1 --scheduler default \
        --configs mixtral --eps 4 --transports peer --reps 10 --deadline 165 2>&1 \
        | tee "$OUT/ep_swiglu_final_fwdbwd.log" | grep "^name=" ;;
    swiglu-rows) timeout 400 python3 benchmarks/swiglu_rows_sweep.py --out "$OUT" 2>&1 | tee "$OUT/swiglu_rows_sweep.log" | grep -v "^20.*INFO.*Unable" | tail -70 ;;
    swiglu) timeout 420 python3 benchmarks/swiglu_fusion.py --out "$OUT" 2>&1 | tee "$OUT/swiglu_fusion.log" | tail -16 ;;
    swiglu-tests) timeout 150 python3 -m pytest tests/gpu/test_triton_swiglu_gmm.py -v -rs -p no:cacheprovider 2>&1 \
      | tee "$OUT/gpu_swiglu_tests.log" | tail -8 ;;
    overlap) timeout 560 python3 benchmarks/ep_overlap.py --out "$OUT" --profile --deadline 480 2>&1 \
      | tee "$OUT/ep_overlap.log" | tail -75 ;;
    exchange-bw) timeout 300 python3 benchmarks/ep_overlap.py --out "$OUT" --exchange-only --dump-hlo --reps 10 2>&1 \
      | tee "$OUT/ep_exchange_bw.log" | tail -40 ;;
    fp8) timeout 110 python3 -m pytest tests/gpu/test_triton_fp8_gmm.py -v -rs -p no:cacheprovider 2>&1 \
      | tee "$OUT/gpu_fp8_tests.log" | tail -12
      timeout 110 python3 benchmarks/fp8_gmm_bench.py --out "$OUT" --shapes mixtral-4096-rows-2-groups deepseek-8192-rows-64-groups 2>&1 | tee "$OUT/fp8_gmm_bench.log" | tail -30 ;;
    final-ep) timeout 360 python3 benchmarks/ep_overlap.py --out "$OUT" --profile --loops after --chunks 1 2 --reps 10 \
      --deadline 320 2>&1 | tee "$OUT/ep_overlap_final.log" | tail -60 ;;
    peer-tests) timeout 200 python3 -m pytest tests/gpu/test_peer_exchange.py -v -rs -p no:cacheprovider 2>&1 \
      | tee "$OUT/gpu_peer_tests.log" | tail -25 ;;
    peer-ep) timeout 420 python3 benchmarks/ep_overlap.py --out "$OUT" --profile --loops after none --chunks 1 \
      --scheduler default --transports all_to_all peer --reps 10 --deadline 380 2>&1 | tee "$OUT/ep_overlap_peer.log" | tail -70 ;;
    peer-ep-after) timeout 330 python3 benchmarks/ep_overlap.py --out "$OUT" --profile --loops after --chunks 1 \
      --scheduler default --transports all_to_all peer --reps 10 --deadline 290 2>&1 | tee "$OUT/ep_overlap_peer2.log" | tail -60 ;;
    peer-ep-quick) timeout 250 python3 benchmarks/ep_overlap.py --out "$OUT" --loops after --chunks 1 --configs deepseek mixtral \
      --scheduler default --transports all_to_all peer --reps 10 --deadline 215 2>&1 | tee "$OUT/ep_overlap_peer3.log" | tail -40 ;;
    ep2-base) timeout 330 python3 benchmarks/ep_overlap.py --out "$OUT" --profile --loops after none --chunks 1 \
      --scheduler default --transports peer --reps 10 --deadline 290 2>&1 | tee "$OUT/ep2_base.log" | tail -60 ;;
    cmdbuf) mkdir -p "$OUT/cmdbuf"; XLA_FLAGS="${XLA_FLAGS:-} --xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL" \
      timeout 240 python3 benchmarks/ep_overlap.py --out "$OUT/cmdbuf" --loops after none --chunks 1 \
      --scheduler default --transports peer --reps 10 --deadline 200 2>&1 | tee "$OUT/cmdbuf.log" | tail -40 ;;
    fused-tests) timeout 240 python3 -m pytest tests/gpu/test_peer_exchange.py \
      "tests/gpu/test_triton_grouped_matmul.py::test_gmm_without_zeros_outside_writes_the_group_rows_alike" \
      -v -rs -p no:cacheprovider 2>&1 | tee "$OUT/gpu_fused_tests.log" | tail -25 ;;
    ep2-fused) timeout 390 python3 benchmarks/ep_overlap.py --out "$OUT" --loops after --chunks 1 --scheduler default \
      --transports all_to_all peer --peer-variants fused unfused looped --reps 10 --forward-only --profile \
      --deadline 350 2>&1 | tee "$OUT/ep2_fused.log" | tail -60 ;;
    ep2-fused-fwdbwd) mkdir -p "$OUT/fwdbwd"; timeout 520 python3 benchmarks/ep_overlap.py --out "$OUT/fwdbwd" --loops after \
      --chunks 1 --scheduler default --transports all_to_all peer --peer-variants fused looped --reps 10 \
      --deadline 480 2>&1 | tee "$OUT/ep2_fused_fwdbwd.log" | tail -40 ;;
    ep2-final) timeout 230 python3 benchmarks/ep_overlap.py --out "$OUT" --loops after --chunks 1 --scheduler default \
        --configs deepseek mixtral --transports all_to_all peer --peer-variants fused looped --reps 10 --forward-only \
        --profile --deadline 200 2>&1 | tee "$OUT/ep2_final.log" | tail -40
      mkdir -p "$OUT/fwdbwd"; timeout 230 python3 benchmarks/ep_overlap.py --out "$OUT/fwdbwd" --loops after --chunks 1 \
        --scheduler default --configs "${FWDBWD_CONFIG:-mixtral}" --transports all_to_all peer --peer-variants fused \
        looped --reps 10 --deadline 200 2>&1 | tee "$OUT/ep2_final_fwdbwd.log" | tail -20 ;;
    issue4) timeout 150 python3 -m pytest tests/gpu/test_peer_exchange.py -v -rs -p no:cacheprovider 2>&1 \
        | tee "$OUT/gpu_peer_tests.log" | tail -8
      timeout 400 python3 benchmarks/ep_overlap.py --out "$OUT" --loops after --chunks 1 --scheduler default \
        --configs mixtral deepseek --transports all_to_all peer --reps 10 --forward-only --deadline 370 2>&1 \
        | tee "$OUT/ep_issue4.log" | tail -30 ;;
    issue4-rows) timeout 170 python3 -m pytest tests/gpu/test_peer_exchange.py tests/gpu/test_triton_swiglu_rows.py -v -rs \
        -p no:cacheprovider 2>&1 | tee "$OUT/gpu_peer_rows_tests.log" | tail -8
      timeout 400 python3 benchmarks/ep_overlap.py --out "$OUT" --loops after --chunks 1 --scheduler default \
        --configs mixtral deepseek --transports all_to_all peer --peer-variants fused all-rows --reps 10 --forward-only \
        --deadline 370 2>&1 | tee "$OUT/ep_issue4_rows.log" | tail -30 ;;
    issue4-fwdbwd) mkdir -p "$OUT/fwdbwd"; timeout 520 python3 benchmarks/ep_overlap.py --out "$OUT/fwdbwd" --loops after \
        --chunks 1 --scheduler default --configs "${FWDBWD_CONFIG:-mixtral}" --transports all_to_all peer \
        --peer-variants fused all-rows --reps 10 --deadline 480 2>&1 | tee "$OUT/ep_issue4_fwdbwd.log" | tail -30 ;;
    push-sweep) timeout 280 python3 benchmarks/ep_overlap.py --out "$OUT" --loops after --chunks 1 --scheduler default \
        --configs mixtral deepseek --transports peer --peer-variants fused push-264x4x8 push-528x4x8 push-132x8x16 \
        push-264x8x16 push-132x4x32 --reps 10 --forward-only --deadline 250 2>&1 | tee "$OUT/ep_push_sweep.log" | tail -30
      mkdir -p "$OUT/fwdbwd"; timeout 250 python3 benchmarks/ep_overlap.py --out "$OUT/fwdbwd" --loops after --chunks 1 \
        --scheduler default --configs mixtral --transports all_to_all peer --peer-variants fused --reps 10 \
        --deadline 220 2>&1 | tee "$OUT/ep_fwdbwd.log" | tail -20 ;;
    dedup) timeout 190 python3 -m pytest tests/gpu/test_peer_exchange.py -v -rs -p no:cacheprovider 2>&1 \
        | tee "$OUT/gpu_peer_dedup_tests.log" | tail -8
      timeout 380 python3 benchmarks/ep_overlap.py --out "$OUT" --loops after --chunks 1 --scheduler default \
        --configs deepseek mixtral --transports peer --peer-variants fused rows --reps 10 --forward-only --profile \
        --deadline 350 2>&1 | tee "$OUT/ep_dedup.log" | tail -40 ;;
    b2b-profile) timeout 400 python3 benchmarks/ep_overlap.py --out "$OUT" --loops after --chunks 1 --scheduler default \
        --configs mixtral deepseek --transports peer --peer-variants fused rows --reps 10 --forward-only --profile \
        --deadline 370 2>&1 | tee "$OUT/ep_b2b_profile.log" | tail -60 ;;
    splitk) timeout 250 python3 -m pytest tests/gpu/test_triton_grouped_matmul.py tests/gpu/test_peer_exchange.py -q -rs \
        -p no:cacheprovider 2>&1 | tee "$OUT/gpu_splitk_tests.log" | tail -8
      timeout 310 python3 benchmarks/ep_overlap.py --out "$OUT" --loops after --chunks 1 --scheduler default \
        --configs mixtral deepseek --transports peer --peer-variants whole-tail fused --reps 10 --forward-only --profile \
        --deadline 280 2>&1 | tee "$OUT/ep_splitk.log" | tail -60 ;;
    splitk-land) timeout 170 python3 -m pytest tests/gpu tests/kernels -q -rs -p no:cacheprovider 2>&1 \
        | tee "$OUT/gpu_splitk_land_tests.log" | tail -8
      timeout 380 python3 benchmarks/ep_overlap.py --out "$OUT" --loops after --chunks 1 --scheduler default \
        --configs mixtral deepseek --transports peer --peer-variants fused whole-tail --reps 10 --forward-only \
        --deadline 350 2>&1 | tee "$OUT/ep_splitk_land.log" | tail -30 ;;
    ranks) nvidia-smi topo -m | tee "$OUT/topo.txt"; nvidia-smi nvlink -s > "$OUT/nvlink_status.txt"
      IFS=, read -ra orders <<< "${ORDERS:-0 1 2 3,2 3 0 1}"  # comma-separated device orders
      for order in "${orders[@]}"; do
        dir="$OUT/order_${order// /}"; mkdir -p "$dir"
        variants="fused"; [ "$order" = "0 1 2 3" ] && variants="fused unfused"
        timeout 230 python3 benchmarks/ep_overlap.py --out "$dir" --loops after --chunks 1 --scheduler default \
          --configs deepseek --eps 4 --transports peer --peer-variants $variants --reps 10 --forward-only --profile \
          --device-order $order --deadline 200 2>&1 | tee "$dir/ep_ranks.log" | grep "^name=\|GPU .: kernels"
        rm -rf "$dir"/trace_*
      done ;;
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
    resident-ep) timeout 200 python3 -m pytest tests/gpu/test_peer_exchange.py -q -rs -p no:cacheprovider 2>&1 \
        | tee "$OUT/gpu_peer_tests_resident.log" | tail -4
      mkdir -p "$OUT/fwdbwd"; timeout 380 python3 benchmarks/ep_overlap.py --out "$OUT/fwdbwd" --loops after \
        --chunks 1 --scheduler default --configs deepseek mixtral --transports peer --reps 10 --deadline 350 2>&1 \
        | tee "$OUT/ep_resident_fwdbwd.log" | grep "^name=" ;;
    peer) timeout 240 python3 benchmarks/peer_exchange_probe.py --out "$OUT" 2>&1 | tee "$OUT/peer_exchange_probe.log" | tail -30 ;;
    fp8-layer) timeout 300 python3 benchmarks/fp8_layer_bench.py --out "$OUT" --deadline 260 2>&1 \
      | tee "$OUT/fp8_layer.log" | tail -14 ;;
    fp8-weight-tests) timeout 150 python3 -m pytest tests/gpu/test_fp8_weight_matmul.py -v -rs -p no:cacheprovider 2>&1 \
      | tee "$OUT/gpu_fp8_weight_tests.log" | tail -10 ;;
    bench-small) python3 benchmarks/moe_layer.py --configs small --reps 3 --out "$OUT/small" 2>&1 | tail -8 ;;
    *) echo "unknown step $step"; exit 2 ;;
  esac
done
echo "=== done $(date -u +%H:%M:%S)"
