"""The inference pipeline on a WAN: relay, pushes, direct return, speculation, and
many chains at once, against a single-process reference, at two distances.

    sudo .venv/bin/python bench/wan.py [--delays 20,50] [--trials 2] [--tokens 48] [--load-core [CPU]]

Three node processes (blocks 0:10, 10:20, 20:30 of SmolLM2-135M, fp32, 1 torch
thread) each in its own network namespace of the project's harness (tools/netlab),
the consumer in a fourth (host 4, a subprocess of this script). Every host delays
the packets it receives by D ms, so a round trip between two hosts takes 2 x D. The
lab and the nodes are built afresh for each D of --delays (default 20 ms, then
50 ms); the RTT is measured with `ping -U -c 10 -i 0.2` consumer -> server 1
(median of the replies; rtt_ok: within 10 % of 2 x D).

Two prompts, chat template applied: `draftable` (bench/wan_prompts.json: rename a
variable in bench/wan_function.py, which is read as text: code edits repeat their
input, so n-gram drafts have something to find) and `freeform` (a short story:
little to draft). Modes, all greedy, stop_at_eos off, from the consumer's namespace:

  local        the whole model in the consumer process (compushare.model.blocks.
               load_full_model, transformers, fp32, 1 torch thread), token by token
               with its KV cache: no network. Its tokens are the reference.
  relay        open_chain(push=False, direct=False): every hidden state goes back to
               the consumer, which sends it to the next server (6 transits a token).
  push         open_chain(push=True, direct=False): each server also pushes its
               output to the next one, which starts on it; the consumer still relays.
  direct       open_chain(push=True, direct=True): the consumer sends the token to
               server 1, the servers push it along, server 3 answers (4 transits).
               `direct_freeform` is the same on the free-form prompt.
  spec         direct + generate(speculate=True): each pass verifies n-gram drafts
               (prompt lookup) in one step. `spec_freeform` on the free-form prompt.
  single /     1 / 8 chains opened at once from the one consumer host over the same
  concurrent8  route (direct, no speculation, draftable prompt), generating in one
               trio nursery. Every chain prefills and picks its first token, then
               waits at a barrier; all decode from the barrier's release on.
               Aggregate tok/s = total decode tokens of the chains / (the last
               chain's last token - the release): the second formula of the brief,
               with every first token before the window starts.

Timing as in pipeline_overhead.py: the decode only (prefill, opening the chain and model
loading excluded): a trial generates --tokens + 1 tokens, and tok/s = --tokens /
(time of the last token - time of the first). Modes are interleaved within each of
--trials rounds, after one short untimed warm-up of every mode; figures are the
medians of the trials. accepted_per_pass = accepted drafts / passes, summed over the
spec trials. `identical`: every single-chain trial's tokens equal local's on its
prompt, and each of the 8 concurrent chains' too. `late_waits` /
`concurrent8_late_waits`: requests (steps, links, receipts) that missed their
deadline and were waited for, their server slow but answering pings (RemoteHop.
late_waits, summed over the timed trials of the single-chain modes / the 8-chain
trials); before deadlines followed load, any one of them failed the run.

Per-token components: t_ms = one-way transit = rtt / 2; f_ms = one server's compute
for one decode token: the compute_ms its replies report (RemoteHop.usage), read per
hop after every decode step of the relay trials, median over steps and servers
(f_hops_ms: each server's median); c_ms = the consumer's own work per token, timed
in the consumer on its own: embed the token, the LM head (ConsumerHead.logits) and
greedy choice (Sampler.choose), median of 200. A relayed token costs about
6t + 3f + c, a direct one 4t + 3f + c (the lines printed compare).

--load-core runs the whole bench on a loaded machine: one more process (this
Python, `python -c` a busy loop, no I/O) keeps one core busy from before the first
lab is built until the end, pinned to CPU number CPU (sched_setaffinity) or, with
no number, left to the scheduler. The servers' steps then take longer and vary (the
step deadlines follow that: pipeline/client/deadlines.py); the run must still
complete every mode with the reference's tokens. The loop is killed by pid on every
exit path, and ends by itself if this script dies (it watches its parent); the
JSON line records `load_core`.

Needs root; the namespaces are removed, the nodes stopped by pid and the temp dirs
removed on every exit path (--keep keeps the temp dir, node logs included). Human-
readable lines first; the last line is one JSON object (keys for the first delay
bare, for every later delay D prefixed `wan{D}_`), also appended to
bench/results/wan.jsonl with run, date and commit (--results '' skips that).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import REPO, finish, stop_lab  # noqa: E402  (this checkout's src/, the shared caches)

sys.path.insert(0, str(REPO / "tools"))
import netlab  # noqa: E402  (tools/netlab, the project's namespace harness)

MODEL = "smollm2-135m"
PROMPTS = Path(__file__).resolve().with_name("wan_prompts.json")
FUNCTION = Path(__file__).resolve().with_name("wan_function.py")
PFX = "csp"  # our own namespace names: nothing else's lab is touched
HOSTS = 4  # 1-3 servers, 4 the consumer
CONCURRENT = 8
WARMUP_TOKENS = 4
TRIAL_TIMEOUT_S = 300  # any one trial (all 8 chains of a concurrent one together)
CLIENT_TIMEOUT_S = 1200  # the consumer's whole run at one delay
CHAIN_MODES = {  # name: (prompt, push, direct, speculate)
    "relay": ("draftable", False, False, False),
    "push": ("draftable", True, False, False),
    "direct": ("draftable", True, True, False),
    "direct_freeform": ("freeform", True, True, False),
    "spec": ("draftable", True, True, True),
    "spec_freeform": ("freeform", True, True, True),
    # The machine's reference for speculation: drafts that are always right (the local
    # reference's own tokens), so every pass keeps all it drafts: what the chain gives
    # when a drafter (or a model that copies) earns it.
    "spec_oracle": ("draftable", True, True, "oracle"),
}


class OracleDrafter:
    """Drafts the reference continuation itself (speculative.NgramDrafter's interface)."""

    def __init__(self, prompt: list[int], reference: list[int]) -> None:
        self.start, self.length, self.reference = len(prompt), len(prompt), reference

    def extend(self, tokens: list[int]) -> None:
        self.length += len(tokens)

    def draft(self, k: int) -> list[int]:
        done = self.length - self.start
        return self.reference[done:done + k] if k > 0 else []


def prompt_texts() -> dict[str, str]:
    prompts = json.loads(PROMPTS.read_text())
    function = FUNCTION.read_text().rstrip("\n")
    return {name: text.replace("{function}", function) for name, text in prompts.items()}


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------- the consumer (host 4)


def cpu_seconds(pids: list[int]) -> float:
    """User + system CPU seconds of these processes (the servers, in other network
    namespaces but this pid namespace) and of this one, all threads."""
    tick = os.sysconf("SC_CLK_TCK")
    total = 0.0
    for pid in [*pids, os.getpid()]:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except (OSError, IndexError, ValueError):
            pass
    return total


def client_main(bootstrap: str, trials: int, tokens: int, server_pids: list[int]) -> None:
    """Runs inside the consumer's namespace; prints one JSON line of trial results."""
    import torch
    import trio
    from transformers import AutoTokenizer

    from compushare.model.blocks import load_full_model
    from compushare.model.catalog import resolve_model
    from compushare.model.head import ConsumerHead
    from compushare.net.dht import connect_bootstrap, open_dht
    from compushare.net.host import open_host
    from compushare.net.identity import load_or_create_identity
    from compushare.pipeline.client.chain import open_chain
    from compushare.pipeline.client.consumer import RunRequest, prompt_ids_of
    from compushare.pipeline.client.planner import SwarmPlanner
    from compushare.pipeline.client.generate import GenerateStats, generate
    from compushare.pipeline.client.sampling import Sampler, SamplingParams
    from compushare.pipeline.client.speculative import MAX_DRAFT

    torch.set_num_threads(1)
    data_dir = Path(tempfile.mkdtemp(prefix="compushare-wan-client-"))
    try:
        model = resolve_model(MODEL, data_dir)
        tokenizer = AutoTokenizer.from_pretrained(str(model.path))
        prompts = {name: prompt_ids_of(tokenizer, RunRequest(model=MODEL, prompt=text))
                   for name, text in prompt_texts().items()}
        assert all(len(ids) < 2048 for ids in prompts.values()), "one prefill step per prompt (Gate counts on it)"
        head = ConsumerHead.load(model.path)
        full = load_full_model(model.path)

        def consumer_ms() -> float:
            """c: embed one token, the LM head on one hidden state, the greedy choice."""
            sampler = Sampler(SamplingParams(stop_at_eos=False))
            hidden = torch.randn(1, 1, model.hidden_size)
            token, samples = 0, []
            for _ in range(200):
                began = time.perf_counter()
                head.embed_tokens([token])
                token = sampler.choose(head.logits(hidden))
                samples.append(time.perf_counter() - began)
            return 1000 * statistics.median(samples[20:])

        def local_trial(ids: list[int], steps: int) -> dict:
            """The single-process reference: greedy, token by token, with the KV cache."""
            times, produced = [], []
            with torch.inference_mode():
                out = full(input_ids=torch.tensor([ids]), use_cache=True)
                for _ in range(steps + 1):
                    token = int(torch.argmax(out.logits[0, -1]))
                    times.append(time.perf_counter())
                    produced.append(token)
                    if len(produced) > steps:
                        break
                    out = full(input_ids=torch.tensor([[token]]), past_key_values=out.past_key_values,
                               use_cache=True)
            return {"tokens": produced, "tok_s": steps / (times[-1] - times[0])}

        class Barrier:
            """Every chain of a concurrent trial waits here after its first token."""

            def __init__(self, parties: int) -> None:
                self.parties, self.arrived, self.released = parties, 0, None
                self.event = trio.Event()
                self.cpu = 0.0  # CPU seconds of the 4 processes when released

            async def wait(self) -> None:
                self.arrived += 1
                if self.arrived == self.parties:
                    self.released = time.perf_counter()
                    self.cpu = cpu_seconds(server_pids)
                    self.event.set()
                await self.event.wait()

        class Gate:
            """A chain whose first decode step (its second step: the prompt is one)
            waits at the barrier; what generate() uses of a chain, passed on."""

            def __init__(self, chain, barrier: Barrier) -> None:
                self.chain, self.barrier, self.steps = chain, barrier, 0

            async def step(self, hidden):
                self.steps += 1
                if self.steps == 2:
                    await self.barrier.wait()
                return await self.chain.step(hidden)

            async def rewind(self, position: int) -> None:
                await self.chain.rewind(position)

        out_local: dict[str, list[dict]] = {name: [] for name in prompts}  # the oracle's drafts come from here

        async def chain_run(host, route, prompt: str, steps: int, *, push: bool, direct: bool,
                            speculate: bool, barrier: Barrier | None = None) -> dict:
            ids = prompts[prompt]
            times, produced = [], []
            compute: list[list[float]] = []  # per hop: compute_ms of each 1-token decode step
            stats = GenerateStats()
            async with open_chain(host, route, model.model_id, max_tokens=len(ids) + steps + 1 + MAX_DRAFT,
                                  hidden_size=model.hidden_size, push=push, direct=direct) as chain:
                compute = [[] for _ in chain.hops]
                last = None

                def on_token(token: int) -> None:
                    nonlocal last
                    times.append(time.perf_counter())
                    produced.append(token)
                    now = [(hop.usage, hop.usage.tokens, hop.usage.compute_ms) for hop in chain.hops]
                    if last is not None and len(now) == len(last):  # a decode step (a receipt renews usage)
                        for samples, (u0, n0, ms0), (u1, n1, ms1) in zip(compute, last, now):
                            if u0 is u1 and n1 - n0 == 1:
                                samples.append(ms1 - ms0)
                    last = now

                drafter = None
                if speculate == "oracle":
                    known = out_local[prompt][-1]["tokens"] if out_local[prompt] else []
                    drafter = OracleDrafter(ids, known)
                await generate(chain if barrier is None else Gate(chain, barrier), head, ids,
                               SamplingParams(max_new_tokens=steps + 1, stop_at_eos=False), on_token=on_token,
                               speculate=bool(speculate), stats=stats, drafter=drafter)
                direct_steps = chain.core.direct_steps
                late = sum(hop.late_waits for hop in chain.hops)  # steps waited for past their deadline
            return {"tokens": produced, "first": times[0], "last": times[-1],
                    "tok_s": steps / (times[-1] - times[0]), "passes": stats.passes, "drafted": stats.drafted,
                    "accepted": stats.accepted, "direct_steps": direct_steps, "compute_ms": compute,
                    "late_waits": late}

        async def concurrent_trial(host, route, chains: int, steps: int) -> dict:
            barrier = Barrier(chains)
            runs: list[dict | None] = [None] * chains

            async def one(index: int) -> None:
                runs[index] = await chain_run(host, route, "draftable", steps, push=True, direct=True,
                                              speculate=False, barrier=barrier)

            async with trio.open_nursery() as nursery:
                for index in range(chains):
                    nursery.start_soon(one, index)
            end = max(run["last"] for run in runs)
            cpu = cpu_seconds(server_pids) - barrier.cpu
            return {"chains": chains, "tok_s": chains * steps / (end - barrier.released),
                    "cpu_s": cpu, "wall_s": end - barrier.released,
                    "per_chain_tok_s": [steps / (run["last"] - barrier.released) for run in runs],
                    "tokens": [run["tokens"] for run in runs],
                    "direct_steps": [run["direct_steps"] for run in runs],
                    "late_waits": sum(run["late_waits"] for run in runs)}

        async def main() -> dict:
            listen = f"/ip4/{netlab.Topology(PFX, hosts=HOSTS).addr(HOSTS)}/tcp/0"
            async with open_host(load_or_create_identity(data_dir), [listen]) as host, \
                    open_dht(host, server=False) as dht:
                await connect_bootstrap(host, dht, [bootstrap])
                route = await SwarmPlanner(host, dht, model.model_id, model.num_blocks).first_route()
                out: dict = {"route": [(h.start, h.end) for h in route], "c_ms": consumer_ms(),
                             "prompt_tokens": {name: len(ids) for name, ids in prompts.items()},
                             "local": out_local, "single": [], "concurrent8": [],
                             **{mode: [] for mode in CHAIN_MODES}}

                async def timed(coro_fn, *args, **kwargs):
                    with trio.fail_after(TRIAL_TIMEOUT_S):
                        return await coro_fn(*args, **kwargs)

                began = time.perf_counter()
                for name in prompts:  # warm-up: connections, sessions, first-call costs
                    await trio.to_thread.run_sync(local_trial, prompts[name], WARMUP_TOKENS)
                for mode, (prompt, push, direct, speculate) in CHAIN_MODES.items():
                    await timed(chain_run, host, route, prompt, WARMUP_TOKENS, push=push, direct=direct,
                                speculate=speculate)
                await timed(concurrent_trial, host, route, CONCURRENT, WARMUP_TOKENS)
                log(f"  warm-up done in {time.perf_counter() - began:.0f} s")
                for index in range(trials):
                    for name in prompts:
                        run = await trio.to_thread.run_sync(local_trial, prompts[name], tokens)
                        out["local"][name].append(run)
                        log(f"  trial {index + 1} local/{name:9} {run['tok_s']:6.2f} tok/s")
                    for mode, (prompt, push, direct, speculate) in CHAIN_MODES.items():
                        run = await timed(chain_run, host, route, prompt, tokens, push=push, direct=direct,
                                          speculate=speculate)
                        out[mode].append(run)
                        log(f"  trial {index + 1} {mode:15} {run['tok_s']:6.2f} tok/s  passes {run['passes']:3}  "
                            f"drafted {run['drafted']:3}  accepted {run['accepted']:3}  "
                            f"direct steps {run['direct_steps']:3}")
                    for name, chains in (("single", 1), ("concurrent8", CONCURRENT)):
                        run = await timed(concurrent_trial, host, route, chains, tokens)
                        out[name].append(run)
                        log(f"  trial {index + 1} {name:15} {run['tok_s']:6.2f} tok/s aggregate (chains: "
                            f"{', '.join(f'{r:.2f}' for r in run['per_chain_tok_s'])})")
                return out

        print(json.dumps(trio.run(main)), flush=True)
    finally:
        shutil.rmtree(data_dir, ignore_errors=True)


# ---------------------------------------------------------------- the run (root namespace)


def ping_rtt_ms(text: str) -> float | None:
    """The median of ping's per-reply times."""
    times = [float(m) for m in re.findall(r"time=([\d.]+) ms", text)]
    return statistics.median(times) if times else None


def run_delay(args, delay_ms: int) -> dict:
    """One lab at one delay: nodes up, ping, the consumer's trials; everything down."""
    from compushare.app.swarm import node_command, split_blocks, start_node, wait_ready
    from compushare.model.catalog import resolve_model

    root = Path(tempfile.mkdtemp(prefix=f"compushare-wan{delay_ms}-"))
    procs: list[subprocess.Popen] = []
    lab = netlab.Lab(netlab.Topology(PFX, hosts=HOSTS, delay_ms=delay_ms))
    failed = True
    try:
        lab.__enter__()  # removes a lab left by a killed earlier run, then builds this one
        model = resolve_model(MODEL, root / "reference")
        print(f"{MODEL}: 3 servers in namespaces {PFX}h1-3, the consumer in {PFX}h{HOSTS}, "
              f"{delay_ms} ms added per one-way transit", flush=True)
        bootstrap: list[str] = []
        pids: list[int] = []
        for index, span in enumerate(split_blocks(model.num_blocks, 3)):
            data_dir = root / f"node-{index}"
            cmd = node_command(MODEL, span, data_dir, bootstrap)
            cmd[cmd.index("--listen") + 1] = f"/ip4/{lab.addr(index + 1)}/tcp/0"
            proc = start_node(lab.wrap(index + 1, cmd), data_dir)
            procs.append(proc)
            state = wait_ready(proc, data_dir, timeout=180)
            pids.append(state["pid"])
            bootstrap = bootstrap or state["addrs"][:1]
        ping = lab.run(HOSTS, ["ping", "-U", "-c", "10", "-i", "0.2", lab.addr(1)], capture_output=True,
                       text=True, timeout=30).stdout
        rtt = ping_rtt_ms(ping)
        print(f"ping consumer -> server 1: median {rtt} ms ({(ping.strip().splitlines() or ['?'])[-1]})", flush=True)
        began = time.perf_counter()
        done = lab.run(HOSTS, [sys.executable, __file__, "--client", bootstrap[0], "--trials", str(args.trials),
                               "--tokens", str(args.tokens), "--pids", ",".join(map(str, pids))],
                       stdout=subprocess.PIPE, text=True,
                       timeout=CLIENT_TIMEOUT_S)  # its stderr (progress) passes through
        if done.returncode != 0:
            raise RuntimeError(f"the consumer failed (exit {done.returncode}); its stderr is above")
        runs = json.loads(done.stdout.strip().splitlines()[-1])
        runs["client_s"] = time.perf_counter() - began
        runs["rtt_ms"] = rtt
        failed = False
        return runs
    finally:
        stop_lab(procs, lab, root, failed=failed, keep=args.keep, logs="node-*/node.log", log=log)


def summarise(runs: dict, delay_ms: int, tokens: int) -> dict:
    med = lambda trials: statistics.median(t["tok_s"] for t in trials)  # noqa: E731
    local = {name: runs["local"][name][0]["tokens"] for name in runs["local"]}
    same = all(t["tokens"] == local[name] for name in runs["local"] for t in runs["local"][name])
    for mode, (prompt, *_rest) in CHAIN_MODES.items():
        same = same and all(t["tokens"] == local[prompt] for t in runs[mode])
    for name in ("single", "concurrent8"):
        same = same and all(chain == local["draftable"] for t in runs[name] for chain in t["tokens"])
    per_hop = [[ms for t in runs["relay"] for ms in t["compute_ms"][hop]] for hop in range(len(runs["route"]))]
    rtt = runs["rtt_ms"]

    def per_pass(trials):
        passes = sum(t["passes"] for t in trials)
        return sum(t["accepted"] for t in trials) / passes if passes else 0.0

    out = {
        "local_tok_s": med(runs["local"]["draftable"]),
        "local_freeform_tok_s": med(runs["local"]["freeform"]),
        **{f"{mode}_tok_s": med(runs[mode]) for mode in CHAIN_MODES},
        "accepted_per_pass": per_pass(runs["spec"]),
        "spec_freeform_accepted_per_pass": per_pass(runs["spec_freeform"]),
        "oracle_accepted_per_pass": per_pass(runs["spec_oracle"]),
        "single_tok_s": med(runs["single"]),
        "concurrent8_tok_s": med(runs["concurrent8"]),
        # The machine's own limit beside it: the 4 processes' CPU per token during the
        # concurrent decode, and the tok/s that would give with every core busy.
        "concurrent8_cpu_ms_per_token": statistics.median(
            1000 * t["cpu_s"] / (CONCURRENT * tokens) for t in runs["concurrent8"]),
        "single_cpu_ms_per_token": statistics.median(1000 * t["cpu_s"] / tokens for t in runs["single"]),
        "concurrent8_cpu_limit_tok_s": statistics.median(
            CONCURRENT * tokens * (os.cpu_count() or 1) / t["cpu_s"] for t in runs["concurrent8"]),
        "concurrent8_cores_busy": statistics.median(t["cpu_s"] / t["wall_s"] for t in runs["concurrent8"]),
        "identical": same,
        # Steps (links, receipts) waited for past their deadline (their server slow, not gone).
        "late_waits": sum(t.get("late_waits", 0) for mode in (*CHAIN_MODES, "single") for t in runs[mode]),
        "concurrent8_late_waits": sum(t.get("late_waits", 0) for t in runs["concurrent8"]),
        "rtt_ms": rtt,
        "t_ms": rtt / 2 if rtt is not None else None,
        "f_ms": statistics.median(ms for hop in per_hop for ms in hop) if any(per_hop) else None,
        "f_hops_ms": [statistics.median(hop) if hop else None for hop in per_hop],
        "c_ms": runs["c_ms"],
        "rtt_ok": rtt is not None and abs(rtt - 2 * delay_ms) <= 0.1 * 2 * delay_ms,
    }
    out.update({
        "direct_vs_push": out["direct_tok_s"] / out["push_tok_s"],
        "direct_vs_relay": out["direct_tok_s"] / out["relay_tok_s"],
        "spec_vs_direct": out["spec_tok_s"] / out["direct_tok_s"],
        "spec_freeform_vs_direct": out["spec_freeform_tok_s"] / out["direct_freeform_tok_s"],
        "spec_oracle_vs_direct": out["spec_oracle_tok_s"] / out["direct_tok_s"],
        "concurrent8_vs_single": out["concurrent8_tok_s"] / out["single_tok_s"],
        "concurrent8_vs_cpu_limit": out["concurrent8_tok_s"] / out["concurrent8_cpu_limit_tok_s"],
    })
    def rounded(value):
        if isinstance(value, float):
            return round(value, 3)
        return [rounded(x) for x in value] if isinstance(value, list) else value

    return {key: rounded(value) for key, value in out.items()}


def report(s: dict, runs: dict, delay_ms: int, tokens: int) -> None:
    print(f"== {delay_ms} ms each way (RTT {s['rtt_ms']} ms, ok: {s['rtt_ok']}), {tokens} decode tokens, "
          f"prompts {runs['prompt_tokens']} tokens, route {runs['route']}", flush=True)
    print(f"  local {s['local_tok_s']:.2f} tok/s (free-form {s['local_freeform_tok_s']:.2f}) | relay "
          f"{s['relay_tok_s']:.2f} | push {s['push_tok_s']:.2f} | direct {s['direct_tok_s']:.2f} (free-form "
          f"{s['direct_freeform_tok_s']:.2f})", flush=True)
    spec_steps = [t["direct_steps"] for t in runs["spec"]]
    print(f"  spec {s['spec_tok_s']:.2f} tok/s, {s['accepted_per_pass']:.2f} accepted drafts a pass | spec free-form "
          f"{s['spec_freeform_tok_s']:.2f} tok/s, {s['spec_freeform_accepted_per_pass']:.2f} a pass "
          f"(passes {[t['passes'] for t in runs['spec']]} / {[t['passes'] for t in runs['spec_freeform']]}, "
          f"direct steps {spec_steps}) | always-right drafts (reference) {s['spec_oracle_tok_s']:.2f} tok/s, "
          f"{s['oracle_accepted_per_pass']:.2f} a pass (x{s['spec_oracle_vs_direct']:.2f} over direct)", flush=True)
    print(f"  single chain {s['single_tok_s']:.2f} tok/s | {CONCURRENT} chains at once {s['concurrent8_tok_s']:.2f} "
          f"tok/s aggregate (x{s['concurrent8_vs_single']:.2f}); CPU per token {s['single_cpu_ms_per_token']:.1f} ms "
          f"alone, {s['concurrent8_cpu_ms_per_token']:.1f} ms in 8 (batched), {s['concurrent8_cores_busy']:.2f} cores "
          f"busy: all cores would give {s['concurrent8_cpu_limit_tok_s']:.1f} tok/s "
          f"(x{s['concurrent8_vs_cpu_limit']:.2f} of it)", flush=True)
    t, f, c = s["t_ms"], s["f_ms"], s["c_ms"]
    if None not in (t, f, c):
        model = {"relay (6t+3f+c)": 6 * t + 3 * f + c, "direct (4t+3f+c)": 4 * t + 3 * f + c}
        seen = {"relay (6t+3f+c)": 1000 / s["relay_tok_s"], "direct (4t+3f+c)": 1000 / s["direct_tok_s"]}
        print(f"  per token: t {t:.1f} ms, f {f:.1f} ms (per server {s['f_hops_ms']}), c {c:.2f} ms; "
              + "; ".join(f"{k} {v:.0f} ms predicted vs {seen[k]:.0f} ms measured" for k, v in model.items()),
              flush=True)
    print(f"  direct/push x{s['direct_vs_push']:.2f}, direct/relay x{s['direct_vs_relay']:.2f}, spec/direct "
          f"x{s['spec_vs_direct']:.2f}, spec/direct free-form x{s['spec_freeform_vs_direct']:.2f}; tokens "
          f"identical to local: {s['identical']}", flush=True)


BUSY_LOOP = """
import os, sys
parent = int(sys.argv[1])
while os.getppid() == parent:  # a busy core, until the bench ends (or dies)
    for _ in range(1_000_000):
        pass
"""


def start_load(core: str) -> subprocess.Popen:
    """The busy-loop process of --load-core: pinned to CPU `core`, or unpinned ("any")."""
    pin = None if core == "any" else int(core)
    proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP, str(os.getpid())], stdin=subprocess.DEVNULL,
                            preexec_fn=None if pin is None else (lambda: os.sched_setaffinity(0, {pin})))
    where = "any core (the scheduler's choice)" if pin is None else f"CPU {pin}"
    print(f"loading the machine: a busy loop (pid {proc.pid}) on {where}", flush=True)
    return proc


