#!/usr/bin/env bash
# Issue 16, the fused decode step (generation/fused.py, fused_loop.py) on one H200, two calls:
#
#   bash benchmarks/issue16_fused_session.sh 1   # GPU tests of the fast path; decode ms/step, 1.5B, batch 8:
#                                                # TRL's eager sampling, the graph loop over the model's forward
#                                                # (the previous default), the fused step (the new default);
#                                                # GRPO step, 1 GPU, 1.5B: stock vs patched-graph
#   bash benchmarks/issue16_fused_session.sh 2   # 24 GiB cap, 1.5B, checkpointing on: stock 192, kit 192 and
#                                                # 224 (does either fit more?); the kit at 160 for the floor multiple
#
# Wheels the device image lacks (trl, datasets, dill, multiprocess) come from .whl/sharded (carry ".whl").
# Results: benchmarks/results/2026-12-01-h200-issue16-fused/ and $OUT/partN.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?part 1 or 2}
R=${R:-benchmarks/results/2026-12-01-h200-issue16-fused}
mkdir -p "$R"
TAG=issue16f
. benchmarks/device_jobs.sh
trl_wheels  # trl, datasets, dill, multiprocess from .whl/sharded; versions.txt
probe() {  # probe VARIANT BATCH [TIMEOUT]: one 24 GiB probe at BATCH only, 1 + 2 steps
  echo "python3 benchmarks/bench_grpo.py --find-max-batch --nproc 1 --mem-cap-gb 24 --policy 1.5b --grad-ckpt on \
    --variants $1 --start-batch $2 --max-batch-limit $2 --no-bisect --probe-steps 3 --probe-timeout ${3:-125} \
    --out $R/24gb-1.5b"
}
case $part in
1)
  job gpu-tests 150 "python3 -m pytest -q -p no:cacheprovider -k 'gpu or cuda' tests/test_generation.py"; wait
  job decode-1.5b 170 "python3 benchmarks/bench_generation.py --policy 1.5b --paths eager,graph_model,graph \
    --repeats 1 --out $R/decode-1.5b.json"; wait
  job grpo-1.5b 200 "GPUS=1 POLICY=1.5b VARIANTS=stock,patched-graph STEPS=2 BUDGET_S=195 \
    BENCH_OUT=$R/1gpu-1.5b bash benchmarks/run_bench.sh"
  ;;
2)
  job 24gb 440 "$(probe stock 192 110); $(probe stock 224 110); $(probe patched-graph 192 90); $(probe patched-graph 224 90); $(probe patched-graph 160 80)"
  ;;
3)  # part 2 bisected stock after its 224 failure and ran out of time before the kit (no --no-bisect then):
    # stock's 24 GiB results are part 2's; here the kit at 192 and 208, then decode with inductor's max-autotune
  job 24gb-kit 200 "$(probe patched-graph 192 95); $(probe patched-graph 208 95)"; wait
  job decode-autotune 190 "python3 benchmarks/bench_generation.py --policy 1.5b --paths graph --repeats 1 \
    --out $R/decode-1.5b-default.json && python3 benchmarks/bench_generation.py --policy 1.5b --paths graph \
    --repeats 1 --mode max-autotune --out $R/decode-1.5b-autotune.json"
  ;;
*) echo "part must be 1, 2 or 3" >&2; exit 2 ;;
esac
wait
log "part $part done"
for f in "$R"/*.log; do echo "== $f"; tail -30 "$f"; done
if [ -n "${OUT:-}" ]; then tar czf "$OUT/part$part.tar.gz" "$R"; fi
