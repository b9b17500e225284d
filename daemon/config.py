"""Daemon settings: flags > environment > config file > platform defaults.

Environment: KVWAKE_SOCKET, KVWAKE_DATA_DIR, KVWAKE_MODEL, KVWAKE_CONFIG, KVWAKE_REMOTE, KVWAKE_HTTP_TOKEN;
for the shared tier the AWS tools' own: AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_REGION.
Config file (TOML, default `<user config dir>/kvwake/config.toml`), any of
the `Settings` field names as top-level keys, e.g.

    model = "~/models/Qwen3-4B-4bit"
    hot_budget_bytes = 4_000_000_000  # hot KV before LRU sessions sleep (default: half the memory left for KV)
    idle_timeout_s = 900
    allow_uids = [501]
    codec = "raw"            # block codec for new blocks (default "auto": measured here; `kvwake status` says which)
    io_workers = 8           # sleep/wake worker threads (default: every core)
    max_batch = 1            # decode every call alone: output bit-identical to a solo run
    max_context = 32768      # refuse prompts beyond this (and below the model's own context)
    mlx_memory_bytes = 48_000_000_000  # MLX's memory limit; sessions whose KV would not fit are refused
    remote = "s3://team-kv/agents"           # shared tier (docs/decisions.md, "Remote tier (issue 13)")
    remote_endpoint = "http://10.0.0.5:8333"  # else AWS_ENDPOINT_URL, else AWS itself
    http = "127.0.0.1:8080"  # the OpenAI and Anthropic APIs (token: KVWAKE_HTTP_TOKEN or <data dir>/http-token)
    anthropic_drop_system = ["x-anthropic-billing-header:"]  # system blocks left out (the default; [] keeps all)
    http_hosted_tools = "refuse"  # OpenAI's built-in tools (web_search, ...): a 400 naming them (default "omit")

    max_loaded = 2           # models loaded at once (LRU unloaded first, sessions slept); also model_ttl_s
    [models]                 # several models by name (docs/models.md): path, aliases (patterns), pinned
    small = {path = "~/models/Qwen3-1.7B-4bit", aliases = ["claude-haiku-*"]}

    [aliases]                # model names clients may ask for; without the table any name is served
    "claude-sonnet-4-5" = "Qwen3-8B-4bit"    # -> the loaded model's name (its folder name or hub id)

    [tuning]                 # `Tuning`'s fields: what each trades is said where it is declared
    slice_of_step = 2.0      # also `kvwake serve --tune slice_of_step=2`, or KVWAKE_SLICE_OF_STEP=2

Tuning knobs come from the same three places, field by field: `--tune NAME=VALUE`
(repeatable) over `KVWAKE_<NAME>` (NAME upper-cased, e.g. KVWAKE_PACK_PREFILL=0)
over the config file's `[tuning]` table over `Tuning`'s defaults. Their
defaults are what the benchmarks chose (docs/decisions.md says why); the others
are there to measure against, or to trade one thing for another. An unknown
name or a bad value is refused, naming where it came from.

Defaults come from platformdirs: the socket in the user runtime dir, the
store and converted models in the user data dir.
"""

from __future__ import annotations

import dataclasses
import fnmatch
import math
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, get_type_hints

from kvwake.paths import default_config, default_data_dir, default_socket

__all__ = ["ModelSpec", "Settings", "Tuning", "default_socket", "load_settings", "load_tuning", "parse_models_table",
           "tuning_from_environment"]

ENV = {"socket": "KVWAKE_SOCKET", "data_dir": "KVWAKE_DATA_DIR", "model": "KVWAKE_MODEL", "remote": "KVWAKE_REMOTE",
       "http_token": "KVWAKE_HTTP_TOKEN",
       "remote_endpoint": "AWS_ENDPOINT_URL", "remote_access_key_id": "AWS_ACCESS_KEY_ID",
       "remote_secret_access_key": "AWS_SECRET_ACCESS_KEY", "remote_region": "AWS_REGION"}


