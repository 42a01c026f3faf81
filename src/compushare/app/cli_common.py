"""What the command modules share: the typer apps, the consoles, the common options,
logging, and running a command with CompuShare's errors reported as one line each."""

from __future__ import annotations

import inspect
import logging
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from ..config import load_toml, resolve_data_dir
from ..errors import CompushareError
from ..gc_policy import startup_done


class _Group(TyperGroup):
    """Lists each command with the whole first paragraph of its help, reflowed (click
    would cut it short with "...")."""

    def format_commands(self, ctx, formatter) -> None:
        rows = [(name, cmd.short_help or inspect.cleandoc(cmd.help or "").partition("\f")[0].split("\n\n")[0])
                for name, cmd in self.commands.items() if not cmd.hidden]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


def command_app(help: str) -> typer.Typer:
    """A typer app whose --help click lays out, not rich: text as written (rich markup
    ate "[tray]"), each paragraph reflowed to the terminal (rich kept the docstring's
    line breaks), a flag without a metavar (rich showed "<bool>"), and the help column
    wider than in rich's five-column panel."""
    return typer.Typer(cls=_Group, rich_markup_mode=None, add_completion=False, no_args_is_help=True, help=help)


err = Console(stderr=True, soft_wrap=True)
out = Console(soft_wrap=True)

DATA_DIR = typer.Option(None, "--data-dir", "--home", help="Data dir (default: $COMPUSHARE_HOME or the platform's).")
BOOTSTRAP = typer.Option(None, help="Bootstrap peer multiaddr with /p2p/ID (repeatable).")
SWARM_HOME = typer.Option(None, help="Join the local swarm started with this --home (default: the data dir's swarm/).")


class _CurrentStderr(logging.StreamHandler):
    """Writes to sys.stderr as it is at each record: while a progress bar shows
    (progress.py), rich has it print log lines above the bar."""

    @property  # type: ignore[override]
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, _value) -> None:
        pass


def setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", handlers=[_CurrentStderr()])


def bootstrap_for(home: Path, flags: list[str] | None, swarm_home: Path | None) -> tuple[str, ...]:
    from ..errors import SwarmUnreachable
    from .swarm import read_swarm

    if flags:
        return tuple(flags)
    configured = load_toml(home).get("node", {}).get("bootstrap")
    if configured:
        return tuple(configured)
    swarm = read_swarm(swarm_home or resolve_data_dir(None) / "swarm")
    if swarm:
        return tuple(swarm["bootstrap"])
    raise SwarmUnreachable(
        "no swarm to join: pass --bootstrap /ip4/.../tcp/.../p2p/ID, set [node] bootstrap in config.toml, "
        "or start a local swarm with `compushare swarm up`."
    )


def _all(exc: BaseException, kind: type) -> list[BaseException]:
    """trio nurseries wrap errors in exception groups: find the ones that matter."""
    if isinstance(exc, kind):
        return [exc]
    if isinstance(exc, BaseExceptionGroup):
        return [found for inner in exc.exceptions for found in _all(inner, kind)]
    return []


def run_or_exit(fn) -> None:
    startup_done()  # the command has imported what it needs
    try:
        fn()
    except BaseException as exc:
        if _all(exc, KeyboardInterrupt):
            err.print("interrupted")
            raise typer.Exit(130) from None
        known = _all(exc, CompushareError)
        if known:
            for message in dict.fromkeys(str(e) for e in known):
                err.print(f"[red]error:[/red] {escape(message)}", markup=True, highlight=False)  # peers' text
            raise typer.Exit(2) from None
        raise
