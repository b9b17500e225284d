"""Codec benchmark on real KV: ratio and single-core speed of kvwake's codecs against plain zstd and raw.

usage: python bench/codec_bench.py KV.npz [--block-tokens 128] [--repeat 5] [--json OUT]

KV.npz comes from bench/capture_kv.py (bf16 KV of the default model as uint16
arrays `layers.{i}.keys` / `layers.{i}.values`, shape [1, heads, tokens, dim]).
The KV is cut into blocks of --block-tokens tokens exactly as the store cuts
them (one block = every layer's keys and values for those tokens, with the
metadata a store writes). Speeds are one thread's CPU time (`time.thread_time`,
best of --repeat), so a machine shared with other work still measures its core.
"decode" is a verified read into strided places of larger KV buffers, as a wake
does: the digest checked, as every store read does; "decode (no digest)" is the
codec alone; "decode (format 3)" and "(format 2)" read the same blocks written in
the block formats before (format 3: rotated planes; format 2: BLAKE3 section
digests too), in the same rounds, alternated with format 4's. The digests
themselves are timed on the same bytes (sha256, BLAKE3, xxh3-128).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import time

import blake3
import numpy as np
import xxhash
import zstandard

from kvwake.store.format.codec import Tensor, decode_into, encode, payload


def blocks_of(path: str, block_tokens: int) -> list[dict[str, Tensor]]:
    kv = np.load(path)
    names = sorted((n for n in kv.files if n.startswith("layers.")), key=lambda n: (int(n.split(".")[1]), n))
    arrays = {n: kv[n] for n in names}
    tokens = next(iter(arrays.values())).shape[2]
    return [
        {n: Tensor("BF16", np.ascontiguousarray(a[:, :, s : s + block_tokens, :])) for n, a in arrays.items()}
        for s in range(0, tokens - block_tokens + 1, block_tokens)
    ]


def metadata(i: int, block_tokens: int) -> dict[str, str]:
    """What a store writes into block i's header (store/writer.py), with made-up keys."""
    return {"kvwake.kind": "block", "kvwake.key": f"{i:064x}", "kvwake.bundle": "b0" * 32,
            "kvwake.tokens": str(block_tokens)}


def timed(fn, repeat: int) -> float:
    """fn's best time in this thread's CPU seconds."""
    best = float("inf")
    for _ in range(repeat):
        start = time.thread_time()
        fn()
        best = min(best, time.thread_time() - start)
    return best


def into_place(blocks: list[dict[str, Tensor]], block_tokens: int):
    """A `place` for decode_into: each block's slice of KV buffers four blocks long (a wake's layout)."""
    buffers = {n: np.zeros((*t.array.shape[:-2], 4 * block_tokens, t.array.shape[-1]), t.array.dtype)
               for n, t in blocks[0].items()}
    return lambda name, dtype, shape: buffers[name][..., block_tokens : 2 * block_tokens, :]


def decodes(files: dict[str, list[bytes]], place, repeat: int) -> dict[str, float]:
    """Best seconds to decode each set of files into place, the sets' rounds alternated."""
    best = dict.fromkeys(files, float("inf"))
    for _ in range(repeat):
        for name, group in files.items():
            digest = not name.endswith("no digest")
            best[name] = min(best[name], timed(lambda: [decode_into(f, place, digest=digest) for f in group], 1))
    return best


def run(path: str, block_tokens: int, repeat: int = 5) -> dict:
    blocks = blocks_of(path, block_tokens)
    payloads = [payload(b, metadata=metadata(i, block_tokens)) for i, b in enumerate(blocks)]
    raw = sum(len(p) for p in payloads)
    results = {"raw": {"ratio": 1.0, "bytes": raw}}
    plain = zstandard.ZstdCompressor(level=3)
    packed = [plain.compress(p) for p in payloads]
    dctx = zstandard.ZstdDecompressor()
    results["zstd-3 (whole payload)"] = {
        "ratio": raw / sum(map(len, packed)),
        "encode_MBps": raw / timed(lambda: [plain.compress(p) for p in payloads], repeat) / 1e6,
        "decode_MBps": raw / timed(lambda: [dctx.decompress(p) for p in packed], repeat) / 1e6,
    }
    for name, fn in (("sha256", lambda p: hashlib.sha256(p).digest()), ("blake3", lambda p: blake3.blake3(p).digest()),
                     ("xxh3-128", lambda p: xxhash.xxh3_128(p).digest())):
        results[name] = {"MBps": raw / timed(lambda: [fn(p) for p in payloads], repeat) / 1e6}
    place = into_place(blocks, block_tokens)
    for codec in ("zstd", "planes-zstd", "raw"):
        def written(version: int) -> list[bytes]:
            return [encode(b, metadata=metadata(i, block_tokens), codec=codec, version=version).data
                    for i, b in enumerate(blocks)]
        files = written(4)
        best = decodes({"decode": files, "decode (no digest)": files, "decode (format 3)": written(3),
                        "decode (format 2)": written(2)}, place, repeat)
        results[f"kvwake {codec}"] = {
            "ratio": raw / sum(map(len, files)),
            "encode_MBps": raw / timed(lambda: [encode(b, codec=codec) for b in blocks], repeat) / 1e6,
            "decode_MBps": raw / best["decode"] / 1e6,
            "decode_no_digest_MBps": raw / best["decode (no digest)"] / 1e6,
            "decode_format_3_MBps": raw / best["decode (format 3)"] / 1e6,
            "decode_format_2_MBps": raw / best["decode (format 2)"] / 1e6,
        }
    return {"kv_file": path, "blocks": len(blocks), "block_tokens": block_tokens, "raw_bytes": raw,
            "clock": "thread CPU time, best of repeat",
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kv")
    parser.add_argument("--block-tokens", type=int, default=128)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json")
    args = parser.parse_args()
    report = run(args.kv, args.block_tokens, args.repeat)
    base = report["results"]["zstd-3 (whole payload)"]["ratio"]
    print(f"{report['blocks']} blocks of {args.block_tokens} tokens, {report['raw_bytes'] / 1e6:.1f} MB raw")
    for name, r in report["results"].items():
        cells = [f"{k}={v:,.3f}" if k == "ratio" else f"{k}={v:,.0f}" for k, v in r.items() if k != "bytes"]
        extra = f"  ({r['ratio'] / base:.3f}x plain zstd's ratio)" if "ratio" in r and name.startswith("kvwake") else ""
        print(f"  {name:24s} " + "  ".join(cells) + extra)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()
