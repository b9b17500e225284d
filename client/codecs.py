"""Which block codec wins on this machine: `kvwake bench` measures it on the daemon's own blocks.

For each codec, on up to `sample` real block files from the store: the ratio,
encode and verified-decode speed on one core, and this disk's write (with
fsync) and cold read speed for the bytes that codec would store (the page
cache is dropped for the file with posix_fadvise before it is read back).
A wake runs at about min(cores x decode, disk read / stored fraction) and a
sleep at min(cores x encode, disk write / stored fraction); the codec with the
faster wake is recommended, the smaller one on a tie (within 10%).
"""

from __future__ import annotations

import os
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["codec_advice"]


def _disk(folder: Path, data: bytes) -> tuple[float, float]:
    """(write+fsync GB/s, cold read GB/s) for `data` written to a temporary file in `folder`."""
    from kvwake.store.files import sync  # the store's own sync (F_FULLFSYNC on macOS); loaded when measuring

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


def codec_advice(store_root: str | Path, *, sample: int = 8, cores: int | None = None) -> dict[str, Any]:
    """Measure every codec on real blocks of the store at `store_root`; returns the numbers and a pick."""
    from kvwake.store.format.codec import CODECS, decode, encode

    root = Path(store_root)
    files = sorted((root / "blocks").glob("*/*.kvb"))[:sample]
    if not files:
        return {"blocks": 0, "recommended": None, "why": "the store holds no blocks yet"}
    blocks = [decode(f.read_bytes())[0] for f in files]
    raw = sum(t.array.nbytes for b in blocks for t in b.values())
    cores = cores or os.cpu_count() or 1
    out: dict[str, Any] = {"blocks": len(blocks), "raw_bytes": raw, "cores": cores, "codecs": {}}
    for codec in sorted(CODECS.values()):
        t0 = time.perf_counter()
        encoded = [encode(b, codec=codec).data for b in blocks]
        enc = raw / (time.perf_counter() - t0) / 1e9
        t0 = time.perf_counter()
        for data in encoded:
            decode(data)
        dec = raw / (time.perf_counter() - t0) / 1e9
        stored = sum(map(len, encoded))
        write, read = _disk(root, b"".join(encoded))
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
