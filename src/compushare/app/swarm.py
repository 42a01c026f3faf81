"""A local swarm: N node processes on 127.0.0.1, each with its own data dir.

`<home>/swarm.json` lists the processes (by pid) and the bootstrap address; `down`
stops exactly those pids (after checking each is still a compushare node).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..config import LISTEN_FILE, STATE_FILE
from ..errors import CompushareError, UsageError

SWARM_FILE = "swarm.json"
START_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 10.0


def split_blocks(num_blocks: int, parts: int) -> list[tuple[int, int]]:
    if not (1 <= parts <= num_blocks):
        raise UsageError(f"cannot split {num_blocks} blocks over {parts} nodes")
    bounds = [round(i * num_blocks / parts) for i in range(parts + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


def node_command(model: str, span: tuple[int, int] | None, data_dir: Path, bootstrap: list[str],
                 extra: list[str] | None = None) -> list[str]:
    """The command line of a node process; span None lets the node place itself."""
    cmd = [sys.executable, "-m", "compushare", "node", "--model", model, "--data-dir", str(data_dir),
           "--listen", "/ip4/127.0.0.1/tcp/0"]
    if span is not None:
        cmd += ["--blocks", f"{span[0]}:{span[1]}"]
    for addr in bootstrap:
        cmd += ["--bootstrap", addr]
    return cmd + (extra or [])


def start_node(cmd: list[str], data_dir: Path) -> subprocess.Popen:
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / STATE_FILE).unlink(missing_ok=True)
    (data_dir / LISTEN_FILE).unlink(missing_ok=True)
    log = open(data_dir / "node.log", "ab")
    # Own session: a Ctrl-C in the terminal that started the swarm does not reach it.
    return subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                            start_new_session=True)


def wait_ready(proc: subprocess.Popen, data_dir: Path, timeout: float = START_TIMEOUT_S,
               watch: tuple[tuple[subprocess.Popen, Path], ...] = (), file: str = STATE_FILE) -> dict:
    """The node's state once it serves (`file`=LISTEN_FILE: its addresses, once it can
    be dialled); an error as soon as it, or a node in `watch` (the one it bootstraps
    from), exits."""
    deadline = time.monotonic() + timeout
    path = data_dir / file
    while time.monotonic() < deadline:
        if path.exists():
            return json.loads(path.read_text())
        for other, other_dir in ((proc, data_dir), *watch):
            if other.poll() is not None:
                tail = (other_dir / "node.log").read_text(errors="replace")[-2000:]
                raise CompushareError(f"node in {other_dir} exited with {other.returncode}:\n{tail}")
        time.sleep(0.1)
    raise CompushareError(f"node in {data_dir} not ready after {timeout:.0f}s")


def is_our_node(pid: int) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    # `python -m compushare node ...` or the console script `/…/bin/compushare node ...`
    return any(os.path.basename(arg) == b"compushare" for arg in cmdline) and b"node" in cmdline


def stop_pids(pids: list[int], timeout: float = STOP_TIMEOUT_S) -> None:
    """SIGTERM each pid, wait, then SIGKILL what is left."""
    live = [p for p in pids if is_our_node(p)]
    for pid in live:
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while live and time.monotonic() < deadline:
        live = [p for p in live if _alive(p)]
        time.sleep(0.1)
    for pid in live:
        os.kill(pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    except ChildProcessError:
        pass
    stat = Path(f"/proc/{pid}/stat")
    try:
        return stat.read_text().split(") ")[1][0] != "Z"
    except (OSError, IndexError):
        return False


def read_swarm(home: Path) -> dict | None:
    path = home / SWARM_FILE
    return json.loads(path.read_text()) if path.exists() else None


def swarm_up(home: Path, nodes: int, model: str, extra_args: list[str] | None = None, *,
             on_stage=lambda _stage: None, progress=None, imported_in: Path | None = None) -> dict:
    """Start `nodes` node processes splitting `model` (obtained first: `on_stage` and
    `progress` follow its conversion, as for catalog.resolve_model). A model the user
    imported (`models import`, held in the store at `imported_in`) is hard-linked into
    the first node's; the others fetch it from the swarm by name, as a user's would."""
    home = home.resolve()
    existing = read_swarm(home)
    if existing and any(is_our_node(n["pid"]) for n in existing["nodes"]):
        raise UsageError(f"a swarm is already running in {home}; `compushare swarm down` first")
    dirs = [home / f"node-{i}" for i in range(nodes)]
    from ..model.catalog import resolve_model
    from ..model.store import ModelStore

    imported = ModelStore(imported_in).get(model) if imported_in is not None else None
    if imported is not None and ModelStore(dirs[0]).get(model) is None:
        ModelStore(dirs[0]).import_dir(imported.path, alias=model, laid_out=True)
    stored = resolve_model(model, dirs[0], on_stage=on_stage, progress=progress)  # converted once, in the cache
    spans = split_blocks(stored.num_blocks, nodes)
    procs: list[subprocess.Popen] = []
    try:
        procs.append(start_node(node_command(model, spans[0], dirs[0], [], extra_args), dirs[0]))
        # The others start as soon as the first can be dialled: they fetch their spans'
        # weights from it while it loads its own (an 8B-shaped model: ~20 s sooner).
        bootstrap = wait_ready(procs[0], dirs[0], file=LISTEN_FILE)["addrs"][:1]
        for span, data_dir in zip(spans[1:], dirs[1:]):
            procs.append(start_node(node_command(model, span, data_dir, bootstrap, extra_args), data_dir))
        states = [wait_ready(procs[0], dirs[0])] + [wait_ready(p, d, watch=((procs[0], dirs[0]),))
                                                    for p, d in zip(procs[1:], dirs[1:])]
    except BaseException:
        stop_pids([p.pid for p in procs])
        raise
    swarm = {
        "model": model,
        "model_id": stored.model_id,
        "bootstrap": bootstrap,
        "nodes": [{"pid": s["pid"], "data_dir": str(d), "peer_id": s["peer_id"], "addrs": s["addrs"],
                   "blocks": f"{s['start']}:{s['end']}", "api": s.get("api")} for s, d in zip(states, dirs)],
    }
    (home / SWARM_FILE).write_text(json.dumps(swarm, indent=2))
    return swarm


def swarm_down(home: Path) -> int:
    swarm = read_swarm(home.resolve())
    if not swarm:
        return 0
    pids = [n["pid"] for n in swarm["nodes"]]
    stop_pids(pids)
    (home / SWARM_FILE).unlink(missing_ok=True)
    return len(pids)


def stop_node(data_dir: Path) -> int:
    """Stop the node running on `data_dir` by the pid in its pid file; its pid.
    UsageError if none runs (a stale pid file is removed)."""
    from ..config import PID_FILE

    path = data_dir / PID_FILE
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        raise UsageError(f"no node runs on {data_dir} (no {PID_FILE})") from None
    if not is_our_node(pid):
        path.unlink(missing_ok=True)
        raise UsageError(f"no node runs on {data_dir} (pid {pid} is gone; stale {PID_FILE} removed)")
    stop_pids([pid])
    return pid
