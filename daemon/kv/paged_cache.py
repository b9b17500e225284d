"""A session's plain-attention KV in the page pool, behind mlx-lm's cache protocol.

mlx-lm's models call each layer's cache as `KVCache`: `offset` for the rotary
position, `update_and_fetch(keys, values)` with the new tokens' K and V
([1, kv_heads, n, head_dim]) for everything held so far, `make_mask` for the
attention mask; callers trim (`is_trimmable`, `trim`), batch (`merge`, which
reads `keys`, `values`, `offset`), evaluate `state` and count `nbytes`.
`PagedKVCache` answers all of them with its K and V in a `PagePool`
(kv/pages.py), so the model's code runs unchanged.

One `PagedSession` (a page table) serves every plain layer of a session: the
first layer a forward pass reaches reserves the new tokens' slots for all (a
shared partial page is copied there), each layer writes its own pool at those
slots and reads its tokens back: a slice of the pool where the table's pages
follow one another (as a `KVCache`'s buffer is read), else gathered into one
contiguous run. Either way MLX's attention runs over the same values in the
same order as over a `KVCache`, bit for bit (the CPU reference path; batched
decode over pages in place is the CUDA kernel's, model/paged_attention.py).
Layers' offsets live in the session, so a trim of every layer gives the pages
back once the last layer is trimmed.

Threads: everything runs on the engine thread, but other threads read shapes
(`keys` for a sleep's budget): what the cache keeps is never an MLX operation
made there (slots are host-made values, kv/pages.py).

Sharing: `publish` names a session's full blocks by their chain keys (the
store's, store/format/keys.py) so other sessions `map_prefix` them instead of
computing them; `fork` lists the same pages. The table is freed when the
session object is gone (a finalizer queues it: PagePool.retire).
"""

from __future__ import annotations

import itertools
import weakref
from typing import Any

import mlx.core as mx
import numpy as np
from mlx_lm.models.cache import BatchKVCache, KVCache, _BaseCache, create_attention_mask

from kvwake.daemon.kv import cudart
from kvwake.daemon.kv.pages import PageLayout, PagePool, PageStateError, Slots
from kvwake.store.format.keys import ROOT_KEY, block_key, chain_keys

__all__ = ["PagedKVCache", "PagedSession", "adopt", "fill", "for_fused", "fork", "gather_pages", "is_paged", "map_keys", "map_prefix", "page_layout",
           "paged_cache", "publish", "resident_prefix", "state_arrays"]

# a padded chunk's K and V gathered by whole pages (`PagedKVCache.padded`); False: gathered by token, then padded
PAGE_GATHER = True
_names = itertools.count()


def for_fused(kv: mx.array) -> mx.array:
    """A slice of a pool's tokens as MLX's fused attention is given it: in place, except on CUDA, where the
    fused attention misreads such a slice (bfloat16 K and V strided by the pool's slots: NaN and wrong rows,
    where float32 and a copy were right), so it gets a copy there (docs/decisions.md, "Paged KV on CUDA: a
    slice of the pool copied for the fused attention")."""
    if cudart.on_cuda():
        return mx.contiguous(kv)
    return kv


