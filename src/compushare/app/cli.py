"""Command line: parse, then call into node / pipeline / model / swarm.

  cli.py         the typer app; node, stop, tray, run, chat
  cli_swarm.py   status, karma, id; swarm up|down
  cli_models.py  models list|fetch|seed|import
  cli_finetune.py finetune
  cli_train.py   train start|join|status
  cli_doctor.py  doctor (its checks: doctor.py)
  cli_common.py  shared options, logging, error reporting
"""

from __future__ import annotations

import dataclasses
import functools
import gc
import sys
from pathlib import Path

import typer

from ..config import NodeConfig, Span, resolve_data_dir
from ..errors import UsageError
from ..gc_policy import pause_during_startup
from ..malloc_policy import bound_retention
from .cli_doctor import doctor
from .cli_finetune import finetune
from .cli_common import (BOOTSTRAP, DATA_DIR, SWARM_HOME, bootstrap_for, command_app, err, out, run_or_exit,
                         setup_logging)
from .cli_models import models_app
from .cli_train import train_app
from .debug import FaultInjection
from .cli_swarm import karma, show_id, status, swarm_app

app = command_app("Peer-to-peer LLM inference over libp2p.")
app.add_typer(swarm_app, name="swarm")
app.add_typer(models_app, name="models")
app.add_typer(train_app, name="train")


# Fault injection (debug.py), for tests: hidden from --help.
DEBUG_SLOWDOWN = typer.Option(None, hidden=True, help="Fault injection: make compute this many times slower.")
DEBUG_NOISE = typer.Option(None, hidden=True, help="Fault injection: add Gaussian noise of this relative scale to "
                                                   "every output (a lying server, for tests).")
DEBUG_FORGE_PUSH = typer.Option(None, "--debug-forge-push", hidden=True,
                                help="Fault injection: push the next server other bytes than the output this "
                                     "server signs (for tests).")
ADAPTER = typer.Option(None, help="A LoRA adapter (PEFT directory or .safetensors file) trained on this model: "
                                   "every server applies it to your sessions.")
DEBUG_CLAIM_FORMAT = typer.Option(None, hidden=True, help="Fault injection: claim this weight format (records, ads, "
                                                          "sessions) instead of the model's (for tests).")
DEBUG_SLOW_STEPS = typer.Option(None, hidden=True, help="Fault injection: FIRST:COUNT:SECONDS, steps FIRST.. of this "
                                                        "server each wait SECONDS, the node responsive (for tests).")


MEMORY_BUDGET = typer.Option(None, help="The node's memory in all, process included: automatic placement takes as "
                                        "many blocks as fit (default: weights and KV budget in half the RAM free at "
                                        "start); a --blocks span that does not fit is refused.")
DEVICE = typer.Option(None, help="Where the span computes: cuda (weights, KV cache and activations on the GPU; the "
                                 "memory budget is its memory), cpu, or auto (CUDA where torch sees a device; the "
                                 "default).")
THREADS = typer.Option(None, help="Threads one forward computes with, either runtime (default 1; config.toml's "
                                  "[node] torch_threads).")
JSON_SCHEMA = typer.Option(None, "--json-schema", exists=True, dir_okay=False, help="A JSON schema file: the "
                           "answer is one JSON document valid against it (a grammar allows only tokens keeping it so).")
SPOT_CHECK = typer.Option(0.05, min=0.0, max=1.0, help="Share of each span's steps also computed by a second server.")
RUNTIME = typer.Option(None, help="What computes the span: ggml (a GGUF model's weights as stored, on llama.cpp's "
                                  "engine), torch, or auto (ggml for a GGUF model on CPU, torch otherwise; the default).")


