"""codec = "auto": a store measures which codec wakes fastest here, once, and reads every codec whatever it picked."""

from __future__ import annotations

import json

import pytest

from kvwake.store import Store, codecpick
from kvwake.store.format.codec import read_file_header
from testkit.kvdata import BUNDLE, assert_snapshot_exact, write_snapshot

TOKENS = list(range(100, 114))


def codecs_on_disk(store):
    return {read_file_header(p.read_bytes())[0] for p in store.files.blocks.rglob("*.kvb")}


@pytest.mark.parametrize("first, second", [("raw", "planes-zstd"), ("planes-zstd", "raw"), ("zstd", "auto")])
def test_a_store_written_with_one_codec_reads_back_exactly_with_another(tmp_path, first, second):
    with Store(tmp_path / "store", block_tokens=4, codec=first) as store:
        store.register_bundle(BUNDLE, {"model": "test"})
        old = write_snapshot(store, "s1", TOKENS)
    with Store(tmp_path / "store", block_tokens=4, codec=second) as store:
        assert_snapshot_exact(store, old.id)
        new = write_snapshot(store, "s2", [7, *TOKENS])  # other chain keys: every block is written anew
        assert_snapshot_exact(store, new.id)
        assert codecs_on_disk(store) == {first, store.codec}


def test_auto_measures_once_per_machine_records_it_and_says_why(tmp_path, monkeypatch):
    calls = []
    real = codecpick.measure

    def measure(blocks, folder, cores=None, among=None):
        calls.append(len(blocks))
        return real(blocks, folder, cores, among)
    monkeypatch.setattr(codecpick, "measure", measure)
    with Store(tmp_path / "store", block_tokens=4, codec="auto") as store:
        choice = store.codec_choice
        assert store.codec == choice["codec"] and choice["codec"] in {"raw", "planes-zstd", "zstd"}
        assert choice["machine"] == codecpick.machine_key() and "estimated wake" in choice["why"]
        assert set(choice["estimates"]) == {"raw", "planes-zstd", "zstd"} and "KV-like" in choice["on"]
        assert json.loads(store.meta(codecpick.META_KEY)) == choice
        store.register_bundle(BUNDLE, {"model": "test"})
        write_snapshot(store, "s1", TOKENS)
    with Store(tmp_path / "store", block_tokens=4, codec="auto") as store:  # a restart: the recorded pick
        assert store.codec_choice == choice and calls == [4]
    monkeypatch.setattr(codecpick, "machine_key", lambda: "another machine")
    with Store(tmp_path / "store", block_tokens=4, codec="auto") as store:  # moved: measured again, on its blocks
        assert calls == [4, 3] and store.codec_choice["machine"] == "another machine"
        assert store.codec_choice["on"] == "3 blocks of the store"


def test_auto_picks_among_the_codecs_it_is_given_and_measures_again_when_they_change(tmp_path, monkeypatch):
    # On a GPU machine "auto" picked zstd (the smallest files for its cold disk reads), a codec a
    # GPU restore did not stage: a long wake took minutes. The daemon now says which may be
    # picked there (fill.STAGED_CODECS); a pick recorded among others is measured again.
    real = codecpick.measure
    favour_zstd = lambda *a, **k: {**(r := real(*a, **k)), "recommended": "zstd" if "zstd" in r["codecs"]  # noqa: E731
                                   else r["recommended"]}
    monkeypatch.setattr(codecpick, "measure", favour_zstd)
    with Store(tmp_path / "store", block_tokens=4, codec="auto") as store:
        assert store.codec == "zstd" and store.codec_choice["among"] == ["planes-zstd", "raw", "zstd"]
    with Store(tmp_path / "store", block_tokens=4, codec="auto", auto_among=("planes-zstd", "raw")) as store:
        assert store.codec in {"planes-zstd", "raw"}
        assert store.codec_choice["among"] == ["planes-zstd", "raw"] and set(store.codec_choice["estimates"]) == {
            "planes-zstd", "raw"}
        again = store.codec_choice
    with Store(tmp_path / "store", block_tokens=4, codec="auto", auto_among=("planes-zstd", "raw")) as store:
        assert store.codec_choice == again  # the same machine and codecs: the recorded pick


def test_a_daemon_whose_restores_stage_never_picks_a_codec_they_do_not_stage(tmp_path, model_dir):
    from kvwake.daemon.kv.restore_buffers import STAGED_CODECS
    from testkit.daemon import Daemon

    d = Daemon(tmp_path, model_dir, env={"KVWAKE_RESTORE_MODE": "staged"}).start()  # as on a GPU
    try:
        with d.client() as c:
            store = c.call("status")["store"]
    finally:
        assert d.stop() == 0
    assert store["codec"] in STAGED_CODECS and store["codec_choice"]["among"] == sorted(STAGED_CODECS)
    assert store["auto_among"] == list(STAGED_CODECS)  # what `kvwake bench` advises among (test_cli.py)


def test_an_unknown_codec_is_refused_naming_the_known_ones(tmp_path):
    with pytest.raises(Exception, match="unknown block codec 'lz4'; known: auto, planes-zstd, raw, zstd"):
        Store(tmp_path / "store", codec="lz4")
