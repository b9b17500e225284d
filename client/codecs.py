"""Which block codec wins on this machine: `kvwake bench` measures it on the daemon's own blocks.

The measurement is the store's (kvwake.store.codecpick, which a store opened
with codec="auto" also runs); this reads up to `sample` real block files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

__all__ = ["codec_advice"]


def codec_advice(store_root: str | Path, *, sample: int = 8, cores: int | None = None,
                 among: list[str] | None = None) -> dict[str, Any]:
    """Measure every codec (or those `among`: what the daemon's restores stage, its status says) on real
    blocks of the store at `store_root`; returns the numbers and a pick."""
    from kvwake.store.codecpick import measure
    from kvwake.store.format.codec import decode

    root = Path(store_root)
    files = sorted((root / "blocks").glob("*/*.kvb"))[:sample]
    if not files:
        return {"blocks": 0, "recommended": None, "why": "the store holds no blocks yet"}
    return measure([decode(f.read_bytes())[0] for f in files], root, cores, tuple(among) if among else None)
