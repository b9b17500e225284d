"""The warmer that fills MLX's kernel cache for a model while the weights load (daemon/model/kernel_cache.py).

Here on the CPU the warmer's child runs the same work it runs on CUDA (the miniature's prefill and decode
step, a batch's compaction), so a model kind it cannot build fails here, not at a GPU machine's start; what
it saves there (compiles taken off a first start and off a round's decode step) is measured on the GPU
machine (docs/benchmarks.md, "fleet").
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import mlx.core as mx
import pytest

from kvwake.daemon.model import kernel_cache, path_costs
from testkit.tinymodel import make_model_dir


@pytest.fixture(autouse=True)
def rows_built_here():
    """Each test's row kernels built by its own `ragged_decode.build` (the process keeps what it built)."""
    saved = dict(kernel_cache._rows)
    kernel_cache._rows.clear()
    yield
    kernel_cache._rows.clear()
    kernel_cache._rows.update(saved)


@pytest.fixture(autouse=True)
def own_disk_cache(tmp_path, monkeypatch):
    """Each test's MLX disk cache a folder of its own, empty, its warmers' notes with it: the suite's process may
    have one set already (`keep_compiled_kernels`, from an engine made as on CUDA), where other tests' warmers noted
    the session's tiny model done, and a test counting warmers found none (CI)."""
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "own-ptx"))


@pytest.mark.parametrize("arch, dtype, name", [
    ("llama", mx.bfloat16, "bfloat16"), ("gemma3_text", mx.float16, "float16"), ("lfm2", mx.bfloat16, "bfloat16"),
                                               ("llama", mx.float32, "float32")])
def test_the_warmer_builds_the_models_miniature_in_its_dtype_and_exits_cleanly(tmp_path, arch, dtype, name):
    model = make_model_dir(tmp_path / arch, arch=arch, dtype=dtype)
    assert kernel_cache.weights_dtype(model) == name
    config = kernel_cache.miniature(json.loads((model / "config.json").read_text()))
    assert (config["num_attention_heads"], config["num_key_value_heads"], config["vocab_size"]) == (2, 1, 256)
    warmer = kernel_cache.Warmer(model)
    assert [p.args[:3] + p.args[4:] for p in warmer.procs] == [
        [sys.executable, "-m", "kvwake.daemon.model.kernel_cache", part] for part in kernel_cache.PARTS]
    assert warmer.wait(timeout=120) is True
    assert warmer.wait() is False  # waited for once: nothing left to wait for


# float32 on CUDA: the masked and the causal fused kernels round apart by about 1e-3 (docs/benchmarks.md)
@pytest.mark.parametrize("dtype, tol", [(mx.float32, 1e-5 if mx.default_device() == mx.cpu else 2e-3),
                                        (mx.bfloat16, 2e-2)])
def test_the_warmers_padded_chunk_is_the_padded_path_and_agrees_with_the_chunk_at_its_own_shape(monkeypatch, dtype,
                                                                                               tol):
    """The forward part also runs a chunk the way a pack pads it (its kernels compiled before a round needs them):
    through `padded_attention`, at a key bucket longer than its keys, and equal to the chunk at its own shape."""
    from kvwake.daemon.model import attention

    seen = []
    bucketed = attention._bucketed
    monkeypatch.setattr(attention, "_bucketed", lambda q, k, *rest: seen.append((q.shape, k.shape)) or
                        bucketed(q, k, *rest))
    padded, own = kernel_cache.padded_chunk(dtype, 64, mx.random.key(3))
    n = attention.PLAIN_MAX_QUERIES + 1
    assert seen == [((1, 2, n, 64), (1, 1, attention.key_bucket(n + 8), 64))] and attention.key_bucket(n + 8) > n + 8
    assert padded.shape == own.shape == (1, 2, n, 64) and padded.dtype == dtype
    assert mx.abs(padded.astype(mx.float32) - own.astype(mx.float32)).max().item() < tol


@pytest.mark.parametrize("arch, pads", [("llama", True), ("lfm2", False)])
def test_the_warmers_forward_part_pads_a_chunk_for_a_model_whose_packs_pad_only(tmp_path, monkeypatch, arch, pads):
    """The forward part (run here in process, as its child runs it) compiles the padded path only where a pack's
    rows pad (packing.packable_model: llama's kind yes, lfm2's no)."""
    from kvwake.daemon import imports

    padded = []
    monkeypatch.setattr(imports, "lighten_imports", lambda: None)  # the child's cut, not this test process's
    monkeypatch.setattr(kernel_cache, "padded_chunk", lambda *a: padded.append(a) or mx.zeros((1,)))
    kernel_cache._warm(make_model_dir(tmp_path / arch, arch=arch), "forward")
    assert len(padded) == (1 if pads else 0)


