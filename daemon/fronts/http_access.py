"""Who may call the HTTP API, and where it listens (`kvwake serve --http [HOST:]PORT`; fronts/http.py serves it).

The Unix socket admits only its owner's uid; a TCP port admits every
local user, and sessions hold private conversations. So every request needs
`Authorization: Bearer <token>` (or `x-api-key: <token>`, as Anthropic's
clients send it): the token is `--http-token` /
`KVWAKE_HTTP_TOKEN` when given, else generated once into `<data dir>/http-token`
(mode 0600, as Jupyter keeps its token), where `kvwake http` and
`kvwake.client.openai_config()` find it. `--http-no-token` turns the check
off, and only on a loopback address. A bare port binds 127.0.0.1.
"""

from __future__ import annotations

import contextlib
import hmac
import ipaddress
import os
import secrets
import socket
from collections.abc import Callable
from pathlib import Path
from typing import Any

from starlette.responses import JSONResponse

from kvwake.daemon.fronts import anthropic_shapes
from kvwake.daemon.fronts.openai_shapes import ApiError

__all__ = ["BearerAuth", "HttpTokenError", "anthropic_client", "bind", "is_loopback", "parse_address", "read_token",
           "refusal"]


class HttpTokenError(RuntimeError):
    """The token file cannot be made or trusted."""


def parse_address(value: str) -> tuple[str, int]:
    """`PORT` (loopback) or `HOST:PORT` (IPv6 in brackets); raises ValueError."""
    host, _, port = value.rpartition(":")
    host = host.strip("[]") or "127.0.0.1"
    if not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--http {value!r}: expected PORT or HOST:PORT")
    return host, int(port)


def is_loopback(host: str) -> bool:
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return host == "localhost"


def read_token(path: Path, *, create: bool) -> str:
    """The token in `path`: made once (0600) when `create`; refused if others may read it."""
    if create and not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileExistsError):  # another process made it first: read theirs
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(secrets.token_urlsafe(32) + "\n")
    mode = path.stat().st_mode
    if mode & 0o077:
        raise HttpTokenError(f"{path} is readable by others (mode {oct(mode & 0o777)}); chmod 600 it")
    token = path.read_text().strip()
    if len(token) < 16:
        raise HttpTokenError(f"{path} holds no usable token (16 characters at least)")
    return token


def bind(host: str, port: int) -> socket.socket:
    """The listening socket (made here, so a port 0 is known before the server starts)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(128)
    sock.setblocking(False)
    return sock


def anthropic_client(path: str, headers: Any) -> bool:
    """Whether a request gets Anthropic's shapes: on its routes, or from a client that sends its version header."""
    return path.startswith("/v1/messages") or "anthropic-version" in headers


def refusal(err: ApiError, anthropic: bool, headers: dict[str, str] | None = None) -> JSONResponse:
    """An error response in the shape of the API the client speaks."""
    status, body = anthropic_shapes.error_body(err) if anthropic else (err.status, err.body())
    return JSONResponse(body, status_code=status, headers=headers)


class BearerAuth:
    """ASGI middleware: every HTTP request carries the token, as `Authorization: Bearer <token>` or as
    `x-api-key: <token>` (Anthropic's clients), compared in constant time."""

    def __init__(self, app: Any, token: str | None) -> None:
        self.app, self.expected = app, token.encode() if token else None

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] == "http" and self.expected is not None:
            headers = dict(scope["headers"])
            scheme, _, given = headers.get(b"authorization", b"").strip().partition(b" ")
            # The scheme is case-insensitive (RFC 9110); the token is compared in constant time.
            bearer = scheme.lower() == b"bearer" and hmac.compare_digest(given.strip(), self.expected)
            if not (bearer or hmac.compare_digest(headers.get(b"x-api-key", b"").strip(), self.expected)):
                err = ApiError(401, "missing or wrong token (see `kvwake http`)", code="invalid_api_key")
                anthropic = anthropic_client(scope["path"], {k.decode("latin-1") for k in headers})
                await refusal(err, anthropic, {"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)