@app.command()
def node(
    model: str = typer.Option(None, help="Model name or id (default smollm2-135m)."),
    blocks: str = typer.Option(None, help="Half-open span of blocks to serve, e.g. 10:20. "
                                          "Without it the node chooses where the swarm is weakest, and moves."),
    max_blocks: int = typer.Option(None, help="Automatic placement: serve at most this many blocks."),
    memory_budget_mb: int = MEMORY_BUDGET,
    device: str = DEVICE,
    threads: int = THREADS,
    runtime: str = RUNTIME,
    data_dir: Path = DATA_DIR,
    listen: list[str] = typer.Option(None, help="Listen multiaddr (repeatable)."),
    bootstrap: list[str] = BOOTSTRAP,
    kv_budget: int = typer.Option(None, help="KV cache budget in tokens over all sessions."),
    idle_timeout: float = typer.Option(None, help="Seconds before an idle session is dropped."),
    record_ttl: float = typer.Option(None, help="Lifetime of the DHT server record (refreshed at 1/3)."),
    ad_period: float = typer.Option(None, help="Seconds between capability ads on gossip."),
    api_port: int = typer.Option(None, help="Local HTTP API (OpenAI-compatible) on 127.0.0.1 (default 8311; "
                                            "0: a free port; -1: none). Its token is in the data dir."),
    private: bool = typer.Option(None, "--private/--no-private",
                                 help="Serve private sessions: products on CKKS ciphertexts (default on)."),
    relay: bool = typer.Option(None, "--relay/--no-relay",
                               help="Relay for peers behind NAT while this node is publicly reachable, within the "
                                    "quotas of config.toml's [relay] (default on)."),
    hole_punch: bool = typer.Option(None, "--hole-punch/--no-hole-punch",
                                    help="Upgrade relayed connections to direct ones by hole punching (DCUtR) where "
                                         "the NATs allow (default on; off: connections through relays stay relayed)."),
    debug_slowdown: float = DEBUG_SLOWDOWN,
    debug_noise: float = DEBUG_NOISE,
    debug_forge_push: bool = DEBUG_FORGE_PUSH,
    debug_claim_format: str = DEBUG_CLAIM_FORMAT,
    debug_slow_steps: str = DEBUG_SLOW_STEPS,
    detach: bool = typer.Option(False, "--detach", "-d", help="Run in the background: pid in node.pid, "
                                                             "log in node.log (data dir); `compushare stop` ends it."),
    log_level: str = typer.Option("info"),
) -> None:
    """Serve blocks of a model to the swarm (in the foreground, or --detach)."""
    import trio

    from .node import Node
    from .progress import Progress

    home = resolve_data_dir(data_dir)
    if detach:
        return run_or_exit(lambda: _detach(home))
    setup_logging(log_level)
    bound_retention()  # a server's buffers come and go with its peers: give them back when freed
    limits = {"kv_budget_tokens": kv_budget, "session_idle_timeout_s": idle_timeout}
    config = NodeConfig.build(home, model=model, blocks=Span.parse(blocks) if blocks else None, listen=listen,
                              bootstrap=bootstrap, record_ttl_s=record_ttl, max_blocks=max_blocks,
                              memory_budget_mb=memory_budget_mb, device=device, runtime=runtime, torch_threads=threads,
                              ad_period_s=ad_period,
                              api_port=api_port, private=private, relay=relay, hole_punch=hole_punch)
    config = dataclasses.replace(config, limits=dataclasses.replace(
        config.limits, **{k: v for k, v in limits.items() if v is not None}))
    faults = FaultInjection.from_flags(slowdown=debug_slowdown, noise=debug_noise, forge_push=debug_forge_push,
                                       claim_format=debug_claim_format, slow_steps=debug_slow_steps)
    run_or_exit(lambda: trio.run(_serve, Node(config, faults, Progress())))  # (progress: conversion, fetching)


async def _serve(node) -> None:
    """Run `node` until stopped, with one line saying what it serves once it does."""
    import trio

    from .status import ready_line

    async with trio.open_nursery() as nursery:
        state = await nursery.start(node.run)
        out.print(ready_line(state), highlight=False, markup=False)


def _detach(home: Path) -> None:
    """Start this same `node` command in its own session, logging to the data dir,
    and return once it serves (or say why it did not)."""
    import subprocess

    from ..config import LOG_FILE, STATE_FILE
    from .status import local_node, ready_line
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
    out.print(f"{ready_line(state)} (pid {proc.pid}); log {home / LOG_FILE}", highlight=False, markup=False)


@app.command()
def stop(data_dir: Path = DATA_DIR) -> None:
    """Stop the node running on this data dir (SIGTERM, then SIGKILL after 10 s)."""
    from .swarm import stop_node

    run_or_exit(lambda: out.print(f"stopped node {stop_node(resolve_data_dir(data_dir))}"))


