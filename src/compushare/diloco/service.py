"""The `/compushare/diloco/1.0.0` handler: what a participant answers its peers.

`state` (the round and the outer weights' torrent ids, for joiners), `join` (the
round's leader lists the group), `part` (an owner averages its part) and `report` (a
failure report against a participant, checked here before anything acts on it).
Every request is checked by diloco/messages.py first; a bad one is answered
`bad_request`, and the stream ends.
"""

from __future__ import annotations

import contextlib
import logging
from typing import TYPE_CHECKING

import trio
from libp2p.abc import INetStream

from .. import wire
from ..proofs.diloco import Contribution
from ..errors import FrameError, PeerMisbehaved
from ..net.framing import FramedStream
from ..net.serve import GuardedHandler, peer_of
from . import messages
from .allreduce import Entry, LateError
from .quant import Quantized

if TYPE_CHECKING:
    from .participant import Participant

log = logging.getLogger(__name__)

REQUEST_TIMEOUT_S = 10.0
STREAMS_PER_PEER = 8  # a member sends one part per attempt, and may join and report meanwhile


def diloco_handler(participant: Participant) -> GuardedHandler:
    async def serve(stream: INetStream) -> None:
        framed = FramedStream(stream, messages.MAX_FRAME)
        with contextlib.suppress(Exception):
            try:
                with trio.fail_after(REQUEST_TIMEOUT_S):
                    request = await framed.receive()
                reply = await _answer(participant, peer_of(stream), request)
            except (PeerMisbehaved, FrameError) as exc:
                reply = messages.error(wire.BAD_REQUEST, str(exc))
            with trio.fail_after(REQUEST_TIMEOUT_S):
                await framed.send(reply)
                await framed.close()

    return GuardedHandler(serve, per_peer=STREAMS_PER_PEER, total=4 * 16 * STREAMS_PER_PEER)


async def _answer(participant: Participant, peer: str, request: dict | None) -> dict:
    if not isinstance(request, dict):
        raise PeerMisbehaved("a request is a map")
    kind = request.get("type")
    if peer in participant.excluded:
        return messages.error(wire.EXCLUDED, "a verified failure report against you is held here")
    if kind == "report":
        return await participant.take_report(peer, request.get("report"))
    run = messages.run_field(request)
    if run != participant.run.run_id:
        return messages.error(wire.UNKNOWN_RUN, "not a run this peer takes part in")
    if kind == "state":
        state = participant.state_reply()
        return state if state is not None else messages.error(wire.WRONG_ROUND, "no outer weights published yet")
    if kind == "join":
        return await participant.rounds.answer_join(peer, *messages.parse_join(request))
    if kind == "part":
        return await _part(participant, peer, request)
    raise PeerMisbehaved(f"unknown request type {kind!r}")


async def _part(participant: Participant, peer: str, request: dict) -> dict:
    run_id, round_, attempt, members, contribution_wire, signature, part_wire = messages.parse_part(request)
    contribution = Contribution.from_wire(contribution_wire)
    if peer not in members or not participant.round <= round_ <= participant.round + 1:
        # Only a member of a round this peer is at (or about to reach) may hold a stream open.
        return messages.error(wire.WRONG_ROUND, f"this peer is at round {participant.round}")
    averaging = participant.averaging
    slot = await averaging.slot_for(contribution.group, participant.run.part_wait_s)
    if slot is None:
        return messages.error(wire.WRONG_GROUP, "this peer has no such all-reduce attempt (yet)")
    if tuple(members) != slot.attempt.members or attempt != slot.attempt.attempt:
        return messages.error(wire.WRONG_GROUP, "the group differs from this owner's")
    if contribution.base != slot.attempt.base:
        return messages.error(wire.WRONG_ROUND, "the contribution starts from other outer weights than this owner's")
    part = Quantized.from_wire(part_wire, expected_size=slot.size)
    try:
        slot.admit(peer, Entry(contribution, signature, part))
    except LateError as exc:
        return messages.error(wire.TOO_LATE, str(exc))
    with trio.move_on_after(2 * participant.run.part_wait_s + REQUEST_TIMEOUT_S):
        result = await slot.close()
    if not slot.closed.is_set():
        return messages.error(wire.TOO_LATE, "this owner did not average its part in time")
    if peer not in slot.entries:
        return messages.error(wire.TOO_LATE, "the part was averaged before this contribution came")
    receipt = participant.receipt_for(peer, slot, contribution.tokens)
    participant.stats["sent_bytes"] += len(result.q) + len(result.scales)  # the average of its slice, sent back
    return messages.averaged_reply(result.to_wire(), receipt)
