#!/usr/bin/env bash
# preflight_sharded_accuracy.py on one H200: nf4 base, FSDP2 + CPU offload, ZeRO-3 (whole-model and
# layer-wise generation gather, param offload, nf4 base) at world size 1, each against preflight.
#
#   bash benchmarks/preflight_sharded_device.sh fetch     # HERE: the wheels the device image lacks -> .whl/sharded/
#   bash benchmarks/preflight_sharded_device.sh run       # ON THE DEVICE (see below)
#
# The device image (FACTS.md) has torch 2.11, transformers 5.17, accelerate 1.15, peft 0.21, Python 3.12 and no
# trl / datasets / dill / multiprocess / deepspeed / bitsandbytes. Wheels carried (cp312, ~50 MB in all):
# bitsandbytes 0.50.2 (43 MB, CUDA kernels inside), deepspeed 0.19.8 (2.2 MB, built here: pure Python, ops
# JIT-only and none needed: the HF optimizer is used), trl 1.16.0, datasets 5.2.0, dill, multiprocess, hjson,
# py-cpuinfo, msgpack, einops, ninja, pydantic (+ core, annotated-types, typing-inspection).
#
# Device call (one, ~15-25 min of device time; `run` writes $OUT/preflight-sharded/ and prints the table):
#   rsync -a --delete --exclude .git --exclude .venv --exclude .nox /work/wt/i17b/ /work/main/.devsrc-i17/
#   cp -r .whl/sharded /work/main/.devsrc-i17/.whl/        # if fetched elsewhere
#   run(command="cd .devsrc-i17 && bash benchmarks/preflight_sharded_device.sh run", carry=[".devsrc-i17"])
set -euo pipefail
cd "$(dirname "$0")/.."
W=.whl/sharded
case "${1:-run}" in
fetch)
  mkdir -p "$W"
  common=(--no-deps -d "$W" --python-version 3.12 --implementation cp --only-binary=:all:
          --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64
          --platform manylinux2014_x86_64)
  python3 -m pip download -q "${common[@]}" bitsandbytes==0.50.2 trl==1.16.0 datasets==5.2.0 dill==0.4.1 \
      multiprocess==0.70.19 hjson py-cpuinfo msgpack einops ninja pydantic pydantic-core annotated-types \
      typing-inspection
  python3 -m pip wheel -q --no-deps -w "$W" deepspeed==0.19.8
  du -ch "$W"/*.whl | tail -1
  ;;
run)
  # One device call of at most ~8 min: each layout in its own launch with its own timeout, results.jsonl written as
  # each finishes, everything packed into $OUT/ps.tgz at the end (the device returns at most 8 files), whatever ran.
  # LAYOUTS_15B / LAYOUTS_05B / PER_LAYOUT_S / TOTAL_S / COMPLETION override the defaults below.
  export PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1
  WORK=/tmp/preflight-sharded
  mkdir -p "$WORK"
  pack() { nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$WORK/gpu.csv" 2>/dev/null || true
           cat "$WORK"/*/results.md 2>/dev/null || true
           [ -n "${OUT:-}" ] && tar czf "$OUT/ps.tgz" -C /tmp preflight-sharded && for d in "$WORK"/*/; do cp "$d/results.jsonl" "$OUT/results-$(basename "$d").jsonl" 2>/dev/null; done; true; }
  trap pack EXIT
  python -m pip install -q --no-deps --no-index "$W"/*.whl
  python -c "import deepspeed, bitsandbytes, trl; print('deepspeed', deepspeed.__version__, 'bnb', bitsandbytes.__version__, 'trl', trl.__version__)"
  T0=$(date +%s); TOTAL=${TOTAL_S:-440}
  left() { echo $(( TOTAL - ($(date +%s) - T0) )); }
  L15=${LAYOUTS_15B:-zero3,zero3-offload,fsdp2-offload,bf16,nf4}
  timeout "$(left)" python benchmarks/preflight_sharded_accuracy.py --policy 1.5b --completion-len "${COMPLETION:-128}" \
      --out "$WORK/1.5b" --timeout "${PER_LAYOUT_S:-110}" --layouts "$L15" || true
  if [ "$(left)" -gt 90 ] && [ -n "${LAYOUTS_05B-zero3-offload,fsdp2-offload}" ]; then
    timeout "$(left)" python benchmarks/preflight_sharded_accuracy.py --policy 0.5b --completion-len 64 \
        --out "$WORK/0.5b" --timeout 80 --layouts "${LAYOUTS_05B:-zero3-offload,fsdp2-offload}" || true
  fi
  ;;
esac
