#!/usr/bin/env bash
# What the 2026-11-29 GPU sessions left unmeasured (issues 5 and 6), for nvidia-h200-x2, calls < 10 min:
#
#   bash benchmarks/gpu_followup.sh 1   # GPU0: the patch's own overhead, paired rounds, stock-graph vs patched-graph
#                                       #       (both sample through the kit's fast path, so generation noise cancels)
#                                       # GPU1: GPU tests of the fast path (fresh noise per replay included), the
#                                       #       24 GB bracket of the graph loop (160 / 176; 144 fits, 192 does not)
#                                       #       and sampling with the LoRA dropout on vs off (bench_generation --dropout)
#   bash benchmarks/gpu_followup.sh 2   # 2 GPUs: stock vs patched-graph, 0.5B then 1.5B (step <= 0.2x on 2 GPUs)
#   bash benchmarks/gpu_followup.sh 3   # GPU0: 1 GPU, 0.5B, stock vs patched-graph; then the kit's 24 GB probe at 144
#                                       # GPU1: stock's 24 GB probe at 192 (both over 3 steps after the first); then
#                                       #       the dropout comparison again, the graph loop's modes alternating
#
# Results: benchmarks/results/<date>-h200-followup/<job>/ and $OUT/partN.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?part 1, 2 or 3}
R=${R:-benchmarks/results/$(date +%F)-h200-followup}
mkdir -p "$R"
TAG=followup
. benchmarks/device_jobs.sh
case $part in
1)
  job overhead 540 "CUDA_VISIBLE_DEVICES=0 GPUS=1 POLICY=0.5b VARIANTS=stock-graph,patched-graph STEPS=4 ROUNDS=4 \
    BUDGET_S=530 BENCH_OUT=$R/1gpu-0.5b-overhead bash benchmarks/run_bench.sh"
  job graph 540 "CUDA_VISIBLE_DEVICES=1 python3 -m pytest -v -k 'gpu or cuda' tests/test_generation.py; \
    probe() { CUDA_VISIBLE_DEVICES=1 python3 benchmarks/bench_grpo.py --find-max-batch --nproc 1 --mem-cap-gb 24 \
      --policy 1.5b --grad-ckpt on --variants patched-graph --start-batch \$1 --max-batch-limit \$1 \
      --probe-timeout 150 --out $R/24gb-1.5b-graph-\$1; }; probe 160; \
    CUDA_VISIBLE_DEVICES=1 python3 benchmarks/bench_generation.py --dropout --policy 1.5b --repeats 2 \
      --out $R/dropout-1.5b.json; probe 176"
  ;;
2)
  job 2gpu-0.5b 280 "GPUS=2 POLICY=0.5b VARIANTS=stock,patched-graph STEPS=3 BUDGET_S=270 \
    BENCH_OUT=$R/2gpu-0.5b bash benchmarks/run_bench.sh"
  wait
  job 2gpu-1.5b 280 "GPUS=2 POLICY=1.5b VARIANTS=stock,patched-graph STEPS=3 BUDGET_S=270 \
    BENCH_OUT=$R/2gpu-1.5b bash benchmarks/run_bench.sh"
  ;;
3)
  probe() {  # probe GPU VARIANT BATCH: one 24 GB probe of 1 + 3 steps (throughput: the 3 after the first)
    echo "CUDA_VISIBLE_DEVICES=$1 python3 benchmarks/bench_grpo.py --find-max-batch --nproc 1 --mem-cap-gb 24 \
      --policy 1.5b --grad-ckpt on --variants $2 --start-batch $3 --max-batch-limit $3 --probe-steps 4 \
      --probe-timeout 200 --out $R/24gb-1.5b-$2-$3-4steps"
  }
  job gpu0 540 "CUDA_VISIBLE_DEVICES=0 GPUS=1 POLICY=0.5b VARIANTS=stock,patched-graph STEPS=3 BUDGET_S=280 \
    BENCH_OUT=$R/1gpu-0.5b bash benchmarks/run_bench.sh; $(probe 0 patched-graph 144)"
  job gpu1 540 "$(probe 1 stock 192); CUDA_VISIBLE_DEVICES=1 python3 benchmarks/bench_generation.py --dropout \
    --policy 1.5b --repeats 4 --out $R/dropout-1.5b-alternating.json"
  ;;
*) echo "part must be 1, 2 or 3" >&2; exit 2 ;;
esac
wait
log "part $part done"
if [ -n "${OUT:-}" ]; then tar czf "$OUT/part$part.tar.gz" "$R"; fi
