"""This daemon's side of the remote tier's leases: its own view of the leases it holds (`LeaseBook`, kept in
`<data dir>/remote/leases.json`, so a session it holds wakes without asking the remote) and its stable name
in lease objects (`daemon_id`). The lease rule is daemon/sessions/remote_tier.py's docstring."""

from __future__ import annotations

import json
import secrets
from dataclasses import asdict
from pathlib import Path

from kvwake.store.files import write_durable
from kvwake.store.remote.objects import Lease

__all__ = ["LeaseBook", "daemon_id"]


class LeaseBook:
    """This daemon's leases, by session id, persisted (`state` "lost": another daemon took it over)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.leases: dict[str, Lease] = {}
        if path.exists():
            self.leases = {sid: Lease(**v) for sid, v in json.loads(path.read_text()).items()}

    def get(self, session_id: str) -> Lease | None:
        return self.leases.get(session_id)

    def set(self, session_id: str, lease: Lease) -> None:
        self.leases[session_id] = lease
        self.path.parent.mkdir(parents=True, exist_ok=True)
        write_durable(self.path, json.dumps({k: asdict(v) for k, v in self.leases.items()}).encode())


def daemon_id(folder: Path) -> str:
    """This daemon's stable name in lease objects (made once per data dir)."""
    path = folder / "daemon-id"
    if not path.exists():
        folder.mkdir(parents=True, exist_ok=True)
        write_durable(path, f"d-{secrets.token_hex(8)}".encode())
    return path.read_text().strip()