@dataclass(frozen=True)
class Tuning:
    """Knobs that trade one cost for another, or switch on a diagnostic; the module docstring says where
    their values come from. None, where allowed, leaves the choice to the machine."""

    # turns that come at once prefill packed in one forward pass; False: one turn at a time, each to its
    # first token before the next starts (a pass's cost per turn against its tokens' cost); None: packed where
    # a GPU computes, one at a time on the CPU (model/packing.py `wanted`)
    pack_prefill: bool | None = None
    # where MLX computes on the CPU, threads that run turns that come at once apart, each its own pass (the
    # engine's among them: a pass there keeps one core busy), packed unless pack_prefill is false; 1: turns one
    # at a time (model/parallel_rows.py; measured no gain on two cores: docs/decisions.md, "Turns apart on the
    # CPU's cores"). A GPU runs a pack in one pass whatever this says
    prefill_threads: int = 1
    # on CUDA, a turn's chunk longer than plain ops take (257 to 2,047 tokens) runs fused at a padded shape other
    # turns share (model/attention.py `padded_attention`); false: at its own shape, a cuDNN graph built for each
    padded_prefill: bool = True
    # while nothing decodes, the first jobs of turns that reach the engine at once wait this long at most for
    # the turns still on their way (rendered, matched), to prefill as one pack; 0: taken as they come (a
    # pack of the first turn, then one of the others)
    pack_gather_ms: float = 50.0
    # where turns go one at a time (pack_prefill off), the waiting turns' prefill runs before other calls' decode
    # steps for at most this long between two of them: sooner first tokens, longer gaps in the streams of the
    # calls decoding meanwhile; 0: a decode step between every two jobs (the turns' chunks sliced beside them)
    prefill_first_ms: float = 1000.0
    # a prefill slice's target beside decoding calls, in decode steps: larger, sooner first tokens for the
    # prompt; smaller, shorter gaps between a decoding neighbour's tokens
    slice_of_step: float = 1.0
    # how a wake lays blocks out: "direct" (decoders write MLX's memory) or "staged" (a ring the device
    # joins); None: by the backend (staged where a GPU computes)
    restore_mode: str | None = None
    # where a wake fills MLX's memory from the CPU ("direct"), block files are decoded and verified by this many
    # worker processes (store/decode_procs.py) and each tensor copied into place by the pool's threads; 0: by
    # the threads themselves. A prototype, off until a many-core host measures it (docs/decisions.md, "Wake on
    # the CPU: the GIL, measured")
    decode_processes: int = 0
    # Linux: the codec and disk workers run this many nice levels below the daemon (0 to 19; 0: at its
    # priority): cores yielded to the engine thread, sleeps and wakes slower where cores are short
    pool_nice: int = 0
    # chat templates rendered at once; None: a quarter of the cores. More: renders queue less, and take
    # cores from the engine thread
    renders_at_once: int | None = None
    # engine jobs longer than this are named in `status` (lower: more jobs named, the oldest dropped sooner)
    slow_job_ms: float = 50.0
    slow_jobs_kept: int = 64  # the latest slow jobs `status` keeps (more: a longer look back, more memory)
    # a watcher thread reports waits for the GIL of this long (`status.gil`); None: off. A diagnostic:
    # the watcher wakes often, which a busy daemon pays for
    gil_watch_ms: float | None = None
    gil_watch_kept: int = 64  # the latest GIL waits `status` keeps
    # Python's switch interval (ms) while a model loads (model/switching.py): a decoding model's engine thread
    # gets the GIL back from the loader's Python this soon; 0: Python's own (5 ms). Off until a run shows it
    # helps (docs/benchmarks.md, "Several models")
    load_switch_ms: float = 0.0
    # how a model's weights are read (model/weights.py): "mapped" (through a staging slot the GPU copies from in
    # place: CUDA's, the others' decode steps barely slowed) or "mlx" (MLX's own load, in pieces); None: by the
    # backend (mapped on CUDA, MLX's where memory is unified or on the CPU)
    weights_read: str | None = None
    # True: `serve` leaves PyTorch and the other frameworks it never runs importable, and transformers'
    # scan of its models as it comes (a slower start, for comparison: daemon/imports.py)
    import_frameworks: bool = False
    # CUDA: a batched decode step's attention by the flash-decoding kernel over each row's own tokens
    # (model/ragged_decode.py); False: mlx-lm's masked attention over the padded batch (for comparison)
    row_kernel: bool = True
    # CUDA: a 4-bit model's products of up to 32 rows (a batch decoding) by kvwake's kernel, which reads the
    # weight once and dequantizes it in registers (model/quantized_kernel.py); False: MLX's vector kernel or a
    # dequantized product (model/quantized.py)
    quantized_kernel: bool = True
    # CUDA: MLX's kernels the model needs compiled by a child process while the weights load, into the kernel
    # cache under the data directory (model/kernel_cache.py); False: each compiled where it is first met
    kernel_warmer: bool = True
    # CUDA: the attention paths' costs (a short chunk's plain ops or fused kernel, model/attention.py PathCosts) kept
    # in a file beside the kernel cache and, where it lacks them, measured by a kernel warmer beside the load: taken
    # before the first chunk. False: measured by the warm-up in idle moments, which back-to-back agents may never
    # leave (docs/decisions.md, "The attention paths' costs measured before serving")
    paths_ahead: bool = False
    # the first start hashes the other configured models' files into the digest cache, one file at a time on a
    # thread of its own, so that their loads find their bundle's digests cached (kv/bundle.py digests_ahead)
    digests_ahead: bool = True
    # the first start builds the other configured models' modules (lazily, nothing read) where weights are read
    # the mapped way, for their loads to take instead of building them beside the decoding (model/weights.py
    # prepare)
    modules_ahead: bool = True
    # plain-attention layers' KV in a pool of pages, a shared prefix's blocks held once (kv/paged_cache.py); None:
    # on CUDA for a model whose every layer is plain attention, off elsewhere (on the CPU each step gathers every
    # row's pages; Metal has no paged kernel). On CUDA a fleet over a shared prompt decodes as fast over pages and
    # holds a fraction of the KV; a lone agent's turn over a long context attends over a copy of its pages
    # (docs/decisions.md, "The paged default")
    paged_kv: bool | None = None
    # CUDA, with paged_kv: a paged batch's attention by the paged kernel, reading every row's pages in place
    # (model/paged_attention.py); False: each row's pages gathered into MLX's fused attention; None: on CUDA
    paged_kernel: bool | None = None
    # a model with sliding-window or recurrent layers takes restore points while it prefills, so its
    # prefixes are reused (kv/points.py); False: such a model reuses only whole snapshots
    restore_points: bool = True
    # a session keeps a device copy of its latest restore point's window and recurrent state (those layers'
    # bytes once more): a resent history that parts from its tokens goes back there without reading the store;
    # False: such a resend restores the point and its blocks from the store
    held_points: bool = True
    # sliding-window layers' rows at a restore point stored by token in the blocks, the point over them a
    # marker (kv/window_rows.py); False: a point holds its rings whole
    window_blocks: bool = True
    # a model whose only uncuttable layers are sliding windows' rings (Gemma 3) takes its restore points from
    # the prefill chunks that ran past them (kv/points.py `cut_at`); False: its chunks stop at each point, as a
    # model with recurrent layers' do
    cut_points: bool = True
    # while the model loads, the blocks of the sessions touched last before the stop are read and verified into
    # memory (kv/hot_set.py), so the wakes right after the start take them from there; False: each wake reads its
    # own from the store
    restart_prefetch: bool = True
    # bytes those blocks may take in memory until their sessions wake; None: a quarter of the memory available
    # at the start. Bounds a load's read-ahead too (`load_prefetch`), a quarter of what is available then
    restart_prefetch_bytes: int | None = None
    # while a model loads on demand for operations on sessions of it that sleep, their blocks are read and verified
    # into the memory its engine will take (sessions/read_ahead.py), so their wakes after the load take them from
    # there; False: each wake reads its own from the store
    load_prefetch: bool = True

    def __post_init__(self) -> None:
        for name, ok, wanted in _TUNING_RULES:
            value = getattr(self, name)
            if value is not None and not ok(value):
                raise ValueError(f"tuning {name} must be {wanted}, not {value!r}")
        if self.weights_read not in (None, "mapped", "mlx"):
            raise ValueError(f"tuning weights_read must be \"mapped\" or \"mlx\", not {self.weights_read!r}")
        if self.restore_mode not in (None, "direct", "staged"):
            raise ValueError(f"tuning restore_mode must be \"direct\" or \"staged\", not {self.restore_mode!r}")


