"""A model's weights read piece by piece (model/weights.py): the same weights as mlx-lm's own load, read either
way: MLX's in pieces (no `mx.eval` of the load larger than a piece, so a load lets another model's engine thread
take the GIL), or through the mapped staging slots (every file tensor as stored; anything the model's sanitize
changed, MLX's way)."""

from __future__ import annotations

import mlx.core as mx
import mlx_lm
import pytest
from mlx.utils import tree_flatten
from mlx_lm import convert
from mlx_lm.models import llama

from kvwake.daemon.model import weights
from testkit.tinymodel import make_model_dir


def test_pieces_keep_order_and_stay_within_the_bound_unless_one_array_is_larger():
    arrays = [mx.zeros((n,), mx.uint8) for n in (10, 20, 5, 40, 3, 3)]
    groups = list(weights.pieces(arrays, most=30))
    assert [[a.size for a in g] for g in groups] == [[10, 20], [5], [40], [3, 3]]
    assert [a for g in groups for a in g] == arrays


def test_a_load_evaluates_its_weights_in_pieces_and_matches_mlx_lm(tmp_path, monkeypatch):
    folder = make_model_dir(tmp_path / "m")
    want_model, want_tokenizer = mlx_lm.load(str(folder))
    want = dict(tree_flatten(want_model.parameters()))
    most = max(v.nbytes for v in want.values())  # pieces of about one large tensor: many evals
    evals: list[int] = []
    real_eval = mx.eval

    def counted(*args):
        evals.append(sum(a.nbytes for a in args[0]))
        return real_eval(*args)

    monkeypatch.setattr(weights.mx, "eval", counted)  # mlx.core's own: any eval of the load is counted
    model, tokenizer = weights.load(str(folder), most=most, read="mlx")
    monkeypatch.undo()
    got = dict(tree_flatten(model.parameters()))
    assert len(evals) > 1 and max(evals) <= most, f"evals of {evals} bytes, a piece at most {most}"
    assert sum(evals) == sum(v.nbytes for v in want.values())
    assert got.keys() == want.keys()
    for name, value in want.items():
        assert mx.array_equal(got[name], value).item(), f"{name} differs from mlx_lm.load's"
    assert tokenizer.encode("hello") == want_tokenizer.encode("hello")


def ops_behind(a: mx.array) -> list[str]:
    """The operations MLX still has to run to compute `a` (none once it is evaluated)."""
    import io
    import re

    graph = io.StringIO()
    mx.export_to_dot(graph, a)
    return re.findall(r'label ="([^"]*)"', graph.getvalue())


def same_bits(got: dict, want: dict) -> None:
    assert got.keys() == want.keys()
    for name, value in want.items():
        g = got[name]
        assert (g.dtype, g.shape) == (value.dtype, value.shape), name
        assert mx.array_equal(g.view(mx.uint8), value.view(mx.uint8)).item(), f"{name} differs from mlx_lm.load's"


@pytest.mark.parametrize("kind", ["llama", "gemma3_text", "llama-4bit"])
def test_a_mapped_read_gives_mlx_lms_weights_bit_for_bit_each_file_tensor_read_through_the_slots(tmp_path, kind,
                                                                                                 monkeypatch):
    """A plain model, one whose sanitize drops and ties tensors (gemma3), a 4-bit one (uint32 weights, bf16
    scales and biases); the slots made small, so a tensor larger than one is read in chunks joined on the
    device."""
    folder = make_model_dir(tmp_path / "m", arch=kind.split("-")[0])
    if kind.endswith("4bit"):
        convert(hf_path=str(folder), mlx_path=str(tmp_path / "q"), quantize=True, q_group_size=64, q_bits=4)
        folder = tmp_path / "q"
    want_model, want_tokenizer = mlx_lm.load(str(folder))
    want = dict(tree_flatten(want_model.parameters()))
    monkeypatch.setattr(weights, "SLOT_BYTES", 4096)
    assert max(v.nbytes for v in want.values()) > 4096  # some tensor is read in chunks
    timeline: list[dict] = []
    model, tokenizer = weights.load(str(folder), read="mapped", timeline=timeline)
    assert type(model) is type(want_model)  # its own class back, not the load's hook
    got = dict(tree_flatten(model.parameters()))
    # every parameter evaluated by the load (a chunked tensor's join too), none left for the first forward
    assert all(ops_behind(v) == [] for v in got.values()), [k for k, v in got.items() if ops_behind(v)]
    same_bits(got, want)
    mapped = sum(p["bytes"] for p in timeline if p["read"] == "mapped")
    assert mapped == sum(v.nbytes for v in want.values()), "every parameter is a file tensor: all read mapped"
    assert all(p["bytes"] <= 4096 for p in timeline)
    assert tokenizer.encode("hello") == want_tokenizer.encode("hello")


