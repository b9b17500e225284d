"""A decoding batch over its rows' own pages (kv/paged_batch.py), on the CPU's gather reference: each row's
logits bit-identical to the same session decoding alone; joins and leaves move no KV; dead slots write
nowhere; the engine's decoder runs it for paged sessions."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm.models.cache import KVCache, make_prompt_cache
from mlx_lm.utils import load

from kvwake.daemon.kv import cache_blocks, paged_batch, paged_cache
from kvwake.daemon.kv.pages import PageLayout, PagePool, PagePoolFullError, PageStateError
from kvwake.daemon.model import attention, paged_attention, ragged_decode
from kvwake.daemon.model.engine import Engine
from kvwake.daemon.model.generation import GenerateParams
from kvwake.store import Store
from tests.test_batching import run_together, session
from tests.test_paged_engine import engines, paged  # noqa: F401 - the fixture and its helper
from tests.test_prefix import CHUNKED_LOGIT_BOUND, assert_diverges_only_at_a_tie

PAGE = 16
LENGTHS = (5, 37, 16, 60)  # a partial page, several, exactly one, a long one
# On CUDA a batched step's row and the same row alone are not bit-identical: MLX picks its matmul kernels by
# shape, so the projections over four rows and over one round apart. Their logits are bf16, whose step grows
# with the logits' magnitude: an absolute bound fails on one rounding of a large logit. Held as a chunked
# prefill's hit is (tests/test_prefix.py): the largest logit difference relative to the row's largest logit,
# greedy tokens the same. Bit for bit on the CPU.
ROWS_LOGIT_BOUND = CHUNKED_LOGIT_BOUND


@pytest.fixture(scope="module")
def tiny(model_dir):
    model, _ = load(str(model_dir))
    return model


def pool_for(model, pages: int = 64) -> PagePool:
    blank = make_prompt_cache(model)
    return PagePool(paged_cache.page_layout(blank, cache_blocks.layout(blank, model=model), PAGE, PAGE), pages)


def prefilled(model, pool: PagePool, lengths=LENGTHS) -> list[list]:
    mx.random.seed(0)
    caches = []
    for n in lengths:
        cache = paged_cache.paged_cache(pool, make_prompt_cache(model))
        model(mx.random.randint(0, 200, (1, n)), cache=cache)
        mx.eval(paged_cache.state_arrays(cache))
        caches.append(cache)
    return caches


def _cuda() -> bool:
    return mx.default_device() == mx.gpu and hasattr(mx, "cuda") and mx.cuda.is_available()


ON_CUDA = pytest.mark.skipif(not _cuda(), reason="the paged kernel is a CUDA kernel: MLX does not run on CUDA here")


def batched_step(model, layers: list, fed: mx.array, kernel: bool = False) -> mx.array:
    return forward(model, fed[:, None], layers, kernel)


def forward(model, fed: mx.array, cache: list, kernel: bool) -> mx.array:
    """The model's last logits for `fed`, attention swapped as the decoder swaps it (`kernel`: on CUDA)."""
    with attention.swapped(model, lambda fused: ragged_decode.paged(fused, kernel)):
        return model(fed, cache=cache)[:, -1]


def assert_as_alone(out: mx.array, alone: list, step: int) -> None:
    """A batched step's rows against each row alone: bit for bit on the CPU. On CUDA (gather path or kernel)
    the attention is the same batched or alone, but the projections' matmuls of four rows and of one may round
    apart: the same greedy tokens, each row's logits within ROWS_LOGIT_BOUND of its largest."""
    if not _cuda():
        assert all(mx.array_equal(out[i], alone[i]).item() for i in range(len(LENGTHS))), step
        return
    assert [int(a.argmax()) for a in alone] == out.argmax(axis=-1).tolist(), step
    for i, want in enumerate(alone):
        got, want = out[i].astype(mx.float32), want.astype(mx.float32)
        diff, scale = mx.abs(got - want).max().item(), mx.abs(want).max().item()
        assert diff <= ROWS_LOGIT_BOUND * scale, f"step {step}, row {i}: max logit diff {diff} " \
            f"> {ROWS_LOGIT_BOUND} x max logit {scale}"


