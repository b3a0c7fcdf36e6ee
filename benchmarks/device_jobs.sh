# Sourced by the device-session scripts: the environment every GPU process needs, and `job`, which
# runs one command in the background under `timeout` (one hang cannot eat the call), logged to
# $R/NAME.log. The caller sets R (results folder) and TAG (log prefix).
export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
# NVLink multicast stays off (shared hosts): keep these set for every process started here.
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
log() { echo "[$TAG $(date +%T)] $*"; }
job() {  # job NAME SECONDS CMD...
  local name=$1 secs=$2; shift 2
  ( log "start $name"; timeout --signal=TERM --kill-after=15 "$secs" bash -c "$*" > "$R/$name.log" 2>&1
    log "end $name rc=$?" ) &
}
trl_wheels() {  # the wheels the device image lacks (carried in .whl/sharded), then $R/versions.txt
  python3 -m pip install -q --no-deps --no-index .whl/sharded/trl-*.whl .whl/sharded/datasets-*.whl \
      .whl/sharded/dill-*.whl .whl/sharded/multiprocess-*.whl 2>&1 | tail -2
  python3 -c "import torch, transformers, peft, trl; print(torch.__version__, transformers.__version__, \
peft.__version__, trl.__version__)" | tee "$R/versions.txt"
}
probe24() {  # probe24 VARIANT BATCH STEPS TIMEOUT [SUBDIR]: the command of one 24 GiB probe at BATCH only (1.5B,
             # checkpointing on, a fresh launch), results under $R/SUBDIR (default 24gb-1.5b)
  echo "python3 benchmarks/bench_grpo.py --find-max-batch --nproc 1 --mem-cap-gb 24 --policy 1.5b --grad-ckpt on \
    --variants $1 --start-batch $2 --max-batch-limit $2 --no-bisect --probe-steps $3 --probe-timeout $4 \
    --out $R/${5:-24gb-1.5b}"
}