def test_a_tensor_the_models_sanitize_changed_is_evaluated_mlxs_way_not_read_from_its_file(tmp_path, monkeypatch):
    folder = make_model_dir(tmp_path / "m")
    plain = llama.Model.sanitize

    def doubled(self, w):
        w = plain(self, w)
        return {**w, "model.norm.weight": w["model.norm.weight"] * 2}

    monkeypatch.setattr(llama.Model, "sanitize", doubled)
    want = dict(tree_flatten(mlx_lm.load(str(folder))[0].parameters()))
    timeline: list[dict] = []
    model, _ = weights.load(str(folder), read="mapped", timeline=timeline)
    got = dict(tree_flatten(model.parameters()))
    same_bits(got, want)
    norm = want["model.norm.weight"].nbytes
    assert sum(p["bytes"] for p in timeline if p["read"] == "mlx") == norm
    assert sum(p["bytes"] for p in timeline if p["read"] == "mapped") == sum(v.nbytes for v in want.values()) - norm


def test_weights_read_is_mapped_or_mlx(tmp_path):
    from kvwake.daemon.config import Tuning

    with pytest.raises(ValueError, match="weights_read"):
        Tuning(weights_read="mmap")
    with pytest.raises(ValueError, match="mapped or mlx"):
        weights.load(str(make_model_dir(tmp_path / "m")), read="mmap")


def test_a_tensor_its_sanitize_changed_in_place_is_not_read_from_its_file(tmp_path):
    """An in-place operator keeps the Python object mlx.load made: falcon_h1's sanitize scales its weights by
    the config's multipliers with `*=` when a checkpoint comes in the hub's layout (conv weights [C, 1, K]).
    Those tensors are evaluated MLX's way (weights._bare_load), the others still read mapped."""
    import json

    folder = make_model_dir(tmp_path / "m", arch="falcon_h1")
    file = next(folder.glob("model*.safetensors"))
    hub = {k: (v.transpose(0, 2, 1) if "conv1d.weight" in k else v) for k, v in mx.load(str(file)).items()}
    mx.save_safetensors(str(file), hub, metadata={"format": "mlx"})
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "embedding_multiplier": 3.0, "lm_head_multiplier": 0.5}))
    want = dict(tree_flatten(mlx_lm.load(str(folder))[0].parameters()))
    timeline: list[dict] = []
    model, _ = weights.load(str(folder), read="mapped", timeline=timeline)
    same_bits(dict(tree_flatten(model.parameters())), want)
    assert {p["read"] for p in timeline} == {"mapped", "mlx"}  # the scaled ones MLX's, the rest mapped


def test_the_readers_slots_and_file_are_let_go_when_its_wait_fails(tmp_path, monkeypatch):
    from kvwake.daemon.kv import devplanes

    released = []
    staging = devplanes.staging

    def noted(shape):
        a, view, release = staging(shape)
        return a, view, lambda: (released.append(shape), release())

    monkeypatch.setattr(devplanes, "staging", noted)
    folder = make_model_dir(tmp_path / "m")
    reader = weights._Reader(weights.Phases(), None)
    name, (path, offset, nbytes, dtype, shape) = next(iter(weights._index(folder).items()))
    reader(path, offset, nbytes, dtype, shape)
    file = reader.file

    def fails(*args):
        raise RuntimeError("the device is gone")

    monkeypatch.setattr(weights.mx, "eval", fails)
    with pytest.raises(RuntimeError, match="gone"):
        reader.close()
    monkeypatch.undo()
    assert len(released) == 2 and file.closed and reader.slots == []