@pytest.mark.parametrize("kernel", [False, pytest.param(True, marks=ON_CUDA)])
def test_each_row_of_a_paged_batch_gives_the_logits_it_gives_alone(tiny, kernel):
    pool = pool_for(tiny)
    layers = paged_batch.merged(prefilled(tiny, pool))
    fed = mx.array([3, 7, 11, 13])
    for step in range(3):  # a row's fork shares its partial page: whichever writes first copies it
        alone = [forward(tiny, fed[i : i + 1, None], _fork_of_row(layers, i), kernel)[0]
                 for i in range(len(LENGTHS))]
        out = batched_step(tiny, layers, fed, kernel)
        assert_as_alone(out, alone, step)
        fed = out.argmax(axis=-1).astype(mx.uint32)


def test_the_kernels_inputs_name_each_rows_pages_and_length(tiny, monkeypatch):
    # On the CPU the paged kernel's reference stands in for it (same inputs: the page table and lengths the
    # batch builds, or a paged call alone): it must give what the gather path gives, bit for bit.
    def reference(queries, keys, values, table, lengths, scale, page_tokens, split=None):
        assert split == paged_attention.ROW_SPLIT
        return paged_attention.gather_attention(queries, keys, values, table, lengths, scale, page_tokens)

    pool = pool_for(tiny)
    layers = paged_batch.merged(prefilled(tiny, pool))
    fed = mx.array([3, 7, 11, 13])
    for step in range(2):
        alone = [forward(tiny, fed[i : i + 1, None], _fork_of_row(layers, i), False)[0] for i in range(len(LENGTHS))]
        with monkeypatch.context() as patched:
            patched.setattr(ragged_decode, "kernel_attention", reference)
            kernel_alone = [forward(tiny, fed[i : i + 1, None], _fork_of_row(layers, i), True)[0]
                            for i in range(len(LENGTHS))]
            out = batched_step(tiny, layers, fed, kernel=True)
        assert all(mx.array_equal(a, b).item() for a, b in zip(alone, kernel_alone, strict=True)), step
        assert_as_alone(out, alone, step)
        fed = out.argmax(axis=-1).astype(mx.uint32)


@ON_CUDA
@pytest.mark.parametrize("dtype,bound", [(mx.float32, 1e-5), (mx.bfloat16, 2e-2)])
def test_the_paged_kernel_over_a_batch_agrees_with_the_gather_reference(dtype, bound):
    pool = PagePool(PageLayout(layers=1, kv_heads=2, head_dim=64, page_tokens=PAGE, block_tokens=PAGE, dtype=dtype), 128)
    caches = []
    for n in (300, 1, 45, 700):
        cache = paged_cache.paged_cache(pool, [KVCache()])
        cache[0].extend(*(mx.random.normal((1, 2, n, 64)).astype(dtype) for _ in range(2)))
        caches.append(cache)
    layer = paged_batch.merged(caches)[0]
    layer.rows.vacate(1)  # a dead row among them: zeros on both paths
    queries = mx.random.normal((4, 8, 1, 64)).astype(dtype)
    refused = lambda *a, **k: pytest.fail("took the fused path")  # noqa: E731
    got, want = (ragged_decode.paged(refused, kernel)(queries, None, None, layer, 0.125, None) for kernel in (True, False))
    assert got.shape == want.shape == queries.shape and got.dtype == want.dtype
    assert mx.abs(got.astype(mx.float32) - want.astype(mx.float32)).max().item() < bound
    assert not got[1].any().item()


def _fork_of_row(layers: list, i: int) -> list:
    """A cache of its own holding what row i holds (sharing its pages)."""
    own = [layer.extract(i) for layer in layers]
    return paged_cache.fork(own, own[0].offset)


