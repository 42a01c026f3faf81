"""A hop's deadline: a prompt's tokens are given the span's compute per token, not the
link's round trip (paid once a step); it follows a sudden slowdown at once; a step past
it is waited for while its server answers pings and nothing could replace it."""

import math

import pytest
import trio

from compushare.pipeline.client.chain import InferenceChain
from compushare.pipeline.client.chain_events import HopSession
from compushare.pipeline.client.deadlines import (
    CHECK_MAX_S, CHECK_MIN_S, DEADLINE_LATENCIES, MIN_DEADLINE_S, RECENT_STEPS, Lateness, Pace, wait_more,
)
from compushare.pipeline.client.hop import Patience, RemoteHop, _Deadline
from compushare.pipeline.client.routing import Hop
from compushare.net.records import ServerRecord


def remote(rtt_s: float, compute_s: float) -> RemoteHop:
    hop = Hop(ServerRecord("12D3KooWpeer", "ab" * 32, 0, 4, "float32", (), math.inf, 0), 0, 4, rtt_s, compute_s)
    return RemoteHop(hop, framed=None, hidden_size=8, session_id=b"s")


def test_a_prompt_on_a_slow_link_is_given_compute_per_token_not_round_trips():
    far = remote(rtt_s=0.3, compute_s=0.02)
    near = remote(rtt_s=0.001, compute_s=0.02)
    # 100 prompt tokens: one step's latency allowance, then the compute per token.
    assert far.deadline(100) - near.deadline(100) == pytest.approx(5 * (far.latency - near.latency))
    assert near.deadline(100) == pytest.approx(MIN_DEADLINE_S + 5 * near.latency + 100 * 0.02)


def test_a_heavy_span_gives_each_prompt_token_a_decode_steps_compute():
    heavy = remote(rtt_s=0.001, compute_s=0.15)  # 11 blocks of an 8B-shaped model, one thread
    assert heavy.deadline(31) > 31 * 0.15
    light = remote(rtt_s=0.001, compute_s=0.0001)
    assert light.deadline(31) == pytest.approx(MIN_DEADLINE_S + 5 * light.latency + 31 * 0.01)


# -- the pace a deadline follows, and waiting for a late step (deadlines.py, hop._Deadline) --

def test_the_deadline_follows_a_sudden_slowdown_at_its_next_step_not_after_the_ewma():
    pace = Pace(latency=0.02, compute=0.01)
    for _ in range(20):
        pace.observe(0.02, 0.01)
    before = pace.deadline(1)
    pace.observe(1.0, 0.9)  # eight sessions arrive: one step takes 50 times as long
    assert pace.latency == pytest.approx(1.0)
    assert pace.deadline(1) >= MIN_DEADLINE_S + DEADLINE_LATENCIES * 1.0 + 0.9 > before
    # Back to normal: the slow step keeps the allowance up for the window, then the EWMA decays.
    for _ in range(RECENT_STEPS - 1):
        pace.observe(0.02, 0.01)
    assert pace.latency == pytest.approx(1.0)
    for _ in range(30):
        pace.observe(0.02, 0.01)
    assert pace.deadline(1) == pytest.approx(before, rel=0.05)


def lateness(**changes) -> Lateness:
    return Lateness(**{"waited_s": 3.0, "timeout_s": 2.0, "limit_s": 60.0, "replaceable": False, "alive": True,
                       **changes})


def test_a_late_step_is_waited_for_only_on_a_live_server_nothing_could_replace():
    assert wait_more(lateness()) == 2.0  # one more deadline's worth, then a new ping
    assert wait_more(lateness(alive=False)) == 0  # stopped, cut off: given up as before
    assert wait_more(lateness(replaceable=True)) == 0  # another server or a standby: fail over
    assert wait_more(lateness(timeout_s=0.1)) == CHECK_MIN_S
    assert wait_more(lateness(timeout_s=40.0)) == CHECK_MAX_S
    assert wait_more(lateness(waited_s=59.5)) == pytest.approx(0.5)  # never past the limit
    assert wait_more(lateness(waited_s=60.0)) == 0


