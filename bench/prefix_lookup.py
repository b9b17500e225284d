"""What the token-granular prefix lookup costs on a store with many blocks and tails.

usage: python bench/prefix_lookup.py [--blocks 200000] [--tails 20000] [--block-tokens 128] [--runs 200]

Fills an index (rows only: the lookup reads no block files) with --blocks block rows: half
of them children of the root (every session's first block, all sharing a 3-token chat
opening), the rest in chains under them, and one popular parent with 2,000 children;
plus --tails snapshot tails, 2,000 of them under the popular parent. Then times, per
request of 200 + 50 tokens (median of --runs, in ms): `longest_prefix` (what every
fresh-cache append paid before), `prefix_hit` (longest_prefix and the children
statement), and the children statement alone, for a request under the root and one
under the popular parent. Results: <out>/prefix-lookup.json.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.append(str(ROOT))

from kvwake.store import ROOT_KEY, Store, block_key  # noqa: E402
from kvwake.store.format.keys import tokens_to_bytes  # noqa: E402
from kvwake.store.reuse import partial_candidate  # noqa: E402

BUNDLE = "ab" * 32
OPENING = [1, 9, 5]  # the chat template's opening every prompt shares


def tokens(rng: random.Random, n: int) -> list[int]:
    return OPENING + [rng.randrange(49152) for _ in range(n - len(OPENING))]


def fill(store: Store, n_blocks: int, n_tails: int, rng: random.Random) -> str:
    """Rows for the index; returns the popular parent's key."""
    b, now = store.block_tokens, time.time()
    rows, parents = [], [ROOT_KEY]
    popular = block_key(ROOT_KEY, BUNDLE, tokens(rng, b))
    for i in range(n_blocks):
        parent = popular if i < 2000 else (ROOT_KEY if i % 2 else rng.choice(parents))
        ids = tokens(rng, b) if parent == ROOT_KEY else [rng.randrange(49152) for _ in range(b)]
        key = block_key(parent, BUNDLE, ids)
        parents.append(key) if len(parents) < 10000 else None
        rows.append((key, parent, BUNDLE, tokens_to_bytes(ids), b, "0" * 64, "planes-zstd", 1, 1, "f", now, now))
    rows.append((popular, ROOT_KEY, BUNDLE, tokens_to_bytes(tokens(rng, b)), b, "0" * 64, "planes-zstd", 1, 1, "f",
                 now, now))
    with store.index.write() as db:
        db.conn.executemany("INSERT OR IGNORE INTO blocks (key, parent, bundle, token_ids, n_tokens, digest, codec,"
                            " raw_bytes, stored_bytes, file, created, last_used) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)", rows)
        db.execute("INSERT INTO sessions (id, created, updated) VALUES ('s', ?, ?)", (now, now))
        db.conn.executemany(
            "INSERT INTO snapshots (id, session_id, bundle, token_ids, n_tokens, tail_file, digest, created,"
            " tail_parent, tail_tokens) VALUES (?, 's', ?, x'', 0, 't', '', ?, ?, ?)",
            [(f"snap{i}", BUNDLE, now, popular if i < 2000 else ROOT_KEY,
              tokens_to_bytes(tokens(rng, rng.randrange(4, b)))) for i in range(n_tails)])
    return popular


def median_ms(fn, runs: int) -> float:
    times = []
    for _ in range(runs):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1000)
    return round(statistics.median(times), 3)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--blocks", type=int, default=200_000)
    ap.add_argument("--tails", type=int, default=20_000)
    ap.add_argument("--block-tokens", type=int, default=128)
    ap.add_argument("--runs", type=int, default=200)
    ap.add_argument("--out", default=str(ROOT / "bench" / "out"))
    args = ap.parse_args()
    rng = random.Random(0)
    with tempfile.TemporaryDirectory() as tmp, Store(tmp, block_tokens=args.block_tokens) as store:
        store.register_bundle(BUNDLE, {"bench": True})
        popular = fill(store, args.blocks, args.tails, rng)
        request = tokens(rng, 250)
        result = {"blocks": args.blocks, "tails": args.tails, "block_tokens": args.block_tokens,
                  "longest_prefix_ms": median_ms(lambda: store.longest_prefix(BUNDLE, request), args.runs),
                  "prefix_hit_ms": median_ms(lambda: store.prefix_hit(BUNDLE, request), args.runs),
                  "children_root_ms": median_ms(lambda: partial_candidate(store, BUNDLE, ROOT_KEY, request, 1),
                                                args.runs),
                  "children_popular_ms": median_ms(lambda: partial_candidate(store, BUNDLE, popular, request, 1),
                                                   args.runs)}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    (Path(args.out) / "prefix-lookup.json").write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
