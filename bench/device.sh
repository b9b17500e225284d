#!/bin/bash
# The wake/sleep benchmarks on the GPU machine (../shared/gpu/README.md has the staging recipe).
# Run from the repository root after setup.sh, with the environment of /tmp/stage/env.sh:
#   bash bench/device.sh [SIZES]        results in $OUT (or bench/out/device)
# Makes the 8B-shaped random model once (/tmp/m8b), then `bench/suite.py resume` at each size
# with planes-zstd (peak RSS and MLX peak memory per size in the JSON: all sizes run in one process),
# the same at 8k with the "raw" codec, at 32k with codec "auto" (what the machine picks),
# and, if .gpu/old holds an older kvwake tree (git archive), that tree's resume benchmark too:
# before and after from one run on one machine.
set -euo pipefail
sizes=${1:-1024,8192,32768}
out=${OUT:-bench/out/device}
mkdir -p "$out"
[ -f /tmp/m8b/config.json ] || python3 /tmp/stage/make_model.py /tmp/m8b --shape llama8b
nproc; nvidia-smi -L || true
python3 bench/suite.py resume --model /tmp/m8b --sizes "$sizes" --out "$out/new"
python3 bench/suite.py resume --model /tmp/m8b --sizes 8192 --codec raw --out "$out/raw"
# codec = "auto" (the daemon's default): the store measures and picks here; the JSON's "codec" says which
python3 bench/suite.py resume --model /tmp/m8b --sizes 32768 --codec auto --out "$out/auto"
if [ -d .gpu/old ]; then
  rm -rf /tmp/old /tmp/oldbench && mkdir -p /tmp/oldbench
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/old .gpu/old >/dev/null
  cp .gpu/old/bench/suite.py .gpu/old/bench/capture_kv.py /tmp/oldbench/
  PYTHONPATH=/tmp/old:$PYTHONPATH python3 /tmp/oldbench/suite.py resume --model /tmp/m8b --sizes "${OLD_SIZES:-$sizes}" --out "$out/old"
fi