def test_a_paged_engines_warmers_run_its_prefill_and_decode_over_pages_too(tmp_path, monkeypatch):
    """A paged engine's pool writes, gathers and page copies are kernels of their own: its warmers run the miniature
    over a pool of pages as well (a part of its own, where pages are asked for or, unset, guessed from the config:
    plain attention only), so a paged daemon's first turns do not compile them."""
    from kvwake.daemon import imports
    from kvwake.daemon.kv import paged_cache
    from kvwake.daemon.kv.pages import PagePool

    monkeypatch.setattr(imports, "lighten_imports", lambda: None)  # the child's cut, not this test process's
    seen: list[str] = []

    def watched(cls, name, kind):
        real = getattr(cls, name)
        monkeypatch.setattr(cls, name, lambda self, *a, **k: seen.append(kind(a)) or real(self, *a, **k))

    watched(PagePool, "write", lambda a: "write a run" if isinstance(a[1], int) else "scatter")
    watched(PagePool, "_copy", lambda a: "page copied")
    watched(paged_cache.PagedKVCache, "_gathered", lambda a: "gathered")
    llama, lfm2 = (make_model_dir(tmp_path / arch, arch=arch) for arch in ("llama", "lfm2"))
    kernel_cache._warm(llama, kernel_cache.PAGED_PART)  # in process, as its child runs it
    assert {"write a run", "scatter", "page copied", "gathered"} <= set(seen), seen
    seen.clear()
    kernel_cache._warm(lfm2, kernel_cache.PAGED_PART)  # a hybrid asked for pages: its attention layers paged
    assert "write a run" in seen and "scatter" in seen, seen
    monkeypatch.setattr(kernel_cache, "_done", {})
    monkeypatch.setattr(kernel_cache, "_early", {})
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)  # as on CUDA: the warmers start early
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))

    def fresh() -> None:  # a new process on a machine whose cache is empty: none done, none noted
        kernel_cache._done.clear()
        shutil.rmtree(tmp_path / "ptx" / kernel_cache.NOTES_DIR, ignore_errors=True)
    # which parts start (each child a process that exits at once: on a GPU the real ones compile for minutes
    # beside the suite; the parts themselves ran above, and the other tests here run whole warmers)
    monkeypatch.setattr(kernel_cache.Warmer, "_start",
                        lambda self, part: subprocess.Popen([sys.executable, "-c", "pass", part], stderr=subprocess.PIPE))
    paged = kernel_cache.PARTS + ("paged",)
    for path, pages, parts in ((llama, False, kernel_cache.PARTS), (llama, None, paged), (lfm2, None, kernel_cache.PARTS),
                               (lfm2, True, paged)):
        assert kernel_cache.start_early(str(path), paged=pages)
        warmer = kernel_cache._early.pop(path.resolve())
        assert [p.args[-1] for p in warmer.procs] == list(parts) == list(warmer.parts), (path.name, pages)
        assert warmer.wait(timeout=120) is True, (path.name, pages)
        fresh()
    # By the parts done: a folder warmed for an engine over buffers, then one over pages (a bench's second engine)
    # warms the paged part alone; then neither starts any
    first = kernel_cache.Warmer.for_model(llama)
    assert first.parts == kernel_cache.PARTS and first.wait(timeout=120)
    second = kernel_cache.Warmer.for_model(llama, paged=True)
    assert second.parts == ("paged",) and second.wait(timeout=120)
    assert kernel_cache.Warmer.for_model(llama) is None and kernel_cache.Warmer.for_model(llama, paged=True) is None
    assert kernel_cache.start_early(str(llama), paged=True) and kernel_cache._early == {}  # none started early
    fresh()  # early warmers for buffers, then an engine over pages: new ones, the paged part too
    assert kernel_cache.start_early(str(llama), paged=False)
    early = kernel_cache._early[llama.resolve()]
    third = kernel_cache.Warmer.for_model(llama, paged=True)
    assert third is not early and early.stopped and third.parts == paged and third.wait(timeout=120)


