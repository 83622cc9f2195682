#!/usr/bin/env bash
# The project's Mosaic GPU kernels under Nsight Compute (run through the device tool from the
# repository root, with $OUT set). Hardware counters need a Firecracker machine: the one-GPU
# H100 kind (`nvidia-h100-x1`); the H200's gVisor refuses them (the device library's KINDS.md).
#   bash scripts/ncu.sh                        # every profile below
#   bash scripts/ncu.sh attention_b128 scan    # some of them
#   bash scripts/ncu.sh attention_b64_merge_unrolled_warm attention_b64_warm   # the merge
#                                              # unrolled (the default before the twentieth
#                                              # session), then looped (the default since)
# Per profile, in $NCU_WORK (default /tmp/ncu_work): <name>.ncu-rep (open it in the Nsight Compute
# UI), <name>_details.txt (every section: throughput, memory, warp states and their stall reasons,
# occupancy) and <name>_sass.csv.gz (the SASS, each instruction with its warp-state samples). The
# second launch of the kernel is profiled (the first compiles it); clocks are left alone
# (`--clock-control none`). Nsight Compute flushes the caches before each of its passes
# (`--cache-control all`); a profile whose name ends in `_warm` leaves them (`none`): its
# instruction fetches find the code the launches before left, as a benchmark's back-to-back
# calls do (batch 64's `no_inst` share, attention NOTES, eighteenth session), and its loads
# find the same inputs in L2, which a benchmark's fresh inputs do not. $OUT gets four files,
# since the device tool brings back only a few: ncu_summary.json and .md (`python -m
# pallas_kernels.ncu_report`), ncu_text.tgz (the details, SASS and run logs) and
# ncu_reports.tgz (the .ncu-rep files).
set -uo pipefail
export PYTHONPATH=. PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
OUT=${OUT:?set OUT to the folder the results go to}
WORK=${NCU_WORK:-/tmp/ncu_work}
mkdir -p "$WORK"
PY=${PYTHON:-python3}
NCU=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | tail -1)
[[ -x $NCU ]] || { echo "ncu: not found" >&2; exit 1; }
"$NCU" --version | tail -1

declare -A PROFILES=(
  [attention_b128]="attention --batch 128"
  [attention_b64]="attention --batch 64"
  [attention_b128_warm]="attention --batch 128"
  [attention_b64_warm]="attention --batch 64"
  [attention_b64_merge_unrolled]="attention --batch 64 --variant merge_unrolled"
  [attention_b64_merge_unrolled_warm]="attention --batch 64 --variant merge_unrolled"
  [attention_b128_no_topk_rows]="attention --batch 128 --variant no_topk_rows"
  [attention_b128_registers]="attention --batch 128 --variant registers"
  [attention_b128_async_gather]="attention --batch 128 --variant async_gather"
  [attention_b128_pipelined]="attention --batch 128 --variant pipelined"
  [attention_b128_pipelined_async]="attention --batch 128 --variant pipelined_async"
  [attention_b64_pipelined]="attention --batch 64 --variant pipelined"
  # The twenty-sixth session's two producers: their slots built in the kernel, and at batch
  # 64 their two splits merged in it too.
  [attention_b128_two_producers]="attention --batch 128 --variant specialized_two_producers_slots"
  [attention_b64_two_producers]="attention --batch 64 --variant specialized_two_producers_merge"
  [pooled]="pooled"
  [scan]="scan"
)
names=("$@")
[[ ${#names[@]} == 0 ]] && names=(attention_b128 attention_b64 attention_b128_warm attention_b64_warm
  attention_b64_merge_unrolled attention_b64_merge_unrolled_warm
  attention_b128_no_topk_rows attention_b128_registers
  attention_b128_async_gather attention_b128_pipelined attention_b128_pipelined_async
  attention_b64_pipelined attention_b128_two_producers attention_b64_two_producers pooled scan)
status=0
for name in "${names[@]}"; do
  args=${PROFILES[$name]:-}
  [[ -n $args ]] || { echo "unknown profile $name: one of ${!PROFILES[*]}" >&2; status=1; continue; }
  echo "== $name: python -m pallas_kernels.profile $args"
  start=$SECONDS
  cache=all
  [[ $name == *_warm ]] && cache=none
  # shellcheck disable=SC2086
  "$NCU" --clock-control none --cache-control $cache --target-processes all --kernel-name regex:mosaic \
    --launch-skip 1 --launch-count 1 --set full --import-source no -f -o "$WORK/$name" \
    "$PY" -m pallas_kernels.profile $args >"$WORK/${name}_run.log" 2>&1 || status=1
  tail -3 "$WORK/${name}_run.log"
  if [[ -f $WORK/$name.ncu-rep ]]; then
    "$NCU" -i "$WORK/$name.ncu-rep" --page details >"$WORK/${name}_details.txt" 2>&1 || status=1
    "$NCU" -i "$WORK/$name.ncu-rep" --page source --csv --print-source sass \
      | gzip >"$WORK/${name}_sass.csv.gz" || status=1
  fi
  echo "== $name: $((SECONDS - start)) s"
done
# No report at all: the machine's runtime refused the counters (2026-12-06, an H100 lent for the
# H200 kind: the profiled program died of a segmentation fault). The run logs still come back.
if compgen -G "$WORK/*.ncu-rep" >/dev/null; then
  "$PY" -m pallas_kernels.ncu_report "$WORK" --out "$OUT/ncu_summary.json" \
    >"$OUT/ncu_summary.md" || status=1
  head -40 "$OUT/ncu_summary.md"
  (cd "$WORK" && tar czf "$OUT/ncu_text.tgz" ./*_details.txt ./*_sass.csv.gz ./*_run.log) || status=1
  (cd "$WORK" && tar czf "$OUT/ncu_reports.tgz" ./*.ncu-rep) || status=1
else
  echo "ncu: no report written (hardware counters refused?); the run logs are in ncu_text.tgz" >&2
  (cd "$WORK" && tar czf "$OUT/ncu_text.tgz" ./*_run.log)
  status=1
fi
exit $status
