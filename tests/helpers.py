"""Shared test helpers: the tiny random Llama, node processes, cleanup."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import torch

from compushare.model.catalog import import_path
from compushare.proofs.inference import DEFAULT_MODE, GENESIS, Statement, StepClaim, step_digest
from compushare.app.swarm import node_command, start_node, wait_ready

import forkserver

TINY_LAYERS = 4
# How long a test waits for something that should come in a second or two. Generous
# on purpose: a wait ends as soon as its condition holds, so a slow or loaded machine
# costs time, never a failure (docs/testing.md).
WAIT_S = 60.0


def wait_until(check, what: str, timeout: float = WAIT_S, interval: float = 0.1):
    """Poll `check()` until it returns something truthy (returned); AssertionError
    naming `what` after `timeout` seconds. For waits outside trio (trio tests poll
    with `trio.fail_after` and `trio.sleep`)."""
    deadline = time.monotonic() + timeout
    while True:
        found = check()
        if found:
            return found
        if time.monotonic() > deadline:
            raise AssertionError(f"not within {timeout:.0f} s: {what}")
        time.sleep(interval)


STALL_S = 90.0
PROGRESS_LIMIT_S = 600.0


async def advance_to(measure, goal: int, what: str, *, stall_s: float = STALL_S,
                     limit_s: float = PROGRESS_LIMIT_S) -> None:
    """In trio: wait until `measure()` (an int, or an awaitable of one) reaches `goal`,
    failing only once it stops advancing for `stall_s`, or after `limit_s` in all. For
    floods and the like, whose pace is the machine's: a loaded machine is slower (a
    fixed 90 s failed once, CI stop 61), a stuck one makes no progress."""
    import inspect
    import trio

    async def now() -> int:
        value = measure()
        return await value if inspect.isawaitable(value) else value

    best, last_gain = -1, trio.current_time()
    with trio.fail_after(limit_s):
        while (reached := await now()) < goal:
            if reached > best:
                best, last_gain = reached, trio.current_time()
            elif trio.current_time() - last_gain > stall_s:
                raise AssertionError(f"{what}: stuck at {best} of {goal} for {stall_s:.0f} s")
            await trio.sleep(0.5)


def dashboard(data_dir: Path, state: dict) -> dict:
    """A node's /control/dashboard (its view of the swarm) through its control API."""
    from compushare.app.api.client import call

    return call(data_dir, state["api"], "/control/dashboard")