def stop_load(proc: subprocess.Popen | None) -> None:
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(timeout=10)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--delays", default="20,50", help="ms added on each host's ingress (RTT = 2x), one lab each")
    parser.add_argument("--trials", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=48, help="timed decode tokens per trial")
    parser.add_argument("--keep", action="store_true", help="keep the temp dirs (node logs)")
    parser.add_argument("--load-core", nargs="?", const="any", default=None, metavar="CPU",
                        help="keep one core busy all along (a busy-loop process), pinned to CPU if given")
    parser.add_argument("--results", default=str(REPO / "bench" / "results" / "wan.jsonl"),
                        help="JSON-lines file the summary is appended to ('' for none)")
    parser.add_argument("--client", help=argparse.SUPPRESS)  # internal: the consumer, in its namespace
    parser.add_argument("--pids", default="", help=argparse.SUPPRESS)  # internal: the servers' pids (CPU use)
    args = parser.parse_args()
    if args.client:
        client_main(args.client, args.trials, args.tokens, [int(p) for p in args.pids.split(",") if p])
        return 0
    if os.geteuid() != 0:
        parser.error("needs root (network namespaces)")
    delays = [int(d) for d in args.delays.split(",")]

    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # run the finallys
    signal.signal(signal.SIGHUP, lambda *_: sys.exit(129))
    began = time.perf_counter()
    runs = {}
    load = None
    try:
        load = start_load(args.load_core) if args.load_core is not None else None
        for delay in delays:
            runs[delay] = run_delay(args, delay)
            print(f"{delay} ms: the consumer's trials took {runs[delay]['client_s']:.0f} s", flush=True)
    finally:
        stop_load(load)
    result: dict = {}
    for index, delay in enumerate(delays):
        summary = summarise(runs[delay], delay, args.tokens)
        report(summary, runs[delay], delay, args.tokens)
        result.update({(k if index == 0 else f"wan{delay}_{k}"): v for k, v in summary.items()})
    result.update({"delays_ms": delays, "tokens": args.tokens, "trials": args.trials, "load_core": args.load_core,
                   "wall_s": round(time.perf_counter() - began)})
    print(f"total {result['wall_s']} s", flush=True)
    return finish(result, args.results)


if __name__ == "__main__":
    sys.exit(main())
