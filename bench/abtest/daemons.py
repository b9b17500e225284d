"""One `kvwake serve` per tree under test, each from its own installed copy of kvwake.

A tree is installed (not editable) into a folder of its own; its daemon runs
that folder's `kvwake` entry point with the folder first on PYTHONPATH, so two
trees whose internals differ run side by side in one benchmark. Nothing here
imports kvwake: the trees are reached only through their entry point and socket.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Tree", "Daemon", "CONFIG"]

# Every daemon gets the same settings, chosen so each hot path does its whole work every time:
# no RAM tier (a wake reads its blocks from disk, through the page cache), no writing of full blocks
# while prefilling (a sleep captures and writes every block), one fixed codec (the "auto" choice is
# measured at first start and could differ between two daemons), and a hot budget and idle timeout
# no run reaches (no session sleeps in the middle of a measurement).
# Both daemons share one GPU: ABTEST_MLX_MEMORY_BYTES gives each its share (unset, each takes MLX's default of
# most of the device, and two of them growing their sessions run it out of memory).
CONFIG = ("ram_tier_bytes = 0\npersist = false\ncodec = \"planes-zstd\"\n"
          f"hot_budget_bytes = {1 << 40}\nidle_timeout_s = 86400.0\n"
          + (f"mlx_memory_bytes = {int(os.environ['ABTEST_MLX_MEMORY_BYTES'])}\n"
             if os.environ.get("ABTEST_MLX_MEMORY_BYTES") else ""))


@dataclass(frozen=True)
class Tree:
    """A tree under test: its label (A, B) and the folder its kvwake is installed in."""

    label: str
    site: Path

    @classmethod
    def parse(cls, text: str) -> Tree:
        """`LABEL=SITE_DIR`, as given on the command line."""
        label, sep, site = text.partition("=")
        if not sep or not label:
            raise ValueError(f"a tree is LABEL=SITE_DIR, not {text!r}")
        path = Path(site).resolve()
        if not (path / "bin" / "kvwake").exists():
            raise FileNotFoundError(f"tree {label}: no kvwake entry point in {path}/bin (install the tree there)")
        return cls(label, path)


def own_path(site: Path) -> str:
    """PYTHONPATH for a tree's daemon: its site first, then the inherited entries that hold no kvwake
    (the driver's own PYTHONPATH names another tree's site: each daemon must see one kvwake only)."""
    inherited = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    return os.pathsep.join([str(site), *(p for p in inherited if not (Path(p) / "kvwake").exists())])


class DaemonFailed(RuntimeError):
    """A tree's daemon exited or did not answer in time; the message ends with its log."""


class Daemon:
    """A tree's `kvwake serve` on `model`, with its own socket, data dir and log under `root`."""

    def __init__(self, tree: Tree, model: Path, root: Path, *, block_tokens: int = 128) -> None:
        self.tree, self.root = tree, root
        self.socket = root / "run" / "kvwake.sock"
        self.log = root / "daemon.log"
        self.args = ["serve", "--socket", str(self.socket), "--data-dir", str(root / "data"),
                     "--model", str(model), "--block-tokens", str(block_tokens)]
        self.proc: subprocess.Popen | None = None

    def start(self) -> Daemon:
        self.root.mkdir(parents=True, exist_ok=True)
        config = self.root / "config.toml"
        config.write_text(CONFIG)
        env = {**os.environ, "PYTHONPATH": own_path(self.tree.site), "KVWAKE_CONFIG": str(config),
               "KVWAKE_AUTOSTART": "0"}
        with open(self.log, "ab") as log:  # cwd: the daemon's root, so no source folder shadows the install
            self.proc = subprocess.Popen([sys.executable, str(self.tree.site / "bin" / "kvwake"), *self.args],
                                         cwd=self.root, env=env, stdout=log, stderr=log)
        return self

    def wait_ready(self, timeout_s: float) -> None:
        """Return once `hello` answers on the socket; raise DaemonFailed if the process exits or time runs out."""
        from kvwake.client import Client

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise DaemonFailed(f"tree {self.tree.label}: daemon exited {self.proc.returncode}\n{self.tail()}")
            if self.socket.exists():
                try:
                    with Client(self.socket, timeout=10, autostart=False) as c:
                        c.hello("kvwake-abtest")
                    return
                except (OSError, ConnectionError):
                    pass
            time.sleep(0.2)
        raise DaemonFailed(f"tree {self.tree.label}: no answer within {timeout_s:.0f} s\n{self.tail()}")

    def stop(self, timeout_s: float = 120.0) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else "(no log)"
