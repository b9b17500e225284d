"""Tuning knobs: one typed object in Settings, from flags, environment and the config file."""

from __future__ import annotations

import dataclasses

import pytest

from kvwake.daemon.config import Tuning, load_settings


@pytest.fixture
def no_config(tmp_path):
    return tmp_path / "absent.toml"


def test_defaults_are_the_benchmarks_choices(no_config, monkeypatch):
    for f in dataclasses.fields(Tuning):
        monkeypatch.delenv(f"KVWAKE_{f.name.upper()}", raising=False)
    tuning = load_settings({}, no_config).tuning
    assert tuning == Tuning()
    assert tuning.pack_prefill is None and tuning.slice_of_step == 1.0 and tuning.restore_mode is None
    assert (tuning.pool_nice, tuning.renders_at_once, tuning.gil_watch_ms) == (0, None, None)
    assert (tuning.slow_job_ms, tuning.slow_jobs_kept, tuning.gil_watch_kept) == (50.0, 64, 64)


def test_flags_over_environment_over_config_file_field_by_field(tmp_path, monkeypatch):
    config = tmp_path / "config.toml"
    config.write_text('[tuning]\nslice_of_step = 2.0\npool_nice = 3\nrestore_mode = "staged"\n')
    monkeypatch.setenv("KVWAKE_SLICE_OF_STEP", "1.5")
    monkeypatch.setenv("KVWAKE_PACK_PREFILL", "0")  # as the old switch was written
    monkeypatch.setenv("KVWAKE_POOL_NICE", "")  # empty: unset, as before
    tuning = load_settings({"tuning": {"slice_of_step": "0.5", "gil_watch_ms": "2.5"}}, config).tuning
    assert tuning.slice_of_step == 0.5 and tuning.gil_watch_ms == 2.5  # flags
    assert tuning.pack_prefill is False  # environment
    assert tuning.pool_nice == 3 and tuning.restore_mode == "staged"  # config file
    assert tuning.slow_jobs_kept == 64  # default


@pytest.mark.parametrize("where, value, named", [
    ("env", ("KVWAKE_POOL_NICE", "low"), "KVWAKE_POOL_NICE: bad tuning pool_nice='low'"),
    ("env", ("KVWAKE_POOL_NICE", "40"), "0 to 19"),
    ("env", ("KVWAKE_GIL_WATCH_MS", "0"), "KVWAKE_GIL_WATCH_MS: bad tuning gil_watch_ms='0'"),
    ("env", ("KVWAKE_GIL_WATCH_KEPT", "none"), "KVWAKE_GIL_WATCH_KEPT: bad tuning gil_watch_kept='none'"),
    ("env", ("KVWAKE_RESTORE_MODE", "fast"), "restore_mode must be \"direct\" or \"staged\""),
    ("env", ("KVWAKE_PACK_PREFILL", "maybe"), "KVWAKE_PACK_PREFILL: bad tuning pack_prefill='maybe'"),
    ("file", "grow_ahead = false", "[tuning]: unknown tuning 'grow_ahead'"),
    ("file", "pack_prefill = 1", "[tuning]: bad tuning pack_prefill=1"),
    ("file", "renders_at_once = 0", "[tuning]: bad tuning renders_at_once=0"),
    ("flag", {"slice_of_step": "-1"}, "--tune: bad tuning slice_of_step='-1'"),
    ("flag", {"admit_ahead": "0"}, "--tune: unknown tuning 'admit_ahead'"),
])
def test_unknown_names_and_bad_values_are_refused_naming_them(tmp_path, monkeypatch, where, value, named):
    config, flags = tmp_path / "config.toml", {}
    if where == "env":
        monkeypatch.setenv(*value)
    elif where == "file":
        config.write_text(f"[tuning]\n{value}\n")
    else:
        flags = {"tuning": value}
    with pytest.raises(ValueError) as refused:
        load_settings(flags, config)
    assert named in str(refused.value)


def test_a_tuning_that_is_not_a_table_is_refused(tmp_path):
    (tmp_path / "config.toml").write_text('tuning = "fast"\n')
    with pytest.raises(ValueError, match=r"tuning must be a table"):
        load_settings({}, tmp_path / "config.toml")