_TUNING_RULES = (
    ("slice_of_step", lambda v: 0 < v < math.inf, "a number above 0"),
    ("pack_gather_ms", lambda v: 0 <= v < math.inf, "a number of ms, 0 (never held) or more"),
    ("prefill_first_ms", lambda v: 0 <= v < math.inf, "a number of ms, 0 (a step between every two jobs) or more"),
    ("pool_nice", lambda v: 0 <= v <= 19, "a whole number of nice levels, 0 to 19"),
    ("renders_at_once", lambda v: v >= 1, "a count above 0"),
    ("slow_job_ms", lambda v: 0 <= v < math.inf, "a number of ms, 0 (every job) or more"),
    ("slow_jobs_kept", lambda v: v >= 1, "a count above 0"),
    ("gil_watch_ms", lambda v: 0 < v < math.inf, "a number of ms above 0"),
    ("gil_watch_kept", lambda v: v >= 1, "a count above 0"),
    ("load_switch_ms", lambda v: 0 <= v < math.inf, "a number of ms, 0 (Python's own) or more"),
    ("restart_prefetch_bytes", lambda v: v >= 0, "a number of bytes, 0 or more"),
    ("prefill_threads", lambda v: v >= 1, "a count above 0"),
    ("decode_processes", lambda v: v >= 0, "a count, 0 (threads decode) or more"),
)