def test_a_machine_whose_cache_its_warmers_filled_starts_none_again_until_the_model_or_cache_changes(
        tmp_path, monkeypatch):
    # Were: each new process started every warmer again, a child importing MLX and making a CUDA context for
    # kernels already in MLX's disk cache, which a small model's engine then waited for before its first pass
    monkeypatch.setattr(kernel_cache, "_done", {})
    monkeypatch.setattr(kernel_cache.Warmer, "_start",  # children that exit at once, as in the test above
                        lambda self, part: subprocess.Popen([sys.executable, "-c", "pass", part],
                                                            stderr=subprocess.PIPE))
    ptx = tmp_path / "ptx"
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(ptx))
    llama = make_model_dir(tmp_path / "llama")
    twin = make_model_dir(tmp_path / "twin")  # another folder of the same config and dtype: the same kernels
    first = kernel_cache.Warmer.for_model(llama, paged=True)
    assert first.parts == kernel_cache.PARTS + ("paged",) and first.wait(timeout=120)
    assert len(list((ptx / kernel_cache.NOTES_DIR).iterdir())) == 3
    kernel_cache._done.clear()  # a later process on this machine
    assert kernel_cache.Warmer.for_model(llama, paged=True) is None and kernel_cache.Warmer.for_model(twin) is None
    config = json.loads((llama / "config.json").read_text())
    (llama / "config.json").write_text(json.dumps({**config, "num_hidden_layers": config["num_hidden_layers"] + 1}))
    changed = kernel_cache.Warmer.for_model(llama)  # its model changed in place: warmed again
    assert changed.parts == kernel_cache.PARTS and changed.wait(timeout=120)
    kernel_cache._done.clear()
    shutil.rmtree(ptx)  # the cache emptied, its notes with it
    again = kernel_cache.Warmer.for_model(twin)
    assert again.parts == kernel_cache.PARTS and again.wait(timeout=120)
    kernel_cache._done.clear()
    monkeypatch.delenv("MLX_PTX_CACHE_DIR")  # no disk cache (not CUDA): nothing noted, each process warms
    assert kernel_cache.Warmer.for_model(twin).wait(timeout=120) and not (tmp_path / kernel_cache.NOTES_DIR).exists()
    kernel_cache._done.clear()
    assert kernel_cache.Warmer.for_model(twin).parts == kernel_cache.PARTS


def test_a_quantized_models_warmer_runs_the_plain_parts_only(tmp_path):
    """A quantized model's products compile nothing (model/quantized.py dequantizes where MLX would compile a
    tile kernel), so its warmer has the same parts as any model's, and ends cleanly."""
    model = make_model_dir(tmp_path / "q")
    config = json.loads((model / "config.json").read_text())
    (model / "config.json").write_text(json.dumps({**config, "quantization": {"group_size": 32, "bits": 4}}))
    warmer = kernel_cache.Warmer(model)
    assert [p.args[-1] for p in warmer.procs] == list(kernel_cache.PARTS)
    assert warmer.wait(timeout=120) is True


def test_a_warmer_that_fails_is_reported_and_the_start_goes_on(tmp_path, caplog):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "no_such_model", "hidden_size": 8,
                                                      "num_attention_heads": 1}))
    warmer = kernel_cache.Warmer(tmp_path)
    with caplog.at_level("WARNING", logger="kvwake.kernels"):
        assert warmer.wait(timeout=120) is False
    assert "kernel warmer (forward) exited 1" in caplog.text and "no_such_model" in caplog.text


@pytest.mark.parametrize("arch, dtype", [("llama", mx.bfloat16), ("gemma3_text", mx.float16), ("lfm2", mx.bfloat16)])
def test_the_row_kernel_built_beside_the_load_is_the_loaded_models_and_not_built_twice(tmp_path, monkeypatch, arch,
                                                                                      dtype):
    """The thread builds the kernel for the heads and dtype the config and weights name; the engine, once the
    weights are in, takes it as built when the loaded model's shape is the same (here on the CPU the build is
    recorded, not compiled: the kernel is CUDA's)."""
    from mlx_lm import load

    from kvwake.daemon.model import ragged_decode

    built = []
    monkeypatch.setattr(ragged_decode, "build", lambda *shape, **kw: built.append(shape) or True)
    path = make_model_dir(tmp_path / arch, arch=arch, dtype=dtype)
    shape = kernel_cache.BesideLoad(path, True, None).result()
    model, _ = load(str(path))
    assert shape == ragged_decode.shape_of(model) and shape[3] == dtype and built == [shape]
    assert ragged_decode.warm(model, built=shape) is True and built == [shape]  # not built again
    assert ragged_decode.warm(model, built=None) is True and built == [shape, shape]  # no build beside: built now