@app.command()
def tray(data_dir: Path = DATA_DIR, log_level: str = typer.Option("warning")) -> None:
    """A system-tray icon for the node on this data dir: its state, karma and tokens
    served; pause/resume, dashboard, quit. Needs the [tray] extra and a tray host."""
    from .tray import Tray

    setup_logging(log_level)
    run_or_exit(Tray(resolve_data_dir(data_dir)).run)


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
    spot_check: float = SPOT_CHECK,
    private: bool = typer.Option(False, "--private", help="Private mode: providers compute on CKKS ciphertexts "
                                                          "and never see the prompt's activations (much slower)."),
    direct: bool = typer.Option(True, "--direct/--no-direct",
                                help="Servers pass hidden states on to each other, the last one back to you "
                                     "(--no-direct: every hop's output comes back through this machine)."),
    speculate: bool = typer.Option(True, "--speculate/--no-speculate",
                                   help="Draft tokens from the context and verify several per pass (same "
                                        "output; faster where the text repeats itself)."),
    standby: bool = typer.Option(False, "--standby",
                                 help="Keep a standby server per span, fed every step, so a failover resumes at "
                                      "once at any context length (costs the swarm each span's compute again)."),
    fast_replay: bool = typer.Option(False, "--fast-replay", help="A failover without a standby replays the "
                                     "context in few forwards: faster, exact within the format's tolerance only."),
    listen: list[str] = typer.Option(None, help="Listen multiaddr (repeatable; default 127.0.0.1). Behind a NAT, "
                                                "listen on the LAN address so that hole punching can reach you."),
    adapter: Path = ADAPTER,
    stop: list[str] = typer.Option(None, help="End the answer before this text (repeatable; never printed)."),
    json_schema: Path = JSON_SCHEMA,
    verbose: bool = typer.Option(False, "--verbose", "-v", help="Print the route and timings."),
    log_level: str = typer.Option("warning"),
) -> None:
    """Answer PROMPT through the swarm, streaming tokens as they come."""
    import trio

    from ..pipeline.client.consumer import ProgressHooks, RunRequest, run_prompt
    from ..pipeline.client.sampling import SamplingParams
    from .progress import Progress

    setup_logging(log_level)
    home = resolve_data_dir(data_dir)

    def main_run():
        request = RunRequest(model=model, prompt=prompt, chat_template=chat_template, private=private,
                             direct=direct, speculate=speculate, standby=standby, adapter=adapter,
                             stop=tuple(stop or ()), fast_replay=fast_replay, grammar=_schema_grammar(json_schema),
                             params=SamplingParams(temperature=temperature, top_p=top_p, seed=seed,
                                                   max_new_tokens=max_tokens))
        boot = bootstrap_for(home, bootstrap, swarm_home)
        on_route = functools.partial(_show_route, private=private, verbose=verbose)
        with Progress() as shown:  # a model converted or fetched first
            outcome = trio.run(lambda: run_prompt(home, boot, request, on_text=_stream, on_route=on_route,
                                                  spot_check_rate=spot_check, listen=tuple(listen or ()),
                                                  hooks=ProgressHooks(shown.stage, shown.update)))
        sys.stdout.write("\n")
        _report(outcome, verbose, shaped=json_schema is not None)

    run_or_exit(main_run)


def _schema_grammar(path: Path | None) -> str | None:
    """`run --json-schema`'s grammar (UsageError for a file that is not a JSON schema)."""
    if path is None:
        return None
    import json

    from ..errors import UsageError
    from ..pipeline.client.grammar import json_schema_grammar

    try:
        schema = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise UsageError(f"--json-schema {path}: not a JSON file ({exc})") from None
    if not isinstance(schema, dict):
        raise UsageError(f"--json-schema {path}: a JSON schema is an object")
    return json_schema_grammar(schema)


