"""Agent frameworks' structured output against a real daemon (a random tiny model, constrained decoding).

Each framework asks the way it does by default: pydantic-ai's default output type
is a tool call forced with tool_choice "required"; the Agents SDK's `output_type`
(chat completions model) and LangChain's `with_structured_output` send
`response_format` json_schema. Each must get back a validated object on its first
try: the random model writes only what the grammar allows.
"""

from __future__ import annotations

import json

import httpx
import openai
import pydantic
import pytest

from kvwake.client import openai_config
from testkit.daemon import serving_http
from testkit.tinymodel import TOOLS_CHATML, make_model_dir


class City(pydantic.BaseModel):
    model_config = pydantic.ConfigDict(extra="forbid")  # else any extra key is valid: a random model adds them
    name: str = pydantic.Field(max_length=8)
    population: int = pydantic.Field(ge=0, le=10_000)
    coastal: bool


@pytest.fixture(scope="module")
def daemon(tmp_path_factory):
    model = make_model_dir(tmp_path_factory.mktemp("models") / "tools-llama", template=TOOLS_CHATML)
    yield from serving_http(tmp_path_factory.mktemp("frameworks"), model)


@pytest.fixture(scope="module")
def config(daemon):
    return openai_config(daemon.socket)


def recorder() -> tuple[list[dict], dict]:
    """Request bodies sent, and httpx event hooks that record them (sync and async)."""
    sent: list[dict] = []

    def record(request: httpx.Request) -> None:
        sent.append(json.loads(request.content))

    async def arecord(request: httpx.Request) -> None:
        record(request)

    return sent, {"sync": {"request": [record]}, "async": {"request": [arecord]}}


async def test_pydantic_ai_default_output_type_gets_a_validated_object(config):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    sent, hooks = recorder()
    client = openai.AsyncOpenAI(base_url=config["base_url"], api_key=config["api_key"], max_retries=0,
                                http_client=httpx.AsyncClient(event_hooks=hooks["async"]))
    agent = Agent(OpenAIChatModel("tiny", provider=OpenAIProvider(openai_client=client)), output_type=City,
                  retries=0)  # no retry: the first answer must validate
    for seed in range(2):
        result = await agent.run("Name a city.", model_settings={"max_tokens": 200, "temperature": 1.0, "seed": seed})
        assert isinstance(result.output, City)
    assert [body.get("tool_choice") for body in sent] == ["required", "required"]
    await client.close()


async def test_openai_agents_output_type_gets_a_validated_object(config):
    from agents import Agent, ModelSettings, OpenAIChatCompletionsModel, Runner, set_tracing_disabled

    set_tracing_disabled(True)  # no traces sent anywhere
    sent, hooks = recorder()
    client = openai.AsyncOpenAI(base_url=config["base_url"], api_key=config["api_key"], max_retries=0,
                                http_client=httpx.AsyncClient(event_hooks=hooks["async"]))
    agent = Agent(name="cities", instructions="Answer with a city.", output_type=City,
                  model=OpenAIChatCompletionsModel(model="tiny", openai_client=client),
                  model_settings=ModelSettings(max_tokens=200, temperature=1.0))
    result = await Runner.run(agent, "Name a city.", max_turns=1)
    assert isinstance(result.final_output, City)
    assert [body["response_format"]["type"] for body in sent] == ["json_schema"]
    await client.close()


def test_langchain_with_structured_output_gets_a_validated_object(config):
    from langchain_openai import ChatOpenAI

    sent, hooks = recorder()
    with httpx.Client(event_hooks=hooks["sync"]) as http:
        llm = ChatOpenAI(model="tiny", base_url=config["base_url"], api_key=config["api_key"], max_tokens=200,
                         temperature=1.0, max_retries=0, http_client=http)
        for seed in range(2):
            city = llm.bind(seed=seed).with_structured_output(City).invoke("Name a city.")
            assert isinstance(city, City)
    assert [body["response_format"]["type"] for body in sent] == ["json_schema", "json_schema"]
