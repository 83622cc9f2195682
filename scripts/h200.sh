#!/usr/bin/env bash
# The H200 session in one command (run through the device tool from the repository root, with
# $OUT set): the GPU tests, the kernel benchmark, training throughput, a learnability probe.
#   bash scripts/h200.sh            # everything, results under $OUT
#   bash scripts/h200.sh tests      # one stage: tests | bench | throughput | learning | ablations
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1
OUT=${OUT:?set OUT to the folder the results go to}
stage=${1:-all}
status=0

if [[ $stage == all || $stage == tests ]]; then
  python3 -m pytest -m gpu -q -p no:cacheprovider 2>&1 | tee "$OUT/gpu_tests.log" || status=1
  nvidia-smi --query-gpu=name,driver_version,clocks.max.sm --format=csv >>"$OUT/gpu_tests.log"
fi
if [[ $stage == all || $stage == bench ]]; then
  python3 experiments/bench_kernels.py --out "$OUT/bench_kernels_h200.json" || status=1
fi
if [[ $stage == all || $stage == throughput ]]; then
  python3 experiments/train_throughput.py --out "$OUT/train_throughput_h200.json" || status=1
fi
if [[ $stage == all || $stage == learning ]]; then
  python3 experiments/learning_speed.py --steps ${STEPS:-1500} --batch 32 --every 100 \
    --settings passkey256 passkey512 --out "$OUT/learning_speed_h200.json" || status=1
fi
if [[ $stage == ablations ]]; then
  # Both studies side by side (the tiny model leaves the GPU mostly idle), each sequential.
  common=(--task-set seq_len=${SEQ_LEN:-256} --steps ${STEPS:-1200}
          --dense-warmup-steps ${WARMUP:-400} --max-minutes ${MAX_MINUTES:-1.5})
  export XLA_PYTHON_CLIENT_MEM_FRACTION=0.3
  python3 experiments/block_score_ablation.py "${common[@]}" --out-dir "$OUT" \
    >"$OUT/block_score_ablation.log" 2>&1 &
  python3 experiments/kv_format_study.py "${common[@]}" --out-dir "$OUT" \
    >"$OUT/kv_format_study.log" 2>&1 &
  wait || status=1
  tail -n 30 "$OUT"/*.log
fi
exit $status
