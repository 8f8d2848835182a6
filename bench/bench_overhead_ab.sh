#!/usr/bin/env bash
# Two revisions of ampdoctor side by side on the deep MLP: bench_overhead.py run alternately from a git worktree of each
# (A B A B ...), one process per run, and each run's paired ratios. On a shared host the paired ratio of one run
# moves by 1 to 2% from run to run (where each process's memory lands, the host's drift), more than one change
# often gains: compare the runs' medians, never one run.
#
#     bash bench/bench_overhead_ab.sh REV_A REV_B [PAIRS=8] [ROUNDS=80]
#
# Run from the repository; REV_B may be "." for the working tree as it is (uncommitted changes included).
set -euo pipefail
A=$1 B=$2 PAIRS=${3:-8} ROUNDS=${4:-80}
ROOT=$(git rev-parse --show-toplevel)
TMP=$(mktemp -d)
trap 'git -C "$ROOT" worktree remove --force "$TMP/a" >/dev/null 2>&1 || true; git -C "$ROOT" worktree remove --force "$TMP/b" >/dev/null 2>&1 || true; rm -rf "$TMP"' EXIT
tree() {  # $1 rev, $2 dir
  if [ "$1" = "." ]; then
    mkdir -p "$2" && (cd "$ROOT" && git ls-files -co --exclude-standard | tar cf - -T -) | tar xf - -C "$2"
  else
    git -C "$ROOT" worktree add -f --detach "$2" "$1" >/dev/null 2>&1
  fi
  (cd "$TMP" && PYTHONPATH="$2" python -c "from ampdoctor.watch import fused; fused.build_now()")  # (each its own kernel)
}
tree "$A" "$TMP/a"
tree "$B" "$TMP/b"
cd "$TMP"  # (not the repository: its ampdoctor would be imported instead of the tree's)
for i in $(seq 1 "$PAIRS"); do
  for side in a b; do
    out=$(PYTHONPATH="$TMP/$side" python "$TMP/$side/bench/bench_overhead.py" --clock cpu --threads 1 --rounds "$ROUNDS" \
          --steps 2 --models deep_mlp --variants "bare,ampdoctor full,ampdoctor monitor only")
    full=$(echo "$out" | awk '/ampdoctor full/ {print $5, $6, $7}')
    only=$(echo "$out" | awk '/monitor only/ {print $6}')
    echo "$side $full $only" >> "$TMP/runs"
    rev=$([ "$side" = a ] && echo "$A" || echo "$B")
    echo "run $i $rev: full paired/mean/low $full, monitor only paired $only"
  done
done
python - "$TMP/runs" "$A" "$B" <<'PY'
import statistics, sys
rows = [line.split() for line in open(sys.argv[1])]
for side, rev in (("a", sys.argv[2]), ("b", sys.argv[3])):
    p = sorted(float(r[1]) for r in rows if r[0] == side)
    o = [float(r[4]) for r in rows if r[0] == side]
    print(f"{rev}: full paired median {statistics.median(p):.3f} (range {p[0]:.3f} to {p[-1]:.3f}, {len(p)} runs), "
          f"monitor only {statistics.median(o):.3f}")
PY