def make_tiny_llama(path: Path, *, seed: int = 0, layers: int = TINY_LAYERS, tie: bool = False) -> Path:
    """A tiny random Llama (4 layers, hidden 64): deterministic across processes, quick to build."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
        tie_word_embeddings=tie, attn_implementation="sdpa", bos_token_id=1, eos_token_id=2,
    )
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(str(path))
    return path


QWEN_TOKENIZER = Path(__file__).resolve().parent / "data" / "tokenizers" / "qwen2.5"
QWEN_VOCAB = 151936  # Qwen2.5's models: the tokenizer's 151,665 tokens, padded


def unpack_qwen_tokenizer(path: Path) -> Path:
    """Qwen2.5's tokenizer files in `path` (tokenizer.json is kept compressed)."""
    import lzma
    import shutil

    path.mkdir(parents=True, exist_ok=True)
    for name in ("tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(QWEN_TOKENIZER / name, path / name)
    with lzma.open(QWEN_TOKENIZER / "tokenizer.json.xz", "rb") as packed:
        (path / "tokenizer.json").write_bytes(packed.read())
    return path


def reference_model(model_dir: Path, **kwargs):
    """transformers' float32 model of a checkpoint, its weights in storage of their own:
    torch's float32 products round by the weights' alignment, and a checkpoint's mapped
    tensors sit at the file's offsets (8 bytes off: 1 ulp apart), as the span runner's
    and the head's do not."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32, **kwargs).eval()
    for tensor in (*model.parameters(), *model.buffers()):
        tensor.data = tensor.data.clone()
    return model


def reference_greedy(model_dir: Path, prompt_ids: list[int], new_tokens: int) -> list[int]:
    """Single-process transformers generation on the same weights and dtype."""
    model = reference_model(model_dir, attn_implementation="sdpa")
    with torch.inference_mode():
        out = model.generate(torch.tensor([prompt_ids]), max_new_tokens=new_tokens, min_new_tokens=new_tokens,
                             do_sample=False, eos_token_id=None, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def local_greedy(model_dir, prompt: list[int], new_tokens: int) -> list[int]:
    """Greedy tokens in one process, in the model's own weight format: every block in
    one span on the runtime a node gives the model (ggml for a GGUF), the head beside it
    (what a swarm of that model must reproduce)."""
    from compushare.spans import load_head, load_span

    runner, head = load_span(model_dir, 0, TINY_LAYERS), load_head(model_dir)
    cache = runner.new_cache()
    hidden = runner.forward(head.embed_tokens(prompt), cache, 0)
    tokens = []
    for _ in range(new_tokens):
        tokens.append(int(torch.argmax(head.logits(hidden))))
        hidden = runner.forward(head.embed_tokens(tokens[-1:]), cache, runner.cached_length(cache))
    return tokens


def random_adapter(config, layers=range(TINY_LAYERS), *, seed: int = 0, rank: int = 4,
                   targets=("q_proj", "v_proj", "o_proj", "down_proj"), model_id: str = ""):
    """A LoRA adapter that changes the model: PEFT's initialisation (A random, B zero)
    with B filled with small random values too."""
    from compushare.model.lora import Adapter, LoraSpec

    adapter = Adapter.initialised(LoraSpec(rank, 2.0 * rank, tuple(targets)), config, layers, seed=seed,
                                  model_id=model_id)
    generator = torch.Generator().manual_seed(seed + 1)
    for name, tensor in adapter.tensors.items():
        if name.endswith("lora_B.weight"):
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.05)
    return adapter


def local_adapted_greedy(model_dir, adapter, prompt: list[int], new_tokens: int, *, layers: int = TINY_LAYERS,
                         ggml: bool = False) -> list[int]:
    """Greedy tokens with `adapter` applied in one process: every block in one
    SpanRunner (with `ggml`, a GGUF's span and head on ggml), the head beside it (what
    a swarm applying the adapter must reproduce)."""
    from compushare.model.blocks import SpanRunner
    from compushare.model.head import ConsumerHead
    from compushare.spans import GGML, load_head, load_span

    if ggml:
        runner, head = load_span(model_dir, 0, layers, runtime=GGML), load_head(model_dir)
    else:
        runner, head = SpanRunner.load(model_dir, 0, layers), ConsumerHead.load(model_dir)
    cache = runner.new_cache()
    hidden = runner.forward(head.embed_tokens(prompt), cache, 0, adapter=adapter)
    tokens = []
    for _ in range(new_tokens):
        tokens.append(int(torch.argmax(head.logits(hidden))))
        hidden = runner.forward(head.embed_tokens(tokens[-1:]), cache, runner.cached_length(cache), adapter=adapter)
    return tokens


class Processes:
    """Starts node processes and always stops them, by pid."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.procs: list[subprocess.Popen] = []

    def node(self, name: str, model_dir: Path | None, blocks: str | None, *, alias: str = "tiny",
             bootstrap: list[str] | tuple = (), extra: list[str] | None = None, wait: bool = True,
             fmt: str | None = None):
        """A node process; with model_dir None it holds nothing and `alias` must be a
        model id (the node fetches the manifest and its span from the swarm). `fmt`:
        the weight format `model_dir` is imported in (model/formats.py)."""
        data_dir = self.root / name
        data_dir.mkdir(parents=True, exist_ok=True)
        if model_dir is not None:
            import_path(model_dir, data_dir, alias=alias, fmt=fmt)
        span = tuple(int(x) for x in blocks.split(":")) if blocks else None  # None: automatic placement
        proc = forkserver.spawn(node_command(alias, span, data_dir, list(bootstrap), extra), data_dir)
        self.procs.append(proc)
        state = wait_ready(proc, data_dir, timeout=120) if wait else None
        return proc, state

    def seeder(self, name: str, model_dir: Path | None, *, bootstrap=(), extra: list[str] | None = None,
               wait: bool = True):
        """A `compushare models seed` process holding the whole of `model_dir`."""
        data_dir = self.root / name
        data_dir.mkdir(parents=True, exist_ok=True)
        if model_dir is not None:
            import_path(model_dir, data_dir, alias="tiny")
        cmd = [sys.executable, "-m", "compushare", "models", "seed", "--data-dir", str(data_dir),
               "--listen", "/ip4/127.0.0.1/tcp/0"]
        for addr in bootstrap:
            cmd += ["--bootstrap", addr]
        proc = start_node(cmd + (extra or []), data_dir)
        self.procs.append(proc)
        return proc, (wait_ready(proc, data_dir, timeout=120) if wait else None)

    def ready(self, name: str, proc) -> dict:
        return wait_ready(proc, self.root / name, timeout=120)

    def nodes(self, specs, model_dir: Path, *, bootstrap=(), alias: str = "tiny", extra=None,
              fmt: str | None = None) -> list[dict]:
        """Start several nodes at once (names and block spans), then wait for all."""
        started = [(name, self.node(name, model_dir, blocks, alias=alias, bootstrap=bootstrap, extra=extra,
                                    wait=False, fmt=fmt)[0]) for name, blocks in specs]
        return [self.ready(name, proc) for name, proc in started]

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 10
        for proc in self.procs:
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=5)


