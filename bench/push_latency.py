"""Server-to-server pushes on a WAN: decode speed with and without them.

    sudo .venv/bin/python bench/push_latency.py [--delay-ms 10] [--trials 3] [--tokens 32]

Three node processes (blocks 0:10, 10:20, 20:30 of SmolLM2-135M, fp32, 1 torch
thread) each in its own network namespace of the project's harness (tools/netlab),
the consumer in a fourth;
every link delays packets by --delay-ms on the way in, so a round trip between two
hosts takes 2 x delay. The consumer generates greedily through the same three
servers, alternating trials with the chain linked (each server pushes its output
to the next: 4 one-way transits per token) and not linked (every hidden state goes
back to the consumer: 6 transits). Timing as in pipeline_overhead.py: the decode
steps only, median of the trials. Needs root; the namespaces are removed on every
exit path.

Human-readable lines first; the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO / "src") not in sys.path:
    try:
        import compushare  # noqa: F401  (installed editable in the venv)
    except ImportError:
        sys.path.insert(0, str(REPO / "src"))
os.environ.setdefault("COMPUSHARE_CACHE", str(REPO / ".cache" / "compushare"))

sys.path.insert(0, str(REPO / "tools"))
import netlab  # noqa: E402  (tools/netlab, the project's namespace harness)

MODEL = "smollm2-135m"
PROMPT = "What is the capital of France?"
PFX = "csp"  # our own namespace names: nothing else's lab is touched
HOSTS = 4  # 1-3 servers, 4 the consumer


# ---------------------------------------------------------------- the consumer (host 4)


def client_main(bootstrap: str, trials: int, tokens: int) -> None:
    """Runs inside the consumer's namespace; prints one JSON line of trial results."""
    import torch
    import trio
    from transformers import AutoTokenizer

    from compushare.model.catalog import resolve_model
    from compushare.model.head import ConsumerHead
    from compushare.net.dht import connect_bootstrap, open_dht
    from compushare.net.host import open_host
    from compushare.net.identity import load_or_create_identity
    from compushare.pipeline.client.chain import open_chain
    from compushare.pipeline.client.consumer import RunRequest, find_route, prompt_ids_of
    from compushare.pipeline.client.generate import generate
    from compushare.pipeline.client.sampling import SamplingParams

    torch.set_num_threads(1)
    data_dir = Path(tempfile.mkdtemp(prefix="compushare-push-client-"))
    try:
        model = resolve_model(MODEL, data_dir)
        tokenizer = AutoTokenizer.from_pretrained(str(model.path))
        prompt_ids = prompt_ids_of(tokenizer, RunRequest(model=MODEL, prompt=PROMPT))
        head = ConsumerHead.load(model.path)

        async def trial(host, route, push: bool, steps: int) -> dict:
            times, produced = [], []

            def on_token(token: int) -> None:
                times.append(time.perf_counter())
                produced.append(token)

            async with open_chain(host, route, model.model_id, max_tokens=len(prompt_ids) + steps + 1,
                                  hidden_size=model.hidden_size, push=push) as chain:
                await generate(chain, head, prompt_ids, SamplingParams(max_new_tokens=steps + 1, stop_at_eos=False),
                               on_token=on_token)
            gaps = [b - a for a, b in zip(times, times[1:])]
            return {"tokens": produced, "tok_s": steps / (times[-1] - times[0]),
                    "step_ms_median": 1000 * statistics.median(gaps)}

        async def main() -> dict:
            async with open_host(load_or_create_identity(data_dir), [f"/ip4/{netlab.Topology(PFX, hosts=HOSTS).addr(HOSTS)}/tcp/0"]) as host, \
                    open_dht(host, server=False) as dht:
                await connect_bootstrap(host, dht, [bootstrap])
                route = await find_route(host, dht, model.model_id, model.num_blocks)
                await trial(host, route, True, 4)  # warm-up: connections, first-call costs
                await trial(host, route, False, 4)
                out = {"push": [], "no_push": [], "route": [(h.start, h.end) for h in route]}
                for _ in range(trials):
                    out["push"].append(await trial(host, route, True, tokens))
                    out["no_push"].append(await trial(host, route, False, tokens))
                return out

        print(json.dumps(trio.run(main)), flush=True)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


