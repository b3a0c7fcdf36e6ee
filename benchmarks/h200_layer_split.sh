#!/bin/sh
# One H200: a random Qwen2-1.5B-shaped policy split over the GPU (24 layers) and the CPU (4 layers) with
# accelerate's hooks, the vendored trainer with the kit (fast generation asked for: it decodes eagerly on a
# split policy and says why), 3 steps; per-device peak memory and step times into $OUT/report.json.
set -x
nvidia-smi --query-gpu=name,memory.total --format=csv
python3 -c "import torch, transformers, accelerate, peft; print(torch.__version__, transformers.__version__, accelerate.__version__, peft.__version__)"
PYTHONUNBUFFERED=1 python3 examples/train_grpo_split.py --model qwen2-1.5b-random --devices cuda:0,cpu --layers 24,4 \
  --trainer vendored --max-steps 3 --num-generations 8 --per-device-batch 8 --max-completion-length 64 \
  --fast-generation --output-dir /tmp/o --report "$OUT/report.json" 2>&1 | tee "$OUT/log.txt"
