"""Every model family (model/families.py) through node processes: per family, a
tiny random checkpoint (tests/tiny_families.py) served by 3 processes in fp32 and 3
in q4 (a 2-hop chain and a replica of its second span), and greedy tokens through
each swarm equal to one process computing in the same format. The runs use what
a user's do, direct return and speculation, and here a spot check of every other
step (the replica recomputes it) and a standby fed every step."""

from __future__ import annotations

import pytest
import trio

from compushare.model.catalog import import_path, resolve_model
from compushare.model.families import FAMILIES
from compushare.pipeline.client.consumer import RunRequest, run_prompt
from compushare.pipeline.client.sampling import SamplingParams
from helpers import dashboard, local_greedy, wait_until
from tiny_families import FAMILY_NAMES, make_tiny_family

PROMPT = [1, 17, 42, 99, 3, 200, 7]  # longer than the sliding windows
TOKENS = 12
# A span checks one step in each window of 1 / rate steps (spotcheck.SpotCheckSchedule):
# at a quarter, two hops leave at least two steps of every four unchecked (direct), and
# every four steps check each span once, whatever the draws (at a half, the two hops
# could check alternate steps all the way: no direct step, 1 run in ~40).
CHECK_RATE = 0.25
SPANS = (("0:2", "a"), ("2:4", "b"), ("2:4", "c"))  # c: a replica of b's span (spot checks, standby)


@pytest.mark.parametrize("family", FAMILY_NAMES)
async def test_three_processes_equal_one_process_in_fp32_and_q4(processes, tmp_path, monkeypatch, family):
    """A mixture of experts runs in fp32 only on torch (its quantized files are GGUF ones,
    served on ggml: tests/integration/test_ggml_swarm.py)."""
    monkeypatch.setenv("COMPUSHARE_CACHE", str(tmp_path / "cache"))
    source = make_tiny_family(family, tmp_path / "hf")
    client = tmp_path / "client"
    fp32 = import_path(source, client, alias=family)
    swarms = [("fp32", source, family)]
    models = [("fp32", fp32)]
    if not FAMILIES[family].moe:
        q4 = resolve_model(f"{family}@q4", client)  # quantized once, into the cache
        [converted] = [p for p in (tmp_path / "cache" / "converted").iterdir() if not p.name.startswith(".")]
        swarms.append(("q4", converted, f"{family}@q4"))  # the q4 nodes hard-link the one conversion
        models.append(("q4", q4))
    # Both swarms' nodes start at once.
    first = {label: processes.node(f"{label}-a", directory, "0:2", alias=alias, wait=False)[0]
             for label, directory, alias in swarms}
    boots = {label: processes.ready(f"{label}-a", proc)["addrs"][:1] for label, proc in first.items()}
    started = [(f"{label}-{name}", processes.node(f"{label}-{name}", directory, blocks, alias=alias,
                                                  bootstrap=boots[label], wait=False)[0])
               for label, directory, alias in swarms
               for blocks, name in SPANS[1:]]
    for name, proc in started:
        processes.ready(name, proc)
    for label in first:  # the first node's view, which the consumer learns, has the replica too

        def replicated(label=label) -> bool:
            state = processes.ready(f"{label}-a", first[label])
            return len({peer["peer_id"] for peer in dashboard(processes.root / f"{label}-a", state)["peers"]
                        for serving in peer["serving"] if serving["state"] == "serving" and serving["start"] == 2}) == 2

        wait_until(replicated, f"{label}: both servers of blocks 2:4 in the first node's view")
    for label, model in models:
        with trio.fail_after(120):
            outcome = await run_prompt(client, tuple(boots[label]), RunRequest(
                model=family if label == "fp32" else f"{family}@q4", prompt=PROMPT, standby=True,
                params=SamplingParams(max_new_tokens=TOKENS, stop_at_eos=False)), spot_check_rate=CHECK_RATE)
        assert outcome.tokens == local_greedy(model.path, PROMPT, TOKENS), label
        assert [(h.start, h.end) for h in outcome.route] == [(0, 2), (2, 4)]
        assert {h.record.fmt for h in outcome.route} == ({""} if label == "fp32" else {model.format.label})
        assert outcome.checks > 0 and not outcome.failovers  # the replica agreed with every checked step
        assert outcome.direct_steps > 0  # the steps no hop checked went straight through the chain
