"""netlab: WAN-like and NAT'd test hosts on one Linux machine, in network namespaces.

The project's own harness for tests and benchmarks that need real distances or home
routers: N hosts on a bridge, each with its own delay, loss and rate, some behind
NAT routers; nothing outside the lab's namespaces is touched. Needs root.

- topology.py  what a lab is (names, addresses) and the commands that build it: pure
- lab.py       Lab (a context manager), down(prefix), ensure_tools(): the I/O
- delayer.py   delay/jitter/loss in user space (NFQUEUE) where the kernel has no netem
- __main__.py  `python -m netlab up|down|ping` for a lab by hand

tools/netlab/README.md says how to use it and what was measured.
"""

from .lab import Lab, LabError, down, ensure_tools, has_netem
from .topology import Topology, TopologyError, parse_hosts, parse_rates

__all__ = ["Lab", "LabError", "Topology", "TopologyError", "down", "ensure_tools", "has_netem", "parse_hosts",
           "parse_rates"]
