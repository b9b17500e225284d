"""Probe: which 4-bit product hangs on CUDA (the real-daemon test of a 4-bit tiny model hung with two sessions
decoding together, whatever kvwake's kernels: bench/q4_daemon.py). Each case in a child process with a time limit;
one JSON line a case: ok, or hung.

    python3 bench/q4_hang.py
"""

from __future__ import annotations

import json
import subprocess
import sys

CASE = """
import mlx.core as mx
rows, k, n, group = {rows}, {k}, {n}, {group}
w, s, b = mx.quantize((mx.random.normal((n, k)) * 0.02).astype(mx.bfloat16), group_size=group, bits=4)
x = mx.random.normal((rows, 1, k)).astype(mx.bfloat16)
y = mx.quantized_matmul(x, w, scales=s, biases=b, transpose=True, group_size=group, bits=4)
mx.eval(y)
print("ok", y.shape)
"""

GENERATOR = """
import sys, tempfile
from pathlib import Path
sys.path.insert(0, ".")
import mlx.core as mx
from mlx_lm import convert, load
from mlx_lm.generate import BatchGenerator
from testkit.tinymodel import make_model_dir
root = Path(tempfile.mkdtemp())
convert(hf_path=str(make_model_dir(root / "src")), mlx_path=str(root / "q4"), quantize=True, q_group_size=64, q_bits=4)
model, _ = load(str(root / "q4"))
if {install}:  # kvwake's products by rows (model/quantized.py), without its kernel
    from kvwake.daemon.model import quantized
    print("installed", quantized.install(model), flush=True)
print("hidden", model.args.hidden_size, flush=True)
gen = BatchGenerator(model, max_tokens=8)
gen.insert([[10 + i % 200 for i in range(300)], [11 + i % 200 for i in range(300)]])
n = 0
while n < 16:
    out = gen.next()
    n += len(out[1]) if isinstance(out, tuple) else len(out)
print("ok", n)
"""


def run(name: str, code: str, limit: float = 60.0) -> None:
    try:
        p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=limit)
        out = {"case": name, "rc": p.returncode, "tail": (p.stdout + p.stderr)[-400:]}
    except subprocess.TimeoutExpired:
        out = {"case": name, "hung": limit}
    print(json.dumps(out), flush=True)


def main() -> None:
    for rows, k, n, group in [(1, 64, 192, 64), (2, 64, 192, 64), (2, 128, 64, 64), (2, 64, 259, 64),
                              (1, 64, 259, 64), (5, 4096, 4096, 64)]:
        run(f"qmm rows={rows} k={k} n={n} group={group}", CASE.format(rows=rows, k=k, n=n, group=group), 40)
    run("mlx-lm BatchGenerator, 2 rows, tiny 4-bit model", GENERATOR.replace("{install}", "False"), 90)
    run("the same, kvwake's products by rows installed", GENERATOR.replace("{install}", "True"), 90)


if __name__ == "__main__":
    main()
