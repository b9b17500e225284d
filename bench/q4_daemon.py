"""Probe: a real daemon on a 4-bit tiny model, two sessions decoding together (tests/test_quantized.py's real-daemon
test, which hung on the H200), once per setting given: `name=value` tuning pairs joined by commas (an upper-case
name an environment variable as it is: CUDA_LAUNCH_BLOCKING=1), or `default`.

Each run: a session appended 300 tokens, 4 decoded alone, forked and woken, both decoding 48 tokens at once with a
`--timeout`-second client; the result (ok, or which calls timed out), status's quantized products, and on a hang
every thread's stack (SIGABRT: the daemon's faulthandler writes them into its log). One JSON line a run.

    python3 bench/q4_daemon.py default quantized_kernel=false row_kernel=false
"""

from __future__ import annotations

import json
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from mlx_lm import convert  # noqa: E402

from testkit.daemon import Daemon  # noqa: E402
from testkit.tinymodel import make_model_dir  # noqa: E402


def run(model: Path, root: Path, setting: str, timeout: float) -> dict:
    env = {}
    if setting != "default":
        for pair in setting.split(","):
            name, value = pair.split("=")
            env[name if name.isupper() else f"KVWAKE_{name.upper()}"] = value  # an upper-case name: as it is
    d = Daemon(root, model, env=env).start()
    out: dict = {"setting": setting}
    began = time.perf_counter()
    try:
        with d.client() as c:
            c.call("session.create", session_id="q")
            c.call("session.append", session_id="q", tokens=[10 + i % 240 for i in range(300)])
            out["alone"] = len(c.call("session.generate", session_id="q", max_tokens=4)["tokens"])
            c.call("session.fork", session_id="q", new_session_id="r")
            c.call("session.wake", session_id="r")
        failed: list[str] = []
        together = threading.Barrier(2, timeout=30)

        def generate(sid: str) -> None:
            try:
                with d.client() as c:
                    c.sock.settimeout(timeout)
                    together.wait()
                    c.call("session.generate", session_id=sid, max_tokens=48)
            except BaseException as exc:  # noqa: BLE001 - reported
                failed.append(f"{sid}: {exc!r}")

        threads = [threading.Thread(target=generate, args=(sid,)) for sid in ("q", "r")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        out["together"] = failed or "ok"
        out["together_s"] = round(time.perf_counter() - began, 1)
        if not failed:
            with d.client() as c:
                out["quantized"] = c.call("status")["generation"]["quantized"]
    finally:
        try:
            out["exit"] = d.stop(timeout=15)
        except Exception:  # noqa: BLE001 - hung: the stacks are in the log (testkit's stop sent SIGABRT)
            out["exit"] = "hung"
            log = d.log.read_text(errors="replace")
            out["stacks"] = log[log.find("Fatal Python error"):][-6000:]
    return out


def main() -> None:
    timeout = 30.0
    settings = [a for a in sys.argv[1:] if not a.startswith("--")] or ["default"]
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        convert(hf_path=str(make_model_dir(root / "src")), mlx_path=str(root / "q4"), quantize=True,
                q_group_size=64, q_bits=4)
        for i, setting in enumerate(settings):
            (root / f"d{i}").mkdir()
            print(json.dumps(run(root / "q4", root / f"d{i}", setting, timeout)), flush=True)


if __name__ == "__main__":
    main()
