#!/bin/bash
# The memory probe of bench/memory.py on the GPU machine, this tree and (if .gpu/old holds an older kvwake tree,
# a git archive) that tree, one after the other in one run: before and after. From the repository root after
# ../shared/gpu's setup.sh, with /tmp/stage/env.sh sourced:  bash bench/device_memory.sh [TOKENS]
set -euo pipefail
tokens=${1:-32768}
out=${OUT:-bench/out/device}
mkdir -p "$out"
[ -f /tmp/m8b/config.json ] || python3 /tmp/stage/make_model.py /tmp/m8b --shape llama8b >/dev/null
python3 bench/memory.py --model /tmp/m8b --tokens "$tokens" --cache-limit 4 --out "$out/new"
if [ -d .gpu/old ]; then
  rm -rf /tmp/old /tmp/oldbench && mkdir -p /tmp/oldbench
  python3 -m pip install -q --no-index --no-deps --no-build-isolation --target /tmp/old .gpu/old >/dev/null
  cp bench/memory.py bench/suite.py bench/capture_kv.py /tmp/oldbench/
  PYTHONPATH=/tmp/old:$PYTHONPATH python3 /tmp/oldbench/memory.py --model /tmp/m8b --tokens "$tokens" --cache-limit 4 \
    --out "$out/old"
fi
