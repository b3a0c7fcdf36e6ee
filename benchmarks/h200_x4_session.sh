#!/usr/bin/env bash
# The 4 x H200 session of 2026-11-29 (nvidia-h200-x4 through the device tool), in three calls of < 10 min.
# Independent jobs share the machine one GPU (or pair) each, so one call does the work of several.
#
#   bash benchmarks/h200_x4_session.sh 1   # 1 GPU: 1.5B and 0.5B without checkpointing (stock / patched /
#                                          # patched-fast) + activation calibration;
#                                          # 2 GPUs: FSDP2 run with the patches, DDP find_unused True vs False
#   bash benchmarks/h200_x4_session.sh 2   # 4 GPUs: stock / patched-local / patched-main / patched-fast,
#                                          # then the multi-rank invariant tests over NCCL (2 and 4 ranks)
#   bash benchmarks/h200_x4_session.sh 3   # (2 GPUs) 1 GPU again (part 1's patched runs hit a bug fixed
#                                          # since) with the graph decode loop; 24 GB cap: largest batch and
#                                          # throughput, stock vs kit (1.5B); generation GPU tests + decode bench
#
# Results land in benchmarks/results/2026-11-29-h200-x4/<job>/ and, for the device tool, in
# $OUT/partN.tar.gz. Every job runs under `timeout`, so one hang cannot eat the call.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?part 1, 2 or 3}
R=${R:-benchmarks/results/2026-11-29-h200-x4}
mkdir -p "$R"
TAG=x4
. benchmarks/device_jobs.sh
nvidia-smi --query-gpu=index,name,memory.total --format=csv,noheader

case $part in
1)
  job gpu0 540 "CUDA_VISIBLE_DEVICES=0 python3 benchmarks/calibrate_activations.py --device cuda --out $R/act_cuda.jsonl \
    && python3 benchmarks/calibrate_activations.py --fit $R/act_cuda.jsonl; \
    CUDA_VISIBLE_DEVICES=0 GPUS=1 POLICY=1.5b GRAD_CKPT=off VARIANTS=stock,patched-local,patched-fast STEPS=3 \
    BUDGET_S=420 BENCH_OUT=$R/1gpu-1.5b-ckptoff bash benchmarks/run_bench.sh"
  job gpu1 540 "CUDA_VISIBLE_DEVICES=1 GPUS=1 POLICY=0.5b GRAD_CKPT=off VARIANTS=stock,patched-local,patched-fast \
    STEPS=3 BUDGET_S=420 BENCH_OUT=$R/1gpu-0.5b-ckptoff bash benchmarks/run_bench.sh"
  job gpu23 540 "CUDA_VISIBLE_DEVICES=2,3 FSDP=1 GPUS=2 PORT=29531 POLICY=0.5b VARIANTS=stock,patched-local,patched-main \
    COMPLETION_LEN=128 STEPS=2 BUDGET_S=260 BENCH_OUT=$R/2gpu-fsdp bash benchmarks/run_bench.sh; \
    [ -s $R/2gpu-fsdp/results.jsonl ] || CUDA_VISIBLE_DEVICES=2,3 FSDP=1 DTYPE=fp32 GPUS=2 PORT=29532 POLICY=0.5b VARIANTS=stock,patched-local \
    COMPLETION_LEN=128 STEPS=2 BUDGET_S=150 BENCH_OUT=$R/2gpu-fsdp-fp32 bash benchmarks/run_bench.sh; \
    CUDA_VISIBLE_DEVICES=2,3 GPUS=2 PORT=29533 POLICY=0.5b VARIANTS=stock,stock-nofind COMPLETION_LEN=128 STEPS=3 \
    ROUNDS=2 BUDGET_S=200 BENCH_OUT=$R/2gpu-find-unused bash benchmarks/run_bench.sh"
  ;;
2)
  job gpu0123 330 "GPUS=4 POLICY=0.5b VARIANTS=stock,patched-local,patched-main,patched-fast STEPS=2 BUDGET_S=320 \
    BENCH_OUT=$R/4gpu-0.5b bash benchmarks/run_bench.sh"
  wait
  job nccl 240 "GRPO_PATCHES_TEST_DEVICE=cuda GRPO_PATCHES_INVARIANT_WORLD_SIZES=2,4 python3 -m pytest -v \
    tests/matrix/test_invariants.py tests/test_trl_main_placement.py tests/test_rewards_distributed.py"
  ;;
3)  # on nvidia-h200-x2: x4 was no longer lent for this part
  job gpu0 525 "CUDA_VISIBLE_DEVICES=0 GPUS=1 POLICY=1.5b GRAD_CKPT=off \
    VARIANTS=stock,patched-local,patched-fast,patched-graph STEPS=3 BUDGET_S=320 BENCH_OUT=$R/1gpu-1.5b-ckptoff \
    bash benchmarks/run_bench.sh; CUDA_VISIBLE_DEVICES=0 python3 benchmarks/bench_grpo.py --find-max-batch --nproc 1 \
    --mem-cap-gb 24 --policy 1.5b --grad-ckpt on --variants patched-fast --start-batch 192 --bisect-step 64 \
    --max-batch-limit 256 --probe-timeout 120 --out $R/24gb-1.5b-kit"
  job gpu1 525 "CUDA_VISIBLE_DEVICES=1 python3 -m pytest -v -k gpu tests/test_generation.py; \
    CUDA_VISIBLE_DEVICES=1 python3 benchmarks/bench_grpo.py --find-max-batch --nproc 1 \
    --mem-cap-gb 24 --policy 1.5b --grad-ckpt on --variants stock --start-batch 192 --bisect-step 64 \
    --max-batch-limit 256 --probe-timeout 120 --out $R/24gb-1.5b-stock; \
    CUDA_VISIBLE_DEVICES=1 python3 benchmarks/bench_generation.py --policy 1.5b --repeats 2 \
    --out $R/generation_decode.json"
  ;;
*) echo "part must be 1, 2 or 3" >&2; exit 2 ;;
esac
wait
log "part $part done"
if [ -n "${OUT:-}" ]; then
  tar czf "$OUT/part$part.tar.gz" --exclude='*/probes/parts/*' "$R"
  ls -la "$OUT"
fi