def test_a_folders_tokenizer_is_read_once_for_the_process_until_its_files_change(tmp_path, monkeypatch):
    """Reading a tokenizer holds the GIL for long stretches (model/weights.py `tokenizer_of`): a load of a model
    whose tokenizer was read before (a reload, or read ahead at the first start) takes it as it is."""
    import os

    read = []
    real = weights.load_tokenizer
    monkeypatch.setattr(weights, "load_tokenizer", lambda path, **kw: read.append(path) or real(path, **kw))
    monkeypatch.setattr(weights, "_tokenizers", {})
    model = make_model_dir(tmp_path / "m")
    first = weights.load(str(model))[1]
    assert weights.load(str(model))[1] is first and weights.tokenizer_of(model, [0]) is not first  # other eos ids
    assert len(read) == 2
    config = model / "tokenizer_config.json"
    os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns + 10**9))
    again = weights.load(str(model))[1]
    assert again is not first and len(read) == 3
    assert again.encode("same text") == first.encode("same text")


def test_the_first_start_reads_the_other_models_tokenizers_ahead_and_a_bad_folder_is_left_to_its_load(
        tmp_path, monkeypatch, caplog):
    import json

    monkeypatch.setattr(weights, "_tokenizers", {})
    model = make_model_dir(tmp_path / "m")
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"model_type": "llama"}))  # no tokenizer
    with caplog.at_level("INFO", logger="kvwake.models"):
        weights.preload([bad, model]).join(timeout=60)
    assert [r.model for r in caplog.records if r.message == "tokenizer not read ahead"] == [str(bad)]
    assert [r.models for r in caplog.records if r.message == "tokenizers read ahead"] == [1]  # with its time
    eos = json.loads((model / "config.json").read_text()).get("eos_token_id")
    read = []
    monkeypatch.setattr(weights, "load_tokenizer", lambda *a, **kw: read.append(a))
    assert weights.tokenizer_of(model, eos) is not None and read == []  # read ahead: not read again
    assert weights.preload([]) is None


def test_a_tokenizer_read_ahead_serves_the_load_when_generation_config_names_other_eos_ids(tmp_path, monkeypatch):
    """mlx-lm's load_config takes eos_token_id from generation_config.json over config.json's (Llama 3, Qwen 2.5
    instruct models): read ahead by config.json's alone, the tokenizer was kept under other eos ids than the
    load asks for, and the load read it again, beside other models' decoding."""
    import json

    monkeypatch.setattr(weights, "_tokenizers", {})
    model = make_model_dir(tmp_path / "m")
    (model / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))  # config.json's: none
    weights.preload([model]).join(timeout=60)
    read = []
    real = weights.load_tokenizer
    monkeypatch.setattr(weights, "load_tokenizer", lambda path, **kw: read.append(path) or real(path, **kw))
    tokenizer = weights.load(str(model))[1]
    assert read == [] and {1, 2} <= set(tokenizer.eos_token_ids)


def test_a_load_of_a_folder_whose_tokenizer_is_being_read_ahead_waits_for_that_read(tmp_path, monkeypatch):
    """The first start reads the other folders' tokenizers on a thread (`preload`) while its own model
    loads, which may be one of them under another name, and a model asked for early loads beside that thread:
    a second read of the same folder at once (0.38 s of the GIL for SmolLM2) is waited for, not done again."""
    import threading

    monkeypatch.setattr(weights, "_tokenizers", {})
    model = make_model_dir(tmp_path / "m")
    entered, release, read = threading.Event(), threading.Event(), []
    real = weights.load_tokenizer

    def slow(path, **kw):
        read.append(path)
        entered.set()
        release.wait(10)
        return real(path, **kw)

    monkeypatch.setattr(weights, "load_tokenizer", slow)
    got = []
    ahead = threading.Thread(target=lambda: got.append(weights.tokenizer_of(model)))
    ahead.start()
    assert entered.wait(10)
    load = threading.Thread(target=lambda: got.append(weights.tokenizer_of(model)))
    load.start()
    load.join(0.3)
    release.set()
    ahead.join(10)
    load.join(10)
    assert len(read) == 1 and len(got) == 2 and got[0] is got[1]


