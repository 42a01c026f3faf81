"""The consumer chain's pure plans and verdicts: what it keeps for replay, how a
history is replayed or a verifier caught up (positions and chunks), and who is
blamed when two servers disagree. No I/O; payloads are opaque except in `judge`
and `build_report`, which read outputs and proofs."""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from ...errors import PeerMisbehaved
from ...proofs.inference import (DEFAULT_MODE, TOLERANCES, FailureReport, Statement, StepClaim, relative_error,
                                 step_digest)
from .chain_events import FileReport, HopSession, HopStepRequest, SendSteps, Span

log = logging.getLogger(__name__)

REPLAY_MAX_TOKENS = 2048  # tokens per replay request (the servers' default max_step_tokens)


def kept_inputs(steps: list[Any], sizes: list[int], computed: list[int]) -> list[Any]:
    """Each step's input cut to the tokens it kept (rejected drafts dropped)."""
    return [x if c == s else x[:, :s] for x, s, c in zip(steps, sizes, computed)]


class History:
    """Every step's input at every block boundary of the chain: enough to replay any hop.

    A step keeps its input as it was computed, rejected drafts included: a replay
    computes it the same way (one chunk of `computed` tokens) and then cuts the
    session back to the `sizes` tokens kept, so its KV cache is bit-identical."""

    def __init__(self) -> None:
        self.sizes: list[int] = []  # tokens kept per step
        self.computed: list[int] = []  # tokens each step was computed with (more after a rewind)
        self.inputs: dict[int, list[Any]] = {}  # boundary -> one payload per step, as computed

    def at(self, boundary: int) -> list[Any]:
        return self.inputs.setdefault(boundary, [])

    def kept(self, boundary: int) -> list[Any]:
        """The inputs at `boundary` without rejected drafts (what a verifier is fed)."""
        return kept_inputs(self.at(boundary), self.sizes, self.computed)


    def append(self, tokens: int) -> None:
        self.sizes.append(tokens)
        self.computed.append(tokens)

    def cut(self, tokens: int) -> None:
        """Forget the last `tokens` kept tokens: whole steps are dropped, a step cut
        within keeps its input as computed."""
        while tokens:
            last = self.sizes[-1]
            keep = max(0, last - tokens)
            if keep:
                self.sizes[-1] = keep
            else:
                for inputs in self.inputs.values():
                    if len(inputs) == len(self.sizes):
                        inputs.pop()
                self.sizes.pop()
                self.computed.pop()
            tokens -= last - keep


@dataclasses.dataclass
class Failover:
    peer_id: str
    start: int
    end: int
    reason: str
    noticed: float  # time.time() when the failure was noticed
    recovered: float = 0.0  # time.time() when the replacement had answered the step
    replacements: tuple[str, ...] = ()


@dataclasses.dataclass
class Verifier:
    """A session recomputing sampled steps of one span."""

    session: HopSession
    fed: int = 0  # steps of the history it has seen


@dataclasses.dataclass
class StandbyFeed:
    """A standby's feed, sent beside a step's requests: once answered, it has seen
    `steps` steps of the history."""

    span: Span
    standby: Verifier
    steps: int
    request: SendSteps


def group_steps(sizes: list[int], limit: int = REPLAY_MAX_TOKENS,
                breaks: frozenset[int] = frozenset()) -> list[tuple[int, int]]:
    """Consecutive steps packed into requests of at most `limit` tokens (a longer step
    goes alone), a request ending after every step in `breaks`: index ranges [i, j)
    into `sizes`."""
    groups: list[tuple[int, int]] = []
    begin = total = 0
    for index, size in enumerate(sizes):
        if index > begin and (total + size > limit or index - 1 in breaks):
            groups.append((begin, index))
            begin, total = index, 0
        total += size
    if begin < len(sizes):
        groups.append((begin, len(sizes)))
    return groups


def replay_plan(steps: list[Any], sizes: list[int], limit: int = REPLAY_MAX_TOKENS,
                computed: list[int] | None = None, *, position: int = 0, rollback: bool = False,
                last_only: bool = False, fast: bool = False) -> tuple[HopStepRequest, ...]:
    """A session fed `steps` (one payload per step, `sizes` tokens each kept) from
    `position`, each step a chunk of its original size (`computed`, if drafts were
    rejected since): its KV cache and outputs are then bit-identical to the first
    computation's. A step computed with more tokens than it kept ends its request,
    and the next request cuts the session back (`rollback`) before going on.

    `fast` (the chain's opt-in fast replay): within the format's tolerance instead.
    A request's steps are one chunk, one forward (a request still ends after a step
    that kept fewer tokens than it computed, and the next rolls back), and the
    reply is cut back into one part per step as computed (`splits`). A multi-token
    forward rounds differently from one-token steps on these kernels, even two
    tokens against one (docs/performance.md, batch invariance): the outputs and KV
    cache differ from the first computation's by about 1e-7 to 1e-6 relative."""
    computed = sizes if computed is None else computed
    trimmed = frozenset(i for i, (s, c) in enumerate(zip(sizes, computed)) if c > s)
    requests = []
    for i, j in group_steps(computed, limit, trimmed):
        chunks: tuple[int, ...] = tuple(computed[i:j])
        splits: tuple[int, ...] = ()
        if fast:
            chunks, splits = (sum(chunks),), chunks
        requests.append(HopStepRequest(position, tuple(steps[i:j]), chunks, last_only=last_only,
                                       rollback=rollback, splits=splits))
        position += sum(sizes[i:j])
        rollback = j - 1 in trimmed
    return tuple(requests)


