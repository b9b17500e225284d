"""Many agents on one daemon (real `kvwake serve`, tiny model): concurrent calls decode in one batch,
and one session's long prefill does not stall another session's tokens (invariant 7)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from kvwake.daemon.model import attention
from testkit.daemon import Daemon, RawClient
from testkit.tinymodel import make_model_dir


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    # A 64k context: the long prefill below (4k tokens) and an endless talker must fit it.
    return make_model_dir(tmp_path_factory.mktemp("models") / "tiny", ascii_replies=True, max_position_embeddings=65536)


def at_once(daemon: Daemon, names: list[str], call: Callable[[Any, str], Any]) -> dict[str, Any]:
    """call(client, name) for every name, each from its own thread and connection, released together."""
    results: dict[str, Any] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(len(names))

    def run(name: str) -> None:
        try:
            with daemon.client() as c:
                start.wait()
                results[name] = call(c, name)
        except BaseException as exc:  # surfaced below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(n,)) for n in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    return results


def generate_in_threads(daemon: Daemon, names: list[str], max_tokens: int) -> dict[str, list[int]]:
    return at_once(daemon, names, lambda c, name: c.call("session.generate", session_id=name,
                                                         max_tokens=max_tokens)["tokens"])


@pytest.fixture(scope="module")
def arch_dirs(tmp_path_factory):
    """arch -> a tiny model of it: plain KV (the module's), a sliding window, recurrent state beside attention."""
    def make(arch: str):
        return make_model_dir(tmp_path_factory.mktemp("models") / arch, arch=arch)
    return make


@pytest.mark.parametrize("arch", ["llama", "gemma3_text", "lfm2"])
def test_concurrent_calls_decode_together_and_give_what_each_gives_alone(tmp_path, model_dir, arch_dirs, arch):
    model_dir = model_dir if arch == "llama" else arch_dirs(arch)
    names = [f"agent{i}" for i in range(4)]
    texts = [f"agent {i} works on task {i * 7}" for i in range(4)]
    outputs = {}
    for mode, extra in (("batched", []), ("solo", ["--max-batch", "1"])):
        (tmp_path / mode).mkdir()
        d = Daemon(tmp_path / mode, model_dir, extra=extra).start()
        try:
            with d.client() as c:
                for n, text in zip(names, texts):
                    c.call("session.create", session_id=n)
                    c.call("session.append", session_id=n, text=text)
            outputs[mode] = generate_in_threads(d, names, max_tokens=64)
            with d.client() as c:
                gen = c.call("status")["generation"]
            assert gen["mode"] == mode and gen["running"] == 0
            assert gen["cuda_graphs"] is attention.cuda_graphs()  # as this process sees it (None off CUDA)
            if mode == "batched":  # four calls shared forward passes
                assert gen["max_batch_seen"] >= 2 and gen["decode_tokens"] > 1.5 * gen["decode_steps"]
                assert gen["admit_s"] > 0  # the calls' admission, timed apart from the passes (status over RPC)
            else:
                assert gen["max_batch_seen"] == 1 and gen["decode_tokens"] == gen["decode_steps"]
                assert "max_batch" in gen["reason"]
        finally:
            assert d.stop() == 0
    if arch == "gemma3_text" and attention.on_cuda():  # its window layers' attention is mlx's fused one, batched
        # or alone, not the row kernel (plain KV only), and rounds by the batch there (docs/decisions.md, "max_batch")
        from mlx_lm import load

        from tests.test_batching_archs import assert_as_alone

        model, tokenizer = load(str(model_dir))
        got, alone = ([outputs[mode][n] for n in names] for mode in ("batched", "solo"))
        assert_as_alone(SimpleNamespace(model=model), [tokenizer.encode(t) for t in texts], got, alone)
    else:
        assert outputs["batched"] == outputs["solo"]


def test_a_long_prefill_does_not_stall_another_sessions_tokens(tmp_path, model_dir):
    (tmp_path / "none.toml").write_text("prefill_step = 32\n")  # many chunks for the long prompt
    d = Daemon(tmp_path, model_dir).start()
    try:
        with d.client() as c:
            c.call("session.create", session_id="talker")
            c.call("session.append", session_id="talker", text="tell me a long story")
            c.call("session.create", session_id="reader")
        talker = RawClient(d.socket)
        arrivals: list[float] = []
        msgid = talker.send("session.generate", {"session_id": "talker", "max_tokens": 1 << 20, "stream": True})

        def listen() -> None:
            try:
                while True:
                    data = talker.sock.recv(1 << 16)
                    if not data:
                        return
                    talker.unpacker.feed(data)
                    arrivals.extend(time.monotonic() for m in talker.unpacker if m[0] == 2)
            except OSError:
                return

        reader_thread = threading.Thread(target=listen)
        reader_thread.start()
        while len(arrivals) < 5:
            time.sleep(0.01)
        with d.client() as c:
            began = time.monotonic()
            appended = c.call("session.append", session_id="reader", text="a long document. " * 250)
            ended = time.monotonic()
        during = sum(began < t < ended for t in arrivals)
        talker.close()  # the talker's call is cancelled by its disconnect
        reader_thread.join(30)
        assert appended["prefilled"] > 4000  # about 4,250 tokens, in chunks of 32
        # The talker kept getting tokens while the reader's prompt prefilled: about one per chunk.
        assert during >= 20, f"talker got {during} tokens during a {ended - began:.2f} s prefill of 130+ chunks"
        with d.client() as c:
            deadline = time.monotonic() + 30
            while c.call("session.info", session_id="talker")["busy"] and time.monotonic() < deadline:
                time.sleep(0.05)
            assert c.call("session.info", session_id="talker")["busy"] is None
            assert msgid == 1
    finally:
        assert d.stop() == 0


def chat_turns_at_once(daemon: Daemon, conversations: dict[str, list[dict[str, str]]]) -> dict[str, list[int]]:
    """Every session's next chat turn sent in the same moment (non-streamed, 6 tokens): session -> its reply."""
    def chat(c: Any, name: str) -> list[int]:
        r = c.call("session.chat", session_id=name, messages=conversations[name], max_tokens=6)
        conversations[name] += [{"role": "assistant", "content": r["text"]}]
        return r["tokens"]
    return at_once(daemon, list(conversations), chat)


def test_chat_turns_sent_at_once_prefill_in_one_pass_and_reply_as_with_packing_off(tmp_path, model_dir):
    """Turns whose chunks wait for the engine together go in one forward pass (model/packing.py) beside a
    decoding talker; each reply is the one the daemon gives with packing off (bit-exact on the CPU)."""
    names = [f"agent{i}" for i in range(6)]
    replies: dict[str, list[dict[str, list[int]]]] = {}
    packed: dict[str, int] = {}
    # packing on (the GPU's default), and off (the CPU's: turns one at a time, model/scheduler/turns.py)
    for mode, env in (("packed", {"KVWAKE_PACK_PREFILL": "1"}), ("off", {"KVWAKE_PACK_PREFILL": "0"})):
        (tmp_path / mode).mkdir()
        d = Daemon(tmp_path / mode, model_dir, env=env).start()
        try:
            conversations = {n: [{"role": "user", "content": f"agent {i} reads module {i * 7}"}]
                             for i, n in enumerate(names)}
            with d.client() as c:
                for n in names:
                    c.call("session.create", session_id=n)
                c.call("session.create", session_id="talker")
                c.call("session.append", session_id="talker", text="tell me a long story")
            talker = RawClient(d.socket)
            talker.send("session.generate", {"session_id": "talker", "max_tokens": 1 << 20, "stream": True})
            replies[mode] = []
            for turn in range(3):
                for i, n in enumerate(names):
                    conversations[n] = conversations[n] + [{"role": "user", "content": f"step {turn}: fix test {i}"}]
                replies[mode].append(chat_turns_at_once(d, conversations))
            talker.close()
            with d.client() as c:
                packed[mode] = c.call("status")["counters"]["prefill_packed_chunks"]
        finally:
            assert d.stop() == 0
    assert replies["packed"] == replies["off"]
    assert packed["off"] == 0
    # 18 turns in three moments: the ones whose chunks met in the queue went together (at least two once)
    assert packed["packed"] >= 2, packed
