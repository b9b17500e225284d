"""Prefill beside decoding (tiny llama, CPU): chunks end on multiples of the prefill step whatever the
offset a turn or a prefix hit starts from, and while a call decodes, a chunk is computed a slice of
layers per engine job, leaving the same cache bit for bit as a chunk computed at once."""

from __future__ import annotations

import threading
import time

import mlx.core as mx
from mlx.utils import tree_flatten
import pytest

from kvwake.daemon.config import Tuning
from kvwake.daemon.model.scheduler import slices as prefillslices
from kvwake.daemon.model.engine import Engine
from kvwake.daemon.model.generation import GenerateParams
from kvwake.daemon.model.thread import EngineThread
from kvwake.daemon.session_state import Session
from kvwake.errors import CancelledError
from kvwake.store import Store
from testkit.tinymodel import make_model_dir

STEP = 32


@pytest.fixture(params=["llama", "gemma3_text", "lfm2"])
def deep(tmp_path, request):
    """An engine on a tiny model with layers to split: a 6-layer llama, and 3-layer models with sliding-window
    and recurrent layers (their caches are evaluated a layer at a time too)."""
    store = Store(tmp_path / "store", block_tokens=16)
    more = {"num_hidden_layers": 6} if request.param == "llama" else {}
    model = make_model_dir(tmp_path / "deep", arch=request.param, **more)
    # no restore points nor pages (CUDA's default for llama): a second prefill of a prompt is a prefill here, not
    # a hit through the first one's point or its mapped pages
    engine = Engine(store, tmp_path, model, prefill_step=STEP, max_batch=8,
                    tuning=Tuning(restore_points=False, paged_kv=False))
    yield engine
    engine.close()
    store.close()


class Fed:
    """The model, recording each prefill pass's (offset, tokens)."""

    def __init__(self, model) -> None:
        self.model, self.passes = model, []

    def __call__(self, inputs, cache=None):
        self.passes.append((next(c.offset for c in cache if hasattr(c, "offset")), inputs.shape[1]))
        return self.model(inputs, cache=cache)


def test_chunks_after_a_turn_end_on_multiples_of_the_step(deep):
    s = Session("s")
    deep.append(s, tokens=list(range(1, 21)))  # 19 prefilled: a turn ends off the step's grid
    deep.model = deep.planner.model = fed = Fed(deep.model)
    deep.append(s, tokens=list(range(1, 21)) + list(range(30, 130)))  # 119 tokens to reach
    assert fed.passes == [(19, 13), (32, 32), (64, 32), (96, 32), (128, 11)]  # each full chunk's keys: a multiple of 32


def test_the_prefill_step_is_2048_tokens_on_cuda_and_512_elsewhere(tmp_path, monkeypatch):
    from kvwake.daemon.model.scheduler import prefill
    monkeypatch.setattr(prefill.attention, "on_cuda", lambda: True)
    assert prefill.default_step() == 2048
    monkeypatch.setattr(prefill.attention, "on_cuda", lambda: False)
    assert prefill.default_step() == 512
    from kvwake.daemon.model import engine as engine_module
    monkeypatch.setattr(engine_module, "default_step", lambda: 64)  # the backend's, whatever it is
    store = Store(tmp_path / "store", block_tokens=16)
    engine = Engine(store, tmp_path, make_model_dir(tmp_path / "m"), max_batch=8)  # no step named: the backend's
    try:
        assert engine.prefill_step == engine.planner.prefill_step == 64
    finally:
        engine.close()
        store.close()


def cache_arrays(session: Session) -> list[mx.array]:
    return [a for _, a in tree_flatten([layer.state for layer in session.cache]) if a is not None]


def test_beside_a_decoding_call_a_chunk_is_computed_in_slices_and_leaves_the_same_cache(deep):
    long_prompt = [(i * 37 + 5) % 200 + 20 for i in range(4 * STEP + 7)]
    whole = Session("whole")
    deep.append(whole, tokens=long_prompt)  # nothing decodes: one job per chunk
    talker = Session("talker")
    deep.append(talker, text="Tell the long story")
    thread = EngineThread()
    thread.attach(deep.decoder, deep.planner)
    slices: list[int] = []
    real = deep.planner.chunk
    built: list[int] = []  # layers computed in the job that builds a chunk's graph (none, beside a decoding call)
    deep.planner.chunk = lambda session, upto: built.append((chunk := real(session, upto)).computed) or \
        slices.append(chunk) or chunk
    try:
        no_eos = tuple((token, -100.0) for token in deep.tokenizer.eos_token_ids)  # it decodes until stopped
        call = thread.call(lambda: deep.start_call(talker, GenerateParams(max_tokens=4000, logit_bias=no_eos)))
        thread.call(lambda: deep.decoder.join(call))
        # One layer per slice, however busy this machine is (sizes are measured; test_a_slice_is_sized_...).
        deep.planner.slicer.layers_for = lambda target_s, tokens, left, kind="fused": 1
        sliced = Session("sliced")
        deep.append(sliced, tokens=long_prompt, mlx=thread.call)
        call.output.should_stop = lambda: True  # the talker stops at its next token
        call.future.result(timeout=60)
    finally:
        thread.stop()
    layers = len(deep.make_cache())
    assert [c.slices for c in slices] == [layers] * len(slices)  # one layer per job
    assert built == [0] * len(slices)  # the graph's building (Python) is a job of its own
    assert sliced.processed == whole.processed == len(long_prompt) - 1
    got, want = cache_arrays(sliced), cache_arrays(whole)
    assert len(got) == len(want) and all(mx.array_equal(a, b).item() for a, b in zip(got, want))