async def _answer_after(seconds: float, reply="reply"):
    await trio.sleep(seconds)
    return reply


async def test_a_request_past_its_deadline_is_waited_for_while_late_says_so(autojump_clock):
    asked: list[tuple[float, float]] = []

    async def late(waited: float, timeout: float) -> float:
        asked.append((round(waited, 3), timeout))
        return 1.0

    clock = _Deadline(trio.current_time(), 2.0)
    assert await clock.run(_answer_after(4.5), None, late) == "reply"
    assert asked == [(2.0, 2.0), (3.0, 2.0), (4.0, 2.0)]  # pinged again each second


async def test_a_request_past_its_deadline_is_given_up_when_late_says_no(autojump_clock):
    async def late(waited: float, timeout: float) -> float:
        return 1.0 if waited < 3.5 else 0.0

    clock = _Deadline(trio.current_time(), 2.0)
    with pytest.raises(trio.TooSlowError):
        await clock.run(_answer_after(10.0), None, late)
    assert clock.given == pytest.approx(4.0)  # what the timeout message names
    clock = _Deadline(trio.current_time(), 2.0)
    with pytest.raises(trio.TooSlowError):  # no patience: the deadline as before
        await clock.run(_answer_after(10.0), None, None)
    assert clock.given == pytest.approx(2.0)


async def test_a_tightened_deadline_still_comes_first_and_errors_come_out_as_themselves(autojump_clock):
    event = trio.Event()
    clock = _Deadline(trio.current_time(), 30.0)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: _set_after(event, 1.0))
        with pytest.raises(trio.TooSlowError):
            await clock.run(_answer_after(10.0), (event, 0.5), None)
    assert clock.given == pytest.approx(1.5) and clock.tightened_at is not None

    async def broken():
        raise ValueError("frame")

    with pytest.raises(ValueError):
        await _Deadline(trio.current_time(), 1.0).run(broken(), None, None)


async def _set_after(event: trio.Event, seconds: float) -> None:
    await trio.sleep(seconds)
    event.set()


async def test_a_late_hop_is_pinged_only_when_nothing_could_replace_it(autojump_clock):
    hop = remote(rtt_s=0.01, compute_s=0.01)
    pings: list[str] = []

    async def alive(host) -> bool:
        pings.append(host)
        return True

    hop.alive = alive
    hop.patience = Patience("host", 60.0, lambda: True)
    assert await hop._late(2.0, 2.0) == 0 and pings == []  # fail over at once: no ping
    hop.patience = Patience("host", 60.0, lambda: False)
    assert await hop._late(2.0, 2.0) == 2.0 and pings == ["host"] and hop.late_waits == 1


def test_a_chain_waits_for_a_late_hop_only_when_nothing_could_take_its_blocks():
    hop = remote(rtt_s=0.01, compute_s=0.01).hop
    session, check = HopSession(hop), HopSession(hop)

    class Planner:
        penalties = None
        route = False

        def replaceable(self, start, end, peer_id):
            assert (start, end, peer_id) == (0, 4, hop.peer_id)
            return self.route

    alone = InferenceChain(None, "m", max_tokens=8, hidden_size=8)  # no planner (bench/wan.py's chains)
    alone.core.hops = [session]
    assert not alone._replaceable(session)
    assert alone._replaceable(check)  # a spot check's session: dropped, never waited for
    planner = Planner()
    swarm = InferenceChain(None, "m", max_tokens=8, hidden_size=8, planner=planner)
    swarm.core.hops = [session]
    assert not swarm._replaceable(session)
    planner.route = True
    assert swarm._replaceable(session)
    planner.route = False
    swarm.core.standbys[session.span] = object()  # a standby would take over
    assert swarm._replaceable(session)