class PagedSession:
    """A page table in `pool` for one session, and the offset of each of its paged layers."""

    def __init__(self, pool: PagePool, source: PagedSession | None = None) -> None:
        """An empty table, or (`source`) one listing the same pages as `source`'s, at the same offsets."""
        self.pool, self.name = pool, f"paged-{next(_names)}"
        if source is None:
            pool.open(self.name)
        else:
            pool.fork(source.name, self.name)
        weakref.finalize(self, pool.retire, self.name)
        self.offsets = list(source.offsets) if source is not None else [0] * pool.layout.layers
        # chain keys of the blocks published, from the first (a fork's: its source's)
        self.keys: list[str] = list(source.keys) if source is not None else []
        self._reserved: tuple[int, int, Slots] | None = None  # the last reserve: start, stop, slots
        self._held: mx.array | None = None  # slots of tokens [0, tokens), while the table is unchanged
        self._run: int | None = None  # run_start's answer (-1: not one run), while the table is unchanged
        self._table: mx.array | None = None  # page_table's answer, while the table is unchanged
        self._padded: tuple[int, int, tuple[mx.array, mx.array]] | None = None  # padded_pages' (tokens, length, answer)

    @property
    def tokens(self) -> int:
        return self.pool.table(self.name).tokens

    def slots_for(self, start: int, count: int) -> Slots:
        """The slots a layer writes tokens [start, start + count) at: reserved by the first layer that
        gets there, the same for the layers after it."""
        if start == self.tokens:
            slots = self.pool.reserve(self.name, count)
            self._reserved, self._held, self._run, self._table = (start, start + count, slots), None, None, None
            self._padded = None
            return slots
        if self._reserved is not None and self._reserved[:2] == (start, start + count):
            return self._reserved[2]
        raise PageStateError(f"session {self.name!r} holds {self.tokens} tokens: a layer cannot write "
                             f"tokens [{start}, {start + count}) there")

    def run_start(self) -> int | None:
        """The first slot of the table when its pages are one run of consecutive pages (a session that
        shares none, its pages taken in order), else None."""
        if self._run is None:
            pages = self.pool.table(self.name).pages
            first = self.pool.run(pages, 0, self.tokens)
            self._run = first if first is not None else -1
        return self._run if self._run >= 0 else None

    def held_slots(self) -> mx.array:
        """Slots of every token held, in order (made once per change of the table)."""
        if self._held is None or self._held.shape[0] != self.tokens:
            table = self.pool.table(self.name)
            self._held = self.pool.slots(table.pages, 0, table.tokens)
        return self._held

    def page_table(self) -> mx.array:
        """[1, pages] int32: the table's pages in token order, as the paged kernel reads a row's (made on the
        host, once per change of the table)."""
        if self._table is None:
            self._table = mx.array(np.asarray([self.pool.table(self.name).pages or [0]], np.int32))
        return self._table

    def padded_pages(self, tokens: int, length: int) -> tuple[mx.array, mx.array]:
        """(The pages holding tokens [0, tokens) in order, then the table's first page again up to `length` tokens
        of whole pages; `tokens`), int32 arrays made on the host once per change of the table, for every layer of a
        pass (`gather_pages`' arguments)."""
        if self._padded is None or self._padded[:2] != (tokens, length):
            p, pages = self.pool.layout.page_tokens, self.pool.table(self.name).pages
            held = -(-tokens // p)
            index = mx.array(np.asarray(pages[:held] + [pages[0]] * (length // p - held), np.int32))
            self._padded = (tokens, length, (index, mx.array(np.asarray([tokens], np.int32))))
        return self._padded[2]

    def settle(self) -> None:
        """After a layer's trim: once every layer is trimmed to one length, the table is too."""
        kept = self.offsets[0]
        if kept < self.tokens and all(offset == kept for offset in self.offsets):
            self.pool.trim(self.name, kept)
            del self.keys[kept // self.pool.layout.block_tokens:]
            self.changed()

    def changed(self) -> None:
        """The table's pages changed (trimmed, published or mapped): slots made before are stale."""
        self._reserved = self._held = self._run = self._table = self._padded = None


class PagedKVCache(_BaseCache):
    """One plain-attention layer's cache, its K and V in pages of `session`'s table (module docstring)."""

    def __init__(self, session: PagedSession, layer: int) -> None:
        self.session, self.layer = session, layer

    @property
    def offset(self) -> int:
        return self.session.offsets[self.layer]

    @offset.setter
    def offset(self, value: int) -> None:
        self.session.offsets[self.layer] = value

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """The new tokens written (`extend`), then every token's K and V for the attention (`fetch`)."""
        self.extend(keys, values)
        return self.fetch()

    def fetch(self) -> tuple[mx.array, mx.array]:
        """Every token's K and V for the attention: a slice of the pools (no copy) where the table's pages are
        one run, else gathered. The slice is for this pass only: held longer, it would keep the pool's buffer
        from being written in place. So a pass that writes several sessions' rows into one pool (a packed
        prefill) writes them all before it fetches any (model/packing.py)."""
        first = self.session.run_start()
        if first is None:
            return self.keys, self.values
        pool, end = self.session.pool, first + self.offset
        return (for_fused(pool.keys[self.layer][None, :, first:end]),
                for_fused(pool.values[self.layer][None, :, first:end]))

    def extend(self, keys: mx.array, values: mx.array) -> None:
        """Write the new tokens' K and V ([1, kv_heads, n, head_dim]) after the layer's own."""
        layout = self.session.pool.layout
        if keys.shape[0] != 1 or keys.dtype != layout.dtype or keys.shape[1] != layout.kv_heads:
            raise PageStateError(f"layer {self.layer}: pages hold one row of {layout.kv_heads} KV heads in "
                                 f"{layout.dtype}, not keys {tuple(keys.shape)} in {keys.dtype}")
        slots = self.session.slots_for(self.offset, keys.shape[2])
        self.session.pool.write(self.layer, slots, keys[0], values[0])
        self.offset += keys.shape[2]

    def padded(self, length: int) -> tuple[mx.array, mx.array] | None:
        """Every token's K and V and zeros after them, `length` tokens ([1, kv_heads, length, head_dim], a copy):
        the table's pages gathered whole, in one gather each, then pages standing in for the padding, every slot
        past `offset` written as zeros. For a chunk's attention at a padded shape (model/attention.py
        `padded_attention`): one copy where a gather by token and a pad were two. None where `length` is not
        whole pages or falls short of the tokens held."""
        pool, p = self.session.pool, self.session.pool.layout.page_tokens
        pages = pool.table(self.session.name).pages
        if not PAGE_GATHER or length % p or length < self.offset or not pages:
            return None
        index, tokens = self.session.padded_pages(self.offset, length)
        return tuple(gather_pages(part[self.layer], index, p, tokens) for part in (pool.keys, pool.values))

    def _gathered(self, pools: list[mx.array], start: int = 0, stop: int | None = None) -> mx.array | None:
        if self.offset == 0:
            return None
        return pools[self.layer][:, self.session.held_slots()[start : self.offset if stop is None else stop]][None]

    def span(self, start: int, stop: int, view: bool = False) -> tuple[mx.array, mx.array]:
        """Tokens [start, stop) of K and V, [1, kv_heads, stop - start, head_dim]: only they are gathered
        (a sleep's or a checkpoint's blocks). `view`: where their pages follow one another in the pool, a slice
        of it, read in place (a gather by token reads far below the memory's speed); only for a caller that
        copies it before holding it (a view held on unified memory would keep MLX from updating the pool in
        place: the pool's next write would copy it whole)."""
        if not 0 <= start <= stop <= self.offset:
            raise PageStateError(f"layer {self.layer} holds {self.offset} tokens, not [{start}, {stop})")
        pool = self.session.pool
        first = pool.run(pool.table(self.session.name).pages, start, stop) if view else None
        if first is not None:
            return tuple(part[self.layer][:, first : first + stop - start][None] for part in (pool.keys, pool.values))
        return self._gathered(pool.keys, start, stop), self._gathered(pool.values, start, stop)

    @property
    def keys(self) -> mx.array | None:
        """[1, kv_heads, offset, head_dim], gathered from the pages (a copy); None while empty."""
        return self._gathered(self.session.pool.keys)

    @property
    def values(self) -> mx.array | None:
        return self._gathered(self.session.pool.values)

    def keys_and_values(self) -> tuple[mx.array | None, mx.array | None]:
        """Both, as `KVCache.keys_and_values` gives them (a layer sharing another's KV reads them so)."""
        return self.keys, self.values

    def size(self) -> int:
        return self.offset

    def empty(self) -> bool:
        return self.offset == 0

    @property
    def state(self) -> tuple[mx.array | None, mx.array | None, int]:
        return self.keys, self.values, self.offset

    @state.setter
    def state(self, v: tuple[mx.array, mx.array, int]) -> None:
        keys, values, offset = v
        if self.offset:
            raise PageStateError(f"layer {self.layer} already holds {self.offset} tokens: state is set once")
        self.extend(keys[..., :offset, :], values[..., :offset, :])

    def is_trimmable(self) -> bool:
        return True

    def trim(self, n: int) -> int:
        n = min(self.offset, n)
        self.offset -= n
        self.session.settle()
        return n

    def make_mask(self, *args: Any, **kwargs: Any) -> Any:
        return create_attention_mask(*args, offset=self.offset, **kwargs)

    @classmethod
    def merge(cls, caches: list) -> BatchKVCache:
        return BatchKVCache.merge(caches)

    @property
    def nbytes(self) -> int:
        """This layer's share of its pages' bytes: a page shared by n tables counts 1/n here, so what the
        memory accounting sums over sessions (kv/cache_blocks.cache_nbytes) counts a shared page once."""
        return self.session.pool.share_bytes(self.session.name, layers=1)


# -- pages copied out ---------------------------------------------------------------------------------------

# One block per (page, KV head): the page's P x D values copied in 16-byte pieces, where MLX's gather goes element by
# element, far below the memory's speed (docs/benchmarks.md, "Paged KV in the fleet"). A token at or past `tokens`
# is written as zeros: its slot may hold what a page's earlier owner or a rewind left, and a masked key weighs
# exactly 0 only while it is finite (an inf there would give NaN).
_PAGE_COPY = """
const int j = blockIdx.x, h = blockIdx.y;
const long slots = pool_shape[1], pages = index_shape[0];
constexpr int PIECES = P * D * (int)sizeof(T) / 16, PER_TOKEN = D * (int)sizeof(T) / 16;
const int held = tokens[0] - j * P;  // this page's tokens that are held (none past them)
const uint4* src = reinterpret_cast<const uint4*>(pool + ((long)h * slots + (long)index[j] * P) * D);
uint4* dst = reinterpret_cast<uint4*>(out + ((long)h * pages + j) * P * D);
for (int i = threadIdx.x; i < PIECES; i += blockDim.x) dst[i] = i / PER_TOKEN < held ? src[i] : uint4{0u, 0u, 0u, 0u};
"""
_page_copy: list = []
COPY_THREADS = 256


def gather_pages(pool: mx.array, index: mx.array, page_tokens: int, tokens: mx.array) -> mx.array:
    """Pages `index` (int32 [n]) of one pool ([kv_heads, slots, head_dim]) in order, [1, kv_heads, n x page_tokens,
    head_dim] (a copy), every token from `tokens` (int32 [1]) on zeros: on CUDA by a kernel that copies whole pages,
    elsewhere by MLX's gather."""
    heads, _, dim = pool.shape
    n = index.shape[0]
    if not cudart.on_cuda() or (dim * pool.dtype.size) % 16:
        whole = pool.reshape(heads, -1, page_tokens, dim)[:, index].reshape(1, heads, n * page_tokens, dim)
        held = (mx.arange(n * page_tokens, dtype=mx.int32) < tokens)[:, None]
        return mx.where(held, whole, mx.zeros((), pool.dtype))
    if not _page_copy:
        _page_copy.append(mx.fast.cuda_kernel(name="kvwake_page_copy", input_names=["pool", "index", "tokens"],
                                              output_names=["out"], source=_PAGE_COPY))
    (out,) = _page_copy[0](inputs=[pool, index, tokens], template=[("T", pool.dtype), ("P", page_tokens), ("D", dim)],
                           grid=(n * COPY_THREADS, heads, 1), threadgroup=(COPY_THREADS, 1, 1),
                           output_shapes=[(1, heads, n * page_tokens, dim)], output_dtypes=[pool.dtype])
    return out


# -- a model's cache, paged ---------------------------------------------------------------------------------


def page_layout(blank: list, probed: list, page_tokens: int, block_tokens: int) -> PageLayout:
    """The pool's layout for a model whose fresh cache is `blank` and whose per-layer facts are `probed`
    (kv/cache_blocks.layout(blank, model=model)): its plain `KVCache` layers, their heads, head size and
    dtype (all plain layers alike, keys and values of one size: what the pool holds)."""
    plain = [facts for c, facts in zip(blank, probed, strict=True) if type(c) is KVCache]
    shapes = {(f["kv_heads"], f["k_head_dim"], f["v_head_dim"], f["dtype"]) for f in plain}
    if not plain or len(shapes) != 1 or plain[0]["k_head_dim"] != plain[0]["v_head_dim"]:
        raise PageStateError(f"pages need plain KV layers of one shape, keys and values alike: {sorted(shapes)}")
    heads, dim, _, dtype = shapes.pop()
    return PageLayout(layers=len(plain), kv_heads=heads, head_dim=dim, page_tokens=page_tokens,
                      block_tokens=block_tokens, dtype=getattr(mx, dtype))


def paged_cache(pool: PagePool, blank: list) -> list:
    """`blank` (a model's fresh cache) with every plain `KVCache` layer paged in `pool`, in one new
    session; other layers (sliding windows, recurrent state) as they are."""
    session, plain = PagedSession(pool), itertools.count()
    return [PagedKVCache(session, next(plain)) if type(c) is KVCache else c for c in blank]


def is_paged(cache: list | None) -> bool:
    return bool(cache) and any(isinstance(c, PagedKVCache) for c in cache)


def state_arrays(cache: list) -> list:
    """What evaluating `cache` evaluates: a paged layer's pools (its `state` would gather a copy), the
    others' `state`."""
    return [[c.session.pool.keys[c.layer], c.session.pool.values[c.layer]] if isinstance(c, PagedKVCache)
            else c.state for c in cache]


def fork(cache: list, tokens: int) -> list:
    """A new session holding the first `tokens` of a paged `cache` (every layer paged: a cuttable cache),
    which stays as it is. No KV is copied: the pages are shared until one side writes into them."""
    source = _whole(cache)
    if min(source.offsets) < tokens:
        raise PageStateError(f"session {source.name!r} holds {min(source.offsets)} tokens, cannot give {tokens}")
    twin = PagedSession(source.pool, source)
    copied = [PagedKVCache(twin, c.layer) for c in cache]
    for c in copied:
        c.trim(c.offset - tokens)
    return copied


def publish(cache: list, token_ids: list[int], bundle_hash: str, stored: bool = False) -> int:
    """Publish the full blocks of a paged `cache` not yet published, each under the chain key of its
    tokens (`token_ids`: the tokens the cache holds, in order): from now on they are shared, read-only.
    A block another session published first is taken from it (its pages, not these: the same tokens'
    KV, computed once, as a prefix hit restores it), unless `stored` (the cache holds the store's bytes)
    and those were computed (PagePool.publish). Returns how many blocks were published."""
    session = _whole(cache)
    block, done = session.pool.layout.block_tokens, len(session.keys)
    for index in range(done, session.tokens // block):  # each key from its parent's: new blocks hashed only
        parent = session.keys[-1] if session.keys else ROOT_KEY
        key = block_key(parent, bundle_hash, token_ids[index * block : (index + 1) * block])
        session.pool.publish(session.name, index, key, stored)
        session.keys.append(key)
    session.changed()
    return len(session.keys) - done


def map_prefix(cache: list, token_ids: list[int], bundle_hash: str) -> int:
    """A prefix hit from memory: the blocks of `token_ids` that some session published, in order from
    the cache's end (it holds whole blocks) to the first not resident, mapped into the cache (no KV read
    or copied). Returns the tokens the cache holds now."""
    return map_keys(cache, chain_keys(bundle_hash, token_ids, cache[0].session.pool.layout.block_tokens))


def map_keys(cache: list, keys: list[str]) -> int:
    """`map_prefix` by chain keys: `keys` name the cache's blocks and the blocks after them, in order; those
    after are mapped up to the first not resident. Returns the tokens the cache holds now."""
    session, block = _whole(cache), cache[0].session.pool.layout.block_tokens
    session.pool.map_shared(session.name, keys[session.tokens // block:])
    session.offsets = [session.tokens] * len(session.offsets)
    session.keys = keys[: session.tokens // block]
    session.changed()
    return session.tokens


def resident_prefix(pool: PagePool, blank: list, target: list[int], bundle_hash: str) -> tuple[list | None, int]:
    """A prefix hit from memory for a new session: a paged cache (from `blank`, the model's fresh cache)
    mapping the published blocks that start `target`, at most len(target) - 1 tokens (the last stays
    pending, as with a stored hit). (None, 0) when no block of it is resident."""
    block = pool.layout.block_tokens
    usable = (len(target) - 1) // block * block
    if not usable or not all(type(c) is KVCache for c in blank):
        return None, 0
    cache = paged_cache(pool, blank)
    tokens = map_prefix(cache, target[:usable], bundle_hash)
    return (cache, tokens) if tokens else (None, 0)


def adopt(pool: PagePool, cache: list, token_ids: list[int], bundle_hash: str, prefix: list | None = None) -> list:
    """A contiguous cache restored from the store (a wake's, a stored prefix's) moved into pages of `pool`,
    its full blocks published over `token_ids` as the store's bytes: a block another restore holds already
    is taken from it, so sessions woken over one prompt hold it once; one a prefill computed is not (a wake
    gives the stored bytes). `prefix`: a paged cache (of `pool`, every layer paged) holding the first tokens
    already, as pages that hold the store's bytes (kv/paged_wake.py): `cache`'s tokens past them go after
    them, its first ones are not read. Evaluated on return, as a restored cache is."""
    blank = [KVCache() if type(c) is KVCache else c for c in cache]
    paged = fill(prefix if prefix is not None else paged_cache(pool, blank), cache)
    if all(isinstance(c, PagedKVCache) for c in paged):
        publish(paged, token_ids, bundle_hash, stored=True)
    mx.eval(state_arrays(paged))  # written here, on this (the engine) thread: any thread may read it after
    return paged


def fill(cache: list, source: list) -> list:
    """`cache` (paged) holding what `source` holds: `source`'s layers in the same order, plain `KVCache`
    where `cache` is paged, holding the same first tokens and maybe more (a row out of a batch, a restored
    cache). Paged layers get `source`'s tokens past their own; other layers are `source`'s."""
    out = []
    for mine, theirs in zip(cache, source, strict=True):
        if not isinstance(mine, PagedKVCache):
            out.append(theirs)
            continue
        if theirs.offset < mine.offset:
            raise PageStateError(f"layer {mine.layer}: {theirs.offset} tokens cannot extend {mine.offset}")
        if theirs.offset > mine.offset:
            new = slice(mine.offset, theirs.offset)
            mine.extend(theirs.keys[..., new, :], theirs.values[..., new, :])
        out.append(mine)
    return out


def _whole(cache: list) -> PagedSession:
    """The session of a cache every layer of which is paged (a cuttable model's), at one length."""
    if not cache or not all(isinstance(c, PagedKVCache) for c in cache):
        raise PageStateError("a cache of paged layers only is needed (a model whose every layer is plain KV)")
    session = cache[0].session
    if any(o != session.tokens for o in session.offsets):
        raise PageStateError(f"session {session.name!r}: layers hold {sorted(set(session.offsets))} tokens, "
                             f"its table {session.tokens}")
    return session
