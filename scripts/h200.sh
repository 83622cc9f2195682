#!/usr/bin/env bash
# The H200 session in one command (run through the device tool from the repository root, with
# $OUT set): the GPU tests, the kernel benchmark, training throughput, a learnability probe.
#   bash scripts/h200.sh            # everything, results under $OUT
#   bash scripts/h200.sh tests      # one stage: tests | bench | throughput | learning | ablations
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to the folder the results go to}
stage=${1:-all}
PY=${PYTHON:-python3}  # the device machine's python3 has everything; locally .venv/bin/python
status=0

if [[ $stage == all || $stage == tests ]]; then
  "$PY" -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" || status=1
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >>"$OUT/gpu_tests.log"
fi
if [[ $stage == all || $stage == bench ]]; then
  "$PY" experiments/bench_kernels.py --out "$OUT/bench_kernels_h200.json" || status=1
fi
if [[ $stage == all || $stage == throughput ]]; then
  "$PY" experiments/train_throughput.py --out "$OUT/train_throughput_h200.json" || status=1
fi
if [[ $stage == all || $stage == learning ]]; then
  "$PY" experiments/learning_speed.py --steps ${STEPS:-1500} --batch 32 --every 100 \
    --settings passkey256 passkey512 --out "$OUT/learning_speed_h200.json" || status=1
fi
if [[ $stage == ablations ]]; then
  # One process per study and seed, side by side: a tiny model leaves the GPU mostly idle.
  # Then one report per study, as a single process over all seeds would have written it.
  common=(--steps ${STEPS:-400} --dense-warmup-steps ${WARMUP:-200}
          --max-minutes ${MAX_MINUTES:-2} ${ABLATION_ARGS:-})
  export XLA_PYTHON_CLIENT_PREALLOCATE=false XLA_FLAGS="--xla_gpu_autotune_level=0"
  parts=$(mktemp -d)
  # Seeds of one variant compile the same programs: share them through the persistent cache.
  export JAX_COMPILATION_CACHE_DIR="$parts/jax_cache" JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=1
  for study in block_score_ablation kv_format_study; do
    for seed in ${SEEDS:-0 1 2}; do
      "$PY" experiments/$study.py "${common[@]}" --seeds $seed \
        --out-dir "$parts/$study-$seed" --runs-dir "$parts/runs/$study-$seed" \
        >"$parts/$study-$seed.log" 2>&1 &
    done
  done
  # A study cut short by the command's limit still merges what its processes finished.
  sleep "${ABLATION_SECONDS:-520}" && pkill -f "experiments/(block_score_ablation|kv_format)" &
  watchdog=$!
  wait $(jobs -p | grep -v "^$watchdog$")
  kill $watchdog 2>/dev/null
  for study in block_score_ablation kv_format_study; do
    "$PY" experiments/merge_reports.py $study "$parts"/$study-*/$study.json --out-dir "$OUT" \
      || status=1
    for log in "$parts"/$study-*.log; do echo "== $log"; grep -v "it/s" "$log"; done \
      >"$OUT/$study.log"
  done
  tail -n 40 "$OUT"/*.log
fi
exit $status