def catch_up_plan(seen: list[Any], sizes: list[int], fed: int, hidden: Any, tokens: int,
                  limit: int = REPLAY_MAX_TOKENS) -> tuple[HopStepRequest, ...]:
    """Bring a verifier that has seen `fed` steps of `seen` (a span's inputs, `sizes`
    tokens each) up to this step, then compute it (`hidden`, `tokens`): the missed
    steps batched (costs little, stays within the tolerance), every request with
    last_only, the last one's final chunk being this step."""
    missed = list(seen[fed:]) + [hidden]
    missed_sizes = list(sizes[fed:]) + [tokens]
    position = sum(sizes[:fed])
    groups = group_steps(missed_sizes, limit)
    requests = []
    for index, (i, j) in enumerate(groups):
        group = missed_sizes[i:j]
        last = index == len(groups) - 1
        chunks = (sum(group[:-1]), group[-1]) if last and len(group) > 1 else (sum(group),)
        requests.append(HopStepRequest(position, tuple(missed[i:j]), chunks, last_only=True))
        position += sum(group)
    return tuple(requests)


def proof_links(reply, expected_input: bytes, model_id: str, hop, position: int, tokens: int,
                mode: str = DEFAULT_MODE) -> str | None:
    """Why a direct step's `reply` (from the server of `hop`) does not link into the
    step's proof chain, or None if it does: its proof covers this step, its signed
    input is `expected_input` (the previous server's signed output, or the digest of
    what the consumer sent the first), its signed output is the bytes it returned,
    and the signature is its own."""
    proof, peer = reply.proof, hop.peer_id
    if proof is None:
        return f"{peer} sent no step proof"
    if proof.position != position or proof.tokens != tokens:
        return f"{peer} proved positions {proof.position}+{proof.tokens}, not {position}+{tokens}"
    if proof.input_digest != expected_input:
        return f"{peer}'s signed input is not the previous server's signed output"
    if proof.output_digest != step_digest(reply.dtype, reply.data, tokens):
        return f"{peer} returned other bytes than it signed"
    statement = Statement(proof.mode, model_id, hop.start, hop.end, position, tokens, proof.prefix,
                          proof.input_digest, proof.output_digest, proof.runtime, proof.forwards)
    if proof.mode != mode:
        return f"{peer} proved its step in compute mode {proof.mode[:16]!r}, not the model's {mode!r}"
    if proof.mode not in TOLERANCES or not statement.verify(peer, proof.sig):
        return f"{peer}'s step proof is not signed by it"
    return None


def judge(primary, check, arbiter, tolerance: float, check_tolerance: float | None = None) -> str:
    """Who is wrong when a spot check disagrees: "primary", "verifier", "both" or
    "neither" (both within the tolerance of a third opinion: a borderline case).
    Without a third opinion the checked server is blamed; with one, whoever the
    third server disagrees with (the primary beyond `tolerance`, the verifier beyond
    `check_tolerance`, the same unless given: their runtimes may differ)."""
    if arbiter is None:
        return "primary"
    a = arbiter.numpy()
    primary_ok = relative_error(primary.numpy(), a) <= tolerance
    check_ok = relative_error(check.numpy(), a) <= (tolerance if check_tolerance is None else check_tolerance)
    if primary_ok:
        return "neither" if check_ok else "verifier"
    return "primary" if check_ok else "both"


def build_report(model_id: str, filed: FileReport) -> FailureReport | None:
    """The failure report for `filed`, when both replies carry proofs of one statement
    but for the output (the same mode, step, prefix and input)."""
    accused, witness = filed.accused, filed.witness
    ours, theirs = filed.accused_reply, filed.witness_reply
    proofs = ours.proof, theirs.proof
    try:
        if None in proofs or _common(proofs[0]) != _common(proofs[1]):
            raise PeerMisbehaved("the two answers do not carry proofs for the same input")
        proof = proofs[0]
        if (proof.position, proof.tokens) != (filed.position, filed.tokens):
            raise PeerMisbehaved("the proofs are not of the disputed step")
        report = FailureReport(
            proof.mode, model_id, accused.hop.start, accused.hop.end, proof.position, proof.tokens, proof.prefix,
            proof.input_digest,
            StepClaim(accused.peer_id, ours.dtype, ours.data, proofs[0].sig, proofs[0].runtime, proofs[0].forwards),
            StepClaim(witness.peer_id, theirs.dtype, theirs.data, proofs[1].sig, proofs[1].runtime,
                      proofs[1].forwards),
        )
        report.check()
    except (PeerMisbehaved, KeyError, TypeError, ValueError) as exc:
        log.warning("mismatch on blocks %d:%d without a checkable report: %s", accused.hop.start,
                    accused.hop.end, exc)
        return None
    log.warning("failure report %s: %s disagrees with %s on blocks %d:%d", report.digest[:12],
                accused.peer_id, witness.peer_id, accused.hop.start, accused.hop.end)
    return report


def _common(proof) -> tuple:
    return proof.mode, proof.position, proof.tokens, proof.prefix, proof.input_digest
