"""OpenAI's chat and text completions: one JSON reply, or server-sent events of
chunks then `data: [DONE]`. Errors have OpenAI's shape: {"error": {"message",
"type", "param", "code"}}; every bad field is a 400 naming it, before any peer is
asked (requests.py says which fields do what).

CompuShare's extensions: `private`, `standby`, `adapter` (requests.py), and
`route`: the reply (when streaming, a chunk with no choices as soon as the route is
known, and the last chunk) carries `compushare: {route: [hop...], stats: {...}}`.
A private request's reply always says which stages ran encrypted where.
"""

from __future__ import annotations

import json
import logging
import secrets
import time

import trio
from starlette.requests import Request
from starlette.responses import JSONResponse, Response

from ...errors import CompushareError, ModelUnavailable, RouteError, SwarmUnreachable, UsageError
from ...pipeline.client.consumer import RunOutcome
from ...pipeline.client.produced import Piece
from ...pipeline.client.sampling import TokenLogprob
from .engine import ChatEngine, Prepared, describe_hops, reply_extension, token_text
from .requests import BadField, Generation, openai_chat, openai_completion
from .tools import CallStream
from .streaming import answer

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 1 << 20


def error(status: int, message: str, kind: str = "invalid_request_error", code: str | None = None,
          param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status)


def failure(exc: BaseException) -> JSONResponse:
    """A request's or a generation's failure, as OpenAI-style JSON with a fitting status."""
    if isinstance(exc, ModelUnavailable):
        return error(404, str(exc), code="model_not_found", param="model")
    if isinstance(exc, UsageError):
        return error(400, str(exc), param=getattr(exc, "param", None))
    if isinstance(exc, (RouteError, SwarmUnreachable)):
        return error(503, f"the swarm cannot serve this model now: {exc}", "server_error", "unavailable")
    if isinstance(exc, CompushareError):
        return error(502, str(exc), "server_error", "swarm_error")
    log.exception("generation failed", exc_info=exc)
    return error(500, "internal error (see the node's log)", "server_error")


async def read_json(request: Request) -> object:
    raw = await request.body()
    if len(raw) > MAX_BODY_BYTES:
        raise BadField(None, f"request body over {MAX_BODY_BYTES} bytes")
    try:
        return json.loads(raw)
    except ValueError:
        raise BadField(None, "the request body is not JSON") from None


