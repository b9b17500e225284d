source /tmp/stage/env.sh
python3 - <<'P'
import zipfile, glob
z = zipfile.ZipFile(glob.glob(".gpu/spy/*.whl")[0]); n = next(n for n in z.namelist() if n.endswith("/py-spy"))
open("/tmp/py-spy", "wb").write(z.read(n))
P
chmod +x /tmp/py-spy
python3 -c "import sys; sys.path.insert(0,'.'); from pathlib import Path; from tests.tinymodel import make_model_dir; make_model_dir(Path('/tmp/tiny'))"
mkdir -p /tmp/sd/run
KVWAKE_CONFIG=/tmp/none.toml python3 -m kvwake.client.cli serve --socket /tmp/sd/run/s.sock --data-dir /tmp/sd/data --model /tmp/tiny > /tmp/sd/log 2>&1 &
P=$!
T0=$(date +%s.%N)
/tmp/py-spy record --pid $P --duration 25 --rate 50 --threads --idle --format raw -o $OUT/start.raw --nonblocking > /tmp/sd/spy.log 2>&1 &
for i in $(seq 1 40); do sleep 1; if grep -q '"event": "ready"' /tmp/sd/log; then echo "ready after $(echo "$(date +%s.%N) - $T0" | bc) s"; break; fi; done
wait %2 2>/dev/null; sleep 1
kill $P; wait $P
grep -o '"event": "[a-z_]*"' /tmp/sd/log | head; tail -3 /tmp/sd/spy.log
python3 - <<'P'
import collections, os
c = collections.Counter()
for line in open(os.environ["OUT"] + "/start.raw"):
    stack, _, n = line.rstrip().rpartition(" ")
    frames = stack.split(";")
    # the deepest kvwake/mlx_lm frame and the innermost one
    own = [f for f in frames if "kvwake" in f or "/main/" in f or "mlx_lm" in f]
    c[(frames[0][:40], own[-1][:110] if own else "-", frames[-1][:90])] += int(n)
for k, v in c.most_common(25): print(v, k)
P
