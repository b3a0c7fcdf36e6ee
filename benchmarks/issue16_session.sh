#!/usr/bin/env bash
# Issue 16 on one H200 (nvidia-h200), two calls of < 10 minutes:
#
#   bash benchmarks/issue16_session.sh 1   # GPU tests of the fast path (merged buffer, release included);
#                                          # decode ms/step, 1.5B, batch 8: eager (TRL's way), graph loop with the
#                                          # adapter's matmuls, graph loop from the merged buffer; GRPO step, 1 GPU,
#                                          # 1.5B: stock vs patched-graph (merged + release) vs patched-graph-kept
#   bash benchmarks/issue16_session.sh 3   # the decode job again (--repeats 1), the 0.5B step, 24 GiB: stock 192, kit 192
#   bash benchmarks/issue16_session.sh 2   # GRPO step, 1 GPU, 0.5B: stock vs patched-graph; 24 GiB cap, 1.5B,
#                                          # checkpointing on: probes (1 + 2 steps each) stock 192, kit 192 / 208 / 160
#
# Results: benchmarks/results/2026-12-01-h200-issue16/ and $OUT/partN.tar.gz.
set -uo pipefail
cd "$(dirname "$0")/.."
part=${1:?part 1 or 2}
R=${R:-benchmarks/results/2026-12-01-h200-issue16}
mkdir -p "$R"
TAG=issue16
. benchmarks/device_jobs.sh
probe() {  # probe VARIANT BATCH: one 24 GiB probe, 1 + 2 steps (throughput and step time: the 2 after the first)
  echo "python3 benchmarks/bench_grpo.py --find-max-batch --nproc 1 --mem-cap-gb 24 --policy 1.5b --grad-ckpt on \
    --variants $1 --start-batch $2 --max-batch-limit $2 --probe-steps 3 --probe-timeout 125 --out $R/24gb-1.5b"
}
case $part in
1)
  job gpu-tests 170 "python3 -m pytest -q -p no:cacheprovider -k 'gpu or cuda' tests/test_generation.py"; wait
  job decode-1.5b 170 "python3 benchmarks/bench_generation.py --policy 1.5b --paths eager,graph_unmerged,graph \
    --repeats 2 --out $R/decode-1.5b.json"; wait
  job grpo-1.5b 250 "GPUS=1 POLICY=1.5b VARIANTS=stock,patched-graph,patched-graph-kept STEPS=2 BUDGET_S=245 \
    BENCH_OUT=$R/1gpu-1.5b bash benchmarks/run_bench.sh"
  ;;
2)
  job grpo-0.5b 150 "GPUS=1 POLICY=0.5b VARIANTS=stock,patched-graph STEPS=2 BUDGET_S=145 \
    BENCH_OUT=$R/1gpu-0.5b bash benchmarks/run_bench.sh"; wait
  job 24gb 390 "$(probe stock 192); $(probe patched-graph 192); $(probe patched-graph 208); $(probe patched-graph 160)"
  ;;
3)  # what part 1 left (the decode job ran past its 170 s) plus what fits of part 2 in one call
  job decode-1.5b 200 "python3 benchmarks/bench_generation.py --policy 1.5b --paths eager,graph_unmerged,graph \
    --repeats 1 --out $R/decode-1.5b.json"; wait
  job grpo-0.5b 140 "GPUS=1 POLICY=0.5b VARIANTS=stock,patched-graph STEPS=2 BUDGET_S=135 \
    BENCH_OUT=$R/1gpu-0.5b bash benchmarks/run_bench.sh"; wait
  job 24gb 235 "$(probe stock 192); $(probe patched-graph 192)"
  ;;
*) echo "part must be 1, 2 or 3" >&2; exit 2 ;;
esac
wait
log "part $part done"
for f in "$R"/*.log; do echo "== $f"; tail -25 "$f"; done
if [ -n "${OUT:-}" ]; then tar czf "$OUT/part$part.tar.gz" "$R"; fi
