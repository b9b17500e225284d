#!/bin/bash
# Issue 11's measurements on the GPU machine (../shared/gpu/README.md has the staging recipe).
# Run from the repository root after setup.sh, with the environment of /tmp/stage/env.sh:
#   bash bench/device_batching.sh        results in $OUT (or bench/out/device)
# Makes the 8B-shaped random model once (/tmp/m8b); batched vs solo logprobs and greedy agreement;
# then aggregate decode and token gaps for 1/4/8/16 sessions, batching on and off, an 8k prefill
# beside a decoding session, and mlx_lm.server on the same model and requests.
set -euo pipefail
out=${OUT:-bench/out/device}
mkdir -p "$out"
[ -f /tmp/m8b/config.json ] || python3 /tmp/stage/make_model.py /tmp/m8b --shape llama8b
nproc; nvidia-smi -L || true
python3 bench/batch_exactness.py --model /tmp/m8b --lengths 16,1000,4000,8000 --tokens 64 --out "$out"
python3 bench/batching.py --model /tmp/m8b --sessions 1,4,8,16 --tokens 128 --prefill 8192 --mlx-server --out "$out"
