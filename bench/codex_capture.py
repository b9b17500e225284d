"""Capture what Codex CLI sends on the Responses API: its first request, and its next one after a call of a
namespace's tool (the fixtures tests/test_responses_codex.py replays).

usage: python bench/codex_capture.py [--version 0.169.0] [--out tests/fixtures]

A stand-in Responses endpoint on a free port (no model): it answers Codex's first request with a
`function_call` of `multi_agent_v1`'s `close_agent` ({"target": "agent-7"}, with its `namespace`, as
OpenAI returns one), and the request that carries the tool's output with the message "Closed it.".
Codex (from npm, as bench/codex_cli.py installs it) runs `codex exec "Say hello"` against it with
the provider docs/http.md gives, its config otherwise the default. Writes
<out>/codex-<version>-request.json and <out>/codex-<version>-request-2.json, the bodies as sent.
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the test kit (testkit/) and bench/lib.py, from this checkout

from bench.lib import npm_binary  # noqa: E402


CALL = {"id": "fc_capture1", "type": "function_call", "status": "completed", "call_id": "call_capture1",
        "name": "close_agent", "namespace": "multi_agent_v1", "arguments": '{"target": "agent-7"}'}
MESSAGE = {"id": "msg_capture2", "type": "message", "role": "assistant", "status": "completed",
           "content": [{"type": "output_text", "text": "Closed it.", "annotations": [], "logprobs": []}]}


def events(item: dict, response_id: str) -> bytes:
    """A streamed response of one output item, as the Responses API sends it."""
    response = {"id": response_id, "object": "response", "created_at": 0, "status": "in_progress",
                "model": "local", "output": []}
    usage = {"input_tokens": 1, "input_tokens_details": {"cached_tokens": 0}, "output_tokens": 1,
             "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 2}
    sent = [("response.created", {"response": response}),
            ("response.output_item.added", {"output_index": 0, "item": item}),
            ("response.output_item.done", {"output_index": 0, "item": item}),
            ("response.completed", {"response": {**response, "status": "completed", "output": [item],
                                                 "usage": usage}})]
    return b"".join(f"event: {kind}\ndata: {json.dumps({'type': kind, 'sequence_number': i, **data})}\n\n".encode()
                    for i, (kind, data) in enumerate(sent))


def endpoint(bodies: list[bytes]) -> http.server.HTTPServer:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            body = self.rfile.read(int(self.headers.get("content-length", 0)))
            bodies.append(body)
            answered = json.loads(body)["input"][-1].get("type") == "function_call_output"
            data = events(MESSAGE if answered else CALL, f"resp_capture{len(bodies)}")
            self.send_response(200)
            self.send_header("content-type", "text/event-stream")
            self.send_header("content-length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: object) -> None:
            pass

    return http.server.HTTPServer(("127.0.0.1", 0), Handler)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--version", default="0.171.0")
    ap.add_argument("--out", default=str(ROOT / "tests" / "fixtures"))
    a = ap.parse_args()
    codex = npm_binary("@openai/codex", "codex", a.version)
    bodies: list[bytes] = []
    server = endpoint(bodies)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    work = Path(tempfile.mkdtemp(prefix="kvwake-codex-capture-"))
    (work / "home").mkdir()
    (work / "project").mkdir()
    (work / "home" / "config.toml").write_text(
        'model = "local"\nmodel_provider = "kvwake"\n\n[model_providers.kvwake]\nname = "kvwake"\n'
        f'base_url = "http://127.0.0.1:{server.server_port}/v1"\nenv_key = "KVWAKE_KEY"\nwire_api = "responses"\n')
    env = {**os.environ, "CODEX_HOME": str(work / "home"), "KVWAKE_KEY": "capture"}
    subprocess.run([str(codex), "exec", "--json", "--skip-git-repo-check", "--dangerously-bypass-approvals-and-sandbox",
                    "Say hello"], cwd=work / "project", env=env, check=True, stdin=subprocess.DEVNULL, timeout=300)
    server.shutdown()
    assert len(bodies) == 2, f"Codex sent {len(bodies)} requests, not 2"
    for suffix, body in zip(("", "-2"), bodies):
        path = Path(a.out) / f"codex-{a.version}-request{suffix}.json"
        path.write_text(json.dumps(json.loads(body), indent=1) + "\n")
        print(path)


if __name__ == "__main__":
    main()
