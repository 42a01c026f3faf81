"""Provider processes of one benchmark run on 127.0.0.1, started and always ended by pid.

    swarm = LocalSwarm(root, model, {"a": (0, 15), "b": (15, 30)})
    swarm.start("a"); swarm.ready("a")      # the first one is the bootstrap of the others
    ...
    swarm.close()                           # SIGCONT + SIGTERM, then SIGKILL after 15 s

or, for a whole run: `with running_swarm("compushare-x-", model, spans) as (swarm, client_dir):`.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import tempfile
import time
from pathlib import Path

from compushare.app.swarm import node_command, start_node, wait_ready


class LocalSwarm:
    def __init__(self, root: Path, model: str, spans: dict[str, tuple[int, int]]) -> None:
        self.root, self.model, self.spans = root, model, spans
        self.procs: dict[str, subprocess.Popen] = {}
        self.states: dict[str, dict] = {}

    def addrs(self, but: str | None = None) -> list[str]:
        return [s["addrs"][0] for name, s in self.states.items()
                if name != but and self.procs[name].poll() is None]

    def start(self, name: str) -> None:
        data_dir = self.root / name
        cmd = node_command(self.model, self.spans[name], data_dir, self.addrs(but=name))
        self.procs[name] = start_node(cmd, data_dir)

    def ready(self, name: str) -> dict:
        self.states[name] = wait_ready(self.procs[name], self.root / name, timeout=300)
        return self.states[name]

    def start_all(self) -> None:
        """The first span's node, then the others bootstrapping from it, all ready."""
        first, *rest = self.spans
        self.start(first)
        self.ready(first)
        for name in rest:
            self.start(name)
        for name in rest:
            self.ready(name)

    def name_of(self, peer_id: str) -> str:
        return next(name for name, s in self.states.items() if s["peer_id"] == peer_id)

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGCONT)
                    os.kill(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 15
        for proc in self.procs.values():
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=5)


@contextlib.contextmanager
def running_swarm(prefix: str, model: str, spans: dict[str, tuple[int, int]]):
    """A temp dir, the model converted once for a client there (the shared cache), every
    provider started and serving: (swarm, client_dir); ended on every exit path."""
    from compushare.model.catalog import resolve_model  # noqa: PLC0415

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        swarm = LocalSwarm(Path(tmp), model, spans)
        try:
            client_dir = Path(tmp) / "client"
            resolve_model(model, client_dir)
            swarm.start_all()
            print(f"swarm: {', '.join(f'{n} {s[0]}:{s[1]}' for n, s in spans.items())}", flush=True)
            yield swarm, client_dir
        finally:
            swarm.close()


def vm_rss_mb(pid: int) -> float:
    """A process's resident set (VmRSS), in MB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise ValueError(f"no VmRSS for {pid}")


def cpu_seconds(pid: int) -> float:
    """A process's CPU time so far (user + system, all threads), in seconds."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
