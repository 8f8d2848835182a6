#!/usr/bin/env bash
# Loop the torchrun jobs the tests run, to catch a rare abort (issue 26: a SIGABRT, "terminate called without
# an active exception", seen twice in full-suite runs on a loaded 2-core machine).
#   bash bench/stress_torchrun.sh [RUNS] [fresh]
# RUNS (default 100) 2-process jobs of sample_models/ddp_bad_batch.py, alternating its full and sentinel modes;
# "fresh" gives every run an empty TORCH_EXTENSIONS_DIR, so the C++ kernel's background build races the
# first steps. Prints one line a run and a count; a failing run's log is kept under $OUT (default /tmp/ampdoctor-stress).
set -u
runs=${1:-100}
fresh=${2:-}
out=${OUT:-/tmp/ampdoctor-stress}
mkdir -p "$out"
out=$(cd "$out" && pwd)
cd "$(dirname "$0")/.."
[ -f .venv/bin/activate ] && . .venv/bin/activate
bad=0
for i in $(seq 1 "$runs"); do
  mode=$([ $((i % 2)) -eq 0 ] && echo sentinel || echo full)
  dir="$out/run$i"
  rm -rf "$dir"
  env_ext=()
  [ "$fresh" = fresh ] && env_ext=(TORCH_EXTENSIONS_DIR="$out/ext$i")
  start=$(date +%s)
  env "${env_ext[@]}" timeout 300 python -m torch.distributed.run --standalone --nproc-per-node 2 \
      sample_models/ddp_bad_batch.py --out "$dir" --mode "$mode" --capture-ranks all > "$dir.log" 2>&1
  rc=$?
  aborts=$(grep -c "terminate called\|SIGABRT\|exitcode  : -6" "$dir.log")
  if [ $rc -ne 0 ] || [ "$aborts" -ne 0 ]; then bad=$((bad + 1)); else rm -f "$dir.log"; rm -rf "$dir" "$out/ext$i"; fi
  echo "run $i ($mode${fresh:+, fresh}): rc=$rc aborts=$aborts $(( $(date +%s) - start ))s"
done
echo "$bad of $runs runs failed"
