#!/usr/bin/env bash
# Issue 16, third session: the fused step's attention kernel (FastGenerationConfig.fused_attention:
# "matmul" = transformers' eager arithmetic, "sdpa" = one scaled_dot_product_attention kernel,
# "flex" = FlexAttention's split-cache decoding kernel) on one H200, and the GRPO step with the default.
# Ran at 1670bb5 (part 1) and 77af6d3 (part 3). "matmul" was the fastest everywhere, so the option
# and the graph_sdpa / graph_flex / patched-graph-{sdpa,flex} variants were removed after: check out
# 77af6d3 to run this script again.
#
#   bash benchmarks/issue16_attention_session.sh 1   # GPU tests of the fused loop (each attention); decode
#                                                    # ms/step of each attention, 1.5B, batch 8 and 192; GRPO
#                                                    # step, 1 GPU, 1.5B: stock vs the kit (matmul, sdpa)
#   bash benchmarks/issue16_attention_session.sh 3   # 24 GiB cap, 1.5B: stock 192, the kit 192 and 160 (1 + 4
#                                                    # steps each); GRPO step 0.5B; kernel profile, batch 8
#   (part 2, the 1-GPU runs without the decode jobs, was not run: part 1 and 3 cover it)
#
# Wheels the device image lacks (trl, datasets, dill, multiprocess) come from .whl/sharded (carry ".whl").
# Results: benchmarks/results/2026-12-01-h200-issue16-attention/ and $OUT/partN.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?part 1, 2 or 3}
R=${R:-benchmarks/results/2026-12-01-h200-issue16-attention}
mkdir -p "$R"
TAG=issue16a
. benchmarks/device_jobs.sh
trl_wheels  # trl, datasets, dill, multiprocess from .whl/sharded; versions.txt
probe() {  # probe VARIANT BATCH [TIMEOUT]: one 24 GiB probe at BATCH only, 1 + PROBE_STEPS-1 steps
  echo "python3 benchmarks/bench_grpo.py --find-max-batch --nproc 1 --mem-cap-gb 24 --policy 1.5b --grad-ckpt on \
    --variants $1 --start-batch $2 --max-batch-limit $2 --no-bisect --probe-steps ${PROBE_STEPS:-4} \
    --probe-timeout ${3:-125} --out $R/24gb-1.5b"
}
decode() {  # decode BATCH: the three attention kernels, timed and profiled, one process
  echo "python3 benchmarks/bench_generation.py --policy 1.5b --batch $1 --paths graph,graph_sdpa,graph_flex \
    --repeats 1 --profile --out $R/decode-1.5b-b$1.json"
}
case $part in
1)  # (the first call's decode jobs recompiled for the profile's shorter call and timed out: no figures)
  job gpu-tests 80 "python3 -m pytest -q -p no:cacheprovider -k 'gpu and fused' tests/test_generation.py"; wait
  job decode-b8 150 "$(decode 8)"; wait
  job decode-b192 160 "$(decode 192)"; wait
  job grpo-1.5b 190 "GPUS=1 POLICY=1.5b VARIANTS=stock,patched-graph,patched-graph-sdpa STEPS=2 BUDGET_S=185 \
    BENCH_OUT=$R/1gpu-1.5b bash benchmarks/run_bench.sh"
  ;;
2)
  job grpo-0.5b 200 "GPUS=1 POLICY=0.5b VARIANTS=stock,patched-graph STEPS=3 BUDGET_S=195 \
    BENCH_OUT=$R/1gpu-0.5b bash benchmarks/run_bench.sh"; wait
  job grpo-1.5b 260 "GPUS=1 POLICY=1.5b VARIANTS=stock,patched-graph STEPS=3 BUDGET_S=255 \
    BENCH_OUT=$R/1gpu-1.5b bash benchmarks/run_bench.sh"
  ;;
3)  # one call: the 24 GiB comparison (1 + 4 steps per probe), the 0.5B step, the batch-8 kernel profile
  job 24gb 330 "$(PROBE_STEPS=5 probe stock 192 150); $(PROBE_STEPS=5 probe patched-graph 192 95); \
    $(PROBE_STEPS=5 probe patched-graph 160 85)"; wait
  job grpo-0.5b 150 "GPUS=1 POLICY=0.5b VARIANTS=stock,patched-graph STEPS=2 BUDGET_S=145 \
    BENCH_OUT=$R/1gpu-0.5b bash benchmarks/run_bench.sh"; wait
  job profile-b8 75 "python3 benchmarks/bench_generation.py --policy 1.5b --batch 8 --paths graph --repeats 0 \
    --profile --out $R/profile-1.5b-b8.json"
  ;;
*) echo "part must be 1, 2 or 3" >&2; exit 2 ;;
esac
wait
log "part $part done"
for f in "$R"/*.log; do echo "== $f"; tail -40 "$f"; done
if [ -n "${OUT:-}" ]; then tar czf "$OUT/part$part.tar.gz" "$R"; fi
