#!/usr/bin/env bash
# Issue 16, next measurements (written after the third session's profile; not run yet), one H200 call:
#
#   bash benchmarks/issue16_kernels_session.sh
#
# 1. benchmarks/gemv_prototype.py: the compiled --check on the 1.5B shapes, then --bench (a split-K skinny
#    GEMM for the batch-8 decode matmuls against cuBLAS, inside CUDA graphs);
# 2. the training phase's CUDA kernels by kind (BENCH_KERNELS=training_step) at batch 192 under the 24 GiB
#    cap, the kit only (its training phase equals stock's: 2.24-2.35 s against 2.23 s);
# 3. the kit at batch 160 under the 24 GiB cap, 1 + 4 steps (the third session's 85 s probe budget was
#    too short for the compilation and five steps), for the floor multiple the issue asks at 160.
#
# Wheels the device image lacks come from .whl/sharded (carry ".whl"). Results under $R and $OUT/kernels.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/.."
R=${R:-benchmarks/results/$(date +%F)-h200-issue16-kernels}
mkdir -p "$R"
TAG=issue16k
. benchmarks/device_jobs.sh
trl_wheels
job gemv 230 "python3 benchmarks/gemv_prototype.py --check --bench --out $R/gemv-h200.json"; wait
job train-kernels 150 "BENCH_KERNELS=training_step BENCH_PROFILE_DIR=$R/train-kernels python3 benchmarks/bench_grpo.py \
  --find-max-batch --nproc 1 --mem-cap-gb 24 --policy 1.5b --grad-ckpt on --variants patched-graph --start-batch 192 \
  --max-batch-limit 192 --no-bisect --probe-steps 3 --probe-timeout 140 --out $R/24gb-profile"; wait
job 24gb-160 150 "python3 benchmarks/bench_grpo.py --find-max-batch --nproc 1 --mem-cap-gb 24 --policy 1.5b \
  --grad-ckpt on --variants patched-graph --start-batch 160 --max-batch-limit 160 --no-bisect --probe-steps 5 \
  --probe-timeout 140 --out $R/24gb-1.5b"
wait
log "done"
for f in "$R"/*.log; do echo "== $f"; tail -40 "$f"; done
if [ -n "${OUT:-}" ]; then tar czf "$OUT/kernels.tar.gz" "$R"; fi