def test_a_join_and_a_leave_move_no_kv_and_a_row_comes_back_as_its_own_pages(tiny):
    pool = pool_for(tiny)
    caches = prefilled(tiny, pool, (20, 9))
    tables = [list(pool.table(c[0].session.name).pages) for c in caches]
    pools = [id(k) for k in pool.keys]
    layers = paged_batch.merged(caches)
    assert [id(k) for k in pool.keys] == pools and sum(layer.nbytes for layer in layers) == 0
    batched_step(tiny, layers, mx.array([1, 2]))
    back = [layer.extract(1) for layer in layers]
    layers[0].rows.vacate(1)
    assert back[0].session is caches[1][0].session and [c.offset for c in back] == [10] * len(back)
    assert pool.table(back[0].session.name).pages == tables[1]  # written in place: same pages, one token more
    batched_step(tiny, layers, mx.array([4, 5]))  # the dead row is written nowhere
    assert pool.table(back[0].session.name).tokens == 10
    assert pool.table(caches[0][0].session.name).tokens == 22


def test_a_dead_slot_takes_a_row_and_rows_extend_and_filter_together(tiny):
    pool = pool_for(tiny)
    a, b, c = prefilled(tiny, pool, (12, 30, 7))
    layers = paged_batch.merged([a])
    for layer, dead in zip(layers, paged_batch.dead(layers, 2), strict=True):
        layer.extend(dead)
    layers[0].rows.place(2, paged_batch.takes(b))
    with pytest.raises(PageStateError):
        layers[0].rows.place(2, paged_batch.takes(c))
    for layer in layers:
        layer.filter([0, 2])
    assert [s.name for s in layers[0].rows.sessions] == [a[0].session.name, b[0].session.name]
    want = [tiny(mx.array([[t]]), cache=paged_cache.fork(x, x[0].offset))[0, -1] for t, x in ((6, a), (8, b))]
    out = batched_step(tiny, layers, mx.array([6, 8]))
    assert mx.array_equal(out[0], want[0]).item() and mx.array_equal(out[1], want[1]).item()


def test_only_a_cache_paged_whole_at_its_length_joins_a_paged_batch(tiny):
    pool = pool_for(tiny)
    (cache,) = prefilled(tiny, pool, (10,))
    assert paged_batch.takes(cache) is cache[0].session
    assert paged_batch.takes(make_prompt_cache(tiny)) is None
    cache[0].trim(2)  # one layer shorter than the table
    assert paged_batch.takes(cache) is None
    with pytest.raises(PageStateError):
        paged_batch.merged([cache])


@pytest.mark.parametrize("in_pages", [True, False])
def test_the_decoder_batches_paged_sessions_over_their_pages(engines, in_pages):  # noqa: F811
    plain, engine, pool = engines
    engine.decoder.in_pages = in_pages
    no_eos = tuple((t, -100.0) for t in engine.tokenizer.eos_token_ids)
    params = [GenerateParams(max_tokens=n, logit_bias=no_eos) for n in (4, 12, 9, 12, 6)]
    texts = ["word " * 40, "a short one", "agent 1", "agent two speaks", "x" * 30]
    alone = [session(plain, f"p{i}", t) for i, t in enumerate(texts)]
    prompts = [list(s.tokens) for s in alone]
    want = [plain.generate(s, p).tokens for s, p in zip(alone, params, strict=True)]
    sessions = [session(engine, f"e{i}", t) for i, t in enumerate(texts)]
    calls = [engine.start_call(s, p) for s, p in zip(sessions, params, strict=True)]
    seen = []
    original = engine.decoder._step_batch

    def step() -> None:
        if engine.decoder.batch is not None:
            seen.append(paged_batch.in_pages(engine.decoder.batch.prompt_cache))
        original()

    engine.decoder._step_batch = step
    run_together(engine, calls, join_at={3: 5, 4: 6})  # 4 takes the dead slot the first call left
    got = [c.future.result().tokens for c in calls]
    if not _cuda():
        assert got == want
    else:  # a paged batch's attention (gathered over its rows' pages) and projections (over several rows)
        # round apart from a plain session's alone (fused attention, one row): its tokens may part from the
        # plain ones only where the plain run's top two logits nearly tie (assert_diverges_only_at_a_tie)
        for prompt, ours, theirs in zip(prompts, got, want, strict=True):
            assert_diverges_only_at_a_tie(plain, prompt, ours, theirs)
    assert seen and all(s is in_pages for s in seen)
    assert engine.decoder.counters["alone_for_length"] == 0
    if in_pages:  # any row fits a dead slot: a paged batch pads none (a merged one fits shorter histories only)
        assert engine.decoder.counters["slot_reuses"] >= 1
    for s in sessions:
        assert all(isinstance(c, paged_cache.PagedKVCache) for c in s.cache)
        assert s.cache[0].offset == s.processed == pool.table(s.cache[0].session.name).tokens