def test_a_paged_engines_kernels_are_built_beside_the_load_not_after_it(tmp_path, monkeypatch):
    """With pages (`paged_kv`), the paged kernel and the page copy are built beside the load with the row kernel,
    once a process, and the engine builds nothing after the load. Was: built by the engine once the weights were
    in, which held up a paged daemon's every start (docs/benchmarks.md, "Paged KV in the
    fleet")."""
    from mlx_lm import load

    from kvwake.daemon.model import ragged_decode

    built = []
    monkeypatch.setattr(ragged_decode, "build", lambda *shape, **kw: built.append((shape, kw)) or True)
    path = make_model_dir(tmp_path / "llama", arch="llama")
    beside = kernel_cache.BesideLoad(path, True, None, page_tokens=64)
    shape = beside.result()
    assert built == [(shape, {}), (shape, {"page_tokens": 64, "row": False})] and beside.paged == (shape, 64)
    model, _ = load(str(path))
    assert ragged_decode.warm(model, built=shape, page_tokens=64, paged=beside.paged) is True
    assert len(built) == 2  # nothing built after the load
    again = kernel_cache.BesideLoad(path, True, None, page_tokens=64)
    assert again.result() == shape and again.paged == (shape, 64) and len(built) == 2  # once a process
    assert ragged_decode.warm(model, built=shape, page_tokens=128, paged=beside.paged) is True
    assert built[-1] == (shape, {"page_tokens": 128, "row": False})  # other pages: built by the engine

def test_a_row_kernel_build_that_fails_leaves_the_engine_to_build_it(tmp_path, monkeypatch, caplog):
    from kvwake.daemon.model import ragged_decode

    def fails(*shape):
        raise RuntimeError("nvrtc: out of resources")

    monkeypatch.setattr(ragged_decode, "build", fails)
    path = make_model_dir(tmp_path / "llama", arch="llama")
    with caplog.at_level("WARNING", logger="kvwake.kernels"):
        assert kernel_cache.BesideLoad(path, True, None).result() is None
    assert "row kernel or staging not made beside the load" in caplog.text and "out of resources" in caplog.text


@pytest.mark.parametrize("arch, staged", [("llama", True), ("gemma3_text", False), ("lfm2", False)])
def test_a_wakes_staging_ring_is_made_beside_the_load_for_a_plain_model_only(tmp_path, monkeypatch, arch, staged):
    """A plain model's ring (every layer's K and V, the store's block) is made beside the load, so a restart's
    first wake does not make it; a hybrid model's rings have another shape: none is made for it from the
    config (here on the CPU the call is recorded: rings are kept only where staging is mapped for a GPU)."""
    from kvwake.daemon.kv import devplanes
    from kvwake.daemon.model import ragged_decode

    made = []
    monkeypatch.setattr(ragged_decode, "build", lambda *shape: True)
    monkeypatch.setattr(devplanes, "warm", lambda kv, tensors, block_tokens, wakes=0: made.append(
        (kv.shape, kv.dtype, tensors, block_tokens, wakes)) or True)
    path = make_model_dir(tmp_path / arch, arch=arch)
    config = json.loads((path / "config.json").read_text())
    # the hot set's sessions (kv/hot_set.py `wakes_ahead`): a slot made for each
    kernel_cache.BesideLoad(path, False, 128, wakes=lambda: 7).result()
    want = [((1, config.get("num_key_value_heads") or config["num_attention_heads"], 1,
              config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]),
             getattr(mx, kernel_cache.weights_dtype(path)), 2 * config["num_hidden_layers"], 128, 7)]
    assert made == (want if staged else [])
    kernel_cache.BesideLoad(path, False, None).result()
    assert len(made) == (1 if staged else 0)  # no staging asked for (a direct restore): none made