class OpenAIReply:
    """One completion, prepared: run to a JSON reply or streamed as chunks."""

    def __init__(self, engine: ChatEngine, prepared: Prepared, gen: Generation) -> None:
        self.engine, self.prepared, self.gen = engine, prepared, gen
        self.chat = gen.messages is not None
        self.ident = f"{'chatcmpl' if self.chat else 'cmpl'}-{secrets.token_hex(12)}"
        self.created = int(time.time())
        self.tokenizer = prepared.consumer.tokenizer
        self.offset = 0  # characters of text so far (legacy logprobs' text_offset)

    def run(self, on_piece=lambda _p: None, on_route=lambda _r: None):
        return self.engine.run(self.prepared, self.gen, on_piece, on_route)

    def _head(self) -> dict:
        kind = "chat.completion" if self.chat else "text_completion"
        return {"id": self.ident, "object": kind, "created": self.created, "model": self.prepared.model}

    def usage(self, outcome: RunOutcome) -> dict:
        prompt = len(self.prepared.prompt)
        return {"prompt_tokens": prompt, "completion_tokens": len(outcome.tokens),
                "total_tokens": prompt + len(outcome.tokens)}

    def hops(self, route) -> list[dict]:
        return describe_hops(route, self.prepared.consumer.view, private=self.gen.private)

    def extension(self, outcome: RunOutcome) -> dict:
        return reply_extension(self.prepared, self.gen, outcome)

    def logprobs(self, scored: list[TokenLogprob], texts: list[str] | None = None):
        """The logprobs of `scored` tokens in this endpoint's shape (None when not asked)."""
        if self.gen.logprobs is None:
            return None
        if self.chat:
            def entry(token: int, logprob: float) -> dict:
                text = token_text(self.tokenizer, token)
                return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

            return {"content": [dict(entry(s.token, s.logprob), top_logprobs=[entry(t, lp) for t, lp in s.top])
                                for s in scored]}
        tokens = [token_text(self.tokenizer, s.token) for s in scored]
        offsets = []
        for text in texts if texts is not None else tokens:
            offsets.append(self.offset)
            self.offset += len(text)
        return {"tokens": tokens, "token_logprobs": [s.logprob for s in scored],
                "top_logprobs": [{token_text(self.tokenizer, t): lp for t, lp in s.top} for s in scored],
                "text_offset": offsets}

    def finish_reason(self, outcome: RunOutcome, calls: list) -> str:
        return "tool_calls" if calls and outcome.finish_reason == "stop" else outcome.finish_reason

    def body(self, outcome: RunOutcome) -> dict:
        """The whole reply, not streamed."""
        content, calls = outcome.text, []
        choice = {"index": 0, "logprobs": self.logprobs(outcome.logprobs)}
        if self.chat:
            if self.prepared.calls is not None:
                content, calls = self.prepared.calls.parse(outcome.text, self.gen.shape.tools)
            choice["message"] = {"role": "assistant", "content": content or (None if calls else "")}
            if calls:
                choice["message"]["tool_calls"] = [call.openai() for call in calls]
        else:
            choice["text"] = outcome.text
        choice["finish_reason"] = self.finish_reason(outcome, calls)
        return {**self._head(), "choices": [choice], "usage": self.usage(outcome), **self.extension(outcome)}

    def chunk(self, text: str | None, scored: list[TokenLogprob], reason: str | None = None,
              extra: dict | None = None, role: bool = False, delta: dict | None = None) -> bytes:
        choice: dict = {"index": 0, "logprobs": self.logprobs(scored, [text or ""]) if scored else None,
                        "finish_reason": reason}
        if self.chat:
            choice["delta"] = (delta if delta is not None else {"role": "assistant", "content": ""} if role else
                               {} if text is None else {"content": text})
        else:
            choice["text"] = text or ""
        usage = {"usage": None} if self.gen.include_usage else {}
        head = dict(self._head(), object="chat.completion.chunk" if self.chat else "text_completion")
        return _event({**head, "choices": [choice], **usage, **(extra or {})})

    def call_chunks(self, events: list[tuple], scored: list[TokenLogprob]) -> list[bytes]:
        """A tool-call stream's events as chunks: content, a call's start, its arguments."""
        chunks = []
        for event in events:
            if event[0] == "content":
                delta: dict = {"content": event[1]}
            elif event[0] == "call":
                call = event[2].openai()
                delta = {"tool_calls": [{"index": event[1], **call}]}
            else:
                delta = {"tool_calls": [{"index": event[1], "function": {"arguments": event[2]}}]}
            chunks.append(self.chunk(None, scored, delta=delta))
            scored = []
        if scored:
            chunks.append(self.chunk(None, scored, delta={}))
        return chunks

    async def produce(self, to_client: trio.MemorySendChannel[bytes]) -> None:
        stream = None if self.prepared.calls is None else CallStream(self.prepared.calls, self.gen.shape.tools)

        def on_piece(piece: Piece) -> None:
            scored = [piece.logprob] if piece.logprob else []
            if stream is not None:
                for chunk in self.call_chunks(stream.feed(piece.text), scored):
                    to_client.send_nowait(chunk)
            elif piece.text or piece.logprob is not None:
                to_client.send_nowait(self.chunk(piece.text, scored))

        def on_route(route) -> None:
            if self.gen.route:
                head = dict(self._head(), object="chat.completion.chunk" if self.chat else "text_completion")
                to_client.send_nowait(_event({**head, "choices": [], "compushare": {"route": self.hops(route)}}))

        if self.chat:
            to_client.send_nowait(self.chunk(None, [], role=True))
        try:
            outcome = await self.run(on_piece, on_route)
            calls = []
            if stream is not None:
                events, _, calls = stream.finish()
                for chunk in self.call_chunks(events, []):
                    to_client.send_nowait(chunk)
            reason = self.finish_reason(outcome, calls)
            to_client.send_nowait(self.chunk(None, [], reason, self.extension(outcome)))
            if self.gen.include_usage:
                head = dict(self._head(), object="chat.completion.chunk" if self.chat else "text_completion")
                to_client.send_nowait(_event({**head, "choices": [], "usage": self.usage(outcome)}))
        except Exception as exc:  # the status line is sent already: the error goes in the stream
            to_client.send_nowait(b"data: " + failure(exc).body + b"\n\n")
        to_client.send_nowait(b"data: [DONE]\n\n")


def _event(obj: dict) -> bytes:
    return ("data: " + json.dumps(obj) + "\n\n").encode()


async def complete(engine: ChatEngine, request: Request) -> Response:
    """POST /v1/chat/completions and /v1/completions."""
    parse = openai_chat if request.url.path.endswith("/chat/completions") else openai_completion
    try:  # before any reply: a bad field, model or prompt gets its proper status, streaming or not
        gen = parse(await read_json(request))
        reply = OpenAIReply(engine, await engine.prepare(gen), gen)
    except Exception as exc:
        return failure(exc)
    return await answer(request, reply, stream=gen.stream, media_type="text/event-stream; charset=utf-8",
                        fail=failure)
