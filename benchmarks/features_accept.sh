#!/bin/bash
# val/accept_len of the EAGLE-3 quickstart trained from bf16 vs float8 features (same 2,000 documents, STEPS
# steps, each seed of SEEDS); read val/accept_len from $OUT/runs-<dtype>-seed<seed> with TensorBoard
# (benchmarks/features_accept_summary.py prints the mean and spread).
# Usage: [SEEDS="0 1 2"] [STEPS=300] benchmarks/features_accept.sh [OUT]
set -e
cd "$(dirname "$0")/.."
export OMP_NUM_THREADS=1
PY=${PYTHON:-.venv/bin/python}
OUT=${1:-runs-features-accept}
SEEDS=${SEEDS:-0 1 2}
STEPS=${STEPS:-300}
mkdir -p $OUT
common="--data.init_args.max_documents=2000 --data.init_args.cache_dir=$OUT/cache"
for dtype in bfloat16 float8_e4m3fn; do
  # The features do not depend on the seed: one capture per storage dtype (a finished one resumes as a no-op).
  nice $PY -m lightning_drafts capture --config configs/quickstart/eagle3.yaml --output $OUT/features-$dtype --dtype $dtype $common
done
for seed in $SEEDS; do
  for dtype in bfloat16 float8_e4m3fn; do
    nice $PY -m lightning_drafts fit --config configs/quickstart/eagle3.yaml $common --data.init_args.features_dir=$OUT/features-$dtype \
      --seed_everything=$seed --trainer.max_steps=$STEPS --trainer.val_check_interval=100 \
      --trainer.logger.init_args.save_dir=$OUT/runs-$dtype-seed$seed --trainer.enable_progress_bar=false
  done
done
