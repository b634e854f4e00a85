#!/usr/bin/env bash
# Packs what a device call left in $OUT into $OUT/runs.tgz, keeping beside it only the files whose names match
# the patterns given (default: *.whl *.md *.txt *.png), because the device tool brings back at most 8 files a
# call and drops the rest: a convergence call alone writes a log and a metrics file per run.
# Usage, last in a device command:  bash tools/device/pack_out.sh ['*.whl' '*.md' ...]
set -u
OUT=${OUT:?set OUT to the output folder}
[ $# -gt 0 ] || set -- '*.whl' '*.md' '*.txt' '*.png'
cd "$OUT" || exit 1
rest=()
for f in * .[!.]*; do
  [ -e "$f" ] && [ "$f" != runs.tgz ] || continue
  keep=0
  for p in "$@"; do [[ $f == $p ]] && keep=1; done
  [ "$keep" = 1 ] && [ -f "$f" ] || rest+=("$f")
done
if [ ${#rest[@]} -gt 0 ]; then
  tar czf runs.tgz "${rest[@]}" && rm -rf "${rest[@]}"
fi
ls -la "$OUT"
