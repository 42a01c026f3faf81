"""Configuration: frozen dataclasses, data-dir resolution and the TOML file.

Precedence, highest first: command-line flags, environment (COMPUSHARE_HOME,
COMPUSHARE_CACHE), `<data dir>/config.toml`, defaults.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from pathlib import Path

import platformdirs

from .errors import UsageError

APP_NAME = "compushare"
STATE_FILE = "node.json"  # a running node's state in its data dir
TRAIN_DIR = "train"  # `compushare train`'s participant: its own identity and state, beside the node's
TRAIN_STATE_FILE = "diloco.json"  # in TRAIN_DIR: the run, round, loss, members (status and the dashboard read it)
LISTEN_FILE = "node.listen.json"  # pid, peer id and addresses, as soon as the node can be dialled


def resolve_data_dir(flag: str | Path | None = None) -> Path:
    """The node's data dir: --data-dir, else $COMPUSHARE_HOME, else platformdirs."""
    if flag:
        path = Path(flag)
    elif os.environ.get("COMPUSHARE_HOME"):
        path = Path(os.environ["COMPUSHARE_HOME"])
    else:
        path = Path(platformdirs.user_data_dir(APP_NAME))
    path = path.expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def resolve_cache_dir() -> Path:
    """Cache shared by every node of this user (converted weights): $COMPUSHARE_CACHE."""
    env = os.environ.get("COMPUSHARE_CACHE")
    path = Path(env) if env else Path(platformdirs.user_cache_dir(APP_NAME))
    path = path.expanduser().resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_toml(data_dir: Path) -> dict:
    path = data_dir / "config.toml"
    if not path.exists():
        return {}
    try:
        return tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as exc:
        raise UsageError(f"{path}: invalid TOML: {exc}") from exc


@dataclasses.dataclass(frozen=True)
class Span:
    """A half-open range of transformer blocks, like a Python slice."""

    start: int
    end: int

    def __post_init__(self) -> None:
        if not (0 <= self.start < self.end):
            raise UsageError(f"invalid block span {self.start}:{self.end}")

    @classmethod
    def parse(cls, text: str) -> Span:
        try:
            start, end = (int(part) for part in text.split(":"))
        except ValueError:
            raise UsageError(f"--blocks wants START:END (half-open), got {text!r}") from None
        return cls(start, end)

    def __len__(self) -> int:
        return self.end - self.start

    def __str__(self) -> str:
        return f"{self.start}:{self.end}"


@dataclasses.dataclass(frozen=True)
class ServerLimits:
    """Admission and lifetime limits of the inference server."""

    kv_budget_tokens: int = 8192  # sum of every open session's max_tokens
    max_session_tokens: int = 4096  # one session's ceiling
    max_step_tokens: int = 2048  # tokens in one step (prefill chunk)
    session_idle_timeout_s: float = 120.0
    max_frame_bytes: int = 16 * 1024 * 1024
    compute_threads: int = 1
    max_sessions: int = 256  # open sessions, all peers together
    max_sessions_per_peer: int = 32
    max_streams_per_peer: int = 16  # concurrent infer streams from one peer
    stream_idle_timeout_s: float = 60.0  # a stream that sends no frame for this long is closed
    peer_requests_per_s: float = 1000.0  # token buckets per peer, with a 2 s burst
    peer_bytes_per_s: float = 256 * 1024 * 1024
    # Activations of training backwards running at once (/compushare/train), at most what
    # the memory budget leaves beside the span's weights and KV budget.
    train_memory_mb: int = 1024

    def __post_init__(self) -> None:
        # A frame must fit in one peer's byte burst (2 s of its rate), or it could never
        # be admitted and its sender would retry until its deadline.
        if self.peer_bytes_per_s * 2 < self.max_frame_bytes:
            raise UsageError(f"limits: peer_bytes_per_s must be at least max_frame_bytes / 2 "
                             f"({self.max_frame_bytes // 2})")
        if self.peer_requests_per_s * 2 < 1:
            raise UsageError("limits: peer_requests_per_s must be at least 0.5")


MiB = 1024 * 1024


@dataclasses.dataclass(frozen=True)
class RelayQuotas:
    """A relay's quotas ([relay] in config.toml); net/relay_quota.py enforces them
    and says why these defaults."""

    reservations: int = 32  # peers holding a slot at once (one slot per peer)
    reservation_ttl_s: int = 3600  # refreshed by the holder before it lapses
    circuits_per_peer: int = 16  # open circuits a peer is an end of (a NAT'd server: its unpunched consumers)
    circuits: int = 128  # open circuits in total
    circuit_bytes: int = 256 * MiB  # both directions of one circuit
    circuit_duration_s: int = 3600
    peer_bytes: int = 1024 * MiB  # through circuits a peer is an end of, per window
    total_bytes: int = 8192 * MiB  # through all circuits, per window
    window_s: float = 3600.0

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            if getattr(self, f.name) <= 0:
                raise ValueError(f"relay quota {f.name} must be positive")


DEFAULT_API_PORT = 8311
DEVICES = ("auto", "cpu", "cuda")
RUNTIMES = ("auto", "torch", "ggml")  # --runtime (spans/__init__.py: auto is ggml for a GGUF model on CPU)  # --device (hardware.resolve_device turns auto into one of the others)
PID_FILE = "node.pid"
LOG_FILE = "node.log"


