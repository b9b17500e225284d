"""A first start's bundle hash, the way before against the way now, in one run (issue 50, point 5).

usage: python bench/bundle_hash.py [--shards 4] [--gb 4] [--repeat 2] [--dir /tmp] [--model PATH] [--json OUT]

A synthetic model folder (`--gb` of weights cut into `--shards` files, the usual small files) is made
under `--dir` and deleted at the end. The digest cache is empty before every timed run, as on a first
start, and the files are either dropped from the page cache ("cold": posix_fadvise DONTNEED after their
writes are synced, a cold read without root) or read into it first ("cached": the case of a disk faster
than one core's sha256). With --model, the rows are timed on that model folder instead (kept). Rows, per layout (the shards, then the same bytes as one file) and cache state:

- sequential: every file's sha256 one after another on the caller's thread (the first format's code).
- parallel: `describe_bundle` as it is now (start_digests: one file per thread, the largest first).
- load: the files read once end to end, as a weights load reads them (no hashing): the disk's floor.
- load+sequential: that load, then the sequential hash (how a first start ran).
- load+started: the digests started, the same load on the caller's thread, then joined (how it runs now).
- chunked-N-MiB: what one file's digest could cost split into chunks hashed on every core (a different
  hash of each file, not the bundle's): the floor a new per-file scheme would reach.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kvwake.daemon.kv.bundle import describe_bundle, start_digests  # noqa: E402
from kvwake.daemon.kv.digests import READ_BYTES  # noqa: E402

ARGS = dict(kv_layout=[{"kind": "kv", "kv_heads": 8, "k_head_dim": 128, "v_head_dim": 128, "dtype": "bfloat16",
                        "window": None}] * 32, block_tokens=128, codec="planes-zstd+kvstate1", codec_version=1)
WRITE_BYTES = 64 << 20



def make_folder(folder: Path, shards: int, total: int) -> None:
    folder.mkdir(parents=True)
    block = os.urandom(WRITE_BYTES)
    for i in range(shards):
        with open(folder / f"model-{i + 1:05d}-of-{shards:05d}.safetensors", "wb") as f:
            left = total // shards
            while left > 0:
                f.write(block[:min(left, WRITE_BYTES)])
                left -= WRITE_BYTES
            f.flush()
            os.fsync(f.fileno())
    (folder / "config.json").write_text('{"model_type": "llama"}')
    (folder / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    (folder / "tokenizer_config.json").write_text('{"chat_template": "{{ messages }}"}')
    past = time.time_ns() - 3600 * 10**9  # past the digest cache's racy window
    for p in folder.iterdir():
        os.utime(p, ns=(past, past))


def evict(folder: Path) -> None:
    """Drop the folder's files from the page cache (symlinks followed)."""
    for p in (p for p in folder.iterdir() if p.is_file()):
        fd = os.open(p, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def sequential(folder: Path) -> str:
    """The first format's way: each counted file's sha256 in turn, on this thread."""
    digests = {}
    for p in sorted(p for p in folder.iterdir() if p.is_file()):
        with open(p, "rb") as f:
            digests[p.name] = hashlib.file_digest(f, "sha256").hexdigest()
    return hashlib.sha256(json.dumps(digests, sort_keys=True).encode()).hexdigest()


def load(folder: Path) -> None:
    buffer = bytearray(READ_BYTES)
    for p in sorted(folder.glob("*.safetensors")):
        with open(p, "rb", buffering=0) as f:
            while f.readinto(buffer):
                pass


def started(folder: Path, cache: Path) -> str:
    digests = start_digests(folder, digest_cache=cache)
    load(folder)
    return describe_bundle(folder, **ARGS, digests=digests).hash


def chunked(folder: Path, chunk: int) -> str:
    """sha256 over the sha256 of each `chunk` bytes of every file, chunks hashed on every core (each thread
    reads READ_BYTES at a time into its own buffer, as the digests now do)."""
    local = threading.local()

    def one(job: tuple[Path, int, int]) -> bytes:
        path, start, end = job
        if not hasattr(local, "view"):
            local.view = memoryview(bytearray(READ_BYTES))
        digest = hashlib.sha256()
        with open(path, "rb", buffering=0) as f:
            while start < end and (n := os.preadv(f.fileno(), [local.view[:min(READ_BYTES, end - start)]], start)):
                digest.update(local.view[:n])
                start += n
        return digest.digest()

    jobs = [(p, o, min(o + chunk, p.stat().st_size))
            for p in sorted(folder.glob("*.safetensors")) for o in range(0, p.stat().st_size, chunk)]
    with ThreadPoolExecutor(os.cpu_count()) as pool:
        return hashlib.sha256(b"".join(pool.map(one, jobs))).hexdigest()


def timed(name: str, folder: Path, run, gb: float, repeat: int, cold: bool) -> dict:  # noqa: ANN001
    times = []
    for _ in range(repeat):
        evict(folder) if cold else load(folder)
        with tempfile.TemporaryDirectory() as scratch:  # a new digest cache, out of the model's folder
            t0 = time.perf_counter()
            run(Path(scratch) / "digests.json")
            times.append(time.perf_counter() - t0)
    row = {"row": name, "s": [round(t, 2) for t in times], "GB/s": round(gb / min(times), 2)}
    print(f"  {name:<16} {' '.join(f'{t:6.2f}' for t in times)} s   {row['GB/s']:.2f} GB/s (best)", flush=True)
    return row


def layout_rows(folder: Path, gb: float, repeat: int, cold: bool) -> list[dict]:
    runs = {
        "sequential": lambda c: sequential(folder),
        "parallel": lambda c: describe_bundle(folder, **ARGS, digest_cache=c),
        "load": lambda c: load(folder),
        "load+sequential": lambda c: (load(folder), sequential(folder)),
        "load+started": lambda c: started(folder, c),
        "chunked-64-MiB": lambda c: chunked(folder, 64 << 20),
    }
    return [timed(name, folder, run, gb, repeat, cold) for name, run in runs.items()]


def measure_model(folder: Path, repeat: int, json_out: str | None) -> None:
    gb = sum(p.stat().st_size for p in folder.glob("*.safetensors")) / 1e9
    out = {"cores": os.cpu_count(), "gb": gb, "model": str(folder), "layouts": {}}
    for cold in (True, False):
        state = "cold" if cold else "cached"
        print(f"{folder.name}: {gb:.2f} GB of weights, {state}, {os.cpu_count()} cores:", flush=True)
        out["layouts"][state] = layout_rows(folder, gb, repeat, cold)
    if json_out:
        Path(json_out).write_text(json.dumps(out, indent=1))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shards", type=int, default=4)
    ap.add_argument("--gb", type=float, default=4.0)
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--dir", default=tempfile.gettempdir())
    ap.add_argument("--model", help="an existing model folder, timed as it is")
    ap.add_argument("--json")
    args = ap.parse_args()
    if args.model:
        return measure_model(Path(args.model).expanduser().resolve(), args.repeat, args.json)
    total = int(args.gb * (1 << 30))
    work = Path(tempfile.mkdtemp(prefix="kvwake-bundle-hash-", dir=args.dir))
    out = {"cores": os.cpu_count(), "gb": args.gb, "layouts": {}}
    try:
        for shards in dict.fromkeys((args.shards, 1)):
            folder = work / f"{shards}-shards"
            make_folder(folder, shards, total)
            for cold in (True, False):
                state = "cold" if cold else "cached"
                print(f"{shards} file(s), {args.gb:g} GiB of weights, {state}, {os.cpu_count()} cores:", flush=True)
                out["layouts"][f"{shards} files, {state}"] = layout_rows(folder, total / 1e9, args.repeat, cold)
            shutil.rmtree(folder)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
