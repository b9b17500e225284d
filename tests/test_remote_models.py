"""The remote tier serves every model of a daemon (issue 53), against a real SeaweedFS: a session of the second
model goes up into that model's own namespace (bundle hash), where another daemon serving the same models
adopts it and wakes it exactly, and a cold append of that model finds its prompt's blocks there."""

from __future__ import annotations

import anyio

from kvwake.daemon.config import Settings
from kvwake.daemon.model.engine import Engine
from kvwake.daemon.model.generation import GenerateParams
from kvwake.daemon.session_state import Session
from kvwake.daemon.sessions.remote_tier import RemoteTier
from kvwake.store import Store
from testkit.seaweed import BUCKET, KEY_ID, SECRET
from testkit.tinymodel import make_model_dir
from tests.test_remote import weed  # noqa: F401 (the module's server)

B = 16
SYSTEM = [{"role": "system", "content": "You are a careful agent. Answer briefly and name your sources. " * 2}]


async def test_a_second_models_session_goes_to_its_own_namespace_and_is_adopted_there(tmp_path, weed):
    folders = {"main": make_model_dir(tmp_path / "main", arch="llama"),
               "small": make_model_dir(tmp_path / "small", arch="gemma3_text", seed=1, ascii_replies=True)}
    daemons = []
    for name in ("a", "b", "c"):
        settings = Settings(socket=tmp_path / f"{name}.sock", data_dir=tmp_path / name, block_tokens=B,
                            remote=f"s3://{BUCKET}/models", remote_endpoint=weed.endpoint,
                            remote_access_key_id=KEY_ID, remote_secret_access_key=SECRET)
        store = Store(settings.store_dir, block_tokens=B)
        engines = {model: Engine(store, settings.data_dir, folder) for model, folder in folders.items()}
        daemons.append((store, engines, RemoteTier(settings, engines["main"])))  # the default model's tier
    (_, a, tier_a), (_, b, tier_b), (_, c, tier_c) = daemons
    small = a["small"].bundle.hash
    try:
        async with anyio.create_task_group() as tg:
            for _, _, tier in daemons:
                tg.start_soon(tier.run)
            with anyio.fail_after(30):
                for _, _, tier in daemons:
                    await tier.ready.wait()
            s, twin, messages = Session("agent"), Session("twin"), [*SYSTEM, {"role": "user", "content": "List tools."}]
            a["small"].append(s, messages=messages)
            a["small"].append(twin, messages=messages)  # never slept: what the session continues with
            expected = a["small"].generate(twin, GenerateParams(max_tokens=8)).tokens
            snapshot = a["small"].sleep(s)["snapshot_id"]
            tier_a.enqueue("agent", snapshot)
            await tier_a.wait_uploaded("agent", snapshot)
            assert await tier_a.release("agent")
            # in the small model's namespace, not the default model's
            assert tier_a.remote_for(small).head("agent") is not None and tier_a.remote.head("agent") is None
            await tier_b.adopt("agent", engine=b["small"])
            woken, _ = b["small"].wake("agent")
            assert b["small"].generate(woken, GenerateParams(max_tokens=8)).tokens == expected
            assert await tier_b.sessions() == (["agent"], None)  # the namespaces it has used
            # a cold append of the small model elsewhere finds the prompt's blocks in the small model's namespace
            tokens = list(s.tokens[:-1])
            assert await anyio.to_thread.run_sync(lambda: tier_c.prefetch(tokens)) == 0  # the default's: none
            found = await anyio.to_thread.run_sync(lambda: tier_c.prefetch(tokens, c["small"]))
            assert found == len(tokens) // B > 0
            tg.cancel_scope.cancel()
    finally:
        for store, engines, tier in daemons:
            tier.close()
            for engine in engines.values():
                engine.close()
            store.close()
