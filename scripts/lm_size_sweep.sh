#!/usr/bin/env bash
# The language model at three sizes (docs/results/regimes.md, issue 40), on CPU thread workers: per
# size, SlowMo's outer lr x momentum grid at tau 16 on the tuning seeds 100-102 (and the points
# that bracket its best), then test seeds 0-2 of AR-AdamW, Local AdamW and Local AdamW + SlowMo
# (the tuned setting) at tau 16 and 64.
# One size finishes before the next starts. Resumable: every step skips the runs the rows file
# already holds, so rerunning the script goes on where it stopped.
#
#   PYTHONPATH=$PWD nice -n 19 scripts/lm_size_sweep.sh [JOBS]   # JOBS runs at a time (2)
#   python examples/regime_map.py lm-report docs/regime_lm_sizes.jsonl
#
# Sizes (width x layers, 4 heads, context 64, batch 16 per worker, 4 workers) and steps: the
# steps grow as the square root of the parameters, 512 x sqrt(P / 137,216) rounded to a
# multiple of 64 (so that tau 16 and 64 divide them), in epochs of 32 steps:
#   64 x 2: 137,216 parameters, 512 steps;  96 x 3: 391,264, 896;  128 x 4: 867,328, 1280.
set -euo pipefail
cd "$(dirname "$0")/.."
JOBS=${1:-2}
OUT=${OUT:-docs/regime_lm_sizes.jsonl}
PYTHON=${PYTHON:-python}
GRID=0.4/0.8,0.4/0.9,0.7/0.8,0.7/0.9,1/0.8,1/0.9
# Per size, the points that bracket the grid's best where it sat on the grid's edge (lowest
# momentum; largest outer lr at the two smaller sizes); at 391K the bracket's best (1.0/0.7) is
# on the new edge, so momentum 0.6 next; at 867K likewise 0.7/0.7 won, so 0.7/0.6.
for size in "64 2 16 1/0.7,1.3/0.8" "96 3 28 1/0.7,1.3/0.8,1/0.6" "128 4 40 0.7/0.7,0.7/0.6"; do
    read -r width layers epochs bracket <<<"$size"
    lm=("$PYTHON" examples/regime_map.py lm --out "$OUT" --jobs "$JOBS")
    lm+=(--logdir "runs/lm_sizes/w$width")
    flags=(-- --width "$width" --layers "$layers" --heads 4 --context 64 --batch-size 16)
    flags+=(--steps-per-epoch 32 --epochs "$epochs" --val-batches 4)
    "${lm[@]}" --methods local-adamw-slowmo --taus 16 --seed-from 100 --seeds 3 \
        --outer "$GRID,$bracket" "${flags[@]}"
    "${lm[@]}" --taus 16,64 --seeds 3 --outer tuned --tune-tau 16 "${flags[@]}"
done
