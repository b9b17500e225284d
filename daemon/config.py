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
    remote = "s3://team-kv/agents"           # shared tier (docs/decisions.md, "Remote tier")
    remote_endpoint = "http://10.0.0.5:8333"  # else AWS_ENDPOINT_URL, else AWS itself
    http = "127.0.0.1:8080"  # the OpenAI and Anthropic APIs (token: KVWAKE_HTTP_TOKEN or <data dir>/http-token)
    anthropic_drop_system = ["x-anthropic-billing-header:"]  # system blocks left out (the default; [] keeps all)
    http_hosted_tools = "omit"  # OpenAI's built-in tools (web_search, ...) left out, not refused (Codex CLI)

    [aliases]                # model names clients may ask for; without the table any name is served
    "claude-sonnet-4-5" = "Qwen3-8B-4bit"    # -> the loaded model's name (its folder name or hub id)

Defaults come from platformdirs: the socket in the user runtime dir, the
store and converted models in the user data dir.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from kvwake.paths import default_config, default_data_dir, default_socket

__all__ = ["Settings", "default_socket", "load_settings"]

ENV = {"socket": "KVWAKE_SOCKET", "data_dir": "KVWAKE_DATA_DIR", "model": "KVWAKE_MODEL", "remote": "KVWAKE_REMOTE",
       "http_token": "KVWAKE_HTTP_TOKEN",
       "remote_endpoint": "AWS_ENDPOINT_URL", "remote_access_key_id": "AWS_ACCESS_KEY_ID",
       "remote_secret_access_key": "AWS_SECRET_ACCESS_KEY", "remote_region": "AWS_REGION"}


@dataclass(frozen=True)
class Settings:
    """Everything `kvwake serve` needs; see the module docstring for where values come from."""

    socket: Path = field(default_factory=default_socket)
    data_dir: Path = field(default_factory=default_data_dir)
    model: str | None = None  # an mlx-lm folder or hub id; None: the default model
    block_tokens: int = 128
    # KV of hot sessions; LRU sessions sleep above it. None: half the memory the KV may have beside the weights
    # and a prefill's scratch (model/memory.py hot_budget: ~26 GB on an 80 GB H100 with an 8B model's weights)
    hot_budget_bytes: int | None = None
    idle_timeout_s: float = 600.0  # a session idle this long sleeps
    store_budget_bytes: int | None = 8 << 30  # prefix-cache blocks beyond this are evicted by gc
    ram_tier_bytes: int = 256 << 20  # decoded hot blocks kept in RAM
    # block codec for new blocks: "planes-zstd" (smallest), "raw" (fastest to read), or "auto": the one
    # measured fastest to wake on this machine, once, recorded in the store (store/codecpick.py)
    codec: str = "auto"
    io_workers: int | None = None  # sleep/wake worker threads; None: every core
    io_inflight_bytes: int = 512 << 20  # raw KV bytes one sleep or wake may have in flight
    keep_history: int = 4  # unlabeled snapshots kept per session
    persist: bool = True  # write a hot session's full blocks as they fill (kill -9 loses at most the tail)
    kv_bits: int | None = None
    max_batch: int = 32  # generate calls decoded together in one forward pass; 1: each alone (solo-bit-exact)
    prefill_step: int = 512  # tokens per prefill chunk; chunks end on its multiples
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
    # OpenAI's built-in tools (web_search, ...) in a Responses request: "refuse" (a 400 naming them) or
    # "omit" (left out of the prompt, named in the X-Kvwake-Omitted-Tools header): fronts/responses_tools.py
    http_hosted_tools: str = "refuse"
    http_keepalive_s: float = 5.0  # a stream with nothing to send this long (a long prefill) gets an SSE comment
    stateless_ttl_s: float | None = 7 * 86400.0  # stateless HTTP sessions unchanged this long are deleted
    # Model names HTTP clients may ask for ([aliases] table: name -> the loaded model's name); empty: any name.
    aliases: dict[str, str] = field(default_factory=dict)
    # System blocks of Anthropic requests left out when they begin with one of these (docs/http.md).
    anthropic_drop_system: tuple[str, ...] = ("x-anthropic-billing-header:",)

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
    if name in ("socket", "data_dir"):
        return Path(str(value)).expanduser()
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


def load_settings(flags: dict[str, Any] | None = None, config_file: Path | None = None) -> Settings:
    """Resolve settings from flags (None values ignored), environment, config file, defaults.

    Raises ValueError naming an unknown config key or a bad value.
    """
    values: dict[str, Any] = {}
    path = config_file or default_config()
    if path.exists():
        data = tomllib.loads(path.read_text())
        unknown = set(data) - {f.name for f in fields(Settings)}
        if unknown:
            raise ValueError(f"{path}: unknown settings {sorted(unknown)}")
        values.update(data)
    values.update({k: os.environ[v] for k, v in ENV.items() if os.environ.get(v)})
    values.update({k: v for k, v in (flags or {}).items() if v is not None})
    try:
        return dataclasses.replace(Settings(), **{k: _coerce(k, v) for k, v in values.items()})
    except (TypeError, ValueError) as exc:
        raise ValueError(f"bad setting: {exc}") from None