def test_a_tokenizers_chat_template_is_made_once_read_ahead_and_taken_by_each_engines_prompter(tmp_path, monkeypatch):
    """A chat template's probes (the template rendered, the system role tried) held the GIL in a load beside other
    models' decode steps: made once per tokenizer (`ChatTemplate.of`), at the first start for the other models
    (`preload`), and every Prompter of that tokenizer (a reload's, two names of one folder) takes it."""
    from kvwake.daemon.model import chat
    from kvwake.daemon.model.prompt import Prompter

    monkeypatch.setattr(weights, "_tokenizers", {})
    monkeypatch.setattr(chat.ChatTemplate, "_kept", {})
    made = []
    real = chat.ChatTemplate.__init__
    monkeypatch.setattr(chat.ChatTemplate, "__init__", lambda self, tok: made.append(tok) or real(self, tok))
    model = make_model_dir(tmp_path / "m")
    weights.preload([model]).join(timeout=60)
    assert len(made) == 1
    tokenizer = weights.load(str(model))[1]
    assert made == [tokenizer]  # the load's tokenizer is the one read ahead, its template made with it
    first, second = Prompter(tokenizer, 512, "m"), Prompter(tokenizer, 512, "m2")
    assert first.template is second.template is chat.ChatTemplate.of(tokenizer) and len(made) == 1
    messages = [{"role": "user", "content": "hello"}]
    assert first.render(messages=messages).target == chat.ChatTemplate(tokenizer).render(messages)  # as a fresh one
    import json
    import os

    config = model / "tokenizer_config.json"  # its files changed: read again, the old template let go
    os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns + 10**9))
    again = weights.tokenizer_of(model, json.loads((model / "config.json").read_text()).get("eos_token_id"))
    assert again is not tokenizer and id(tokenizer) not in chat.ChatTemplate._kept
    assert chat.ChatTemplate.of(again) is not first.template


def test_a_model_built_ahead_is_taken_once_by_its_mapped_load_with_its_other_arrays_evaluated(tmp_path, monkeypatch):
    """The first start builds the other configured models' modules (`prepare`, in `preload`) where weights are
    read the mapped way (CUDA; here the mapped path on the CPU): their load takes them instead of building them
    beside the other models' decoding, once; the arrays the modules hold besides their parameters (a Llama 3
    RoPE's frequencies) are evaluated by the thread that built them (MLX on CUDA evaluates an array only on its
    own thread's stream), and the load reads the same weights as a plain one."""
    monkeypatch.setattr(weights, "_prepared", {})
    monkeypatch.setattr(weights, "default_read", lambda: "mapped")
    model = make_model_dir(tmp_path / "m", rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 256})
    weights.preload([model]).join(timeout=60)
    (built, _, _), = [b for _, b in weights._prepared.values()]
    freqs = [v for k, v in tree_flatten(built.filter_and_map(lambda _m, _k, v: isinstance(v, (dict, list, mx.array))))
             if k.endswith("_freqs")]
    assert freqs and all(weights._primitives(f) == [] for f in freqs)  # evaluated where they were made
    made = []
    real = weights.load_model
    monkeypatch.setattr(weights, "load_model", lambda *a, **kw: made.append(a) or real(*a, **kw))
    taken = weights.load(str(model), read="mapped")[0]
    assert taken is built and made == [] and weights._prepared == {}
    again = weights.load(str(model), read="mapped")[0]  # taken once: a later load builds its own
    assert again is not built and len(made) == 1
    plain = mlx_lm.load(str(model))[0]
    for (name, a), (_, b) in zip(tree_flatten(taken.parameters()), tree_flatten(plain.parameters())):
        assert mx.array_equal(a, b).item(), name
    tokens = mx.array([[1, 2, 3, 4]])
    assert mx.array_equal(taken(tokens), plain(tokens)).item()


def test_a_model_built_ahead_is_not_taken_once_its_files_changed_or_a_parameter_would_be_left_unread(
        tmp_path, monkeypatch, caplog):
    """A folder changed since its model was built ahead is built again by its load (its weights may be others);
    so is a model whose mapped reads would leave a parameter to evaluate (made on the building thread's stream,
    which the engine thread has not on CUDA); where weights are not read the mapped way, nothing is built ahead."""
    import os

    monkeypatch.setattr(weights, "_prepared", {})
    model = make_model_dir(tmp_path / "m")
    monkeypatch.setattr(weights, "default_read", lambda: "mlx")  # the CPU's way (CUDA's default is mapped)
    assert weights.prepare(model) is False and weights._prepared == {}  # read MLX's way here
    monkeypatch.setattr(weights, "default_read", lambda: "mapped")
    assert weights.prepare(model)
    config = model / "config.json"
    os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns + 10**9))
    with caplog.at_level("INFO", logger="kvwake.models"):
        loaded = weights.load(str(model), read="mapped")[0]
    assert [r.model for r in caplog.records if r.message == "model built ahead not taken"] == [str(model)]
    weights.prepare(model)
    (built, _, stored), = [b for _, b in weights._prepared.values()]
    stored.pop(next(iter(stored)))  # one parameter the reads would not find as stored
    assert weights.load(str(model), read="mapped")[0] is not built
    assert loaded is not built