@dataclass(frozen=True)
class Settings:
    """Everything `kvwake serve` needs; see the module docstring for where values come from."""

    socket: Path = field(default_factory=default_socket)
    data_dir: Path = field(default_factory=default_data_dir)
    model: str | None = None  # an mlx-lm folder or hub id; None: the default model
    # Several models (model/registry.py): further `--model`s (PATH, hub id or NAME=PATH), a folder of model
    # folders, the [models] table; how many may be loaded at once, the bytes their weights and hot KV may take
    # together (model/budget.py; at most what MLX's memory limit leaves), and how long one may stay unused
    # before it is unloaded (its sessions slept). None: no limit
    more_models: tuple[str, ...] = ()
    models_dir: Path | None = None
    models: dict[str, Any] = field(default_factory=dict)
    max_loaded: int | None = None
    models_budget_bytes: int | None = None
    model_ttl_s: float | None = None
    block_tokens: int = 128
    # KV of hot sessions; LRU sessions sleep above it. None: half the memory the KV may have beside the weights
    # and a prefill's scratch (model/memory.py hot_budget)
    hot_budget_bytes: int | None = None
    idle_timeout_s: float = 600.0  # a session idle this long sleeps
    store_budget_bytes: int | None = 8 << 30  # prefix-cache blocks beyond this are evicted by gc
    ram_tier_bytes: int = 256 << 20  # decoded blocks of shared prefixes kept in RAM (the RAM tier)
    # block codec for new blocks: "planes-zstd" (smallest), "raw" (fastest to read), or "auto": the one
    # measured fastest to wake on this machine, once, recorded in the store (store/codecpick.py)
    codec: str = "auto"
    io_workers: int | None = None  # sleep/wake worker threads; None: every core
    io_inflight_bytes: int = 512 << 20  # raw KV bytes one sleep or wake may have in flight
    keep_history: int = 4  # unlabeled snapshots kept per session
    persist: bool = True  # write a hot session's full blocks as they fill (kill -9 loses at most the tail)
    kv_bits: int | None = None
    max_batch: int = 32  # generate calls decoded together in one forward pass; 1: each alone (solo-bit-exact)
    prefill_step: int | None = None  # tokens per prefill chunk (chunks end on its multiples); None: 2048 on CUDA, else 512
    max_context: int | None = None  # tokens a session may hold, below the model's own context; None: the model's
    mlx_memory_bytes: int | None = None  # MLX's memory limit; None: 90% of the GPU's memory (CUDA), else of RAM
    mlx_cache_bytes: int = 4 << 30  # freed buffers MLX keeps for reuse (daemon/model/memory.py says why)
    kv_group_size: int = 64
    allow_uids: tuple[int, ...] = ()  # besides the daemon's own uid
    read_timeout_s: float = 30.0  # a peer stalled mid-frame this long is dropped
    out_buffer_bytes: int = 8 << 20  # replies queued for a client that stopped reading; beyond it, it is dropped
    lifecycle_interval_s: float = 5.0
    gc_interval_s: float = 900.0  # store gc (history, prefix-cache budget, orphans) this often
    log_level: str = "INFO"
    remote: str | None = None  # s3://BUCKET/PREFIX: the shared tier; None: local only
    remote_endpoint: str | None = None  # e.g. http://127.0.0.1:8333 for SeaweedFS or MinIO
    remote_access_key_id: str | None = None
    remote_secret_access_key: str | None = field(default=None, repr=False)
    remote_region: str = "us-east-1"
    remote_timeout_s: float = 10.0  # one S3 request; also how long sleep's remote_wait waits at most x3
    remote_prefix_deadline_s: float = 2.0  # a prefix lookup waits this long for remote blocks, then prefills
    remote_queue: int = 1024  # snapshots waiting for upload; more are dropped (and counted) until it drains
    http: str | None = None  # [HOST:]PORT of the OpenAI-compatible API (daemon/fronts/http.py); None: off
    http_token: str | None = field(default=None, repr=False)  # None: the one in <data_dir>/http-token
    http_auth: bool = True  # False (`--http-no-token`): no bearer token asked, loopback only
    # OpenAI's built-in tools (web_search, ...) in a Responses request: "omit" (left out of the prompt, named
    # in the X-Kvwake-Omitted-Tools header and the log), as an agent's default config needs (Codex CLI sends
    # web_search), or "refuse" (a 400 naming them): fronts/responses_tools.py
    http_hosted_tools: str = "omit"
    http_keepalive_s: float = 5.0  # a stream with nothing to send this long (a long prefill) gets an SSE comment
    stateless_ttl_s: float | None = 7 * 86400.0  # stateless HTTP sessions unchanged this long are deleted
    # Model names HTTP clients may ask for ([aliases] table: name -> the loaded model's name); empty: any name.
    aliases: dict[str, str] = field(default_factory=dict)
    # System blocks of Anthropic requests left out when they begin with one of these (docs/http.md).
    anthropic_drop_system: tuple[str, ...] = ("x-anthropic-billing-header:",)
    tuning: Tuning = field(default_factory=Tuning)

    @property
    def store_dir(self) -> Path:
        return self.data_dir / "store"

    @property
    def http_token_file(self) -> Path:
        return self.data_dir / "http-token"

    @property
    def status_file(self) -> Path:
        return self.socket.with_suffix(".json")