def test_warmers_started_early_are_taken_by_the_engine_once_and_not_started_off_cuda(tmp_path, monkeypatch):
    # `serve` starts a folder model's warmers before its heavy imports (CUDA only); the engine's start takes
    # them rather than starting its own, and a second engine of the same folder starts new ones
    path = make_model_dir(tmp_path / "llama", arch="llama")
    monkeypatch.setattr(mx.cuda, "is_available", lambda: False)  # as off CUDA (the CPU, Metal): none started
    assert kernel_cache.start_early(str(path)) is False
    assert kernel_cache.start_early(None) is False and kernel_cache.start_early(str(tmp_path / "no-such")) is False
    assert kernel_cache._early == {}
    monkeypatch.setattr(mx, "default_device", lambda: mx.gpu)  # as on CUDA: the warmers start at once
    monkeypatch.setattr(mx.cuda, "is_available", lambda: True)
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    assert kernel_cache.start_early(str(path), kernel_warmer=False) is False  # tuned off
    assert kernel_cache.start_early(str(path)) is True
    early = kernel_cache._early[path.resolve()]
    assert kernel_cache.start_early(str(path)) is True and kernel_cache._early[path.resolve()] is early  # once
    assert kernel_cache.Warmer.for_model(path) is early and kernel_cache._early == {}
    later = kernel_cache.Warmer.for_model(path)
    assert later is not early
    assert early.wait(timeout=120) and later.wait(timeout=120)
    # once they filled the cache, a model of the folder loaded again in this process starts none (a reload's
    # first job waited for them), nor does another folder of the same model (noted on the machine)
    assert kernel_cache.Warmer.for_model(path) is None
    assert kernel_cache.start_early(str(path)) is True and kernel_cache._early == {}  # none started early either
    assert kernel_cache.Warmer.for_model(make_model_dir(tmp_path / "other", arch="llama")) is None
    config = json.loads((path / "config.json").read_text())  # the folder's model changed in place: warmed again
    (path / "config.json").write_text(json.dumps({**config, "rms_norm_eps": 1e-6}))
    again = kernel_cache.Warmer.for_model(path)
    assert again is not None and again.wait(timeout=120)


def test_the_first_start_builds_the_other_configured_models_row_kernels_each_shape_once(tmp_path, monkeypatch):
    """A second model's row kernel compiled at its load stalled the first model's decoding for the compile (MLX
    compiles under a lock every kernel launch takes: docs/benchmarks.md, "Several models"): the first start
    builds the kernels of the other configured models' folders too, each shape once; a folder that is not a
    model of the kind is passed over."""
    from kvwake.daemon.model import ragged_decode

    built = []
    monkeypatch.setattr(ragged_decode, "build", lambda *shape, **kw: built.append(shape) or True)
    main = make_model_dir(tmp_path / "main", arch="llama")
    twin = make_model_dir(tmp_path / "twin", arch="llama", seed=1)  # the same heads: nothing more to build
    other = make_model_dir(tmp_path / "other", arch="gemma3_text", dtype=mx.float16)
    (tmp_path / "empty").mkdir()
    beside = kernel_cache.BesideLoad(main, True, None, others=[twin, tmp_path / "empty", other])
    shape = beside.result()
    assert built == beside.built and built[0] == shape and len(built) == 2
    assert built[1] != shape and built[1][3] == mx.float16  # its dtype: a kernel of its own
    assert kernel_cache.BesideLoad(main, False, None, others=[other]).result() is None and len(built) == 2


def test_a_later_load_whose_row_kernels_were_built_runs_nothing_on_mlx_beside(tmp_path, monkeypatch):
    """MLX keeps a custom kernel for the process: a later load of a shape built already (at the first start,
    as another configured model's) builds nothing again, and its thread makes no stream of its own to let go
    of (one made and let go of at once beside another model's decoding cost that model's steps)."""
    from kvwake.daemon.model import ragged_decode

    built, streams = [], []
    monkeypatch.setattr(ragged_decode, "build", lambda *shape, **kw: built.append(shape) or True)
    monkeypatch.setattr(mx, "clear_streams", lambda: streams.append("cleared"))
    main = make_model_dir(tmp_path / "main", arch="llama")
    small = make_model_dir(tmp_path / "small", arch="gemma3_text", dtype=mx.float16)
    first = kernel_cache.BesideLoad(main, True, None, others=[small])
    assert first.result() is not None and len(built) == 2 and streams == ["cleared"]
    later = kernel_cache.BesideLoad(small, True, None)
    assert later.result() == built[1] and later.built == [built[1]]  # the shape the engine compares with
    assert len(built) == 2 and streams == ["cleared"]  # nothing built, no stream made and let go of
    monkeypatch.setattr(ragged_decode, "build", lambda *shape, **kw: built.append(shape) or False)
    odd = make_model_dir(tmp_path / "odd", arch="llama", head_dim=48)
    assert kernel_cache.BesideLoad(odd, True, None).result() is None and len(built) == 3  # not a shape it takes
    assert kernel_cache.BesideLoad(odd, True, None).result() is None and len(built) == 3  # known: not tried again

    def fails(*shape, **kw):
        raise RuntimeError("nvrtc: out of resources")  # after its thread made a stream

    monkeypatch.setattr(ragged_decode, "build", fails)
    third, before = make_model_dir(tmp_path / "third", arch="llama", head_dim=32), len(streams)
    assert kernel_cache.BesideLoad(third, True, None).result() is None
    assert len(streams) == before + 1  # let go of all the same


