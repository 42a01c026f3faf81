"""`compushare chat`: an interactive consumer REPL.

The swarm client lives in a background thread's trio loop (one host, one DHT
client, one Consumer per model, kept across turns); the main thread reads lines
with readline (history in the data dir). Ctrl-C during a reply cancels that
generation (its sessions are closed) and returns to the prompt; at the prompt it
clears the line; Ctrl-D or /exit leaves. `/private on` makes the next turns private
(pipeline/client/private_chain.py): providers compute on ciphertexts only, at
seconds per token.
"""

from __future__ import annotations

import contextlib
import dataclasses
import signal
import sys
import threading
from collections.abc import Callable
from pathlib import Path

import trio

from .api.engine import messages_to_ids
from ..errors import CompushareError, RouteError, UsageError
from ..pipeline.client.consumer import Consumer, ProgressHooks, RunOutcome, RunRequest
from ..pipeline.client.routing import Hop
from ..pipeline.client.sampling import SamplingParams

HISTORY_FILE = "chat_history"
PROMPT = ">>> "
HELP = """commands:
  /model NAME     switch model (the conversation starts over)
  /temp X         sampling temperature (0 = greedy)
  /max N          most new tokens per reply
  /stats          speed and route of the last reply
  /private on|off private mode for the next turns: providers see only encrypted (CKKS)
                  activations; much slower (seconds per token). /private shows the mode
  /reset          forget the conversation
  /exit           leave (or Ctrl-D); Ctrl-C stops a reply"""
PRIVATE_SLOW = "private turns are much slower: expect seconds per token"


@dataclasses.dataclass
class Conversation:
    """The REPL's state: pure, no I/O."""

    model: str
    temperature: float = 0.0
    max_tokens: int = 256
    private: bool = False  # every turn's request private (RunRequest.private)
    adapter: Path | None = None  # a LoRA adapter every turn applies (RunRequest.adapter)
    messages: list[dict] = dataclasses.field(default_factory=list)
    last: RunOutcome | None = None

    def params(self) -> SamplingParams:
        return SamplingParams(temperature=self.temperature, max_new_tokens=self.max_tokens)

    def command(self, line: str) -> str | None:
        """Apply a /command; returns text to show, or None for /exit. Raises UsageError."""
        name, _, arg = line.strip().partition(" ")
        arg = arg.strip()
        if name in ("/exit", "/quit"):
            return None
        if name == "/help":
            return HELP
        if name == "/reset":
            self.messages.clear()
            return "conversation cleared"
        if name == "/model":
            if not arg:
                return f"model: {self.model}"
            self.model, self.messages = arg, []
            return f"model: {arg} (new conversation)"
        if name == "/temp":
            try:
                value = float(arg)
            except ValueError:
                raise UsageError("/temp takes a number, e.g. /temp 0.7") from None
            if not 0 <= value <= 2:
                raise UsageError("/temp must be within 0..2")
            self.temperature = value
            return f"temperature: {value:g}"
        if name == "/max":
            if not arg.isdigit() or not 1 <= int(arg) <= 4096:
                raise UsageError("/max takes a whole number within 1..4096")
            self.max_tokens = int(arg)
            return f"max tokens: {arg}"
        if name == "/stats":
            return self.stats()
        if name == "/private":
            return self.private_mode(arg)
        raise UsageError(f"unknown command {name}; /help lists them")

    def private_mode(self, arg: str) -> str:
        if arg in ("on", "off"):
            self.private = arg == "on"
        elif arg:
            raise UsageError("/private takes on or off (alone it shows the mode)")
        if not self.private:
            return "private mode: off (providers compute on plaintext activations)"
        return (f"private mode: on: the next turns keep every norm, attention and the KV cache here and "
                f"send providers only CKKS ciphertexts; {PRIVATE_SLOW}")

    def stats(self) -> str:
        last = self.last
        if last is None:
            return "no reply yet"
        lines = [f"last reply: {len(last.tokens)} tokens, {last.decode_tok_s:.1f} tok/s, first token after "
                 f"{last.first_token_s:.2f} s, {last.checks} spot checks, {len(last.failovers)} failovers",
                 f"route ({len(last.route)} hops):"]
        lines += [f"  {hop.peer_id} blocks {hop.start}:{hop.end}" for hop in last.route]
        if last.private:
            p = last.private
            lines.append(f"private: {p['projections']} encrypted projections; {p['bytes_sent'] / 1e6:.1f} MB sent, "
                         f"{p['bytes_received'] / 1e6:.1f} MB received; encrypt {p['encrypt_s']:.1f} s, decrypt "
                         f"{p['decrypt_s']:.1f} s, providers {p['provider_s']:.1f} s, local layers "
                         f"{p['local_s']:.1f} s")
        return "\n".join(lines)


