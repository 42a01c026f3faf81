"""Commands about the swarm: `status`, `karma`, `id`, and `swarm up|down` (a local
swarm of node processes)."""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.markup import escape
from rich.table import Table

from ..config import resolve_data_dir
from ..errors import UsageError
from .cli_common import BOOTSTRAP, DATA_DIR, SWARM_HOME, bootstrap_for, command_app, err, out, run_or_exit, setup_logging

swarm_app = command_app("A local swarm of node processes on 127.0.0.1.")


def status(
    data_dir: Path = DATA_DIR,
    bootstrap: list[str] = BOOTSTRAP,
    swarm_home: Path = SWARM_HOME,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    log_level: str = typer.Option("warning"),
) -> None:
    """Peers, coverage per block of each model, and this node's roles."""
    import trio

    from .status import gather_status, local_node, render

    setup_logging(log_level)
    home = resolve_data_dir(data_dir)

    def main_status():
        boot = () if local_node(home) is not None and not bootstrap else bootstrap_for(home, bootstrap, swarm_home)
        result = trio.run(gather_status, home, boot)
        if as_json:
            print(json.dumps(result, indent=2))
        else:
            render(result, out)

    run_or_exit(main_status)


def karma(
    peer: str = typer.Argument(None, help="Peer id (default: this data dir's)."),
    data_dir: Path = DATA_DIR,
    bootstrap: list[str] = BOOTSTRAP,
    swarm_home: Path = SWARM_HOME,
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object."),
    log_level: str = typer.Option("warning"),
) -> None:
    """A peer's karma, recomputed here from its DHT record, its receipts and the
    failure reports against it (karma never gates access)."""
    import trio

    from ..net.identity import KEY_FILE, load_or_create_identity, peer_id_of
    from .status import local_node, read_karma

    setup_logging(log_level)
    home = resolve_data_dir(data_dir)

    def main_karma():
        if peer is None and not (home / KEY_FILE).exists():
            raise UsageError(f"{home} has no identity yet (no node ever ran there): name a PEER")
        target = peer or peer_id_of(load_or_create_identity(home)).to_string()
        local = local_node(home)
        boot = tuple(local["addrs"][:1]) if local is not None and not bootstrap \
            else bootstrap_for(home, bootstrap, swarm_home)
        result = trio.run(read_karma, boot, target)
        if as_json:
            print(json.dumps(result.to_wire(), indent=2))
            return
        table = Table(title=f"karma of {target}")
        table.add_column("figure")
        table.add_column("value")
        table.add_row("score", f"{result.score:.4f}")
        table.add_row("compute counted", f"{result.compute_ms / 1000:.1f} s in {result.counted} of "
                                         f"{result.receipts} receipts")
        table.add_row("verified failure reports", str(result.reports))
        if result.rejected:
            table.add_row("receipts not counted", ", ".join(f"{k}: {v}" for k, v in sorted(result.rejected.items())))
        if result.problem:
            table.add_row("note", escape(result.problem))
        out.print(table)

    run_or_exit(main_karma)


def show_id(data_dir: Path = DATA_DIR) -> None:
    """Print this data dir's peer id."""
    from ..net.identity import load_or_create_identity, peer_id_of

    print(peer_id_of(load_or_create_identity(resolve_data_dir(data_dir))).to_string())


@swarm_app.command("up")
def swarm_up_cmd(
    nodes: int = typer.Option(3, help="Number of node processes."),
    model: str = typer.Option("smollm2-135m", help="A catalog name, or a name `models import` gave."),
    home: Path = typer.Option(None, help="Directory holding the nodes' data dirs (default <data dir>/swarm)."),
    memory_budget_mb: int = typer.Option(None, help="Each node's memory in all (MB): a node whose share of the "
                                                    "blocks does not fit refuses to start."),
    kv_budget: int = typer.Option(None, help="Each node's KV cache budget in tokens over all sessions."),
    threads: int = typer.Option(None, help="Threads each node's forwards compute with (default 1)."),
    runtime: str = typer.Option(None, help="What computes the spans: ggml, torch or auto (the default)."),
) -> None:
    """Start N nodes on 127.0.0.1 splitting the model's blocks between them (a catalog
    name, or one `models import` stored). The first node holds the model; the others
    fetch their blocks from it through the swarm."""
    from .progress import Progress
    from .swarm import swarm_up

    setup_logging("warning")
    target = home or resolve_data_dir(None) / "swarm"
    extra = ([] if memory_budget_mb is None else ["--memory-budget-mb", str(memory_budget_mb)]) + (
        [] if kv_budget is None else ["--kv-budget", str(kv_budget)]) + (
        [] if threads is None else ["--threads", str(threads)]) + ([] if runtime is None else ["--runtime", runtime])

    def up():
        with Progress() as shown:  # the model converted first
            swarm = swarm_up(target, nodes, model, extra, on_stage=shown.stage, progress=shown.update,
                             imported_in=resolve_data_dir(None))
        for n in swarm["nodes"]:
            err.print(f"node pid {n['pid']:>7}  blocks {n['blocks']:>6}  {n['peer_id']}")
        err.print(f"bootstrap: {swarm['bootstrap'][0]}")

    run_or_exit(up)


@swarm_app.command("down")
def swarm_down_cmd(home: Path = typer.Option(None)) -> None:
    """Stop the local swarm's nodes (by pid)."""
    from .swarm import swarm_down

    count = swarm_down(home or resolve_data_dir(None) / "swarm")
    err.print(f"stopped {count} nodes")
