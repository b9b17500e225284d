"""The Responses API's `tools`, as the OpenAI-form function tools templates render (fronts/responses_shapes.py).

Translation only. Three kinds of tool come in:

- `function` tools: offered as they are.
- `namespace` tools (a named group of function tools, as Codex CLI sends its
  `multi_agent_v1`): each member is offered as a function named
  `<namespace>__<member>` (NAMESPACE_SEPARATOR). Flattened always, not only
  when a bare name would collide: the name the model writes then says which
  namespace it meant, whatever other tools a later turn offers, and `__`
  keeps it inside the characters OpenAI allows in a function name
  (`[a-zA-Z0-9_-]`), the names chat templates and tool-call parsers expect
  (Codex and Claude Code name MCP tools `mcp__server__tool` the same way).
  A call of one comes back as a `function_call` item with the member's bare
  `name` and its `namespace`, as OpenAI returns it; an input `function_call`
  with a `namespace` renders as the flat name again, so a resent turn is the
  same tokens the model wrote.
- OpenAI's built-in tools (BUILT_IN: `web_search`, `file_search`, `mcp`,
  `code_interpreter`, ...): kvwake cannot run them and its models cannot
  call them in their formats. By default (`http_hosted_tools = "omit"`)
  they are left out of the prompt and the response says which (the
  `X-Kvwake-Omitted-Tools` header; the HTTP front logs it too): an agent
  run with its default config (Codex CLI sends `web_search`) is served.
  With `"refuse"` a 400 names the tool.

Any other type (`custom` tools, unknown ones) is a 400 naming it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvwake.daemon.fronts.openai_shapes import ApiError

__all__ = ["BUILT_IN", "NAMESPACE_SEPARATOR", "Tools", "bad", "flat_name"]

NAMESPACE_SEPARATOR = "__"
# The tool types of OpenAI's own tools (the `openai` package's responses.Tool union, less function,
# namespace and custom): run by OpenAI's servers, or called in item types of their own.
BUILT_IN = frozenset({"web_search", "web_search_2025_08_26", "web_search_preview", "web_search_preview_2025_03_11",
                      "file_search", "code_interpreter", "image_generation", "mcp", "computer", "computer_use_preview",
                      "local_shell", "shell", "apply_patch", "tool_search", "programmatic_tool_calling"})


def flat_name(namespace: str, name: str) -> str:
    """The function name a namespace's member is offered under."""
    return f"{namespace}{NAMESPACE_SEPARATOR}{name}"


def bad(message: str, param: str) -> ApiError:
    """A 400 naming the request's field `param`, its message beginning with it."""
    return ApiError(400, f"{param}: {message}", param=param)


@dataclass
class Tools:
    """The tools of one request: as the response repeats them, as the template gets them, and where
    each offered name came from."""

    echo: list[dict[str, Any]] = field(default_factory=list)
    chat: list[dict[str, Any]] = field(default_factory=list)
    members: dict[str, tuple[str, str]] = field(default_factory=dict)  # flat name -> (namespace, bare name)
    omitted: list[str] = field(default_factory=list)  # built-in tool types left out ("omit")

    @classmethod
    def parse(cls, raw: Any, hosted: str) -> Tools:
        """`tools` of a request; `hosted` is the http_hosted_tools setting ("omit" or "refuse")."""
        if raw is None:
            raw = []
        if not isinstance(raw, list):
            raise bad("must be an array", "tools")
        tools = cls()
        for i, t in enumerate(raw):
            kind, where = t.get("type") if isinstance(t, dict) else None, f"tools[{i}]"
            if kind == "function":
                tools.echo.append(tools._function(t, where))
            elif kind == "namespace":
                tools.echo.append(tools._namespace(t, where))
            elif kind in BUILT_IN and hosted == "omit":
                tools.omitted.append(kind)
            elif kind in BUILT_IN:
                raise bad(f"{kind!r} is one of OpenAI's built-in tools, which kvwake cannot run: leave it out of "
                           "the request (Codex CLI: web_search = \"disabled\" in config.toml), or start the daemon "
                           "with --http-hosted-tools omit (the default) to have such tools left out of the "
                           "prompt", f"{where}.type")
            else:
                raise bad(f"{kind!r} tools are not supported by kvwake: only function and namespace tools",
                           f"{where}.type")
        return tools

    def call(self, name: str) -> dict[str, str]:
        """A call's `name` (and `namespace`, for a namespace's member) as the function_call item has them."""
        if name in self.members:
            namespace, bare = self.members[name]
            return {"name": bare, "namespace": namespace}
        return {"name": name}

    def _function(self, t: dict[str, Any], where: str, flat: str | None = None) -> dict[str, Any]:
        """A function tool: offered (under `flat` when a namespace's member); returns it as repeated."""
        if not isinstance(t.get("name"), str) or not t["name"]:
            raise bad("a function tool needs a name", f"{where}.name")
        name = flat or t["name"]
        if name in {c["function"]["name"] for c in self.chat}:
            raise bad(f"a second tool named {name!r}" + (" (a namespace's member, as offered)" if flat else ""),
                       f"{where}.name")
        parameters = t.get("parameters") or {"type": "object", "properties": {}}
        function = {"name": name, "parameters": parameters}
        if t.get("description"):
            function["description"] = t["description"]
        self.chat.append({"type": "function", "function": function})
        return {"type": "function", "name": t["name"], "description": t.get("description"), "parameters": parameters,
                "strict": t.get("strict", True)}

    def _namespace(self, t: dict[str, Any], where: str) -> dict[str, Any]:
        namespace, members = t.get("name"), t.get("tools")
        if not isinstance(namespace, str) or not namespace:
            raise bad("a namespace tool needs a name", f"{where}.name")
        if not isinstance(members, list) or not members:
            raise bad("a namespace tool needs an array of function tools", f"{where}.tools")
        echo = []
        for j, member in enumerate(members):
            kind = member.get("type") if isinstance(member, dict) else None
            if kind != "function":
                raise bad(f"{kind!r} tools are not supported by kvwake in a namespace: only function tools",
                           f"{where}.tools[{j}].type")
            echo.append(self._function(member, f"{where}.tools[{j}]", flat_name(namespace, member.get("name"))))
            self.members[flat_name(namespace, member["name"])] = (namespace, member["name"])
        return {"type": "namespace", "name": namespace, "description": t.get("description") or "", "tools": echo}
