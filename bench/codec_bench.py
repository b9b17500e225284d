"""Codec benchmark on real KV: ratio and MB/s of kvwake's codecs against plain zstd and raw.

usage: python bench/codec_bench.py KV.npz [--block-tokens 128] [--json OUT]

KV.npz comes from bench/capture_kv.py (bf16 KV of the default model as uint16
arrays `layers.{i}.keys` / `layers.{i}.values`, shape [1, heads, tokens, dim]).
The KV is cut into blocks of --block-tokens tokens exactly as the store cuts
them (one block = every layer's keys and values for those tokens). Speeds are
single-threaded. "decode" includes verifying the BLAKE3 digest (block format
2), as every store read does; "decode (no digest)" is the codec alone. The
digests themselves are timed on the same bytes (sha256, BLAKE3, and xxh3-128
when the xxhash package is installed).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import platform
import time

import blake3
import numpy as np
import zstandard

from kvwake.store.format.codec import Tensor, decode, encode, payload


def blocks_of(path: str, block_tokens: int) -> list[dict[str, Tensor]]:
    kv = np.load(path)
    names = sorted((n for n in kv.files if n.startswith("layers.")), key=lambda n: (int(n.split(".")[1]), n))
    arrays = {n: kv[n] for n in names}
    tokens = next(iter(arrays.values())).shape[2]
    return [
        {n: Tensor("BF16", np.ascontiguousarray(a[:, :, s : s + block_tokens, :])) for n, a in arrays.items()}
        for s in range(0, tokens - block_tokens + 1, block_tokens)
    ]


def timed(fn, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def run(path: str, block_tokens: int, repeat: int = 3) -> dict:
    blocks = blocks_of(path, block_tokens)
    payloads = [payload(b) for b in blocks]
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
    results["sha256"] = {"MBps": raw / timed(lambda: [hashlib.sha256(p).digest() for p in payloads], repeat) / 1e6}
    results["blake3"] = {"MBps": raw / timed(lambda: [blake3.blake3(p).digest() for p in payloads], repeat) / 1e6}
    try:
        import xxhash

        results["xxh3-128"] = {"MBps": raw / timed(lambda: [xxhash.xxh3_128(p).digest() for p in payloads], repeat) / 1e6}
    except ImportError:
        pass
    for codec in ("zstd", "planes-zstd", "raw"):
        files = [encode(b, codec=codec).data for b in blocks]
        results[f"kvwake {codec}"] = {
            "ratio": raw / sum(map(len, files)),
            "encode_MBps": raw / timed(lambda: [encode(b, codec=codec) for b in blocks], repeat) / 1e6,
            "decode_MBps": raw / timed(lambda: [decode(f) for f in files], repeat) / 1e6,
            "decode_no_digest_MBps": raw / timed(lambda: [decode(f, digest=False) for f in files], repeat) / 1e6,
        }
    return {"kv_file": path, "blocks": len(blocks), "block_tokens": block_tokens, "raw_bytes": raw,
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip(), "results": results}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("kv")
    parser.add_argument("--block-tokens", type=int, default=128)
    parser.add_argument("--json")
    args = parser.parse_args()
    report = run(args.kv, args.block_tokens)
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
