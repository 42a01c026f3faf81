"""What a lab is, and the commands that build it: pure, no I/O, tested without root.

A lab is N hosts on one Ethernet bridge. The bridge lives in a namespace of its own
(`<prefix>hub`), so nothing touches the machine's own network and the hosts reach
nothing but each other. Public host i is 10.200.0.i. A NAT'd host i sits behind its
own router namespace (`<prefix>r<i>`, MASQUERADE, unsolicited inbound dropped): the
host is 10.201.i.2 on the router's LAN and appears on the bridge as 10.200.0.(100+i),
the address every peer sees, the way a home machine shows its router's address.

Shaping, per host:
- delay/jitter/loss on the host's *ingress* (so a round trip between two delayed
  hosts is about 2 x delay), by netem where the kernel has it and otherwise by the
  user-space NFQUEUE delayer (`delayer.py`) run inside the host's namespace. The
  queue sits on INPUT, not OUTPUT: holding locally sent packets trips TCP Small
  Queues and caps a TCP stream at a few Mbit/s.
- a rate with `tbf` on the host's upload (its own eth0) and its download (its port
  on the bridge). Offloads (TSO/GSO/GRO) are off on every shaped link so each
  packet is one MTU and shaping acts per packet, not per 64 KB blob.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

MAX_HOSTS = 99  # 10.200.0.(100+i) must stay a host address for NAT'd hosts
_PREFIX = re.compile(r"[a-z][a-z0-9]{0,7}")
_RATE = re.compile(r"\d+(\.\d+)?(bit|kbit|mbit|gbit)")
DELAY_QUEUE = 0  # the NFQUEUE number the delayer reads (one per namespace, so 0 everywhere)


class TopologyError(ValueError):
    """A lab that cannot be built as asked."""


@dataclass(frozen=True)
class Topology:
    prefix: str
    hosts: int
    delay_ms: float = 0.0
    jitter_ms: float = 0.0
    loss_pct: float = 0.0
    # One rate per host (None: unshaped); a single value applies to every host.
    rates: tuple[str | None, ...] = (None,)
    nat: frozenset[int] = field(default_factory=frozenset)

    def __post_init__(self) -> None:
        if not _PREFIX.fullmatch(self.prefix):
            raise TopologyError(f"prefix {self.prefix!r}: 1-8 lowercase letters or digits, a letter first")
        if not 1 <= self.hosts <= MAX_HOSTS:
            raise TopologyError(f"hosts: 1..{MAX_HOSTS}, not {self.hosts}")
        if self.delay_ms < 0 or self.jitter_ms < 0 or not 0 <= self.loss_pct <= 100:
            raise TopologyError("delay and jitter must be >= 0 and loss within 0..100 %")
        if len(self.rates) not in (1, self.hosts):
            raise TopologyError(f"give one rate or one per host ({self.hosts}), not {len(self.rates)}")
        for rate in self.rates:
            if rate is not None and not _RATE.fullmatch(rate):
                raise TopologyError(f"rate {rate!r}: a number and bit/kbit/mbit/gbit, e.g. 20mbit")
        if not self.nat <= set(range(1, self.hosts + 1)):
            raise TopologyError(f"NAT'd hosts {sorted(self.nat)} are not all within 1..{self.hosts}")

    # ------------------------------------------------------------------ names

    @property
    def hub(self) -> str:
        return f"{self.prefix}hub"

    def host_ns(self, host: int) -> str:
        self._check(host)
        return f"{self.prefix}h{host}"

    def router_ns(self, host: int) -> str:
        if host not in self.nat:
            raise TopologyError(f"host {host} is not behind a NAT router")
        return f"{self.prefix}r{host}"

    def namespaces(self) -> list[str]:
        """Every namespace of the lab, hosts and routers before the hub (the order to delete)."""
        names = [self.host_ns(i) for i in range(1, self.hosts + 1)]
        return names + [self.router_ns(i) for i in sorted(self.nat)] + [self.hub]

    def owns(self, namespace: str) -> bool:
        """Whether a namespace name is one this prefix's labs make (any size)."""
        return re.fullmatch(rf"{self.prefix}(hub|h\d+|r\d+)", namespace) is not None

    # -------------------------------------------------------------- addresses

    def addr(self, host: int) -> str:
        """The host's own address: where it listens."""
        self._check(host)
        return f"10.201.{host}.2" if host in self.nat else f"10.200.0.{host}"

    def seen_addr(self, host: int) -> str:
        """The address other hosts see its connections come from (its router's, if NAT'd)."""
        self._check(host)
        return f"10.200.0.{100 + host}" if host in self.nat else f"10.200.0.{host}"

    def rate(self, host: int) -> str | None:
        self._check(host)
        return self.rates[0] if len(self.rates) == 1 else self.rates[host - 1]

    @property
    def delayed(self) -> bool:
        return bool(self.delay_ms or self.jitter_ms or self.loss_pct)

    # --------------------------------------------------------------- commands

    def up_commands(self, *, netem: bool) -> list[list[str]]:
        """The commands that build the lab, in order (the delayers excepted: see delayer_command)."""
        hub = self.hub
        cmds = [["ip", "netns", "add", hub], ["ip", "-n", hub, "link", "set", "lo", "up"],
                ["ip", "-n", hub, "link", "add", "br0", "type", "bridge"],
                ["ip", "-n", hub, "link", "set", "br0", "up"]]
        for host in range(1, self.hosts + 1):
            cmds += self._host_commands(host, netem=netem)
        return cmds

    def delayer_command(self, host: int, python: str, script: str) -> list[str]:
        """The user-space delayer of one host (only without netem, only when delayed)."""
        return ["ip", "netns", "exec", self.host_ns(host), python, script, str(self.delay_ms),
                str(self.jitter_ms), str(self.loss_pct), str(DELAY_QUEUE)]

    def _host_commands(self, host: int, *, netem: bool) -> list[list[str]]:
        ns, hub, port = self.host_ns(host), self.hub, f"v{host}"
        cmds = [["ip", "netns", "add", ns], ["ip", "-n", ns, "link", "set", "lo", "up"]]
        if host in self.nat:
            router = self.router_ns(host)
            cmds += [
                ["ip", "netns", "add", router], ["ip", "-n", router, "link", "set", "lo", "up"],
                ["ip", "-n", hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", router],
                ["ip", "-n", hub, "link", "set", port, "master", "br0", "up"],
                ["ip", "-n", router, "addr", "add", f"{self.seen_addr(host)}/24", "dev", "eth0"],
                ["ip", "-n", router, "link", "set", "eth0", "up"],
                ["ip", "-n", router, "link", "add", "lan0", "type", "veth", "peer", "name", "eth0", "netns", ns],
                ["ip", "-n", router, "addr", "add", f"10.201.{host}.1/24", "dev", "lan0"],
                ["ip", "-n", router, "link", "set", "lan0", "up"],
                ["ip", "netns", "exec", router, "sysctl", "-qw", "net.ipv4.ip_forward=1"],
                ["ip", "netns", "exec", router, "iptables", "-t", "nat", "-A", "POSTROUTING", "-o", "eth0",
                 "-j", "MASQUERADE"],
                # A home router: replies to what the LAN opened pass, nothing else comes in.
                ["ip", "netns", "exec", router, "iptables", "-A", "FORWARD", "-i", "eth0", "-o", "lan0",
                 "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
                ["ip", "netns", "exec", router, "iptables", "-A", "FORWARD", "-i", "eth0", "-o", "lan0",
                 "-j", "DROP"],
                # Nor does the router itself answer them: without this its own kernel
                # sends a RST for every port it has no mapping on, which tears down the
                # half-open mapping of a simultaneous TCP open (hole punching).
                ["ip", "netns", "exec", router, "iptables", "-A", "INPUT", "-i", "eth0",
                 "-m", "conntrack", "--ctstate", "ESTABLISHED,RELATED", "-j", "ACCEPT"],
                ["ip", "netns", "exec", router, "iptables", "-A", "INPUT", "-i", "eth0", "-j", "DROP"],
                ["ip", "netns", "exec", router, "ethtool", "-K", "lan0", "tso", "off", "gso", "off", "gro", "off"],
                ["ip", "-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", "eth0"],
                ["ip", "-n", ns, "link", "set", "eth0", "up"],
                ["ip", "-n", ns, "route", "add", "default", "via", f"10.201.{host}.1"],
            ]
        else:
            cmds += [
                ["ip", "-n", hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns],
                ["ip", "-n", hub, "link", "set", port, "master", "br0", "up"],
                ["ip", "-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", "eth0"],
                ["ip", "-n", ns, "link", "set", "eth0", "up"],
            ]
        cmds += [["ip", "netns", "exec", ns, "ethtool", "-K", "eth0", "tso", "off", "gso", "off", "gro", "off"],
                 ["ip", "netns", "exec", hub, "ethtool", "-K", port, "tso", "off", "gso", "off", "gro", "off"]]
        rate = self.rate(host)
        if rate is not None:
            tbf = ["root", "tbf", "rate", rate, "burst", "32kb", "latency", "200ms"]
            cmds += [["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", "eth0", *tbf],
                     ["ip", "netns", "exec", hub, "tc", "qdisc", "add", "dev", port, *tbf]]
        if self.delayed:
            if netem:  # the hub port's egress is the host's ingress
                shape = ["delay", f"{self.delay_ms:g}ms", f"{self.jitter_ms:g}ms", "loss", f"{self.loss_pct:g}%"]
                cmds.append(["ip", "netns", "exec", hub, "tc", "qdisc", "replace", "dev", port, "root", "netem",
                             *shape, *(["rate", rate] if rate else [])])
            else:
                cmds.append(["ip", "netns", "exec", ns, "iptables", "-A", "INPUT", "-i", "eth0",
                             "-j", "NFQUEUE", "--queue-num", str(DELAY_QUEUE)])
        return cmds

    def _check(self, host: int) -> None:
        if not 1 <= host <= self.hosts:
            raise TopologyError(f"no host {host} in a lab of {self.hosts}")


def parse_rates(text: str | None) -> tuple[str | None, ...]:
    """`20mbit` or `20mbit,20mbit,-` (one per host, `-` unshaped) as Topology.rates."""
    if not text or text == "-":
        return (None,)
    return tuple(None if part == "-" else part for part in text.split(","))


def parse_hosts(text: str | None) -> frozenset[int]:
    """`3,4` as a set of host numbers."""
    if not text:
        return frozenset()
    try:
        return frozenset(int(part) for part in text.split(","))
    except ValueError as exc:
        raise TopologyError(f"host list {text!r}: numbers separated by commas") from exc
