"""Direct return and speculative decoding through 3 node processes: every mode gives
exactly the greedy tokens of single-process transformers, and a server that pushes
other bytes than it signs is caught by the proof chain without changing a token."""

import pytest

from compushare.model.catalog import import_path
from compushare.pipeline.client.consumer import RunRequest, run_prompt
from compushare.pipeline.client.sampling import SamplingParams
from helpers import reference_greedy

# The second repeats itself: prompt-lookup drafts come from it at once.
PROMPTS = [[1, 17, 42, 99, 3], [1, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6, 7, 8, 9, 5, 6], [1, 7]]
NEW = 32
MODES = {"relay": dict(direct=False, speculate=False), "direct": dict(direct=True, speculate=False),
         "direct+speculation": dict(direct=True, speculate=True)}


def swarm(processes, model, extra_first=None, states=None):
    _, first = processes.node("a", model, "0:1", extra=extra_first)
    boot = first["addrs"][:1]
    if states is not None:
        states["a"] = first
    for name, blocks in (("b", "1:3"), ("c", "3:4")):
        state = processes.node(name, model, blocks, bootstrap=boot)[1]
        if states is not None:
            states[name] = state
    return boot


async def generate(client_dir, boot, prompt, **mode):
    return await run_prompt(client_dir, tuple(boot), RunRequest(
        model="tiny", prompt=prompt, params=SamplingParams(max_new_tokens=NEW, stop_at_eos=False), **mode))


async def test_every_mode_gives_the_reference_greedy_tokens(processes, tiny_model, tmp_path):
    boot = swarm(processes, tiny_model)
    clients = {name: tmp_path / name for name in MODES}  # one consumer per mode: 3 runs each
    for client_dir in clients.values():
        import_path(tiny_model, client_dir, alias="tiny")
    drafted = accepted = 0
    for prompt in PROMPTS:
        expected = reference_greedy(tiny_model, prompt, NEW)
        for name, mode in MODES.items():
            outcome = await generate(clients[name], boot, prompt, **mode)
            assert outcome.tokens == expected, (name, prompt)
            assert [(h.start, h.end) for h in outcome.route] == [(0, 1), (1, 3), (3, 4)]
            assert outcome.chain_breaks == 0
            if mode["direct"]:  # every step after the prompt went straight through but spot-checked ones
                assert outcome.direct_steps + outcome.checked_relays == outcome.passes + 1, name  # + the prompt
            else:
                assert outcome.direct_steps == 0
            if mode["speculate"]:
                drafted, accepted = drafted + outcome.drafted, accepted + outcome.accepted
                assert outcome.passes == NEW - 1 - outcome.accepted  # each kept draft saves a pass
            else:
                assert outcome.drafted == 0 and outcome.passes == NEW - 1
    assert drafted > 0 and accepted > 0, (drafted, accepted)


async def test_a_forged_push_is_caught_and_changes_nothing(processes, tiny_model, tmp_path):
    """Server a pushes b other bytes than the output it signs and returns: b's signed
    input is then not a's signed output. The consumer relays that step from a's
    signed output (b cuts its cache back), stops trusting the link, and the tokens
    are still the reference's."""
    boot = swarm(processes, tiny_model, extra_first=["--debug-forge-push"])
    client_dir = tmp_path / "client"
    import_path(tiny_model, client_dir, alias="tiny")
    prompt = PROMPTS[0]
    outcome = await generate(client_dir, boot, prompt, direct=True, speculate=False)
    assert outcome.tokens == reference_greedy(tiny_model, prompt, NEW)
    assert outcome.chain_breaks == 1 and outcome.direct_steps == 1


@pytest.mark.parametrize("prompt", PROMPTS[:1])
async def test_relay_mode_when_asked(processes, tiny_model, tmp_path, prompt):
    """--no-direct: no step goes direct, and the tokens are the same."""
    boot = swarm(processes, tiny_model)
    client_dir = tmp_path / "client"
    import_path(tiny_model, client_dir, alias="tiny")
    outcome = await generate(client_dir, boot, prompt, direct=False, speculate=True)
    assert outcome.tokens == reference_greedy(tiny_model, prompt, NEW)
    assert outcome.direct_steps == 0


async def test_concurrent_sessions_batched_give_the_reference_greedy_tokens(processes, tiny_model, tmp_path):
    """8 consumers at once through the same 3 servers: the servers compute decode
    steps that are ready together as one forward (their status counts them), and
    every consumer still gets transformers' greedy tokens."""
    import trio

    from compushare.app.api.client import call

    states = {}
    boot = swarm(processes, tiny_model, states=states)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(8)]
    expected = {tuple(p): reference_greedy(tiny_model, p, NEW) for p in PROMPTS}
    outcomes = [None] * len(prompts)
    for index in range(len(prompts)):
        import_path(tiny_model, tmp_path / f"client{index}", alias="tiny")

    async def one(index: int) -> None:
        outcomes[index] = await generate(tmp_path / f"client{index}", boot, prompts[index], direct=True,
                                         speculate=False)

    async with trio.open_nursery() as nursery:
        for index in range(len(prompts)):
            nursery.start_soon(one, index)
    for prompt, outcome in zip(prompts, outcomes):
        assert outcome.tokens == expected[tuple(prompt)]
    batched = [call(tmp_path / "nodes" / name, states[name]["api"], "/control/status")["batched_steps"]
               for name in "abc"]
    print("batched steps per server:", batched)
    assert sum(batched) > 0, batched