def private_route_lines(route: list[Hop]) -> list[str]:
    """Where each part of a private turn runs (shown as the turn starts, as `run --private` does)."""
    from ..pipeline.client.private_chain import describe_private_route  # noqa: PLC0415

    return describe_private_route(route, route[-1].end if route else 0)


class SwarmThread:
    """A Consumer per model on one host, in a background trio loop."""

    def __init__(self, data_dir: Path, bootstrap: tuple[str, ...], spot_check_rate: float,
                 hooks: ProgressHooks = ProgressHooks()) -> None:
        self.data_dir, self.bootstrap, self.spot_check_rate = data_dir, bootstrap, spot_check_rate
        self.hooks = hooks  # a model's obtaining (converted, or its head fetched): progress.py's bars
        self._consumers: dict[str, Consumer] = {}
        self._token = None
        self._ready = threading.Event()
        self._error: BaseException | None = None
        self._stop: trio.Event | None = None
        self._scope: trio.CancelScope | None = None
        self._thread = threading.Thread(target=self._main, name="swarm", daemon=True)

    def start(self, model: str) -> None:
        self._thread.start()
        self._ready.wait()
        if self._error is not None:
            raise self._error
        self._call(self._consumer, model)

    def _main(self) -> None:
        try:
            trio.run(self._run)
        except BaseException as exc:  # reported to the main thread
            self._error = exc
            self._ready.set()

    async def _run(self) -> None:
        self._stop = trio.Event()
        self._lock = trio.Lock()  # one generation at a time: a cancelled one finishes closing first
        async with trio.open_nursery() as nursery:  # holds every Consumer's host
            self._nursery = nursery
            self._token = trio.lowlevel.current_trio_token()
            self._ready.set()
            await self._stop.wait()
            nursery.cancel_scope.cancel()

    def _call(self, fn, *args):
        return trio.from_thread.run(fn, *args, trio_token=self._token)

    async def _consumer(self, model: str) -> Consumer:
        if model not in self._consumers:
            self._consumers[model] = await self._nursery.start(self._hold, model)
        return self._consumers[model]

    async def _hold(self, model: str, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        """Keep one model's Consumer (and its host) open until the REPL ends: a task of
        the long-lived nursery, since a nursery must close in the task that opened it."""
        async with Consumer.connect(self.data_dir, self.bootstrap, model, spot_check_rate=self.spot_check_rate,
                                    hooks=self.hooks) as consumer:
            task_status.started(consumer)
            await trio.sleep_forever()

    def check_adapter(self, model: str, path: Path) -> None:
        """Refuse, before the first turn, an adapter not made for `model` (UsageError)."""
        self._call(self._check_adapter, model, path)

    async def _check_adapter(self, model: str, path: Path) -> None:
        (await self._consumer(model)).load_adapter(path)

    def generate(self, conversation: Conversation, on_text: Callable[[str], None],
                 on_route: Callable[[list[Hop]], None] = lambda _r: None) -> RunOutcome:
        return self._call(self._generate, conversation.model, list(conversation.messages), conversation.params(),
                          conversation.private, on_text, on_route, conversation.adapter)

    async def _generate(self, model, messages, params, private, on_text, on_route,
                        adapter: Path | None = None) -> RunOutcome | None:
        # The scope covers the wait for the lock and the model's loading too: Ctrl-C at
        # any point cancels this request, never an earlier one's leftover scope.
        with trio.CancelScope() as scope:
            self._scope = scope
            try:
                async with self._lock:
                    consumer = await self._consumer(model)
                    prompt = messages_to_ids(consumer.tokenizer, messages)
                    return await consumer.generate(RunRequest(model=model, prompt=prompt, params=params,
                                                              chat_template=False, private=private,
                                                              adapter=adapter),
                                                   on_text=on_text, on_route=on_route)
            finally:
                if self._scope is scope:
                    self._scope = None
        return None  # cancelled by Ctrl-C: nobody waits for this result

    def cancel(self) -> None:
        """Stop the generation in progress (called after Ctrl-C)."""
        if self._scope is not None:
            with contextlib.suppress(Exception):
                trio.from_thread.run_sync(self._scope.cancel, trio_token=self._token)

    def close(self) -> None:
        if self._stop is not None and self._token is not None:
            with contextlib.suppress(Exception):
                trio.from_thread.run_sync(self._stop.set, trio_token=self._token)
        self._thread.join(timeout=10)


def _readline_history(data_dir: Path):
    try:
        import readline
    except ImportError:  # not on every platform: plain input() then
        return lambda: None
    path = data_dir / HISTORY_FILE
    with contextlib.suppress(OSError):
        readline.read_history_file(path)
    readline.set_history_length(1000)

    def save() -> None:
        with contextlib.suppress(OSError):
            readline.write_history_file(path)

    return save


def interruptible() -> None:
    """Make Ctrl-C raise KeyboardInterrupt here even if SIGINT came ignored: a process
    started in the background of a shell without job control (some CI runners and
    scripts) inherits SIGINT ignored, and Python then leaves it so. The REPL reads the
    terminal, so it is in the foreground; Ctrl-C is how its user stops a reply."""
    if sys.stdin.isatty() and signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def repl(data_dir: Path, bootstrap: tuple[str, ...], model: str, *, temperature: float, max_tokens: int,
         spot_check_rate: float, private: bool = False, adapter: Path | None = None, out=sys.stdout,
         err=sys.stderr, hooks: ProgressHooks = ProgressHooks()) -> int:
    interruptible()
    conversation = Conversation(model, temperature, max_tokens, private=private, adapter=adapter)
    swarm = SwarmThread(data_dir, bootstrap, spot_check_rate, hooks)
    save_history = _readline_history(data_dir)
    print(f"compushare chat: {model} (/help for commands, Ctrl-D to leave)", file=err, flush=True)
    if private:
        print(conversation.private_mode(""), file=err, flush=True)
    try:
        swarm.start(model)
        if adapter is not None:
            swarm.check_adapter(model, adapter)
        while True:
            try:
                line = input(PROMPT)
            except EOFError:
                print(file=out)
                return 0
            except KeyboardInterrupt:
                print(file=out)
                continue
            if not line.strip():
                continue
            if line.startswith("/"):
                if not _command(conversation, line, out, err):
                    return 0
                continue
            _turn(conversation, swarm, line, out, err)
    finally:
        save_history()
        swarm.close()


def _command(conversation: Conversation, line: str, out, err) -> bool:
    """Run one /command and show what it says; False when it leaves the chat."""
    try:
        shown = conversation.command(line)
    except UsageError as exc:
        print(f"error: {exc}", file=err, flush=True)
        return True
    if shown is None:
        return False
    print(shown, file=out, flush=True)
    return True


def _turn(conversation: Conversation, swarm: SwarmThread, line: str, out, err) -> None:
    """One question and its reply, streamed; a reply cancelled (Ctrl-C) or failed takes
    its question out of the context."""
    conversation.messages.append({"role": "user", "content": line})
    stopped = threading.Event()  # Ctrl-C: not a character more of this reply

    def show(text: str) -> None:  # called in the swarm thread
        if not stopped.is_set():
            out.write(text)
            out.flush()

    private = conversation.private
    if private:  # before the first turn's keys are made (seconds), not only once the route is known
        print(f"[private turn: {PRIVATE_SLOW}]", file=err, flush=True)

    routes: list[list[Hop]] = []

    def show_route(route: list[Hop]) -> None:
        routes.append(route)
        if private and len(routes) == 1:  # as the turn starts (a failover's new route: /stats)
            err.write("".join(line + "\n" for line in private_route_lines(route)))
            err.flush()

    try:
        conversation.last = swarm.generate(conversation, show, show_route)
        conversation.messages.append({"role": "assistant", "content": conversation.last.text})
        print(file=out, flush=True)
    except KeyboardInterrupt:
        stopped.set()
        swarm.cancel()
        conversation.messages.pop()  # the unanswered question leaves the context too
        print("\n[reply cancelled]", file=err, flush=True)
    except CompushareError as exc:
        conversation.messages.pop()
        hint = " (private turns need providers that serve encrypted sessions; /private off to go " \
               "back)" if private and isinstance(exc, RouteError) else ""
        print(f"\nerror: {exc}{hint}", file=err, flush=True)