# ---------------------------------------------------------------- the run (root namespace)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delay-ms", type=int, default=10, help="added on each host's ingress (RTT = 2x)")
    parser.add_argument("--trials", type=int, default=3)
    parser.add_argument("--tokens", type=int, default=32, help="timed decode tokens per trial")
    parser.add_argument("--client", help=argparse.SUPPRESS)  # internal: the consumer, in its namespace
    args = parser.parse_args()
    if args.client:
        client_main(args.client, args.trials, args.tokens)
        return 0
    if os.geteuid() != 0:
        parser.error("needs root (network namespaces)")

    from compushare.model.catalog import resolve_model
    from compushare.app.swarm import node_command, split_blocks, start_node, stop_pids, wait_ready

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finally below
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))
    root = Path(tempfile.mkdtemp(prefix="compushare-push-bench-"))
    procs: list[subprocess.Popen] = []
    lab = netlab.Lab(netlab.Topology(PFX, hosts=HOSTS, delay_ms=args.delay_ms))
    try:
        lab.__enter__()  # removes a lab left by a killed earlier run, then builds this one
        model = resolve_model(MODEL, root / "reference")
        print(f"{MODEL}: 3 servers in namespaces {PFX}h1-3, the consumer in {PFX}h{HOSTS}, "
              f"{args.delay_ms} ms added per one-way transit", flush=True)
        bootstrap: list[str] = []
        states = []
        for index, span in enumerate(split_blocks(model.num_blocks, 3)):
            data_dir = root / f"node-{index}"
            cmd = node_command(MODEL, span, data_dir, bootstrap)
            cmd[cmd.index("--listen") + 1] = f"/ip4/{lab.addr(index + 1)}/tcp/0"
            proc = start_node(lab.wrap(index + 1, cmd), data_dir)
            procs.append(proc)
            states.append(wait_ready(proc, data_dir, timeout=180))
            bootstrap = bootstrap or states[0]["addrs"][:1]
        ping = lab.run(HOSTS, ["ping", "-U", "-c", "5", "-i", "0.2", lab.addr(1)], capture_output=True,
                       text=True).stdout
        rtt = ping.strip().splitlines()[-1] if ping else "?"
        print(f"ping consumer -> server: {rtt}", flush=True)
        done = lab.run(HOSTS, [sys.executable, __file__, "--client", bootstrap[0], "--trials", str(args.trials),
                               "--tokens", str(args.tokens)], capture_output=True, text=True, timeout=1200)
        if done.returncode != 0:
            raise RuntimeError(f"the consumer failed: {done.stderr[-3000:]}")
        runs = json.loads(done.stdout.strip().splitlines()[-1])
    finally:
        stop_pids([p.pid for p in procs if p.poll() is None], timeout=10)
        for proc in procs:
            with contextlib.suppress(Exception):
                proc.wait(timeout=5)
        lab.close()
        shutil.rmtree(root, ignore_errors=True)

    for push, name in ((True, "push"), (False, "no_push")):
        for index, trial in enumerate(runs[name]):
            print(f"trial {index + 1} {'linked (pushes)' if push else 'not linked':16} {trial['tok_s']:6.2f} tok/s  "
                  f"step median {trial['step_ms_median']:7.2f} ms", flush=True)
    med = {name: statistics.median(t["tok_s"] for t in runs[name]) for name in ("push", "no_push")}
    steps = {name: statistics.median(t["step_ms_median"] for t in runs[name]) for name in ("push", "no_push")}
    reference = runs["push"][0]["tokens"]
    same = all(t["tokens"] == reference for name in ("push", "no_push") for t in runs[name])
    result = {
        "delay_ms_one_way": args.delay_ms,
        "push_tok_s": round(med["push"], 3),
        "no_push_tok_s": round(med["no_push"], 3),
        "speedup": round(med["push"] / med["no_push"], 3),
        "step_ms_median": {k: round(v, 2) for k, v in steps.items()},
        "saved_ms_per_token": round(steps["no_push"] - steps["push"], 2),
        "tokens_match": same,
        "trials": {name: [round(t["tok_s"], 3) for t in runs[name]] for name in ("push", "no_push")},
        "route": runs["route"],
        "decode_tokens": args.tokens,
    }
    print(f"linked {med['push']:.2f} tok/s vs not linked {med['no_push']:.2f} tok/s: x{result['speedup']:.2f}, "
          f"{result['saved_ms_per_token']:.1f} ms saved per token; tokens identical: {same}", flush=True)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
