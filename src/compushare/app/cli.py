"""Command line: parse, then call into node / pipeline / model / swarm."""

from __future__ import annotations

import dataclasses
import gc
import json
import logging
import sys
from pathlib import Path

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ..config import NodeConfig, Span, load_toml, resolve_data_dir
from ..errors import CompushareError, UsageError
from ..gc_policy import pause_during_startup, startup_done

app = typer.Typer(add_completion=False, no_args_is_help=True, help="Peer-to-peer LLM inference over libp2p.")
swarm_app = typer.Typer(no_args_is_help=True, help="A local swarm of node processes on 127.0.0.1.")
models_app = typer.Typer(no_args_is_help=True, help="The local model store.")
app.add_typer(swarm_app, name="swarm")
app.add_typer(models_app, name="models")
err = Console(stderr=True, soft_wrap=True)
out = Console(soft_wrap=True)

DATA_DIR = typer.Option(None, "--data-dir", "--home", help="Data dir (default: $COMPUSHARE_HOME or the platform's).")
BOOTSTRAP = typer.Option(None, help="Bootstrap peer multiaddr with /p2p/ID (repeatable).")
SWARM_HOME = typer.Option(None, help="Join the local swarm started with this --home (default: the data dir's swarm/).")


def _setup_logging(level: str) -> None:
    logging.basicConfig(level=getattr(logging, level.upper(), logging.INFO),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr)


@app.command()
def node(
    model: str = typer.Option(None, help="Model name or id (default smollm2-135m)."),
    blocks: str = typer.Option(None, help="Half-open span of blocks to serve, e.g. 10:20. "
                                          "Without it the node chooses where the swarm is weakest, and moves."),
    max_blocks: int = typer.Option(None, help="Automatic placement: serve at most this many blocks."),
    memory_budget_mb: int = typer.Option(None, help="Automatic placement: memory for weights "
                                                    "(default: half the RAM free at start)."),
    data_dir: Path = DATA_DIR,
    listen: list[str] = typer.Option(None, help="Listen multiaddr (repeatable)."),
    bootstrap: list[str] = BOOTSTRAP,
    kv_budget: int = typer.Option(None, help="KV cache budget in tokens over all sessions."),
    idle_timeout: float = typer.Option(None, help="Seconds before an idle session is dropped."),
    record_ttl: float = typer.Option(None, help="Lifetime of the DHT server record (refreshed at 1/3)."),
    ad_period: float = typer.Option(None, help="Seconds between capability ads on gossip."),
    api_port: int = typer.Option(None, help="Local HTTP API (OpenAI-compatible) on 127.0.0.1 (default 8311; "
                                            "0: a free port; -1: none). Its token is in the data dir."),
    debug_slowdown: float = typer.Option(None, hidden=True,
                                         help="Fault injection: make compute this many times slower."),
    debug_noise: float = typer.Option(None, hidden=True,
                                      help="Fault injection: add Gaussian noise of this relative scale to "
                                           "every output (a lying server, for tests)."),
    detach: bool = typer.Option(False, "--detach", "-d", help="Run in the background: pid in node.pid, "
                                                             "log in node.log (data dir); `compushare stop` ends it."),
    log_level: str = typer.Option("info"),
) -> None:
    """Serve blocks of a model to the swarm (in the foreground, or --detach)."""
    import trio

    from .node import Node

    home = resolve_data_dir(data_dir)
    if detach:
        _run_or_exit(lambda: _detach(home))
        return
    _setup_logging(log_level)
    config = NodeConfig.build(home, model=model, blocks=Span.parse(blocks) if blocks else None,
                              listen=listen, bootstrap=bootstrap, record_ttl_s=record_ttl, max_blocks=max_blocks,
                              memory_budget_mb=memory_budget_mb, ad_period_s=ad_period, slowdown=debug_slowdown,
                              noise=debug_noise, api_port=api_port)
    overrides = {"kv_budget_tokens": kv_budget, "session_idle_timeout_s": idle_timeout}
    config = dataclasses.replace(config, limits=dataclasses.replace(
        config.limits, **{k: v for k, v in overrides.items() if v is not None}))
    _run_or_exit(lambda: trio.run(Node(config).run))