def test_what_waited_for_a_chunk_runs_after_its_last_slice_as_jobs_of_their_own():
    """A checkpoint's capture waits for the chunk in flight (Session.when_settled). Run inside the last
    slice's job, it made that job several times longer (docs/decisions.md, "Many agents at once (issue 24)"):
    a decoding neighbour's gap.
    On an engine thread each now runs as its own job, in order, before anything queued once the slice is
    done (the prefill's next chunk)."""

    class Layer:
        state: list = []  # nothing to compute: MLX's streams are the engine thread's own

    session = Session("s")
    session.cache = [Layer() for _ in range(3)]
    thread = EngineThread()
    ran: list[str] = []
    try:
        chunk = thread.call(lambda: prefillslices.Chunk(session, 10, prefillslices.Slicer(), target_s=None,
                                                        later=thread.submit))
        waited = [thread.call(lambda k=k: session.when_settled(lambda k=k: ran.append(f"waited {k}") or k))
                  for k in range(2)]
        assert ran == [] and not any(f.done() for f in waited)

        def last_slice() -> None:
            chunk.step()
            ran.append("last slice")
        assert thread.submit(last_slice).result(timeout=10) is None
        thread.call(lambda: ran.append("queued after"))  # as the prefill's next chunk: once the slice is done
        assert [f.result(timeout=10) for f in waited] == [0, 1]
        assert ran == ["last slice", "waited 0", "waited 1", "queued after"]
        # off an engine thread (the in-process engine's `direct`), they run inside the slice, as before
        ran.clear()
        chunk = prefillslices.Chunk(session, 20, prefillslices.Slicer(), target_s=None)
        session.when_settled(lambda: ran.append("waited"))
        chunk.step()
        ran.append("last slice")
        assert ran == ["waited", "last slice"]
    finally:
        thread.stop()


def test_what_waited_for_a_chunk_fails_with_the_engines_error_when_the_engine_stops_first():
    # Queued behind the last slice, a checkpoint's capture may fall behind the engine's stop: its waiter (a
    # pool thread) must get an error, not wait for ever.
    class Layer:
        state: list = []

    session = Session("s")
    session.cache = [Layer()]
    thread = EngineThread()
    chunk = thread.call(lambda: prefillslices.Chunk(session, 10, prefillslices.Slicer(), target_s=None,
                                                    later=thread.submit))
    waited = thread.call(lambda: session.when_settled(lambda: "ran"))
    gate = threading.Event()
    thread.submit(gate.wait)
    thread.submit(chunk.step)  # settles: the waiting job is queued behind the stop below
    stopping = threading.Thread(target=thread.stop)
    stopping.start()
    while thread.scheduler.waiting()[0] < 2:  # the step, then the stop's sentinel
        time.sleep(0.001)
    gate.set()
    stopping.join(timeout=30)
    with pytest.raises(CancelledError, match="engine stopped"):
        waited.result(timeout=10)
    assert chunk.done and not session.computing


def test_a_slice_is_sized_to_the_decode_step_from_the_measured_layer_cost():
    from kvwake.daemon.model.scheduler.slices import Slicer

    slicer = Slicer()
    assert slicer.layers_for(0.010, 512, 32) == 1  # nothing measured yet: one layer, measured
    slicer.observe(0.004, 2, 512)  # 2 ms a layer for 512 tokens
    assert slicer.layers_for(0.010, 512, 32) == 5 and slicer.layers_for(0.010, 512, 3) == 3
    assert slicer.layers_for(0.001, 512, 32) == 1  # a layer costs more than the step: still one
    slicer.observe(0.024, 4, 512)  # now 6 ms a layer: the average moves halfway, to 4 ms
    assert slicer.layers_for(0.010, 512, 32) == 2


def test_a_slice_of_another_attention_path_is_sized_from_that_paths_own_cost():
    # Was: one cost for every chunk. A long prompt's last chunk, run plain beside decoding (a shape new to the
    # process, on CUDA), was sized from the fused chunks' cost: its first slice took several times its
    # target, the longest gap of a neighbour's stream during the prefill.
    from kvwake.daemon.model.scheduler.slices import Slicer

    slicer = Slicer()
    slicer.observe(0.004, 2, 512)  # fused: 2 ms a layer for 512 tokens
    assert slicer.layers_for(0.010, 512, 32) == 5
    assert slicer.layers_for(0.010, 318, 32, "plain") == 1  # plain not measured yet: one layer, measured
    slicer.observe(0.006, 1, 318, "plain")  # 6 ms a layer
    assert slicer.layers_for(0.013, 318, 32, "plain") == 2
    assert slicer.layers_for(0.010, 512, 32) == 5  # the fused cost is its own