def _show_route(route, *, private: bool, verbose: bool) -> None:
    """`run`'s stderr, once the route is chosen: a private run's stages, the hops with -v."""
    if private:
        from ..pipeline.client.private_chain import describe_private_route

        for line in describe_private_route(route, route[-1].end if route else 0):
            err.print(line, highlight=False, markup=False)
    if verbose:
        from ..pipeline.client.routing import describe_route

        err.print(f"[bold]route[/bold] ({len(route)} hops, chosen for the least expected latency):")
        for line in describe_route(route):
            err.print(f"  {line}", highlight=False, markup=False)


def _report(outcome, verbose: bool, shaped: bool = False) -> None:
    """`run`'s stderr, once the answer is out: an unfinished JSON answer, failovers and
    failed spot checks; timings with -v."""
    if shaped and outcome.finish_reason == "length":
        err.print("[yellow]the answer was cut before its JSON was complete: raise --max-tokens[/yellow]")
    for failover in outcome.failovers:
        err.print(f"failover: blocks {failover.start}:{failover.end} moved from {failover.peer_id[-8:]} "
                  f"({failover.reason}) to {', '.join(p[-8:] for p in failover.replacements)} in "
                  f"{failover.recovered - failover.noticed:.2f}s", highlight=False)
    for report in outcome.reports:
        err.print(f"[red]spot check failed[/red]: {report.accused.peer_id} excluded; failure report "
                  f"{report.digest[:12]} kept")
    if not verbose:
        return
    err.print(f"first token after {outcome.first_token_s:.2f}s; {len(outcome.tokens)} tokens at "
              f"{outcome.decode_tok_s:.1f} tok/s in {outcome.passes} passes ({outcome.accepted} of "
              f"{outcome.drafted} drafted tokens kept); {outcome.direct_steps} steps direct; "
              f"{outcome.checks} spot checks", highlight=False)
    if outcome.private:
        p = outcome.private
        err.print(f"private: {p['projections']} encrypted projections; keys {p['keys_bytes'] / 1e6:.1f} MB "
                  f"(sent to {p['keys_sent']} providers, cached by the others); "
                  f"{p['bytes_sent'] / 1e6:.0f} MB sent, {p['bytes_received'] / 1e6:.0f} MB received; "
                  f"encrypt {p['encrypt_s']:.1f}s, decrypt {p['decrypt_s']:.1f}s, providers "
                  f"{p['provider_s']:.1f}s, round trips {p['roundtrip_s']:.1f}s, local layers "
                  f"{p['local_s']:.1f}s", highlight=False)


@app.command()
def chat(
    model: str = typer.Option("smollm2-135m", help="Model name or id (/model switches)."),
    data_dir: Path = DATA_DIR,
    bootstrap: list[str] = BOOTSTRAP,
    swarm_home: Path = SWARM_HOME,
    temperature: float = typer.Option(0.0, help="0 is greedy (/temp changes it)."),
    max_tokens: int = typer.Option(256, help="Most new tokens per reply (/max changes it)."),
    spot_check: float = typer.Option(0.05, min=0.0, max=1.0, help="Share of steps re-checked elsewhere."),
    private: bool = typer.Option(False, "--private", help="Start in private mode (/private on|off switches): "
                                                          "providers see only CKKS ciphertexts; much slower."),
    adapter: Path = ADAPTER,
    log_level: str = typer.Option("warning"),
) -> None:
    """Chat with a model through the swarm: multi-turn, streamed; /help lists commands."""
    from ..pipeline.client.consumer import ProgressHooks
    from .chat import repl
    from .progress import Progress

    setup_logging(log_level)
    home = resolve_data_dir(data_dir)
    boot = bootstrap_for(home, bootstrap, swarm_home)
    code = 0

    def main_chat():
        nonlocal code
        with Progress() as shown:  # a model converted or fetched first
            code = repl(home, boot, model, temperature=temperature, max_tokens=max_tokens,
                        spot_check_rate=spot_check, private=private, adapter=adapter,
                        hooks=ProgressHooks(shown.stage, shown.update))

    run_or_exit(main_chat)
    raise typer.Exit(code)


def _stream(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


app.command()(status)
app.command()(karma)
app.command()(finetune)
app.command()(doctor)
app.command("id")(show_id)


def main() -> None:
    pause_during_startup()
    try:
        app()
    finally:
        gc.enable()  # a command that ended before run_or_exit (or a caller running main in-process)


if __name__ == "__main__":
    main()
