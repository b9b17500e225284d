"""`kvwake models`: the models a daemon serves, loaded and unloaded by hand (docs/models.md).

Registered on the `kvwake` group by client/cli.py, which also turns their failures into one `Error:` line.
"""

from __future__ import annotations

import click

from kvwake.client.options import Options
from kvwake.client.output import echo_json, fields, human_bytes, json_option, short, spinner, table

__all__ = ["models"]


@click.group(invoke_without_command=True)
@json_option
@click.pass_context
def models(ctx: click.Context, as_json: bool) -> None:
    """List the models the daemon serves: name, state, sessions, aliases (the default, first).

    Example: kvwake models; kvwake models load small; kvwake models unload small
    """
    if ctx.invoked_subcommand is not None:
        return
    with ctx.obj.client() as client:
        listed = client.models()
        memory = None if as_json else client.models_memory()
    if as_json:
        return echo_json(listed)
    table(["MODEL", "STATE", "HOT", "ASLEEP", "WEIGHTS", "BUNDLE", "PINNED", "ALIASES"],
          [[m["name"], m["state"], m["sessions"]["hot"], m["sessions"]["asleep"], human_bytes(m.get("weights_bytes")),
            short(m.get("bundle_hash")), "yes" if m["pinned"] else "", ", ".join(m["aliases"] + m["patterns"])]
           for m in listed])
    if memory:  # the one budget every loaded model's weights and hot KV share (docs/models.md)
        click.echo(f"memory: {human_bytes(memory.get('weights_bytes'))} of weights and "
                   f"{human_bytes(memory.get('hot_kv_bytes'))} of hot KV, of a budget of "
                   f"{human_bytes(memory.get('budget_bytes'))}")


@models.command("load")
@click.argument("name")
@json_option
@click.pass_obj
def models_load(opts: Options, name: str, as_json: bool) -> None:
    """Load a model now (a request naming it would load it too).

    Example: kvwake models load small
    """
    _change(opts, "loading", name, as_json)


@models.command("unload")
@click.argument("name")
@json_option
@click.pass_obj
def models_unload(opts: Options, name: str, as_json: bool) -> None:
    """Sleep the model's hot sessions, then unload it; its sessions wake when it loads again.

    Example: kvwake models unload small
    """
    _change(opts, "unloading", name, as_json)


def _change(opts: Options, doing: str, name: str, as_json: bool) -> None:
    """Load or unload model `name` (`doing`: "loading" or "unloading"), and show what the daemon did."""
    with opts.client() as client, spinner(f"{doing} {name}"):
        result = client.load_model(name) if doing == "loading" else client.unload_model(name)
    echo_json(result) if as_json else fields([(k, v) for k, v in result.items()])
