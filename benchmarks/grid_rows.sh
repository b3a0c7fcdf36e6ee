#!/usr/bin/env bash
# The 1.5B grid's best rows, stock and the kit, one after another in one call, with A/B switches per row.
#
#   bash benchmarks/grid_rows.sh                                    # the kit's speed row, then stock's
#   ROWS="patched-speed stock patched-speed-g16 BENCH_FUSED_GATE_UP=0:patched-speed" bash benchmarks/grid_rows.sh
#   POLICY=tiny COMPLETIONS=8 GEN_BATCH=8 MICRO=4 CAP=0 bash benchmarks/grid_rows.sh   # CPU: the code path
#
# A row is VARIANT or ENV=VALUE[,ENV=VALUE]:VARIANT (the environment only for that row, e.g. BENCH_PICK=gumbel,
# BENCH_REWARD_MODEL_ROWS=0, BENCH_FUSED_GATE_UP=0; see bench_grpo.py; MICRO, GRAD_CKPT, WARMUP and STEPS there
# set the row's micro-batch, gradient checkpointing and step counts, e.g. MICRO=8,GRAD_CKPT=off,WARMUP=1:stock).
# Rows with an environment write to their own folder under OUT (their variant name is the same). Each row gets what
# is left of BUDGET_S, less a minute for the driver's own start, as its --probe-timeout; a row that would get less
# than MIN_ROW_S is skipped. Each row's step lines are printed when it ends (a call cut short still shows what
# finished), every folder's report at the end.
#
# Env (defaults): ROWS ("patched-speed stock"), POLICY (1.5b), COMPLETIONS (1024), GEN_BATCH (1024), MICRO (128),
# GRAD_CKPT (on), CAP (24; 0: no cap), WARMUP (2), STEPS (2), BUDGET_S (560), MIN_ROW_S (120), OUT (/tmp/grid-rows),
# PYTHON (python3).
set -uo pipefail
cd "$(dirname "$0")/.."

ROWS=${ROWS:-"patched-speed stock"}
POLICY=${POLICY:-1.5b}
COMPLETIONS=${COMPLETIONS:-1024}
GEN_BATCH=${GEN_BATCH:-1024}
MICRO=${MICRO:-128}
GRAD_CKPT=${GRAD_CKPT:-on}
CAP=${CAP:-24}
WARMUP=${WARMUP:-2}
STEPS=${STEPS:-2}
BUDGET_S=${BUDGET_S:-560}
MIN_ROW_S=${MIN_ROW_S:-120}
OUT=${OUT:-/tmp/grid-rows}
PY=${PYTHON:-python3}
DRIVER_S=60  # the grid driver's imports and preflight before its row starts
export PYTHONUNBUFFERED=1
start=$(date +%s)
cap=()
[ "$CAP" != 0 ] && cap=(--mem-cap-gb "$CAP")

report() {
  for dir in "$OUT"/*/; do
    [ -f "$dir/grid/results.jsonl" ] || continue
    echo "== ${dir%/}"
    "$PY" benchmarks/bench_grpo.py --grid --report-only --out "$dir" 2>&1 | grep "|"
  done
}

for row in $ROWS; do
  variant=${row##*:}
  envs=""
  [ "$row" != "$variant" ] && envs=${row%:*}
  folder="$OUT/${envs:-default}"
  folder=${folder//[^A-Za-z0-9_\/.-]/_}
  left=$(( BUDGET_S - ($(date +%s) - start) - DRIVER_S ))
  if [ "$left" -lt "$MIN_ROW_S" ]; then
    echo "[grid_rows] skipping $row: ${left}s of the budget left"; continue
  fi
  echo "[grid_rows] $(date +%T) $row: --probe-timeout $left"
  (  # the row's environment: bench_grpo.py's switches and this script's MICRO, GRAD_CKPT, WARMUP, STEPS
    # shellcheck disable=SC2086  # envs is a comma list of NAME=VALUE, split on purpose
    [ -z "$envs" ] || export ${envs//,/ }
    timeout $(( left + DRIVER_S )) "$PY" benchmarks/bench_grpo.py --grid --policy "$POLICY" \
      --completions-per-step "$COMPLETIONS" --grid-generation-batches "$GEN_BATCH" --grid-micro-batches "$MICRO" \
      --grad-ckpt "$GRAD_CKPT" "${cap[@]}" --grid-variants "$variant" --warmup "$WARMUP" --steps "$STEPS" \
      --probe-timeout "$left" --out "$folder" 2>&1 | grep -E "^\[bench|tokens/s" | cut -c1-200
  )
  grep -h "step [0-9]*/" "$folder"/grid/log-* 2>/dev/null | cut -c1-200 | tail -4
done
report
