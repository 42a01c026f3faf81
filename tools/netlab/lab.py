"""Building and removing labs: the I/O around topology.py. Needs root.

    with Lab(Topology("csp", hosts=4, delay_ms=10)) as lab:
        server = lab.popen(1, [sys.executable, "server.py", "--listen", lab.addr(1)])
        lab.run(4, ["ping", "-U", "-c", "3", lab.addr(1)])

Entering removes whatever an earlier lab of the same prefix left behind (a killed
run), installs the tools it needs, and builds the lab; leaving removes it: every
process still running in one of its namespaces is stopped by pid (`ip netns pids`),
then the namespaces are deleted, which deletes their links and rules. Only
namespaces named by the lab's own prefix are touched.
"""

from __future__ import annotations

import os
import selectors
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from .topology import Topology

DELAYER = Path(__file__).resolve().with_name("delayer.py")
NETFILTERQUEUE = "netfilterqueue==1.1.0"  # the delayer's one dependency (builds against libnetfilter-queue)
APT_PACKAGES = ("iproute2", "iptables", "ethtool", "iputils-ping", "libnetfilter-queue-dev")
_NFQ_HEADER = Path("/usr/include/libnetfilter_queue/libnetfilter_queue.h")


class LabError(RuntimeError):
    """A lab could not be built (its command and stderr say why)."""


def _sh(cmd: list[str], timeout: float = 30) -> str:
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    if done.returncode != 0:
        raise LabError(f"{' '.join(cmd)}: {done.stderr.strip() or f'exit {done.returncode}'}")
    return done.stdout


def ensure_tools(python: str = sys.executable, *, delayer: bool = True) -> None:
    """Install what labs need if it is missing: apt packages, and netfilterqueue for `python`."""
    missing = [tool for tool in ("ip", "tc", "ethtool", "iptables", "ping") if shutil.which(tool) is None]
    if missing or (delayer and not _NFQ_HEADER.exists()):
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        print(f"netlab: installing {', '.join(APT_PACKAGES)} (apt-get)", file=sys.stderr, flush=True)
        for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *APT_PACKAGES]):
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
            if done.returncode != 0:
                raise LabError(f"{' '.join(cmd)} failed: {done.stderr[-2000:]}")
    if delayer and subprocess.run([python, "-c", "import netfilterqueue"], capture_output=True).returncode != 0:
        print(f"netlab: installing {NETFILTERQUEUE} into {python} (pip)", file=sys.stderr, flush=True)
        _sh([python, "-m", "pip", "install", "-q", NETFILTERQUEUE], timeout=900)


def namespaces() -> list[str]:
    """Every network namespace on the machine (`ip netns list` prints `name (id: n)`)."""
    return [line.split()[0] for line in _sh(["ip", "netns", "list"]).splitlines() if line.strip()]


def has_netem(prefix: str) -> bool:
    """Whether the kernel can netem (many sandboxes' kernels cannot): probed in a scratch namespace."""
    probe = f"{prefix}probe"
    _sh(["ip", "netns", "add", probe])
    try:
        return subprocess.run(["ip", "netns", "exec", probe, "tc", "qdisc", "add", "dev", "lo", "root", "netem",
                               "delay", "1ms"], capture_output=True).returncode == 0
    finally:
        subprocess.run(["ip", "netns", "del", probe], capture_output=True)


def down(prefix: str, grace: float = 3.0) -> list[str]:
    """Remove every namespace of this prefix's labs and stop what runs in them; the names removed."""
    owner = Topology(prefix, hosts=1)
    doomed = [ns for ns in namespaces() if owner.owns(ns)]
    doomed.sort(key=lambda ns: ns == owner.hub)  # hosts and routers first, the bridge last
    pids = {int(pid) for ns in doomed for pid in _sh(["ip", "netns", "pids", ns]).split()}
    _signal(pids, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while pids and time.monotonic() < deadline:
        pids = {pid for pid in pids if _alive(pid)}
        time.sleep(0.05)
    _signal(pids, signal.SIGKILL)
    for ns in doomed:
        subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
    return doomed


def _signal(pids: set[int], sig: int) -> None:
    for pid in pids:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead to us; /proc says so (our own children are reaped by their Popen).
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[-1][:1] != "Z"
    except OSError:
        return False


class Lab:
    """One lab, up while the context is entered."""

    def __init__(self, topology: Topology, python: str = sys.executable, ready_timeout: float = 20) -> None:
        self.topology = topology
        self.python = python
        self.ready_timeout = ready_timeout
        self.netem: bool | None = None
        self._delayers: list[subprocess.Popen] = []

    def __enter__(self) -> Lab:
        if os.geteuid() != 0:
            raise LabError("network namespaces need root")
        ensure_tools(self.python, delayer=False)
        down(self.topology.prefix)  # what a killed earlier run left
        try:
            self._up()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        for proc in self._delayers:
            if proc.poll() is None:
                proc.terminate()
        for proc in self._delayers:
            try:
                proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(timeout=5)
        self._delayers.clear()
        down(self.topology.prefix)

    def _up(self) -> None:
        top = self.topology
        self.netem = has_netem(top.prefix) if top.delayed else False
        if top.delayed and not self.netem:
            ensure_tools(self.python, delayer=True)
        for cmd in top.up_commands(netem=self.netem):
            _sh(cmd)
        if top.delayed and not self.netem:
            for host in range(1, top.hosts + 1):
                self._start_delayer(host)

    def _start_delayer(self, host: int) -> None:
        cmd = self.topology.delayer_command(host, self.python, str(DELAYER))
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                start_new_session=True)  # a Ctrl-C meant for the caller leaves it be
        self._delayers.append(proc)
        # The delayer prints "ready" once bound; until then its queue drops every packet.
        said: list[str] = []
        deadline = time.monotonic() + self.ready_timeout
        with selectors.DefaultSelector() as sel:
            sel.register(proc.stdout, selectors.EVENT_READ)
            while time.monotonic() < deadline:
                if sel.select(timeout=max(0.0, deadline - time.monotonic())):
                    line = proc.stdout.readline()
                    if line.strip() == "ready":
                        return
                    if not line:
                        break
                    said.append(line)
        why = "".join(said).strip() or f"no 'ready' within {self.ready_timeout} s"
        raise LabError(f"the delayer of host {host} did not start: {why[-2000:]}")

    def detach(self) -> None:
        """Leave the lab up after this object is gone (`down(prefix)` removes it and its delayers)."""
        self._delayers.clear()

    # -------------------------------------------------------------- running

    def addr(self, host: int) -> str:
        return self.topology.addr(host)

    def seen_addr(self, host: int) -> str:
        return self.topology.seen_addr(host)

    def wrap(self, host: int, cmd: list[str]) -> list[str]:
        """`cmd` as run inside host `host`'s namespace."""
        return ["ip", "netns", "exec", self.topology.host_ns(host), *cmd]

    def run(self, host: int, cmd: list[str], **kwargs) -> subprocess.CompletedProcess:
        kwargs.setdefault("timeout", 60)
        return subprocess.run(self.wrap(host, cmd), **kwargs)

    def popen(self, host: int, cmd: list[str], **kwargs) -> subprocess.Popen:
        """A process in host `host`; leaving the lab stops it if its owner has not."""
        return subprocess.Popen(self.wrap(host, cmd), **kwargs)
