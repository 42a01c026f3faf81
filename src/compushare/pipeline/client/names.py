"""Model names through the swarm: which model ids are served under a name. Pure, no I/O.

A name ("tinyllama", "smollm2-135m@q4") is only a local alias; servers put the name
they know a model by in their signed capability ads, beside its id and weight format.
A node that does not hold a name asks its view which ids are served under it. Anyone
can sign an ad naming anything, so a candidate counts only the providers the view
holds *evidence* for (net/view.py's policy: this node itself, a live or past
connection, karma above a newcomer's, or minutes in view; a consumer asking afresh
counts only the bootstrap peers its user gave and karma, since anyone can open a
connection): a flood of fresh Sybil identities can add candidates but cannot make one
win. The best-evidenced candidate
is chosen; when none has evidence the user is shown the candidates and chooses by id.
"""

from __future__ import annotations

import dataclasses

from ...errors import ModelUnavailable
from ...net.view import NONE, SwarmView


@dataclasses.dataclass(frozen=True)
class NameCandidate:
    model_id: str
    fmt: str  # weight format label its ads name ("" when unsaid)
    providers: int  # servers whose ads name it under the name
    evidenced: int  # of those, the ones the view holds evidence for
    blocks: int  # distinct blocks the evidenced providers serve

    def describe(self) -> str:
        return (f"{self.model_id[:16]} ({self.fmt or 'format unsaid'}): {self.evidenced} of {self.providers} "
                f"providers with evidence, serving {self.blocks} blocks")


def name_candidates(view: SwarmView, name: str, now: float) -> list[NameCandidate]:
    """Every model id live ads serve under `name`, best first: the most blocks served by
    providers with evidence (a model is only useful whole), then the most such providers,
    then the most providers; the id breaks ties, so no order is random."""
    providers: dict[str, set[str]] = {}
    evidenced: dict[str, set[str]] = {}
    blocks: dict[str, set[int]] = {}
    formats: dict[str, str] = {}
    for ad in view.live(now):
        with_evidence = not view.policy or view.evidence(ad.peer_id, now) > NONE
        for serving in ad.serving:
            if serving.name != name:
                continue
            providers.setdefault(serving.model_id, set()).add(ad.peer_id)
            formats.setdefault(serving.model_id, serving.fmt)
            if with_evidence:
                evidenced.setdefault(serving.model_id, set()).add(ad.peer_id)
                blocks.setdefault(serving.model_id, set()).update(range(serving.start, serving.end))
    found = [NameCandidate(model_id, formats[model_id], len(peers), len(evidenced.get(model_id, ())),
                           len(blocks.get(model_id, ()))) for model_id, peers in providers.items()]
    return sorted(found, key=lambda c: (-c.blocks, -c.evidenced, -c.providers, c.model_id))


def choose_candidate(name: str, candidates: list[NameCandidate]) -> NameCandidate:
    """The best-evidenced candidate; a clear error when there is none with evidence."""
    if candidates and candidates[0].evidenced > 0:
        return candidates[0]
    if not candidates:
        raise ModelUnavailable(f"no server in the swarm serves a model named {name!r}")
    listing = "; ".join(c.describe() for c in candidates[:8])
    raise ModelUnavailable(f"servers name {len(candidates)} model(s) {name!r}, none from a provider with evidence "
                           f"(a connection, karma or minutes in view): {listing}. Choose one by id: "
                           f"--model <id>")
