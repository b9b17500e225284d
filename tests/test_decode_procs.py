"""Block files decoded in worker processes (tuning decode_processes): the same arrays, the same refusals, and
workers that end with the engine."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from kvwake.daemon.config import Tuning
from kvwake.daemon.model.engine import Engine
from kvwake.daemon.session_state import Session
from kvwake.errors import CorruptBlockError
from kvwake.store import Store
from kvwake.store.decode_procs import DecodeProcs
from kvwake.store.format.codec import BlockFormatError, Tensor, decode_into, encode


def block(seed: int = 0) -> dict[str, Tensor]:
    rng = np.random.default_rng(seed)
    arrays = {f"layers.{i}.{kv}": Tensor("BF16", rng.integers(0, 1 << 16, (1, 2, 16, 8), dtype=np.uint16))
              for i in range(3) for kv in ("keys", "values")}
    arrays["layers.0.quant"] = Tensor("I32", np.array([64, 4], np.int32))  # another dtype after the run
    return arrays


@pytest.fixture
def procs():
    p = DecodeProcs(2)
    yield p
    p.close()


@pytest.mark.parametrize("codec,version", [("planes-zstd", 4), ("planes-zstd", 3), ("raw", 4), ("zstd", 4)])
def test_a_worker_decodes_into_place_what_the_codec_decodes_in_process(procs, tmp_path, codec, version):
    arrays = block()
    encoded = encode(arrays, metadata={"kvwake.key": "k"}, codec=codec, version=version)
    path = tmp_path / "b.kvb"
    path.write_bytes(encoded.data)
    into = np.zeros((1, 2, 32, 8), np.uint16)  # each tensor a strided slice of a larger buffer, as a wake's

    def place(name: str, dtype: str, shape: tuple[int, ...]) -> np.ndarray | None:
        return into[..., 16:, :] if name == "layers.1.values" else None

    tensors, meta, digest = procs.decode(path, encoded.digest, encoded.raw_bytes, place)
    want, want_meta, want_digest = decode_into(encoded.data, max_raw_bytes=encoded.raw_bytes)
    assert (meta, digest) == (want_meta, want_digest) == ({"kvwake.key": "k"}, encoded.digest)
    assert list(tensors) == list(want)
    for name, t in want.items():
        assert tensors[name].dtype == t.dtype and np.array_equal(tensors[name].array, t.array)
    assert np.shares_memory(tensors["layers.1.values"].array, into)
    assert np.array_equal(into[..., 16:, :], arrays["layers.1.values"].array) and not into[..., :16, :].any()


def test_a_worker_refuses_what_the_codec_refuses(procs, tmp_path):
    encoded = encode(block(), codec="planes-zstd")
    path = tmp_path / "b.kvb"
    data = bytearray(encoded.data)
    data[-3] ^= 0x10
    path.write_bytes(bytes(data))
    try:
        decode_into(bytes(data), max_raw_bytes=encoded.raw_bytes)
    except BlockFormatError as exc:
        with pytest.raises(BlockFormatError, match=str(exc)):
            procs.decode(path, encoded.digest, encoded.raw_bytes, None)
    else:  # decoded: the digest tells
        assert procs.decode(path, encoded.digest, encoded.raw_bytes, None)[2] != encoded.digest
    with pytest.raises(BlockFormatError, match="more than the"):
        procs.decode(path, encoded.digest, encoded.raw_bytes - 1, None)
    with pytest.raises(FileNotFoundError):
        procs.decode(tmp_path / "gone.kvb", encoded.digest, encoded.raw_bytes, None)


@pytest.fixture
def engines(model_dir, tmp_path):
    """Two engines on one store: worker processes decoding (2) and the pool's threads (0); KV in buffers (paged,
    CUDA's default, a wake would map its hot twin's pages and read nothing)."""
    store = Store(tmp_path / "store", block_tokens=16)
    made = [Engine(store, tmp_path, model_dir, io_workers=3, io_inflight_bytes=4096, warm=False,
                   tuning=Tuning(restore_mode="direct", decode_processes=n, paged_kv=False)) for n in (2, 0)]
    yield made
    for e in made:
        e.close()
    store.close()


def kv(cache: list, n: int) -> list[np.ndarray]:
    return [np.array(getattr(c, part)[..., :n, :].view(mx.uint16)) for c in cache for part in ("keys", "values")]


def test_a_wake_through_worker_processes_restores_the_same_cache_bit_for_bit(engines, monkeypatch):
    on, off = engines
    assert on.kv.procs is not None and off.kv.procs is None
    asked = []
    real = DecodeProcs.decode
    monkeypatch.setattr(DecodeProcs, "decode", lambda self, *a: asked.append(a[0]) or real(self, *a))
    tokens = [(i * 7) % 256 for i in range(203)]
    hot, slept = Session("a"), Session("b")
    for s in (hot, slept):
        on.append(s, tokens=tokens)
    on.sleep(slept)
    woken, info = on.wake("b")
    assert info["blocks_from_disk"] == len(asked) == 202 // 16  # every block by a worker, the tail in process
    by_threads, _ = off.wake("b")
    for x, y, z in zip(kv(hot.cache, 202), kv(woken.cache, 202), kv(by_threads.cache, 202)):
        assert np.array_equal(x, y) and np.array_equal(y, z)
    from kvwake.daemon.model.generation import GenerateParams
    assert on.generate(woken, GenerateParams(max_tokens=6)).tokens == on.generate(hot, GenerateParams(max_tokens=6)).tokens


def refusal(engine: Engine) -> CorruptBlockError:
    with pytest.raises(CorruptBlockError) as caught:
        engine.wake("s")
    return caught.value


@pytest.mark.parametrize("damage", ["payload", "header digest", "missing"])
def test_a_damaged_block_is_refused_as_the_threads_refuse_it(engines, damage):
    on, off = engines
    s = Session("s")
    on.append(s, tokens=list(range(100)))
    snapshot = on.sleep(s)["snapshot_id"]
    record = on.store.snapshot(snapshot)
    path = on.store.files.absolute(record.blocks[3].file)
    good = path.read_bytes()
    data = bytearray(good)
    if damage == "payload":
        data[-5] ^= 0x40
    elif damage == "header digest":
        data[20] ^= 0x01
    path.write_bytes(bytes(data))
    if damage == "missing":
        path.unlink()
    by_procs, by_threads = refusal(on), refusal(off)
    assert by_procs.message == by_threads.message and by_procs.data == by_threads.data
    assert by_procs.data["block"] == record.blocks[3].key and by_procs.data["session_id"] == "s"
    path.write_bytes(good)
    assert on.wake("s")[0].tokens == list(range(100))  # nothing changed by the failed wake


def test_the_workers_and_their_staging_end_with_the_engine(model_dir, tmp_path):
    store = Store(tmp_path / "store", block_tokens=16)
    engine = Engine(store, tmp_path, model_dir, warm=False, tuning=Tuning(restore_mode="direct", decode_processes=2))
    s = Session("s")
    engine.append(s, tokens=list(range(80)))
    engine.sleep(s)
    engine.wake("s")
    procs = engine.kv.procs
    workers, staging = [w.proc for w in procs._started], [Path(slot.path) for slot in procs._made]
    assert workers and staging and all(w.poll() is None for w in workers) and all(p.exists() for p in staging)
    engine.close()
    store.close()
    assert all(w.poll() is not None for w in workers) and not any(p.exists() for p in staging)
    assert procs.closed


def test_staged_restores_and_the_default_start_no_workers(model_dir, tmp_path):
    store = Store(tmp_path / "store", block_tokens=16)
    made = [Engine(store, tmp_path, model_dir, warm=False, tuning=t)
            for t in (Tuning(), Tuning(restore_mode="staged", decode_processes=2))]
    try:
        assert [e.kv.procs for e in made] == [None, None]
    finally:
        for e in made:
            e.close()
        store.close()
    with pytest.raises(ValueError, match="decode_processes"):
        Tuning(decode_processes=-1)


def test_staging_a_killed_daemon_left_is_removed_by_the_next(tmp_path, monkeypatch):
    from kvwake.store import decode_procs

    monkeypatch.setattr(decode_procs, "_staging_dir", lambda: tmp_path)
    ended = subprocess.Popen([sys.executable, "-c", ""])
    ended.wait()
    dead = ended.pid
    left = tmp_path / f"{decode_procs.PREFIX}{dead}-x"
    left.write_bytes(b"x")
    p = DecodeProcs(1)
    try:
        encoded = encode(block(), codec="raw")
        (tmp_path / "b.kvb").write_bytes(encoded.data)
        p.decode(tmp_path / "b.kvb", encoded.digest, encoded.raw_bytes, None)
        assert not left.exists()
    finally:
        p.close()
    assert not list(tmp_path.glob(f"{decode_procs.PREFIX}*"))


def decode_workers(parent: int) -> list[int]:
    """Pids of the decode worker processes whose parent is `parent` (from /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmdline = (entry / "cmdline").read_bytes()
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        if ppid == parent and b"kvwake.store.decode_worker" in cmdline:
            found.append(int(entry.name))
    return found


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads a process's children from Linux's /proc")
def test_a_real_daemon_wakes_through_worker_processes_exactly_and_its_workers_go_when_it_is_killed(model_dir, tmp_path):
    import signal
    import time

    from testkit.daemon import Daemon

    # direct restores, as the engine tests above: the workers decode for those alone (a GPU's default is staged);
    # out of pages whatever the default: a paged wake maps the blocks its hot twin holds and reads none
    d = Daemon(tmp_path, model_dir, extra=["--tune", "decode_processes=2", "--tune", "restore_mode=direct",
                                           "--tune", "paged_kv=false"]).start()
    try:
        text = "a long document about the harbour and its ships. " * 30
        with d.client() as c:
            for sid in ("slept", "never"):
                c.call("session.create", session_id=sid)
                c.call("session.append", session_id=sid, text=text)
            c.call("session.sleep", session_id="slept")
            woken = c.call("session.wake", session_id="slept")
            assert woken["blocks_from_disk"] > 0, woken
            assert c.call("status")["tuning"]["decode_processes"] == 2
            replies = [c.call("session.generate", session_id=sid, max_tokens=12, temperature=0)["tokens"]
                       for sid in ("slept", "never")]
        assert replies[0] == replies[1]  # woken through the workers, as if never slept
        workers = decode_workers(d.proc.pid)
        assert len(workers) == 2, workers
    finally:
        d.stop(signal.SIGKILL)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(Path(f"/proc/{pid}").exists() and
                                               b"decode_worker" in Path(f"/proc/{pid}/cmdline").read_bytes()
                                               for pid in workers):
        time.sleep(0.1)
    assert not [pid for pid in workers if Path(f"/proc/{pid}").exists()
                and b"decode_worker" in Path(f"/proc/{pid}/cmdline").read_bytes()], "workers outlived the daemon"