class LayersOnly:
    """A session of six cache layers that cost nothing to evaluate: what a Chunk's slicing sees."""

    class Layer:
        state = [mx.zeros((2,))]

    def __init__(self) -> None:
        self.cache, self.processed, self.computing = [self.Layer() for _ in range(6)], 0, False

    def settle(self, later=None) -> None:
        self.computing = False


def test_a_chunks_first_slice_computes_no_attention_so_its_cost_sizes_nothing():
    """Layer 0's slice only projects the chunk's keys and values (a slice of layers a..b computes the
    attention of layers a-1..b-1): sized from a plain chunk's cheap layer 0, the next slice took too many
    layers, several times its target. A kind not measured stays so after it."""
    slicer = prefillslices.Slicer()
    chunk = prefillslices.Chunk(LayersOnly(), 10, slicer, target_s=1.0, kind="plain@13")
    chunk.step()
    assert chunk.last == (0, 1) and "plain@13" not in slicer.layer_token_s
    chunk.step()  # one layer again, now with an attention: measured
    assert chunk.last == (1, 1) and "plain@13" in slicer.layer_token_s
    chunk.step()  # sized from that (a fake layer costs ~nothing: the rest at once)
    assert chunk.last == (2, 4) and chunk.done


def test_beside_a_decoding_call_the_chunk_on_the_plain_path_starts_at_one_layer(deep, monkeypatch):
    # CUDA's choice here: a chunk shorter than the step (a prompt's last piece) runs plain attention
    deep.planner.plain_prefill = True
    deep.planner.paths = None  # every short chunk plain, as on the CPU (CUDA's measured costs ran this one fused)
    long_prompt = [(i * 37 + 5) % 200 + 20 for i in range(4 * STEP + 7)]
    whole = Session("whole")
    deep.append(whole, tokens=long_prompt)  # nothing decodes: the full chunks' shapes are known fused after
    talker = Session("talker")
    deep.append(talker, text="Tell the long story")
    thread = EngineThread(slow_job_ms=0.0)  # every job kept by name: each slice says its layers
    thread.attach(deep.decoder, deep.planner)
    chunks = []
    real = deep.planner.chunk
    deep.planner.chunk = lambda session, upto: chunks.append(chunk := real(session, upto)) or chunk
    try:
        no_eos = tuple((token, -100.0) for token in deep.tokenizer.eos_token_ids)
        call = thread.call(lambda: deep.start_call(talker, GenerateParams(max_tokens=4000, logit_bias=no_eos)))
        thread.call(lambda: deep.decoder.join(call))
        deep.planner.slicer.layer_token_s.clear()  # `whole`'s chunks were measured too
        observe = deep.planner.slicer.observe
        for keys in range(1, 4 * STEP + 8):  # fused layers cost nothing (and stay so): a fused chunk is one slice
            observe(1e-12, 1, 1, prefillslices.kind("fused", keys))
        deep.planner.slicer.observe = lambda s, layers, tokens, kind="fused": kind.startswith("fused") or \
            observe(s, layers, tokens, kind)
        sized = deep.planner.slicer.layers_for
        asked: list[tuple[str, int]] = []  # (kind, layers) of every slice sized
        deep.planner.slicer.layers_for = lambda target_s, tokens, left, kind="fused": \
            asked.append((kind, n := sized(target_s, tokens, left, kind))) or n
        sliced = Session("sliced")
        deep.append(sliced, tokens=long_prompt, mlx=thread.call)
        call.output.should_stop = lambda: True
        call.future.result(timeout=60)
    finally:
        thread.stop()
    assert [c.kind.split("@")[0] for c in chunks] == ["fused"] * 4 + ["plain"], [(c.kind, c.tokens) for c in chunks]
    assert [c.slices for c in chunks[:4]] == [1] * 4
    plain = [n for kind, n in asked if kind.startswith("plain")]
    assert plain[0] == 1 and chunks[-1].slices == len(plain)  # its first slice one layer: the fused cost not its own
    assert chunks[-1].kind in deep.planner.slicer.layer_token_s
    named = [j["what"] for j in thread.timing()["slow"] if j["what"].startswith("Chunk.step")]
    last = len(chunks[-1].layers)
    assert f"Chunk.step {chunks[-1].kind} 6 tokens, layers 0-0 of {last}" in named, named  # the plain one's first
    assert named[-1].endswith(f"-{last - 1} of {last}"), named
    got, want = cache_arrays(sliced), cache_arrays(whole)
    assert len(got) == len(want) and all(mx.array_equal(a, b).item() for a, b in zip(got, want))