def test_a_row_the_pool_has_no_page_for_is_left_out_of_the_step(tiny):
    pool = pool_for(tiny, pages=2)
    full, room = prefilled(tiny, pool, (PAGE, 5))  # the first needs a new page for its next token
    layers = paged_batch.merged([full, room])
    rows = layers[0].rows
    assert rows.begin_step() == [0]
    assert rows.sessions[0] is None and pool.table(full[0].session.name).tokens == PAGE
    want = tiny(mx.array([[9]]), cache=prefilled(tiny, pool_for(tiny), (PAGE, 5))[1])[0, -1]  # the same KV
    out = batched_step(tiny, layers, mx.array([0, 9]))  # the step the decoder began: its layers write
    assert mx.array_equal(out[1], want).item() and pool.table(room[0].session.name).tokens == 6


def test_the_pass_raises_when_it_finds_the_pool_full(tiny):
    pool = pool_for(tiny, pages=1)
    layers = paged_batch.merged(prefilled(tiny, pool, (PAGE,)))
    with pytest.raises(PagePoolFullError):
        batched_step(tiny, layers, mx.array([1]))


def test_a_call_the_pool_cannot_grow_fails_alone_and_the_batch_goes_on(model_dir, tmp_path):
    stores = [Store(tmp_path / name, block_tokens=PAGE) for name in ("plain", "paged")]
    plain, engine = (Engine(s, tmp_path, model_dir, max_batch=8) for s in stores)
    try:
        params = GenerateParams(max_tokens=6, logit_bias=tuple((t, -100.0) for t in engine.tokenizer.eos_token_ids))
        extra = len(session(plain, "n", "x" * 40).tokens) - 40  # the template's tokens
        # caches of 2 pages exactly (the next token needs a third) and of 2 pages and 4 tokens (room for 12)
        texts = ["x" * (2 * PAGE + 1 - extra), "y" * (2 * PAGE + 5 - extra)]
        want = plain.generate(session(plain, "p1", texts[1]), params).tokens
        pages = 5
        pool = paged(engine, capacity=pages)
        sessions = [session(engine, f"e{i}", t) for i, t in enumerate(texts)]
        calls = [engine.start_call(s, params) for s in sessions]
        run_together(engine, calls)
        assert isinstance(calls[0].future.exception(), PagePoolFullError)
        assert calls[1].future.result().tokens == want and pool.pages_held() <= pages
    finally:
        for e in (plain, engine):
            e.close()
        for s in stores:
            s.close()


def test_a_merged_row_whose_tokens_find_no_page_as_it_leaves_fails_alone(model_dir, tmp_path):
    # A merged batch (a paged batch turned off here; a hybrid model's plain layers) writes a row's new
    # tokens into its pages as it leaves: a full pool there failed every call in flight.
    stores = [Store(tmp_path / name, block_tokens=PAGE) for name in ("plain", "paged")]
    plain, engine = (Engine(s, tmp_path, model_dir, max_batch=8) for s in stores)
    try:
        engine.decoder.in_pages = False
        params = GenerateParams(max_tokens=6, logit_bias=tuple((t, -100.0) for t in engine.tokenizer.eos_token_ids))
        extra = len(session(plain, "n", "x" * 40).tokens) - 40
        texts = ["x" * (2 * PAGE + 1 - extra), "y" * (2 * PAGE + 5 - extra)]  # 2 pages full; 2 and 4 tokens
        want = plain.generate(session(plain, "p1", texts[1]), params).tokens
        paged(engine, capacity=5)
        calls = [engine.start_call(session(engine, f"e{i}", t), params) for i, t in enumerate(texts)]
        run_together(engine, calls)
        assert engine.decoder.counters["merges"] == 1
        assert isinstance(calls[0].future.exception(), PagePoolFullError) and calls[0].session.cache is None
        assert calls[1].future.result().tokens == want
    finally:
        for e in (plain, engine):
            e.close()
        for s in stores:
            s.close()


