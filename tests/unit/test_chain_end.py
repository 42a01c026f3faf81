"""How a consumer's chain ends (pipeline/client/chain.open_chain): settled (receipts,
then closes) when the generation ends or fails; reset at once when it is cancelled
or interrupted, since the user is waiting and a step may be in flight."""

from __future__ import annotations

import pytest
import trio

from compushare.errors import RouteError
from compushare.pipeline.client.chain import InferenceChain, open_chain


@pytest.fixture
def ends(monkeypatch) -> list[str]:
    """The chain's network steps replaced by a record of which end it took."""
    ended: list[str] = []

    async def opened(self, route) -> None:
        pass

    async def close(self) -> None:
        ended.append("close")

    async def abort(self) -> None:
        ended.append("abort")

    monkeypatch.setattr(InferenceChain, "open", opened)
    monkeypatch.setattr(InferenceChain, "close", close)
    monkeypatch.setattr(InferenceChain, "abort", abort)
    return ended


def _chain():
    return open_chain(None, [], "m" * 64, max_tokens=8, hidden_size=4)


async def test_a_finished_generation_settles_its_sessions(ends):
    async with _chain():
        pass
    assert ends == ["close"]


async def test_a_failed_generation_still_settles_its_sessions(ends):
    with pytest.raises(RouteError):
        async with _chain():
            raise RouteError("no route")
    assert ends == ["close"]


async def test_a_cancelled_generation_resets_its_streams(ends):
    with trio.CancelScope() as scope:
        async with _chain():
            scope.cancel()
            await trio.sleep_forever()
    assert ends == ["abort"]


async def test_an_interrupted_generation_resets_its_streams(ends):
    with pytest.raises(KeyboardInterrupt):
        async with _chain():
            raise KeyboardInterrupt
    assert ends == ["abort"]


class _Remote:
    def __init__(self, hangs: bool) -> None:
        self.hangs, self.aborted = hangs, False

    async def abort(self) -> None:
        if self.hangs:  # a reset stuck behind a full connection
            await trio.sleep_forever()
        self.aborted = True


class _Core:
    def __init__(self, live, retired) -> None:
        self._live, self.retired = live, retired

    def live(self):
        return self._live


async def test_abort_resets_every_session_even_when_cancelled_and_gives_up_on_one_that_hangs(autojump_clock):
    chain = InferenceChain(None, "m" * 64, max_tokens=8, hidden_size=4)
    remotes = {"a": _Remote(False), "b": _Remote(True), "old": _Remote(False)}
    chain.core, chain._remotes = _Core(["a", "b"], ["old"]), remotes
    began = trio.current_time()
    with trio.CancelScope() as scope:
        scope.cancel()  # abort() runs as the generation unwinds from a cancellation
        await chain.abort()
    assert remotes["a"].aborted and remotes["old"].aborted and not remotes["b"].aborted
    assert trio.current_time() - began <= 1.0  # the hung one is given up on