def _detach(home: Path) -> None:
    """Start this same `node` command in its own session, logging to the data dir,
    and return once it serves (or say why it did not)."""
    import subprocess

    from ..config import LOG_FILE, STATE_FILE
    from .status import local_node
    from .swarm import wait_ready

    from ..config import PID_FILE
    from .swarm import is_our_node

    try:
        running = is_our_node(int((home / PID_FILE).read_text()))
    except (OSError, ValueError):
        running = False
    if running or local_node(home) is not None:  # the pid file exists while the node loads, too
        raise UsageError(f"a node already runs on {home}; `compushare stop --data-dir {home}` first")
    argv = [a for a in sys.argv[1:] if a not in ("--detach", "-d")]
    if "--data-dir" not in argv and "--home" not in argv:
        argv += ["--data-dir", str(home)]  # the child must not depend on our environment
    home.mkdir(parents=True, exist_ok=True)
    (home / STATE_FILE).unlink(missing_ok=True)  # a crashed node's: readiness is its reappearance
    with open(home / LOG_FILE, "ab") as log_file:
        proc = subprocess.Popen([sys.executable, "-m", "compushare", *argv], stdin=subprocess.DEVNULL,
                                stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)
    state = wait_ready(proc, home)  # raises with the log's tail if the node exits
    out.print(f"node {state['peer_id']} serving blocks {state['start']}:{state['end']} (pid {proc.pid}); "
              f"API {state.get('api') or 'off'}; log {home / LOG_FILE}", highlight=False)


@app.command()
def stop(data_dir: Path = DATA_DIR) -> None:
    """Stop the node running on this data dir (SIGTERM, then SIGKILL after 10 s)."""
    from .swarm import stop_node

    _run_or_exit(lambda: out.print(f"stopped node {stop_node(resolve_data_dir(data_dir))}"))


@app.command()
def tray(data_dir: Path = DATA_DIR, log_level: str = typer.Option("warning")) -> None:
    """A system-tray icon for the node on this data dir: its state, karma and tokens
    served; pause/resume, dashboard, quit. Needs the [tray] extra and a tray host."""
    from .tray import Tray

    _setup_logging(log_level)
    _run_or_exit(Tray(resolve_data_dir(data_dir)).run)


def _bootstrap_for(home: Path, flags: list[str] | None, swarm_home: Path | None) -> tuple[str, ...]:
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


@app.command()
def run(
    prompt: str = typer.Argument(..., help="The prompt."),
    model: str = typer.Option("smollm2-135m", help="Model name or id."),
    data_dir: Path = DATA_DIR,
    bootstrap: list[str] = BOOTSTRAP,
    swarm_home: Path = SWARM_HOME,
    max_tokens: int = typer.Option(128, help="Maximum new tokens."),
    temperature: float = typer.Option(0.0, help="0 is greedy."),
    top_p: float = typer.Option(1.0),
    seed: int = typer.Option(None),
    chat_template: bool = typer.Option(True, help="Wrap the prompt in the model's chat template."),
    spot_check: float = typer.Option(0.05, min=0.0, max=1.0,
                                     help="Share of each span's steps also computed by a second server."),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print the route and timings."),
    log_level: str = typer.Option("warning"),
) -> None:
    """Answer PROMPT through the swarm, streaming tokens as they come."""
    import trio

    from ..pipeline.client.consumer import RunRequest, run_prompt
    from ..pipeline.client.sampling import SamplingParams

    _setup_logging(log_level)
    home = resolve_data_dir(data_dir)

    def show_route(route) -> None:
        if verbose:
            from ..pipeline.client.routing import describe_route

            err.print(f"[bold]route[/bold] ({len(route)} hops, chosen for the least expected latency):")
            for line in describe_route(route):
                err.print(f"  {line}", highlight=False, markup=False)

    def main_run():
        request = RunRequest(model=model, prompt=prompt, chat_template=chat_template,
                             params=SamplingParams(temperature=temperature, top_p=top_p, seed=seed,
                                                   max_new_tokens=max_tokens))
        boot = _bootstrap_for(home, bootstrap, swarm_home)
        outcome = trio.run(lambda: run_prompt(home, boot, request, on_text=_stream, on_route=show_route,
                                              spot_check_rate=spot_check))
        sys.stdout.write("\n")
        for failover in outcome.failovers:
            err.print(f"failover: blocks {failover.start}:{failover.end} moved from {failover.peer_id[-8:]} "
                      f"({failover.reason}) to {', '.join(p[-8:] for p in failover.replacements)} in "
                      f"{failover.recovered - failover.noticed:.2f}s", highlight=False)
        for report in outcome.reports:
            err.print(f"[red]spot check failed[/red]: {report.accused.peer_id} excluded; failure report "
                      f"{report.digest[:12]} kept")
        if verbose:
            err.print(f"first token after {outcome.first_token_s:.2f}s; {len(outcome.tokens)} tokens at "
                      f"{outcome.decode_tok_s:.1f} tok/s; {outcome.checks} spot checks")

    _run_or_exit(main_run)