def test_on_cuda_the_fused_attention_reads_a_copy_of_a_slice_of_the_pool(monkeypatch):
    # On CUDA, MLX's fused attention over a bfloat16 slice of the pool read in place gave NaN and wrong rows
    # (the agreement test above failed on its reference, not on the kernel: a copy and the kernel agreed). Both
    # places that hand it such a slice (a paged batch's gather, a paged cache alone) give it a copy on CUDA.
    copied = []
    monkeypatch.setattr(paged_cache.mx, "contiguous", lambda a: copied.append(a.shape) or a)
    monkeypatch.setattr(paged_cache.mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(paged_cache.mx, "cuda", type("Cuda", (), {"is_available": staticmethod(lambda: True)}),
                        raising=False)
    pools = mx.zeros((2, 64, 8))
    assert paged_cache.for_fused(pools[:, 3:20]) is not None and copied == [(2, 17, 8)]
    copied.clear()  # the batch's gather: a row whose pages are one run is a slice
    paged_attention.gather_rows(mx.zeros((1, 4, 8)), pools, pools, [slice(3, 20)], 0.5)
    assert copied == [(1, 2, 17, 8)] * 2
    copied.clear()  # a paged cache alone: its pages one run, read as a slice
    pool = PagePool(PageLayout(layers=1, kv_heads=2, head_dim=8, page_tokens=PAGE, block_tokens=PAGE,
                               dtype=mx.float32), 8)
    layer = paged_cache.paged_cache(pool, [KVCache()])[0]
    kv = mx.ones((1, 2, 20, 8))
    layer.update_and_fetch(kv, kv)
    assert copied == [(1, 2, 20, 8)] * 2
    monkeypatch.undo()
    assert paged_cache.for_fused(pools[:, 3:20]).shape == (2, 17, 8)  # on the CPU: read in place, as it was


def test_the_decoder_feeds_the_kernel_each_rows_table_and_length_through_a_leave_and_a_join(model_dir, tmp_path,
                                                                                              monkeypatch):
    # The decoder's own wiring of the kernel path (a paged call alone and a batch's rows, as on CUDA), run here
    # with the kernel's reference in its place: the first call leaves after its second token, a call with one
    # token and no KV takes its slot; every call decodes the tokens it decodes alone. On CUDA this scenario
    # once parted at a row's 7th token with the real kernel (docs/decisions.md, "The paged default on the GPU's
    # suite"): these inputs are not why.
    from kvwake.daemon.config import Tuning
    from kvwake.daemon.session_state import Session

    fed = []

    def reference(queries, keys, values, table, lengths, scale, page_tokens, split=None):
        assert split == paged_attention.ROW_SPLIT
        fed.append(queries.shape[0])
        return paged_attention.gather_attention(queries, keys, values, table, lengths, scale, page_tokens)

    monkeypatch.setattr(ragged_decode, "kernel_attention", reference)
    store = Store(tmp_path / "store", block_tokens=16)
    engine = Engine(store, tmp_path, model_dir, max_batch=8, warm=False, tuning=Tuning(paged_kv=True))
    try:
        engine.decoder.row_kernel = engine.decoder.paged_kernel = True  # the kernel path, as on CUDA
        no_eos = tuple((t, -100.0) for t in engine.tokenizer.eos_token_ids)
        params = [GenerateParams(max_tokens=n, logit_bias=no_eos) for n in (2, 12, 12, 12, 8)]
        inputs = [[40, 41, 42], [50, 51, 52, 53], [60, 61], [70, 71, 72, 73, 74], [99]]  # the last: no KV

        def fresh(name, tokens):
            s = Session(name)
            engine.append(s, tokens=tokens)
            return s

        alone = [engine.generate(fresh(f"alone{i}", t), p).tokens for i, (t, p) in enumerate(zip(inputs, params))]
        assert fed and set(fed) == {1}  # each alone by the kernel's path
        calls = [engine.start_call(fresh(f"o{i}", t), p) for i, (t, p) in enumerate(zip(inputs, params))]
        run_together(engine, calls, join_at={4: 5})
        assert [c.future.result().tokens for c in calls] == alone
        assert max(fed) == 4  # then batched
    finally:
        engine.close()
        store.close()