def _coerce(name: str, value: Any) -> Any:
    kind = {f.name: f.type for f in fields(Settings)}[name]
    if name in ("socket", "data_dir", "models_dir"):
        return Path(str(value)).expanduser()
    if name == "more_models":
        return (str(value),) if isinstance(value, str) else tuple(str(v) for v in value)
    if name == "models":
        parse_models_table(value)  # checked here, kept as the table
        return dict(value)
    if name == "allow_uids":
        return tuple(int(v) for v in value)
    if name == "anthropic_drop_system":
        return (str(value),) if isinstance(value, str) else tuple(str(v) for v in value)
    if name == "aliases":
        if not isinstance(value, dict):
            raise ValueError("aliases must be a table of model name = loaded model name")
        return {str(k): str(v) for k, v in value.items()}
    if value is None:
        return None
    if name == "http_hosted_tools" and value not in ("refuse", "omit"):
        raise ValueError(f"http_hosted_tools must be \"refuse\" or \"omit\", not {value!r}")
    if kind == "bool" or kind is bool:
        return value if isinstance(value, bool) else str(value).lower() in ("1", "true", "yes")
    if "int" in str(kind) and "float" not in str(kind):
        return int(value)
    if "float" in str(kind):
        return float(value)
    return str(value)


def _tuning_value(name: str, value: Any) -> Any:
    """`value` (text from a flag or the environment, or a TOML value) as the type of Tuning's `name`."""
    kind = get_type_hints(Tuning)[name]
    base = next(t for t in (bool, int, float, str) if t is kind or t in getattr(kind, "__args__", ()))
    if isinstance(value, str) and base is bool:
        text = value.strip().lower()
        if text not in _BOOL_TEXT:
            raise ValueError(f"not a yes or no: {value!r}")
        return _BOOL_TEXT[text]
    if isinstance(value, str) and base in (int, float):
        return base(value)
    if isinstance(value, bool) != (base is bool) or not isinstance(value, (int, float) if base is float else base):
        raise ValueError(f"not {base.__name__}: {value!r}")
    return base(value)


_BOOL_TEXT = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