def test_the_first_models_start_names_the_other_model_folders_and_a_later_load_makes_nothing_beside(tmp_path,
                                                                                                      monkeypatch):
    from types import SimpleNamespace

    from kvwake.daemon.config import ModelSpec, Settings, Tuning
    from kvwake.daemon.model import loader

    made, warmed = [], []
    engine = SimpleNamespace(wait_kernels=lambda: None, decoder=None, planner=None)
    monkeypatch.setattr(loader, "Engine", lambda *a, **kw: made.append(kw) or engine)
    monkeypatch.setattr(loader.kernel_cache, "start_early",
                        lambda model, on, paged=False, paths=False: warmed.append((model, on)))
    preloaded, hashed = [], []
    monkeypatch.setattr(loader.weights, "preload", lambda paths, modules, read: preloaded.append(paths))
    monkeypatch.setattr(loader.bundle, "digests_ahead", lambda folders, cache: hashed.append((folders, made[:])))
    folder = tmp_path / "small"
    folder.mkdir()
    main, small, hub = ModelSpec("main", str(tmp_path)), ModelSpec("small", str(folder)), ModelSpec("hub", "org/m")
    settings = Settings(data_dir=tmp_path)
    _, thread = loader.start_model(settings, None, main, None, neighbours=[main, small, hub])
    thread.stop()
    _, thread = loader.start_model(settings, None, small, object(), neighbours=[main, small, hub])
    thread.stop()
    assert [(kw["kernels_for"], kw["staging_beside_load"]) for kw in made] == [([folder], True), ([], False)]
    # llguidance's tokenizer (0.2 s and more of the GIL) built in the first start only: a later load has neighbours
    assert [kw["eager_grammars"] for kw in made] == [True, False]
    assert preloaded == [[folder], []]  # the other folder's tokenizer read ahead at the first start only
    assert warmed == [(str(folder), True)]  # the other folder's warmers at the first start, none at the later load
    # and its files hashed into the digest cache, once the first model's engine is made (not beside its load)
    assert [(folders, len(before)) for folders, before in hashed] == [([folder], 1)]
    loader.start_model(Settings(data_dir=tmp_path, tuning=Tuning(digests_ahead=False)), None, main, None,
                       neighbours=[main, small])[1].stop()
    assert len(hashed) == 1  # the knob off: none


