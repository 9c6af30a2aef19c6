#!/bin/bash
# Time to first step, two versions of the code side by side: bench/first_step.py (one repetition:
# cold, then warm) run in checkout A and in checkout B, alternating, the order swapped each round.
#
#   git worktree add /tmp/before <commit>
#   flock /tmp/ray.lock bench/ab_first_step.sh /tmp/before . 2
#
# Writes /tmp/fs_a_<round>.json and /tmp/fs_b_<round>.json; prints each run's figures.
set -euo pipefail
a=$(realpath "$1"); b=$(realpath "$2"); rounds=${3:-2}
for round in $(seq 1 "$rounds"); do
  if (( round % 2 )); then order="a b"; else order="b a"; fi
  for side in $order; do
    root=$a; [ "$side" = b ] && root=$b
    echo "== round $round $side ($root) $(date +%T) load $(cut -d' ' -f1 /proc/loadavg)"
    (cd "$root" && python bench/first_step.py --reps 1 --out "/tmp/fs_${side}_${round}.json" 2>&1 \
      | grep -E "^(cold|warm):")
  done
done
