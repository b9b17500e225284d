#!/bin/bash
# py-spy on the daemon while 16 sessions decode: the GIL's holders, then every thread (idle included),
# each summed by thread and innermost frame. On the GPU machine py-spy comes from its wheel, carried
# in .gpu/spy (`pip download --no-deps -d .gpu/spy py-spy`); here: PYSPY=.venv/bin/py-spy MODEL=tiny.
# NATIVE=1 adds a third recording with native frames (py-spy pauses the process for each sample: read it
# for where the engine thread's C++ time goes, not for how long).
# usage: [MODEL=/tmp/m8b] [SESSIONS=16] [TOKENS=1500] [SETTLE=10] [NATIVE=1] [OUT=dir] bash bench/daemon_profile.sh
source bench/pyspy.sh
MODEL=${MODEL:-/tmp/m8b}
OUT=${OUT:-/tmp/spyout}; mkdir -p $OUT
python3 bench/batching.py --model $MODEL --sessions ${SESSIONS:-16} --tokens ${TOKENS:-1500} --no-batch-generator --whole "" --prefill 64 --out $OUT/bp > $OUT/bp.txt 2>&1 &
B=$!
for i in $(seq 1 120); do P=$(pgrep -P $B -f "kvwake.client.cli serve" | head -1); [ -n "$P" ] && break; sleep 1; done
L=$(ls -d /proc/$P >/dev/null && ls -t /tmp/kvwake-batching-*/batched/daemon.log | head -1)
for i in $(seq 1 120); do grep -q '"ready"' $L && break; sleep 1; done
echo "daemon $P ready after $i s"
sleep ${SETTLE:-10}
$PYSPY record --pid $P --duration 5 --rate 250 --threads --gil --format raw -o $OUT/gil.raw --nonblocking >$OUT/spy1.log 2>&1
$PYSPY record --pid $P --duration 5 --rate 250 --threads --idle --format raw -o $OUT/all.raw --nonblocking >$OUT/spy2.log 2>&1
tail -n 1 $OUT/spy1.log; tail -n 1 $OUT/spy2.log
RAWS="$OUT/all.raw $OUT/gil.raw"
if [ "${NATIVE:-0}" = 1 ]; then
  $PYSPY record --pid $P --duration 5 --rate 100 --threads --idle --native --format raw -o $OUT/native.raw >$OUT/spy3.log 2>&1
  tail -n 1 $OUT/spy3.log; RAWS="$RAWS $OUT/native.raw"
fi
pkill -P $B; kill $B; sleep 2; pkill -f "kvwake.client.cli serve"
python3 - $RAWS <<'PY'
import collections, sys
for path in sys.argv[1:]:
    own, threads = collections.Counter(), collections.Counter()
    for line in open(path):
        stack, n = line.rstrip().rsplit(" ", 1)
        frames = stack.split(";")
        th = frames[0].split(":")[-1].strip()
        threads[th] += int(n)
        deep = 4 if "native" in path else 1  # native: the innermost frames down to the Python caller
        own[(th, " < ".join(f[:70] for f in reversed(frames[-deep:])))] += int(n)
    print("==", path, dict(threads.most_common(6)))
    for k, v in own.most_common(25):
        print(f"  {v:6d} {k}")
PY