@app.command()
def chat(
    model: str = typer.Option("smollm2-135m", help="Model name or id (/model switches)."),
    data_dir: Path = DATA_DIR,
    bootstrap: list[str] = BOOTSTRAP,
    swarm_home: Path = SWARM_HOME,
    temperature: float = typer.Option(0.0, help="0 is greedy (/temp changes it)."),
    max_tokens: int = typer.Option(256, help="Most new tokens per reply (/max changes it)."),
    spot_check: float = typer.Option(0.05, min=0.0, max=1.0, help="Share of steps re-checked elsewhere."),
    log_level: str = typer.Option("warning"),
) -> None:
    """Chat with a model through the swarm: multi-turn, streamed; /help lists commands."""
    from .chat import repl

    _setup_logging(log_level)
    home = resolve_data_dir(data_dir)
    boot = _bootstrap_for(home, bootstrap, swarm_home)
    code = 0

    def main_chat():
        nonlocal code
        code = repl(home, boot, model, temperature=temperature, max_tokens=max_tokens, spot_check_rate=spot_check)

    _run_or_exit(main_chat)
    raise typer.Exit(code)


def _stream(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _all(exc: BaseException, kind: type) -> list[BaseException]:
    """trio nurseries wrap errors in exception groups: find the ones that matter."""
    if isinstance(exc, kind):
        return [exc]
    if isinstance(exc, BaseExceptionGroup):
        return [found for inner in exc.exceptions for found in _all(inner, kind)]
    return []


def _run_or_exit(fn) -> None:
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


@app.command()
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

    _setup_logging(log_level)
    home = resolve_data_dir(data_dir)

    def main_status():
        boot = () if local_node(home) is not None and not bootstrap else _bootstrap_for(home, bootstrap, swarm_home)
        result = trio.run(gather_status, home, boot)
        if as_json:
            print(json.dumps(result, indent=2))
        else:
            render(result, out)

    _run_or_exit(main_status)


@app.command()
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

    from ..karma.service import read_karma
    from ..net.identity import KEY_FILE, load_or_create_identity, peer_id_of
    from .status import local_node

    _setup_logging(log_level)
    home = resolve_data_dir(data_dir)

    def main_karma():
        if peer is None and not (home / KEY_FILE).exists():
            raise UsageError(f"{home} has no identity yet (no node ever ran there): name a PEER")
        target = peer or peer_id_of(load_or_create_identity(home)).to_string()
        local = local_node(home)
        boot = tuple(local["addrs"][:1]) if local is not None and not bootstrap \
            else _bootstrap_for(home, bootstrap, swarm_home)
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

    _run_or_exit(main_karma)


@app.command("id")
def show_id(data_dir: Path = DATA_DIR) -> None:
    """Print this data dir's peer id."""
    from ..net.identity import load_or_create_identity, peer_id_of

    print(peer_id_of(load_or_create_identity(resolve_data_dir(data_dir))).to_string())


@swarm_app.command("up")
def swarm_up_cmd(
    nodes: int = typer.Option(3, help="Number of node processes."),
    model: str = typer.Option("smollm2-135m"),
    home: Path = typer.Option(None, help="Directory holding the nodes' data dirs (default <data dir>/swarm)."),
) -> None:
    """Start N nodes on 127.0.0.1 splitting the model's blocks between them."""
    from .swarm import swarm_up

    _setup_logging("warning")
    target = home or resolve_data_dir(None) / "swarm"

    def up():
        swarm = swarm_up(target, nodes, model)
        for n in swarm["nodes"]:
            err.print(f"node pid {n['pid']:>7}  blocks {n['blocks']:>6}  {n['peer_id']}")
        err.print(f"bootstrap: {swarm['bootstrap'][0]}")

    _run_or_exit(up)


@swarm_app.command("down")
def swarm_down_cmd(home: Path = typer.Option(None)) -> None:
    """Stop the local swarm's nodes (by pid)."""
    from .swarm import swarm_down

    count = swarm_down(home or resolve_data_dir(None) / "swarm")
    err.print(f"stopped {count} nodes")


def _held(model) -> str:
    """What of a model this node holds, e.g. "all", "blocks 10-19", "head, blocks 0-4"."""
    held = model.held_files()
    if held == set(range(len(model.manifest.files))):
        return "all"
    blocks = model.held_blocks()
    runs, start = [], None
    for i, b in enumerate(blocks):
        if start is None:
            start = b
        if i + 1 == len(blocks) or blocks[i + 1] != b + 1:
            runs.append(f"{start}" if start == b else f"{start}-{b}")
            start = None
    parts = (["head"] if model.holds(head=True) else []) + ([f"blocks {', '.join(runs)}"] if runs else [])
    return ", ".join(parts) or "manifest only"


@models_app.command("list")
def models_list(data_dir: Path = DATA_DIR, as_json: bool = typer.Option(False, "--json")) -> None:
    """Models in the local store (and what of each this node holds), and the catalog."""
    from ..model.catalog import CATALOG
    from ..model.store import ModelStore

    stored = ModelStore(resolve_data_dir(data_dir)).list()
    if as_json:
        print(json.dumps([{"names": n, "id": m.model_id, "blocks": m.num_blocks, "dtype": m.dtype,
                           "bytes": m.manifest.total_bytes, "held_blocks": m.held_blocks(),
                           "holds_head": m.holds(head=True)} for n, m in stored]))
        return
    table = Table("names", "id", "blocks", "dtype", "size", "held here")
    for names, m in stored:
        table.add_row(", ".join(names), m.model_id[:16], str(m.num_blocks), m.dtype,
                      f"{m.manifest.total_bytes / 1e6:.1f} MB", _held(m))
    Console().print(table)
    for entry in CATALOG.values():
        print(f"catalog: {entry.name:14} {entry.description}")


class _Progress:
    """A rich progress bar on stderr (bytes, rate, ETA), or nothing at all (--json):
    its callbacks are safe to hand to the code doing the work either way."""

    def __init__(self, description: str, enabled: bool) -> None:
        from rich.progress import (BarColumn, DownloadColumn, Progress, TextColumn, TimeRemainingColumn,
                                   TransferSpeedColumn)

        self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), DownloadColumn(),
                            TransferSpeedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=err,
                            transient=False) if enabled else None
        self.task = self.bar.add_task(description, total=None) if self.bar else None

    def __enter__(self) -> _Progress:
        if self.bar is not None:
            self.bar.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.bar is not None:
            self.bar.stop()

    def progress(self, done: int, total: int) -> None:
        if self.bar is not None:
            self.bar.update(self.task, completed=done, total=total)

    def describe(self, description: str) -> None:
        if self.bar is not None:
            self.bar.update(self.task, description=description)