def test_a_model_built_ahead_while_its_folder_loads_is_not_kept_and_one_not_taken_lets_go_of_its_arrays(
        tmp_path, monkeypatch):
    """A `prepare` during which a load of its folder began (that load built its own) keeps nothing, and a model
    built ahead that its load refuses drops its arrays (its lazily loaded ones keep their files open)."""
    import os

    monkeypatch.setattr(weights, "_prepared", {})
    monkeypatch.setattr(weights, "default_read", lambda: "mapped")
    model = make_model_dir(tmp_path / "m")
    real = weights._build

    def build_with_a_load_meanwhile(path):
        built = real(path)
        assert weights._take_prepared(model, {}) is None  # a load of the folder begins while this one builds
        return built

    monkeypatch.setattr(weights, "_build", build_with_a_load_meanwhile)
    assert weights.prepare(model) is False and not weights.prepared(model)
    monkeypatch.setattr(weights, "_build", real)
    assert weights.prepare(model) and weights.prepared(model)
    (built, _, stored), = [b for _, b in weights._prepared.values()]
    config = model / "config.json"
    os.utime(config, ns=(config.stat().st_atime_ns, config.stat().st_mtime_ns + 10**9))
    assert weights.load(str(model), read="mapped")[0] is not built
    assert tree_flatten(built.parameters()) == [] and stored == {}  # let go of


def test_the_preload_thread_lets_go_of_its_mlx_stream_even_when_a_build_ahead_fails(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(weights, "_prepared", {})
    monkeypatch.setattr(weights, "default_read", lambda: "mapped")
    cleared = []
    monkeypatch.setattr(weights.mx, "clear_streams", lambda: cleared.append(True))

    def fails(path, read=None):
        raise ValueError("a shape the weights do not have")

    monkeypatch.setattr(weights, "prepare", fails)
    model = make_model_dir(tmp_path / "m")
    with caplog.at_level("INFO", logger="kvwake.models"):
        weights.preload([model]).join(timeout=60)
    assert cleared == [True]
    assert [r.model for r in caplog.records if r.message == "model not built ahead"] == [str(model)]
    assert [r.models for r in caplog.records if r.message == "tokenizers read ahead"] == [1]  # its tokenizer was


def test_a_build_ahead_asked_for_before_a_load_began_keeps_nothing_and_a_newer_one_replaces_an_older(
        tmp_path, monkeypatch):
    """`preload` notes each folder's loads as it is asked: a load that begins while its thread still reads the
    tokenizer (before the build itself) built its own, so the build keeps nothing; and a model built ahead again
    before any load took the first lets the first go."""
    monkeypatch.setattr(weights, "_prepared", {})
    monkeypatch.setattr(weights, "default_read", lambda: "mapped")
    model = make_model_dir(tmp_path / "m")
    real = weights.tokenizer_of

    def with_a_load_meanwhile(path, eos=None):
        assert weights._take_prepared(model, {}) is None  # a load of the folder begins meanwhile
        return real(path, eos)

    monkeypatch.setattr(weights, "tokenizer_of", with_a_load_meanwhile)
    weights.preload([model]).join(timeout=60)
    assert not weights.prepared(model)
    monkeypatch.setattr(weights, "tokenizer_of", real)
    assert weights.prepare(model)
    (older, _, _), = [b for _, b in weights._prepared.values()]
    assert weights.prepare(model)
    (newer, _, _), = [b for _, b in weights._prepared.values()]
    assert newer is not older and tree_flatten(older.parameters()) == []  # the older let go of


def test_a_model_built_ahead_with_an_array_left_unevaluated_beside_its_parameters_is_not_taken(tmp_path, monkeypatch):
    """Anything a model's modules hold besides their parameters must hold its values when a load takes the model
    (on CUDA the engine thread could not evaluate it: another thread's stream): one left with a graph behind it
    (here a tuple member made after the build) has the load build its own."""
    monkeypatch.setattr(weights, "_prepared", {})
    monkeypatch.setattr(weights, "default_read", lambda: "mapped")
    model = make_model_dir(tmp_path / "m")
    assert weights.prepare(model)
    (built, _, _), = [b for _, b in weights._prepared.values()]
    built.model.layers[0]._pair = (mx.ones((2,)) * 2, mx.zeros((1,)))  # lazy: made and never evaluated
    assert weights.load(str(model), read="mapped")[0] is not built
