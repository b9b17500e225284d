#!/bin/bash
# A/B of kvwake's hot paths: tree A (a commit, as a tarball) against tree B (a source folder), in one run.
#
#   bash bench/abtest/run.sh pack     make bench/abtest/.before.tar.gz from REV_A (needs git: run it here)
#   bash bench/abtest/run.sh          install both trees under $WORK and run abtest.py on them
#
# Variables (defaults in brackets):
#   PY      the python that runs everything [python3]: it needs mlx, mlx-lm and kvwake's dependencies
#   REV_A   the commit `pack` archives [4469ee7]
#   TREE_A  tree A: a .tar.gz made by `pack`, or a source folder [bench/abtest/.before.tar.gz]
#   TREE_B  tree B: a source folder [the repository this script is in]
#   WORK    scratch: unpacked tree, installs, models, stores, logs [/tmp/abtest]
#   MODEL   a model folder, or "tiny" (tree B's testkit/tinymodel.py makes one under $WORK) [tiny]
#   OUT     where the JSON record goes [$WORK/abtest.json]
#   Any arguments after the mode go to abtest.py (sizes, rounds: see its --help).
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)
PY=${PY:-python3}
REV_A=${REV_A:-4469ee7}
TREE_A=${TREE_A:-$here/.before.tar.gz}
TREE_B=${TREE_B:-$repo}
WORK=${WORK:-/tmp/abtest}
MODEL=${MODEL:-tiny}
OUT=${OUT:-$WORK/abtest.json}

if [ "${1:-}" = pack ]; then
  git -C "$repo" archive --format=tar.gz -o "$here/.before.tar.gz" "$REV_A"
  echo "$here/.before.tar.gz: $(git -C "$repo" rev-parse --short "$REV_A") ($(du -h "$here/.before.tar.gz" | cut -f1))"
  exit 0
fi
[ "${1:-}" = run ] && shift

# One install per tree, not editable, each into its own folder (daemons.py puts it first on PYTHONPATH).
install_tree() {  # label, source folder
  rm -rf "$WORK/site-$1"
  "$PY" -m pip install -q --no-deps --no-build-isolation --no-compile --target "$WORK/site-$1" "$2"
  echo "tree $1: $2 -> $WORK/site-$1"
}
rm -rf "$WORK/run"
mkdir -p "$WORK"
if [ -f "$TREE_A" ]; then
  rm -rf "$WORK/tree-A"; mkdir -p "$WORK/tree-A"; tar -xf "$TREE_A" -C "$WORK/tree-A"; TREE_A=$WORK/tree-A
fi
install_tree A "$TREE_A"
install_tree B "$TREE_B"

if [ "$MODEL" = tiny ]; then
  MODEL=$WORK/tiny-llama
  [ -f "$MODEL/config.json" ] || (cd "$TREE_B" && "$PY" -c \
    "import sys; from pathlib import Path; from testkit.tinymodel import make_model_dir; make_model_dir(Path(sys.argv[1]))" \
    "$MODEL")
fi

# The driver's client is tree B's (the public client API is the same in both).
PYTHONPATH="$WORK/site-B${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 \
  "$PY" "$here/abtest.py" --tree "A=$WORK/site-A" --tree "B=$WORK/site-B" --model "$MODEL" --work "$WORK/run" \
  --out "$OUT" "$@"