@models_app.command("fetch")
def models_fetch(
    model: str = typer.Argument(..., help="Model id (64 hex digits): names are local only."),
    blocks: str = typer.Option(None, help="Fetch only these blocks, e.g. 10:20."),
    head: bool = typer.Option(False, "--head", help="Fetch only what a consumer needs (embeddings, LM head, "
                                                    "tokenizer); with --blocks, those too."),
    name: str = typer.Option(None, help="Alias for the model."),
    data_dir: Path = DATA_DIR,
    bootstrap: list[str] = BOOTSTRAP,
    swarm_home: Path = SWARM_HOME,
    upload_limit_kbps: float = typer.Option(None, "--upload-limit", help="Seeding limit while fetching, KB/s."),
    as_json: bool = typer.Option(False, "--json", help="Print the result as JSON (no progress bar)."),
    log_level: str = typer.Option("warning"),
) -> None:
    """Fetch a model (or a span of it) from the swarm's seeders, verifying every piece."""
    import trio

    from ..model.store import is_model_id
    from ..torrent.service import fetch_from_swarm

    _setup_logging(log_level)
    home = resolve_data_dir(data_dir)

    def do():
        if not is_model_id(model):
            raise UsageError(f"{model!r} is not a model id: peers know models by id only "
                             "(`compushare status` lists the swarm's)")
        span = Span.parse(blocks) if blocks else None
        boot = _bootstrap_for(home, bootstrap, swarm_home)
        with _Progress(f"fetching {model[:12]}", not as_json) as shown:
            result = trio.run(lambda: fetch_from_swarm(
                home, boot, model, blocks=(span.start, span.end) if span else None, head=head,
                everything=span is None and not head, progress=shown.progress, alias=name,
                upload_limit=upload_limit_kbps * 1000 if upload_limit_kbps else None))
        if as_json:
            print(json.dumps(dataclasses.asdict(result)))
            return
        err.print(f"fetched {result.pieces} pieces ({result.bytes / 1e6:.1f} MB) in {result.seconds:.1f}s, "
                  f"{result.rate_mbps:.1f} MB/s; {result.already_held} were already here")
        for peer, count in sorted(result.bytes_from.items(), key=lambda kv: -kv[1]):
            err.print(f"  {peer}: {count / 1e6:.1f} MB", highlight=False)
        for peer in result.banned:
            err.print(f"  [red]banned[/red] {escape(peer)}: sent corrupted pieces")

    _run_or_exit(do)


