"""What the benchmarks share to use ../shared/tools/netlab: running netlab.sh under
a prefix of their own, commands inside a host's namespace, and installing what
netlab needs (the NFQUEUE delayer only when a bench adds delay: this kernel has
no netem)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

NETLAB = Path(__file__).resolve().parent.parent.parent / "shared" / "tools" / "netlab" / "netlab.sh"


def netlab(prefix: str, *args: str, timeout: float = 180) -> None:
    """`netlab.sh ARGS` with namespaces named `<prefix>h1..`: nothing else's lab is touched."""
    env = dict(os.environ, PFX=prefix, PY=sys.executable)
    subprocess.run(["bash", str(NETLAB), *args], check=True, env=env, timeout=timeout)


def in_ns(prefix: str, host: int | None, cmd: list[str]) -> list[str]:
    """`cmd` run on netlab host `host` (None: here, on loopback)."""
    return cmd if host is None else ["ip", "netns", "exec", f"{prefix}h{host}", *cmd]


def ensure_tools(*, delayer: bool) -> None:
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    packages = ["iproute2", "iptables", "ethtool", "iputils-ping"] + (["libnetfilter-queue-dev"] if delayer else [])
    missing = [tool for tool in ("ip", "tc", "ethtool", "iptables", "ping") if shutil.which(tool) is None]
    if missing or (delayer and not Path("/usr/include/libnetfilter_queue/libnetfilter_queue.h").exists()):
        print(f"installing {', '.join(packages)} for netlab (apt-get)", flush=True)
        for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", *packages]):
            done = subprocess.run(cmd, env=env, timeout=900, capture_output=True, text=True)
            if done.returncode != 0:
                raise RuntimeError(f"{' '.join(cmd)} failed: {done.stderr[-2000:]}")
    if delayer:
        try:
            import netfilterqueue  # noqa: F401
        except ImportError:
            print("installing netfilterqueue for netlab's delayer (pip)", flush=True)
            subprocess.run([sys.executable, "-m", "pip", "install", "-q", "netfilterqueue==1.1.0"], check=True,
                           timeout=900)
