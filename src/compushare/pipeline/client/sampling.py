"""Next-token choice: greedy, or temperature + top-p with a seeded generator."""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop_at_eos: bool = True

    def __post_init__(self) -> None:
        if self.temperature < 0 or not (0 < self.top_p <= 1) or self.max_new_tokens < 1:
            raise ValueError("temperature >= 0, 0 < top_p <= 1 and max_new_tokens >= 1")


class Sampler:
    def __init__(self, params: SamplingParams) -> None:
        self.params = params
        self.generator = torch.Generator()
        if params.seed is None:
            self.generator.seed()  # fresh entropy without touching torch's global RNG
        else:
            self.generator.manual_seed(params.seed)

    @property
    def greedy(self) -> bool:
        return self.params.temperature == 0

    def distribution(self, logits: torch.Tensor) -> torch.Tensor:
        """The distributions `choose` samples from, one per row of `logits` [n, vocab]
        (temperature, then top-p keeping the top token): speculative sampling's p."""
        probs = torch.softmax(logits.float() / self.params.temperature, dim=-1)
        if self.params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, dim=-1, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            keep = cumulative - sorted_probs < self.params.top_p
            sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
            probs = torch.zeros_like(probs).scatter(-1, order, sorted_probs)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    def choose(self, logits: torch.Tensor) -> int:
        if self.params.temperature == 0:
            return int(torch.argmax(logits))
        probs = torch.softmax(logits.float() / self.params.temperature, dim=-1)
        if self.params.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            cumulative = torch.cumsum(sorted_probs, dim=-1)
            keep = cumulative - sorted_probs < self.params.top_p  # always keeps the top token
            sorted_probs = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs))
            choice = torch.multinomial(sorted_probs / sorted_probs.sum(), 1, generator=self.generator)
            return int(order[choice])
        return int(torch.multinomial(probs, 1, generator=self.generator))


MAX_TOP_LOGPROBS = 20  # OpenAI's limit


@dataclasses.dataclass(frozen=True)
class TokenLogprob:
    """A produced token's log-probability under the model (temperature 1, before top-p:
    what the model thinks, not how it was sampled), and the `top` most likely tokens."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def logprobs_of(logits: torch.Tensor, tokens: list[int], top: int) -> list[TokenLogprob]:
    """`logits` [n >= len(tokens), vocab]: row i the model's logits before tokens[i]."""
    rows = torch.log_softmax(logits[:len(tokens)].float(), dim=-1)
    best = torch.topk(rows, top, dim=-1) if top > 0 else None
    out = []
    for index, token in enumerate(tokens):
        alternatives = () if best is None else tuple(
            zip(best.indices[index].tolist(), best.values[index].tolist(), strict=True))
        out.append(TokenLogprob(token, float(rows[index, token]), alternatives))
    return out
