#!/bin/bash
# py-spy (native frames) on the daemon through bench/batching.py's prefill row: one session decodes while
# another appends a long prompt. Prints the engine thread's samples inside decode steps and prefill jobs,
# by their innermost frames: what a decoding neighbour waits for. py-spy pauses the process for each
# native sample: read it for where the time goes, not for how long.
# usage: [MODEL=/tmp/m8b] [PREFILL=8192] [RATE=100] [ARGS=--no-persist] [OUT=dir] bash bench/prefill_spy.sh
source bench/pyspy.sh
MODEL=${MODEL:-/tmp/m8b}
OUT=${OUT:-/tmp/prefillspy}; mkdir -p $OUT
python3 bench/batching.py --model $MODEL --sessions 1 --tokens 8 --prefill ${PREFILL:-8192} --no-batch-generator --whole "" \
  --modes batched ${ARGS:-} --out $OUT/bp > $OUT/bp.txt 2>&1 &
B=$!
for i in $(seq 1 120); do P=$(pgrep -P $B -f "kvwake.client.cli serve" | head -1); [ -n "$P" ] && break; sleep 1; done
echo "daemon $P"
$PYSPY record --pid $P --duration ${DURATION:-120} --rate ${RATE:-100} --threads --native --format raw -o $OUT/native.raw >$OUT/spy.log 2>&1 &
S=$!
wait $B; kill -INT $S 2>/dev/null; wait $S
tail -n 2 $OUT/spy.log
python3 - $OUT/native.raw <<'PY'
import collections, sys
for want in ("Decoder.step", "Chunk.step", "capture"):
    c, total = collections.Counter(), 0
    for line in open(sys.argv[1]):
        stack, n = line.rstrip().rsplit(" ", 1)
        frames = stack.split(";")
        if "kvwake-engine" not in frames[0] or not any(want in f for f in frames):
            continue
        total += int(n)
        c[" < ".join(f[:60] for f in reversed(frames[-5:]))] += int(n)
    print(f"== engine thread samples under {want}: {total}")
    for k, v in c.most_common(14):
        print(f"  {v:6d} {k}")
PY
python3 -c "
import json,glob; r=json.load(open(glob.glob('$OUT/bp/*.json')[0])); print(json.dumps(r['prefill']))"