def test_an_engine_closed_before_its_first_forward_pass_reaps_its_kernel_warmers(model_dir, tmp_path, monkeypatch):
    # The warmers are waited for by the engine thread's first job; an engine closed before one (an in-process
    # engine made with warm=False) left them running, unreaped, their pipes open (found as a ResourceWarning).
    # Closed now, they end on their own (not killed: a kill could cut MLX's write of a kernel) and are reaped then
    import time
    from kvwake.daemon.model import attention
    from kvwake.daemon.model.engine import Engine
    from kvwake.store import Store

    monkeypatch.setattr(attention, "on_cuda", lambda: True)  # as on CUDA: the warmers start with the engine
    store = Store(tmp_path / "store", block_tokens=16)
    engine = Engine(store, tmp_path, model_dir, warm=False)
    try:
        procs = list(engine.kernels.procs)
        # the paged part too where the engine keeps its KV in pages (CUDA's default for this plain model)
        assert len(procs) == len(kernel_cache.PARTS) + engine.paged
    finally:
        engine.close()
        store.close()
        from kvwake.daemon.kv import capacity

        capacity.uninstall()
    assert engine.kernels is None
    deadline = time.monotonic() + 120
    while not all(p.returncode is not None and p.stderr.closed for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert all(p.returncode is not None for p in procs) and all(p.stderr.closed for p in procs)


def test_the_row_kernel_is_built_beside_the_load_with_the_warmer_off_too(model_dir, tmp_path, monkeypatch):
    # With the warmer's knob off the row kernel was built on the loading engine's own thread, and a second
    # model's load stopped the serving model's decode step for that whole compile (docs/benchmarks.md, "Several
    # models")
    from kvwake.daemon.config import Tuning
    from kvwake.daemon.model import attention
    from kvwake.daemon.model.engine import Engine
    from kvwake.store import Store

    built = []

    class Beside:
        paged = None

        def __init__(self, model_path, row_kernel, staging_tokens, others=(), wakes=None, quantized=False,
                     page_tokens=None):
            built.append(model_path)

        def result(self):
            return None

    monkeypatch.setattr(attention, "on_cuda", lambda: True)  # as on CUDA
    monkeypatch.setattr(kernel_cache, "BesideLoad", Beside)
    from kvwake.daemon.kv import capacity

    store = Store(tmp_path / "store", block_tokens=16)
    try:  # the engine installs CUDA's cache growth (as on CUDA): undone whatever happens
        engine = Engine(store, tmp_path, model_dir, warm=False, tuning=Tuning(kernel_warmer=False))
        try:
            assert engine.kernels is None and len(built) == 1  # no warmer process; the row kernel beside the load
        finally:
            engine.close()
    finally:
        store.close()
        capacity.uninstall()


def test_gemma3s_multimodal_wrapper_is_warmed_and_its_row_kernel_shaped_from_its_text_model(tmp_path):
    """Gemma 3's 4B, 12B and 27B checkpoints (mlx-lm's gemma3) name their heads in `text_config`. Was: the warmer's
    miniature and the row kernel's shape read the top-level config (a KeyError in the child), and the loaded
    model's shape (its wrapper's args) was None, so the decoder took no row kernel."""
    from mlx_lm import load

    from kvwake.daemon.model import ragged_decode
    from testkit.tinymodel import ARCHS

    path = make_model_dir(tmp_path / "gemma3", arch="gemma3_text", model_type="gemma3",
                          text_config=dict(ARCHS["gemma3_text"]))
    config = json.loads((path / "config.json").read_text())
    small = kernel_cache.miniature(config)
    assert small["model_type"] == "gemma3" and small["text_config"]["num_attention_heads"] == 2
    assert kernel_cache.Warmer(path).wait(timeout=120) is True
    model, _ = load(str(path))
    assert ragged_decode.shape_of(model) == kernel_cache._heads(path, config) == (4, 2, 16, mx.bfloat16)


def test_a_stopped_warmer_is_left_to_end_on_its_own_and_a_wait_for_it_returns_at_once(tmp_path):
    """MLX writes a compiled kernel into its disk cache in place: a warmer killed inside that write would leave it
    broken for every later process. A stop (a model unloaded before its first forward pass, an engine closed)
    ends a wait for the warmers at once and kills none: each ends on its own and is reaped then."""
    import subprocess
    import threading
    import time

    # each child notes that it runs in a file of its own (its pipes are the warmer's to read)
    script = "import pathlib, sys, time; pathlib.Path(sys.argv[1]).touch(); time.sleep(1.5)"
    started = []

    class Compiling(kernel_cache.Warmer):
        def _start(self, part):
            started.append(tmp_path / f"running-{len(started)}")
            return subprocess.Popen([sys.executable, "-c", script, str(started[-1])], stdout=subprocess.DEVNULL,
                                    stderr=subprocess.PIPE)

    def running() -> None:
        deadline = time.monotonic() + 20
        while not all(f.exists() for f in started) and time.monotonic() < deadline:
            time.sleep(0.01)

    waited_for = Compiling(tmp_path)
    procs = list(waited_for.procs)
    running()
    waited = []
    waiting = threading.Thread(target=lambda: waited.append(waited_for.wait(timeout=60)))
    waiting.start()
    time.sleep(0.2)
    began = time.monotonic()
    waited_for.stop()
    waiting.join(timeout=20)
    assert waited == [False] and time.monotonic() - began < 0.5  # at once
    assert all(p.poll() is None for p in procs)  # not killed
    never_waited = Compiling(tmp_path)
    procs += never_waited.procs
    began = time.monotonic()
    never_waited.stop()
    assert time.monotonic() - began < 0.5
    deadline = time.monotonic() + 20
    while any(p.returncode is None for p in procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert [p.returncode for p in procs] == [0] * len(procs)  # each ended on its own, reaped


@pytest.fixture
def cache_home(tmp_path, monkeypatch):
    """The user's cache folder (platformdirs: XDG_CACHE_HOME here) in tmp_path, for this process and its children;
    this process's measured attention costs emptied (a process that measured nothing)."""
    from kvwake.daemon.model import attention

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(attention, "_measured", {})
    return tmp_path / "cache"


def test_the_paths_part_keeps_the_models_attention_costs_and_an_engine_takes_them_before_its_first_chunk(
        tmp_path, cache_home, monkeypatch):
    # Was: only the warm-up measured them, in idle moments, which back-to-back agents never left: the fleet's
    # daemons never finished it (docs/benchmarks.md, "A lone agent's turn before the warm-up measured its paths")
    from kvwake.daemon.config import Tuning
    from kvwake.daemon.model import attention
    from kvwake.daemon.model.engine import Engine
    from kvwake.store import Store

    model = make_model_dir(tmp_path / "llama").resolve()  # 4 heads over 2 of 16, a 4k context: keys 1k and 4k
    assert kernel_cache._missing(model, False, paths=True) == (*kernel_cache.PARTS, kernel_cache.PATHS_PART)
    assert kernel_cache._missing(model, False) == kernel_cache.PARTS  # not asked for
    child = subprocess.run([sys.executable, "-m", "kvwake.daemon.model.kernel_cache", str(model), "paths"],
                           capture_output=True, timeout=300)  # the warmer's child, as `Warmer` starts it
    assert child.returncode == 0, child.stderr.decode(errors="replace")[-2000:]
    (key, rows), = json.loads(path_costs.costs_file().read_text()).items()
    device = mx.device_info()["device_name"]
    assert key.startswith(f"{path_costs.COSTS_FORMAT}|{device}|4x2x16|") and sorted(rows, key=int) == ["1024", "4096"]
    assert all(plain > 0 and fused > 0 and extra >= 0 for plain, fused, extra in rows.values())
    assert kernel_cache._missing(model, False, paths=True) == kernel_cache.PARTS  # kept: no child for them again

    monkeypatch.setattr(attention, "wanted", lambda: True)  # as on CUDA: short chunks' paths by their costs
    store = Store(tmp_path / "store", block_tokens=16)
    kept = [(int(k), *row) for k, row in sorted(rows.items(), key=lambda item: int(item[0]))]
    for ahead, taken in ((False, None), (True, kept)):
        engine = Engine(store, tmp_path, model, warm=False, tuning=Tuning(paths_ahead=ahead))
        assert engine.planner.paths is None
        engine.wait_kernels()  # its first job: the costs the machine keeps, before any chunk and any warm-up
        assert (engine.planner.paths.table if engine.planner.paths else None) == taken
        engine.close()
    store.close()


def test_costs_the_warm_up_measures_are_kept_for_the_machines_later_processes(tmp_path, cache_home, monkeypatch):
    from mlx_lm import load

    from kvwake.daemon.model import attention

    model, _ = load(str(make_model_dir(tmp_path / "llama")))
    got: list = []
    steps = attention.PathCosts.steps(model, [64, 128], got.append, kept=True)
    assert len(steps) == 2  # one a key length
    for step in steps:
        step()
    measured = got[0].table
    monkeypatch.setattr(attention, "_measured", {})  # a later process
    assert attention.PathCosts.known(model, [64, 128]) is None  # not measured here, the file not asked
    assert attention.PathCosts.known(model, [64, 128], kept=True).table == measured
    again = attention.PathCosts.steps(model, [64, 128], got.append, kept=True)
    assert len(again) == 1  # nothing to measure: the kept rows, at once
    again[0]()
    assert got[1].table == measured


def test_writers_of_the_costs_file_at_once_lose_no_row(cache_home):
    # Was: one temporary file a process and no lock: engines of two models writing at once lost rows and whole keys
    import threading

    def write(model: int) -> None:
        for k in range(25):
            path_costs.store_cost(f"model-{model}", k, (k, 2.0 * k, 0.0))

    threads = [threading.Thread(target=write, args=(m,)) for m in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for m in range(4):
        assert path_costs.stored_costs(f"model-{m}") == {k: (k, 2.0 * k, 0.0) for k in range(25)}, m
    assert sorted(p.name for p in path_costs.costs_file().parent.iterdir()) == ["path-costs.json",
                                                                                 "path-costs.json.lock"]