def load_tuning(layers: list[tuple[str, Mapping[str, Any]]]) -> Tuning:
    """Tuning from (source, {name: value}) layers, later ones over earlier ones. Raises ValueError naming
    the source and the name of an unknown knob or a bad value."""
    names, values = {f.name for f in fields(Tuning)}, {}
    for source, layer in layers:
        for name, value in layer.items():
            if name not in names:
                raise ValueError(f"{source}: unknown tuning {name!r} (known: {', '.join(sorted(names))})")
            try:
                values[name] = _tuning_value(name, value)
                Tuning(**{name: values[name]})
            except (TypeError, ValueError) as exc:
                raise ValueError(f"{source}: bad tuning {name}={value!r}: {exc}") from None
    return Tuning(**values)


def tuning_from_environment() -> list[tuple[str, Mapping[str, Any]]]:
    """One layer per KVWAKE_<NAME> set (not empty), named by its variable."""
    named = ((f"KVWAKE_{f.name.upper()}", f.name) for f in fields(Tuning))
    return [(variable, {name: os.environ[variable]}) for variable, name in named if os.environ.get(variable)]


def load_settings(flags: dict[str, Any] | None = None, config_file: Path | None = None) -> Settings:
    """Resolve settings from flags (None values ignored), environment, config file, defaults. Tuning
    comes as flags["tuning"], a {name: value} map (`--tune NAME=VALUE`), and field by field.

    Raises ValueError naming an unknown config key or a bad value.
    """
    values: dict[str, Any] = {}
    flags = dict(flags or {})
    tuning: list[tuple[str, Mapping[str, Any]]] = []
    path = config_file or default_config()
    if path.exists():
        data = tomllib.loads(path.read_text())
        unknown = set(data) - {f.name for f in fields(Settings)}
        if unknown:
            raise ValueError(f"{path}: unknown settings {sorted(unknown)}")
        table = data.pop("tuning", {})
        if not isinstance(table, dict):
            raise ValueError(f"{path}: tuning must be a table ([tuning])")
        tuning.append((f"{path} [tuning]", table))
        values.update(data)
    tuning += tuning_from_environment()
    tuning.append(("--tune", flags.pop("tuning", None) or {}))
    values.update({k: os.environ[v] for k, v in ENV.items() if os.environ.get(v)})
    values.update({k: v for k, v in flags.items() if v is not None})
    try:
        settings = dataclasses.replace(Settings(), **{k: _coerce(k, v) for k, v in values.items()})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad setting: {exc}") from None
    return dataclasses.replace(settings, tuning=load_tuning(tuning))


# -- the [models] table (model/registry.py serves by it) ---------------------------------------------------


@dataclass(frozen=True)
class ModelSpec:
    """One model the daemon may serve: `source` is an mlx-lm folder or hub id (None: the default model)."""

    name: str
    source: str | None
    aliases: tuple[str, ...] = ()
    pinned: bool = False

    def answers(self, requested: str) -> bool:
        """Whether `requested` names this model: its name, or one of its alias patterns."""
        return requested == self.name or any(fnmatch.fnmatchcase(requested, a) for a in self.aliases)


def _spec(name: str, value: Any, where: str) -> ModelSpec:
    if isinstance(value, str):
        return ModelSpec(name, value)
    if not isinstance(value, Mapping) or not isinstance(value.get("path"), str):
        raise ValueError(f"{where}: model {name!r} must be a path, or a table with a path")
    unknown = set(value) - {"path", "aliases", "pinned"}
    if unknown:
        raise ValueError(f"{where}: model {name!r} has unknown keys {sorted(unknown)} (known: aliases, path, pinned)")
    aliases = value.get("aliases", ())
    if isinstance(aliases, str) or not all(isinstance(a, str) for a in aliases):
        raise ValueError(f"{where}: model {name!r}: aliases must be a list of names or patterns")
    return ModelSpec(name, value["path"], tuple(aliases), bool(value.get("pinned", False)))


def parse_models_table(table: Any, where: str = "[models]") -> dict[str, ModelSpec]:
    """The config file's `[models]` table as specs by name; ValueError names what is wrong."""
    if not isinstance(table, Mapping):
        raise ValueError(f"{where} must be a table of name = path (or a table with path, aliases, pinned)")
    return {str(name): _spec(str(name), value, where) for name, value in table.items()}
