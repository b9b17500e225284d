#!/bin/bash
# One device call after the machine's first (staging) call: sets the machine up once, checks that the test
# clients' wheels are in (the session-22 calls that skipped them failed at import, 19 s each), then runs
# bench/device_round.sh's parts in order, each under what is left of ${UNTIL_S:-560} s.
#   call 1, a fresh machine:  bash .gpu/a/stage.sh                 carry [".gpu/a"]
#   call 2, at once:          bash bench/device_go.sh PART [PART...]  carry [".gpu/b", ".gpu/c"]
#   later, within ~30 s:      bash bench/device_go.sh PART [PART...]  (no carry needed: the wheels stay)
# Exit 3: the machine is fresh (it was given back): stage it again. Output of each part under $OUT.
set -uo pipefail
[ -f /tmp/stage/setup.sh ] || { echo "fresh machine: run 'bash .gpu/a/stage.sh' first (carry .gpu/a)"; exit 3; }
if [ ! -f /tmp/stage/.set-up ]; then
  bash /tmp/stage/setup.sh >/tmp/setup.log 2>&1 || { tail -20 /tmp/setup.log; exit 4; }
  touch /tmp/stage/.set-up
fi
source /tmp/stage/env.sh
if ! python3 -c 'import llguidance, anthropic' 2>/dev/null; then
  ls .gpu/c/*.whl >/dev/null 2>&1 || { echo "no .gpu/c wheels here: carry .gpu/c in this call"; exit 5; }
  python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/c/*.whl >/dev/null 2>&1
  python3 -c 'import llguidance, anthropic' || { echo ".gpu/c's wheels did not install"; exit 5; }
fi
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader
budget=${UNTIL_S:-560}
for part in "$@"; do
  left=$((budget - SECONDS))
  [ $left -gt 30 ] || { echo "== $part: skipped, ${left} s left"; continue; }
  echo "== $part ($left s left)"
  # a part's UNTIL_S is when it starts no more runs; its runs' own timeouts are up to 200 s
  UNTIL_S=$((left > 200 ? left - 200 : 0)) OUT=${OUT:-bench/out/device} timeout $left bash bench/device_round.sh "$part"
done
