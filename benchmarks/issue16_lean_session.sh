#!/usr/bin/env bash
# Issue 16, fourth session: what apply(lean_lora=True) buys in the training phase (the kernel profile of
# the third session's kernels call put PEFT's fp32 input copies and fp32 dropout at ~0.6 s of the
# 2.3 s training phase at batch 192). One H200; carry ".whl" (trl, datasets, dill, multiprocess).
#
#   bash benchmarks/issue16_lean_session.sh 1   # GPU tests; 24 GiB probes: kit vs kit + lean at 192, lean at 224 and 160
#   bash benchmarks/issue16_lean_session.sh 2   # 1-GPU GRPO step, 1.5B batch 8: stock, kit, kit + lean (one launch);
#                                               # the training step's kernels by kind with lean_lora at 192, 24 GiB
#   bash benchmarks/issue16_lean_session.sh 3   # 24 GiB probes: stock at 192 and 208, the lean kit at 240
#   bash benchmarks/issue16_lean_session.sh 4   # 24 GiB probes: the lean kit at 256 and 288
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?part 1 to 4}
R=${R:-benchmarks/results/$(date +%F)-h200-issue16-lean}
mkdir -p "$R"
TAG=issue16l
. benchmarks/device_jobs.sh
trl_wheels
case $part in
1)
  job gpu-tests 90 "python3 -m pytest -q -p no:cacheprovider tests/test_lean_lora.py"; wait
  job 24gb 470 "$(probe24 patched-graph 192 5 105); $(probe24 patched-graph-lean 192 5 105); \
    $(probe24 patched-graph-lean 224 4 125); $(probe24 patched-graph-lean 160 5 95)"
  ;;
2)
  job grpo-1.5b 290 "GPUS=1 POLICY=1.5b VARIANTS=stock,patched-graph,patched-graph-lean STEPS=3 BUDGET_S=285 \
    BENCH_OUT=$R/1gpu-1.5b bash benchmarks/run_bench.sh"; wait
  job train-kernels 150 "BENCH_KERNELS=training_step BENCH_PROFILE_DIR=$R/train-kernels-lean $(probe24 patched-graph-lean 192 3 140 24gb-profile)"
  ;;
3)  # stock beside the lean kit under the same cap, in one call: stock at its largest batch and one above it,
    # the lean kit one step above its 224
  job 24gb-stock 420 "$(probe24 stock 192 5 160); $(probe24 stock 208 3 110); $(probe24 patched-graph-lean 240 4 130)"
  ;;
4)  # where the lean kit stops fitting
  job 24gb-lean-max 260 "$(probe24 patched-graph-lean 256 4 130); $(probe24 patched-graph-lean 288 3 120)"
  ;;
*) echo "part must be 1 to 4" >&2; exit 2 ;;
esac
wait
log "part $part done"
for f in "$R"/*.log; do echo "== $f"; tail -25 "$f"; done
if [ -n "${OUT:-}" ]; then tar czf "$OUT/lean-$part.tar.gz" "$R"; fi
