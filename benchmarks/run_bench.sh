#!/usr/bin/env bash
# GRPO benchmark on the GPU machine: stock TRL vs grpo-patches, 2 GPUs then 1 GPU, one call.
#
#   bash benchmarks/run_bench.sh                       # 0.5B policy, grad ckpt on, 1 + 5 steps, 256 tokens
#   COMPLETION_LEN=128 bash benchmarks/run_bench.sh    # shrink if time is short
#   GPUS=1 bash benchmarks/run_bench.sh                # one GPU count only
#   MAXBATCH=1 bash benchmarks/run_bench.sh            # + largest batch under a 24 GiB cap (long: ~10+ min)
#   FSDP=1 GPUS=2 bash benchmarks/run_bench.sh         # accelerate's FSDP2 plugin instead of DDP
#
# Env (defaults): POLICY (0.5b), GRAD_CKPT (on), STEPS (5), WARMUP (1), COMPLETION_LEN (256),
# BATCH (8), VARIANTS (stock,patched-local,patched-main), ROUNDS (1), GPUS ("2 1"),
# BUDGET_S (540: each launch runs under `timeout` for what is left of it), PORT (29517), FSDP (0), DTYPE (auto),
# BENCH_OUT (benchmarks/results/<date>-<gpu>), MEM_CAP_GB (24, MAXBATCH only), MAXBATCH_NPROC (2),
# PYTHON (python3). GPU counts above what nvidia-smi lists are skipped.
# 2 GPUs run first: the main-placement memory check needs a non-main rank. A launch cut by the
# budget leaves its finished variants in BENCH_OUT/parts; the final --report-only merges them.
set -uo pipefail
cd "$(dirname "$0")/.."

POLICY=${POLICY:-0.5b}
GRAD_CKPT=${GRAD_CKPT:-on}
STEPS=${STEPS:-5}
WARMUP=${WARMUP:-1}
COMPLETION_LEN=${COMPLETION_LEN:-256}
BATCH=${BATCH:-8}
VARIANTS=${VARIANTS:-stock,patched-local,patched-main}
ROUNDS=${ROUNDS:-1}
GPUS=${GPUS:-"2 1"}
BUDGET_S=${BUDGET_S:-540}
PORT=${PORT:-29517}
PY=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# NVLink multicast stays off (shared hosts): keep these set for every process started here.
export NCCL_NVLS_ENABLE=${NCCL_NVLS_ENABLE:-0} TORCH_SYMM_MEM_DISABLE_MULTICAST=${TORCH_SYMM_MEM_DISABLE_MULTICAST:-1} \
       NVSHMEM_DISABLE_NVLS=${NVSHMEM_DISABLE_NVLS:-1}
ngpu=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ -z "${BENCH_OUT:-}" ]; then
  gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1 | tr '[:upper:]' '[:lower:]' \
        | sed -E 's/[^a-z0-9]+/-/g; s/^-+//; s/-+$//')
  BENCH_OUT="benchmarks/results/$(date +%F)-${gpu:-cpu}"
fi
mkdir -p "$BENCH_OUT"
start=$(date +%s)
echo "[run_bench] $(date -Is) policy=$POLICY grad_ckpt=$GRAD_CKPT steps=$WARMUP+$STEPS len=$COMPLETION_LEN" \
     "batch=$BATCH variants=$VARIANTS gpus=[$GPUS] budget=${BUDGET_S}s out=$BENCH_OUT"

for n in $GPUS; do
  left=$(( BUDGET_S - ($(date +%s) - start) ))
  if [ "$left" -lt 60 ]; then
    echo "[run_bench] skipping $n GPU(s): only ${left}s of the budget left"; continue
  fi
  if [ "${ngpu:-0}" -gt 0 ] && [ "$n" -gt "$ngpu" ]; then
    echo "[run_bench] skipping $n GPU(s): nvidia-smi lists $ngpu"; continue
  fi
  if [ "$n" -gt 1 ] && [ "${FSDP:-0}" = 1 ]; then  # accelerate's FSDP2 plugin, one shard per decoder layer
    launch=("$PY" -m accelerate.commands.launch --use_fsdp --fsdp_version 2 --fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP
            --fsdp_transformer_layer_cls_to_wrap Qwen2DecoderLayer --fsdp_reshard_after_forward true
            --num_processes "$n" --num_machines 1 --mixed_precision bf16 --dynamo_backend no --main_process_port "$PORT")
  elif [ "$n" -gt 1 ]; then
    launch=("$PY" -m accelerate.commands.launch --multi_gpu --num_processes "$n" --num_machines 1
            --mixed_precision bf16 --dynamo_backend no --main_process_port "$PORT")
  else
    launch=("$PY" -m accelerate.commands.launch --num_processes 1 --num_machines 1
            --mixed_precision bf16 --dynamo_backend no)
  fi
  cmd=("${launch[@]}" benchmarks/bench_grpo.py --policy "$POLICY" --grad-ckpt "$GRAD_CKPT"
       --variants "$VARIANTS" --steps "$STEPS" --warmup "$WARMUP" --rounds "$ROUNDS"
       --per-device-batch "$BATCH" --completion-len "$COMPLETION_LEN" --dtype "${DTYPE:-auto}" --out "$BENCH_OUT")
  echo "[run_bench] $n GPU(s), at most ${left}s: ${cmd[*]}"
  t0=$(date +%s)
  timeout --signal=TERM --kill-after=20 "$left" "${cmd[@]}"
  rc=$?
  echo "[run_bench] $n GPU(s) finished rc=$rc in $(( $(date +%s) - t0 ))s"
done

if [ "${MAXBATCH:-0}" = 1 ]; then
  left=$(( BUDGET_S - ($(date +%s) - start) ))
  echo "[run_bench] largest batch under ${MEM_CAP_GB:-24} GiB per GPU, ${MAXBATCH_NPROC:-2} rank(s), at most ${left}s"
  timeout --signal=TERM --kill-after=20 "$left" "$PY" benchmarks/bench_grpo.py --find-max-batch \
    --nproc "${MAXBATCH_NPROC:-2}" --mem-cap-gb "${MEM_CAP_GB:-24}" --policy "$POLICY" --grad-ckpt "$GRAD_CKPT" \
    --variants "$VARIANTS" --completion-len "$COMPLETION_LEN" --max-batch-limit "${MAXBATCH_LIMIT:-256}" \
    --probe-timeout "${PROBE_TIMEOUT:-300}" --out "$BENCH_OUT"
fi

"$PY" benchmarks/bench_grpo.py --report-only --out "$BENCH_OUT"
echo "[run_bench] total $(( $(date +%s) - start ))s; results: $BENCH_OUT/results.md"