def vm_rss_mb(pid: int) -> float:
    """A process's resident set (VmRSS), in MB: what the hostile-peer tests bound."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for {pid}")


def liar_and_honest(processes: Processes, model_dir: Path, fmt: str | None = None,
                    noise: float = 0.05) -> tuple[dict, list[str], dict, dict]:
    """A serves 0:2; B serves 2:4 but adds noise to every output (a lying server: `noise`
    times the output's mean magnitude) and is fast, C serves 2:4 honestly but slowly,
    so routes prefer B. Returns the states of A, the bootstrap addresses, B and C, once
    both ads say "serving" with their speeds. `fmt`: the weight format all three serve
    the model in."""
    _, a = processes.node("a", model_dir, "0:2", fmt=fmt)
    boot = a["addrs"][:1]
    fast_ads = ["--ad-period", "1"]
    liar = processes.node("b", model_dir, "2:4", bootstrap=boot, extra=["--debug-noise", str(noise)] + fast_ads,
                          wait=False, fmt=fmt)[0]
    honest = processes.node("c", model_dir, "2:4", bootstrap=boot, extra=["--debug-slowdown", "30"] + fast_ads,
                            wait=False, fmt=fmt)[0]
    liar, honest = processes.ready("b", liar), processes.ready("c", honest)

    def b_preferred() -> bool:  # A's view, which a consumer bootstrapping from A learns
        rates = {peer["peer_id"]: serving["rate"] for peer in dashboard(processes.root / "a", a)["peers"]
                 for serving in peer["serving"] if serving["state"] == "serving" and serving["start"] == 2}
        return rates.get(liar["peer_id"], 0) > rates.get(honest["peer_id"], 0) > 0

    wait_until(b_preferred, "A's view shows B and C serving 2:4, B faster")
    return a, boot, liar, honest


@contextlib.contextmanager
def chat_at_a_terminal(data_dir: Path, bootstrap: str, *args: str, home: Path, **spawn):
    """`compushare chat` in a pseudo-terminal, driven as a person would (pexpect):
    yields the child at its first prompt. Leaving the block types /exit and checks
    the REPL ends cleanly; an error kills it."""
    import pexpect

    child = pexpect.spawn(sys.executable, ["-m", "compushare", "chat", "--data-dir", str(data_dir),
                                           "--bootstrap", bootstrap, *args],
                          env=dict(os.environ, COMPUSHARE_HOME=str(home)), encoding="utf-8", timeout=120, **spawn)
    try:
        child.expect_exact(">>> ")
        yield child
        child.sendline("/exit")
        child.expect(pexpect.EOF)
        child.close()
        assert child.exitstatus == 0
    finally:
        if child.isalive():
            child.kill(signal.SIGKILL)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def signed_claim(key_pair, output: bytes, *, model: str, start: int, end: int, position: int, tokens: int,
                 input_digest: bytes, prefix: bytes = GENESIS, dtype: str = "float32", mode: str = DEFAULT_MODE,
                 peer: str | None = None, runtime: str = "", forwards: bytes = GENESIS) -> StepClaim:
    """A server's claim of `output` for a step, signed by `key_pair` (as `peer`, if
    given: a forgery), the way a server signs its step proofs."""
    from libp2p.peer.id import ID

    statement = Statement(mode, model, start, end, position, tokens, prefix, input_digest,
                          step_digest(dtype, output, tokens), runtime, forwards)
    return StepClaim(peer or ID.from_pubkey(key_pair.public_key).to_base58(), dtype, output,
                     statement.sign(key_pair), runtime, forwards)


WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city now",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}


def tool_conversations() -> list[tuple[list[dict], str]]:
    """What the tool-trained tiny model learnt to answer, by heart: (messages, reply).
    A question about one city's weather is a call; about two, two calls; a tool's
    result, an answer."""
    call = {"id": "call_1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    asked = [{"role": "user", "content": "What is the weather in Paris?"}]
    return [
        (asked, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'),
        ([{"role": "user", "content": "Weather in Paris and in Rome?"}],
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
         '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Rome"}}\n</tool_call>'),
        (asked + [{"role": "assistant", "content": None, "tool_calls": [call]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}],
         "It is 18 C and sunny in Paris."),
    ]


def make_tool_model(path: Path, tokenizer_dir: Path, *, steps: int = 150) -> Path:
    """A tiny Qwen2.5-shaped model (4 layers, hidden 64, Qwen2.5's tokenizer, vocabulary
    and chat template) trained until it answers tool_conversations() greedily: a model
    that calls tools of its own accord, as no small tool-trained checkpoint is at hand.
    The loss is taken at the replies' positions only, so a step costs milliseconds."""
    import shutil

    from transformers import AutoTokenizer, Qwen2Config, Qwen2ForCausalLM

    from compushare.app.api.engine import messages_to_ids
    from compushare.app.api.tools import parse_tools

    tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    tools = parse_tools([WEATHER_TOOL])
    sequences = []
    for messages, reply in tool_conversations():
        prompt = messages_to_ids(tokenizer, messages, tools)
        target = tokenizer.encode(reply, add_special_tokens=False) + [tokenizer.eos_token_id]
        sequences.append((prompt, target))
    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=QWEN_VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=TINY_LAYERS,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         tie_word_embeddings=True, bos_token_id=None, eos_token_id=tokenizer.eos_token_id,
                         attn_implementation="sdpa")
    model = Qwen2ForCausalLM(config)
    # The embedding (and the tied LM head) stays as drawn: the blocks learn to point at
    # its rows. Updating 151,936 rows each step would cost seconds, not milliseconds.
    model.model.embed_tokens.weight.requires_grad_(False)
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    for _ in range(steps):
        optimizer.zero_grad()
        for prompt, target in sequences:
            ids = torch.tensor([prompt + target[:-1]])
            hidden = model.model(input_ids=ids).last_hidden_state[0, len(prompt) - 1:]
            loss = torch.nn.functional.cross_entropy(model.lm_head(hidden), torch.tensor(target))
            loss.backward()
        optimizer.step()
    model.eval().save_pretrained(str(path))
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(tokenizer_dir / name, path / name)
    return path
