"""Karma end to end, with real node processes: a server's karma rises once it has
served a generation (receipts signed by the consumer, countersigned by it, committed
to by its DHT record), two independent readers compute the same score from the DHT
and the evidence, and a verified failure report takes 5% off."""

import json
import subprocess
import sys

import pytest
import trio

from compushare.karma.rules import REPORT_FACTOR, base_score
from compushare.karma.service import karma_of
from compushare.model.catalog import import_path
from compushare.karma.record import karma_validators
from compushare.net.peer import open_swarm_host
from compushare.pipeline.client.consumer import Consumer, RunRequest
from compushare.pipeline.client.sampling import SamplingParams
from libp2p.crypto.ed25519 import create_new_key_pair

from helpers import liar_and_honest

PROMPT = [1, 17, 42, 99, 3, 250, 7]


def _request(new_tokens=16):
    return RunRequest(model="tiny", prompt=PROMPT, params=SamplingParams(max_new_tokens=new_tokens,
                                                                         stop_at_eos=False))


@pytest.fixture
def client_dir(tmp_path, tiny_model):
    path = tmp_path / "client"
    import_path(tiny_model, path, alias="tiny")
    return path


async def _karma_when(host, dht, peer_id, condition, timeout=45.0):
    """Read `peer_id`'s karma until `condition` holds (records are republished a
    couple of seconds after new receipts)."""
    with trio.fail_after(timeout):
        while True:
            result = await karma_of(host, dht, peer_id)
            if condition(result):
                return result
            await trio.sleep(1.0)


def _cli_karma(peer_id: str, data_dir, boot: list[str]) -> dict:
    """Another node's view: a separate process with its own identity and DHT client."""
    out = subprocess.run([sys.executable, "-m", "compushare", "karma", peer_id, "--json", "--data-dir",
                          str(data_dir), "--bootstrap", boot[0]], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


async def test_karma_rises_after_serving_is_shared_by_readers_and_drops_after_a_report(
        processes, tiny_model, client_dir, tmp_path):
    a, boot, b, c = liar_and_honest(processes, tiny_model)  # B lies but is fast: routes take it

    async with open_swarm_host(create_new_key_pair(), server=False, validators=karma_validators(),
                               bootstrap=boot) as swarm:
        host, dht = swarm.host, swarm.dht
        before = await karma_of(host, dht, b["peer_id"])
        assert before.score == 1.0 and before.compute_ms == 0  # a newcomer

        # 1. B serves a generation nobody checks: receipts, a new record, higher karma.
        async with Consumer.connect(client_dir, tuple(boot), "tiny", text_prompts=False,
                                    spot_check_rate=0.0) as consumer:
            with trio.fail_after(60):
                outcome = await consumer.generate(_request())
        assert b["peer_id"] in {h.peer_id for h in outcome.route}
        served = await _karma_when(host, dht, b["peer_id"], lambda r: r.compute_ms > 0)
        assert served.score > 1.0 and served.receipts >= 1 and served.counted == served.receipts
        assert served.score == pytest.approx(base_score(served.compute_ms))
        assert served.reports == 0 and served.problem == ""
        a_karma = await _karma_when(host, dht, a["peer_id"], lambda r: r.compute_ms > 0)
        assert a_karma.score > 1.0

        # 2. Two other nodes, each on its own, compute the same score from the DHT.
        readers = [_cli_karma(b["peer_id"], tmp_path / f"reader-{i}", boot) for i in range(2)]
        assert readers[0] == readers[1]
        assert readers[0]["score"] == pytest.approx(served.score, rel=1e-12)
        assert readers[0]["compute_ms"] == pytest.approx(served.compute_ms, rel=1e-12)

        # 3. Every step checked: B is caught; the report goes to the witness C, which
        # advertises it; B's karma drops by exactly 5% (its compute is unchanged: the
        # session that caught it was cut off, unreceipted).
        async with Consumer.connect(client_dir, tuple(boot), "tiny", text_prompts=False,
                                    spot_check_rate=1.0) as consumer:
            with trio.fail_after(60):
                caught = await consumer.generate(_request(8))
        assert [r.accused.peer_id for r in caught.reports] == [b["peer_id"]]
        assert caught.reports[0].witness.peer_id == c["peer_id"]
        dropped = await _karma_when(host, dht, b["peer_id"], lambda r: r.reports >= 1)
        assert dropped.reports == 1
        assert dropped.compute_ms == pytest.approx(served.compute_ms)
        assert dropped.score == pytest.approx(served.score * REPORT_FACTOR, rel=1e-9)
        # C, the honest witness, earned karma from the checks and lost nothing.
        c_karma = await _karma_when(host, dht, c["peer_id"], lambda r: r.compute_ms > 0)
        assert c_karma.reports == 0 and c_karma.score > 1.0