@dataclasses.dataclass(frozen=True)
class NodeConfig:
    data_dir: Path
    listen: tuple[str, ...] = ("/ip4/127.0.0.1/tcp/0",)
    bootstrap: tuple[str, ...] = ()
    model: str | None = None
    blocks: Span | None = None
    torch_threads: int = 1  # threads of one forward, either runtime (ggml spans too)
    # A server record's lifetime, refreshed at a third of it (60 s before revision 23: each
    # re-put is a look-up and k stores, the largest part of an idle node's DHT upkeep).
    record_ttl_s: float = 300.0
    max_blocks: int | None = None  # automatic placement: at most this many blocks
    memory_budget_mb: int | None = None  # automatic placement: weights must fit (default: half the free RAM)
    # Where the span computes: "cuda" (weights, KV cache, activations on the GPU; the
    # memory budget is the device's), "cpu", or "auto" (CUDA where torch sees one).
    device: str = "auto"
    # What computes the span: "ggml" (a GGUF model's weights as stored, llama.cpp's
    # engine), "torch", or "auto" (ggml for a GGUF model on CPU, torch otherwise).
    runtime: str = "auto"
    ad_period_s: float = 5.0  # capability ads: one per period (net/ads.AD_PERIOD_S)
    api_port: int = DEFAULT_API_PORT  # local HTTP API on 127.0.0.1 (0: a free port, negative: none)
    # Ollama's routes without the token, for requests from 127.0.0.1 (clients that
    # cannot send one): off by default; docs/security.md says what it exposes.
    api_ollama_open: bool = False
    # Private mode (/compushare/private): serve encrypted products; keep the span's
    # weights pre-encoded as CKKS plaintexts (~264 MB a SmolLM2 block, both plans; ~2x faster)
    # rather than encoding them for every request.
    private: bool = True
    private_preencode: bool = True
    limits: ServerLimits = ServerLimits()
    # Circuit relay v2 for NAT'd peers, offered only while this node is publicly
    # reachable (AutoNAT), within these quotas (net/relay_quota.py: why these defaults).
    relay: bool = True
    relay_quotas: RelayQuotas = RelayQuotas()
    hole_punch: bool = True  # DCUtR: upgrade relayed connections to direct ones where the NATs allow

    def __post_init__(self) -> None:
        if not (1.0 <= self.ad_period_s <= 20.0):  # net/ads.MIN_AD_PERIOD_S..MAX_AD_PERIOD_S
            raise UsageError(f"--ad-period must be within 1..20 s, got {self.ad_period_s:g}")
        if self.max_blocks is not None and self.max_blocks < 1:
            raise UsageError("--max-blocks must be at least 1")
        if self.device not in DEVICES:
            raise UsageError(f"--device must be one of {', '.join(DEVICES)}, got {self.device!r}")
        if not (1 <= self.torch_threads <= 256):
            raise UsageError(f"--threads must be within 1..256, got {self.torch_threads}")
        if self.runtime not in RUNTIMES:
            raise UsageError(f"--runtime must be one of {', '.join(RUNTIMES)}, got {self.runtime!r}")

    @classmethod
    def build(cls, data_dir: Path, **flags) -> NodeConfig:
        """Merge `config.toml` under explicit flags (None means "not given")."""
        toml = load_toml(data_dir)
        node = toml.get("node", {})
        merged = {
            "listen": tuple(node.get("listen", cls.listen)),
            "bootstrap": tuple(node.get("bootstrap", ())),
            "model": node.get("model"),
            "blocks": Span.parse(node["blocks"]) if "blocks" in node else None,
            "torch_threads": int(node.get("torch_threads", 1)),
            "max_blocks": node.get("max_blocks"),
            "memory_budget_mb": node.get("memory_budget_mb"),
            "device": str(node.get("device", "auto")),
            "runtime": str(node.get("runtime", "auto")),
            "api_port": int(node.get("api_port", DEFAULT_API_PORT)),
            "api_ollama_open": bool(node.get("api_ollama_open", False)),
            "private": bool(node.get("private", True)),
            "private_preencode": bool(node.get("private_preencode", True)),
            "relay": bool(node.get("relay", True)),
            "hole_punch": bool(node.get("hole_punch", True)),
        }
        limit_fields = {f.name for f in dataclasses.fields(ServerLimits)}
        limits = ServerLimits(**{k: v for k, v in toml.get("limits", {}).items() if k in limit_fields})
        quota_fields = {f.name for f in dataclasses.fields(RelayQuotas)}
        unknown = set(toml.get("relay", {})) - quota_fields
        if unknown:
            raise UsageError(f"config.toml [relay]: unknown quota {sorted(unknown)[0]!r} "
                             f"(known: {', '.join(sorted(quota_fields))})")
        try:
            merged["relay_quotas"] = RelayQuotas(**toml.get("relay", {}))
        except (TypeError, ValueError) as exc:
            raise UsageError(f"config.toml [relay]: {exc}") from None
        for key, value in flags.items():
            if value is None or value == () or value == []:
                continue
            if key == "limits":
                limits = value
            else:
                merged[key] = tuple(value) if isinstance(value, list) else value
        return cls(data_dir=data_dir, limits=limits, **merged)