@models_app.command("seed")
def models_seed(
    models: list[str] = typer.Argument(None, help="Models to seed (default: every model stored)."),
    data_dir: Path = DATA_DIR,
    listen: list[str] = typer.Option(None, help="Listen multiaddr (repeatable)."),
    bootstrap: list[str] = BOOTSTRAP,
    upload_limit_kbps: float = typer.Option(None, "--upload-limit", help="Upload limit over all peers, KB/s."),
    log_level: str = typer.Option("info"),
) -> None:
    """Seed models to the swarm without serving inference (runs in the foreground)."""
    import trio

    from ..torrent.service import seed_forever

    _setup_logging(log_level)
    home = resolve_data_dir(data_dir)
    config = NodeConfig.build(home, listen=listen, bootstrap=bootstrap)
    _run_or_exit(lambda: trio.run(lambda: seed_forever(
        home, listen=config.listen, bootstrap=config.bootstrap, models=models or None,
        upload_limit=upload_limit_kbps * 1000 if upload_limit_kbps else None)))


@models_app.command("import")
def models_import(path: Path, name: str = typer.Option(None, help="Alias for the model."),
                  data_dir: Path = DATA_DIR,
                  as_json: bool = typer.Option(False, "--json", help="Print the result as JSON (no progress bar).")
                  ) -> None:
    """Import a safetensors / Hugging Face directory or a GGUF file (prints its id)."""
    from ..model.catalog import import_path

    def do():
        with _Progress(f"importing {path.name}", not as_json) as shown:
            model = import_path(path, resolve_data_dir(data_dir), alias=name, progress=shown.progress,
                                on_stage=lambda stage: shown.describe(f"{stage} {path.name}"))
        if as_json:
            print(json.dumps({"model_id": model.model_id, "name": name, "num_blocks": model.num_blocks,
                              "bytes": sum(f.size for f in model.manifest.files)}))
        else:
            print(model.model_id)

    _run_or_exit(do)


def main() -> None:
    pause_during_startup()
    try:
        app()
    finally:
        gc.enable()  # a command that ended before _run_or_exit (or a caller running main in-process)


if __name__ == "__main__":
    main()
