"""Which block codec wins on this machine: measured on real (or KV-like) blocks, kept in the store's index.

For each codec, on a few blocks: the ratio, encode and verified-decode speed on
one core, and this disk's write (with fsync) and cold read speed for the bytes
that codec would store (the page cache is dropped for the file with
posix_fadvise before it is read back). A wake runs at about
min(cores x decode, disk read / stored fraction) and a sleep at
min(cores x encode, disk write / stored fraction); the codec with the faster
wake is picked, the smaller one on a tie (within 10%).

`kvwake bench` runs `measure` on the store's own blocks (client/codecs.py).
A store opened with `codec="auto"` (the daemon's default) runs `choose`: the
pick recorded in its index (`store_meta`, key `codec_auto`) for this machine
(CPU model and core count), else a fresh measurement (the store's blocks, or
KV-like bf16 blocks while it has none), recorded for the next start.
"""

from __future__ import annotations

import json
import os
import platform
import tempfile
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np

from kvwake.store.files import sync
from kvwake.store.format.codec import CODECS, Tensor, decode, encode

__all__ = ["META_KEY", "choose", "kv_like_blocks", "machine_key", "measure"]

META_KEY = "codec_auto"


def _disk(folder: Path, data: bytes) -> tuple[float, float]:
    """(write+fsync GB/s, cold read GB/s) for `data` written to a temporary file in `folder`."""
    fd, name = tempfile.mkstemp(dir=folder, prefix=".codec-probe-")
    try:
        t0 = time.perf_counter()
        os.write(fd, data)
        sync(fd)  # as the store syncs: F_FULLFSYNC on macOS
        write = len(data) / (time.perf_counter() - t0) / 1e9
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.lseek(fd, 0, os.SEEK_SET)
        t0 = time.perf_counter()
        while os.read(fd, 8 << 20):
            pass
        read = len(data) / (time.perf_counter() - t0) / 1e9
    finally:
        os.close(fd)
        os.unlink(name)
    return write, read


def _candidates(among: tuple[str, ...] | None) -> list[str]:
    """The codecs a measurement considers, sorted: every one, or those `among`."""
    return sorted(c for c in CODECS.values() if among is None or c in among)


def measure(blocks: list[Mapping[str, Tensor]], folder: Path, cores: int | None = None,
            among: tuple[str, ...] | None = None) -> dict[str, Any]:
    """Every codec (or those `among`) measured on these blocks (disk speeds in `folder`); the numbers and
    the pick."""
    raw = sum(t.array.nbytes for b in blocks for t in b.values())
    cores = cores or os.cpu_count() or 1
    out: dict[str, Any] = {"blocks": len(blocks), "raw_bytes": raw, "cores": cores, "codecs": {}}
    for codec in _candidates(among):
        t0 = time.perf_counter()
        encoded = [encode(b, codec=codec).data for b in blocks]
        enc = raw / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter()
        for data in encoded:
            decode(data)
        dec = raw / (time.perf_counter() - t0) / 1e9
        stored = sum(map(len, encoded))
        write, read = _disk(folder, b"".join(encoded))
        fraction = stored / raw
        out["codecs"][codec] = {
            "ratio": round(raw / stored, 3), "encode_GBps_1core": round(enc, 3), "decode_GBps_1core": round(dec, 3),
            "disk_write_GBps": round(write, 3), "disk_read_GBps": round(read, 3),
            "wake_GBps_estimate": round(min(cores * dec, read / fraction), 3),
            "sleep_GBps_estimate": round(min(cores * enc, write / fraction), 3)}
    ranked = sorted(out["codecs"].items(), key=lambda kv: -kv[1]["wake_GBps_estimate"])
    best, smallest = ranked[0][0], max(out["codecs"].items(), key=lambda kv: kv[1]["ratio"])[0]
    if out["codecs"][smallest]["wake_GBps_estimate"] >= 0.9 * out["codecs"][best]["wake_GBps_estimate"]:
        best = smallest
    out["recommended"] = best
    out["why"] = (f"estimated wake {out['codecs'][best]['wake_GBps_estimate']} GB/s with {best} "
                  f"({out['codecs'][best]['ratio']}x smaller than raw KV)")
    return out


def kv_like_blocks(count: int = 4, tokens: int = 128, heads: int = 8, dim: int = 128) -> list[dict[str, Tensor]]:
    """bf16 blocks shaped and distributed like attention KV (normal values): for a store with no blocks yet.

    Their exponent planes compress about as real KV's do; their mantissas, like real ones, do not.
    """
    rng = np.random.default_rng(0)
    blocks = []
    for _ in range(count):
        x = rng.standard_normal((2, 1, heads, tokens, dim), dtype=np.float32)
        bits = (x.view(np.uint32) >> 16).astype(np.uint16)  # bf16 by truncation
        blocks.append({f"layers.0.{part}": Tensor("BF16", bits[i]) for i, part in enumerate(("keys", "values"))})
    return blocks


def machine_key() -> str:
    """What a recorded pick holds for: the CPU model and its cores (a store moved elsewhere measures again)."""
    cpu = platform.processor() or platform.machine()
    if Path("/proc/cpuinfo").exists():
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    return f"{platform.system()} {platform.machine()} {cpu} x{os.cpu_count()}"


def choose(root: Path, recorded: str | None, record: Callable[[str], None],
           blocks: Callable[[], list[Mapping[str, Tensor]]], among: tuple[str, ...] | None = None) -> dict[str, Any]:
    """The codec for a store opened with codec="auto": {"codec", "machine", "measured", "why", "estimates",
    "among"}.

    recorded: the store's `codec_auto` value (JSON) or None; record(value) keeps a new one;
    blocks(): a few of the store's blocks (may be empty: then KV-like ones are measured); among: the
    codecs it may pick (None: all). A recorded pick holds for the same machine and the same `among`.
    """
    key = machine_key()
    candidates = _candidates(among)
    if recorded:
        choice = json.loads(recorded)
        if choice.get("machine") == key and choice.get("codec") in candidates \
                and choice.get("among", _candidates(None)) == candidates:
            return choice
    own = blocks()
    result = measure(own or kv_like_blocks(), root, among=among)
    choice = {"codec": result["recommended"], "machine": key, "measured": time.time(), "why": result["why"],
              "on": f"{len(own)} blocks of the store" if own else "KV-like blocks (the store had none)",
              "estimates": {c: r["wake_GBps_estimate"] for c, r in result["codecs"].items()},
              "among": candidates}
    record(json.dumps(choice, sort_keys=True))
    return choice
