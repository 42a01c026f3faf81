"""A lab by hand (root):

    python -m netlab up --prefix nl --hosts 4 --delay-ms 20 --rate 20mbit --nat 3,4
    python -m netlab exec --prefix nl --host 1 -- ping -U -c 3 10.200.0.2
    python -m netlab down --prefix nl

`up` leaves the lab running (with its delayers) until `down`, which needs only the prefix.
Run with tools/ on PYTHONPATH, or from tools/.
"""

from __future__ import annotations

import argparse
import os
import sys

from .lab import Lab, LabError, down
from .topology import Topology, TopologyError, parse_hosts, parse_rates


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m netlab", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="build a lab and leave it running")
    up.add_argument("--hosts", type=int, required=True)
    up.add_argument("--delay-ms", type=float, default=0.0, help="added on each host's ingress (RTT ~ 2x)")
    up.add_argument("--jitter-ms", type=float, default=0.0)
    up.add_argument("--loss-pct", type=float, default=0.0)
    up.add_argument("--rate", default=None, help="20mbit, or one per host: 20mbit,20mbit,- (- unshaped)")
    up.add_argument("--nat", default=None, help="hosts behind their own NAT router, e.g. 3,4")
    run = sub.add_parser("exec", help="run a command in a host of a running lab")
    run.add_argument("--host", type=int, required=True)
    run.add_argument("argv", nargs=argparse.REMAINDER)
    remove = sub.add_parser("down", help="remove a lab and stop what runs in it")
    for command in (up, run, remove):
        command.add_argument("--prefix", default="nl", help="names of the lab's namespaces (default nl)")
    args = parser.parse_args(argv)
    try:
        if args.command == "down":
            removed = down(args.prefix)
            print(f"removed {len(removed)} namespaces: {' '.join(removed) or '-'}")
            return 0
        if args.command == "exec":
            cmd = args.argv[1:] if args.argv[:1] == ["--"] else args.argv
            ns = Topology(args.prefix, hosts=args.host).host_ns(args.host)
            os.execvp("ip", ["ip", "netns", "exec", ns, *cmd])
        topology = Topology(args.prefix, hosts=args.hosts, delay_ms=args.delay_ms, jitter_ms=args.jitter_ms,
                            loss_pct=args.loss_pct, rates=parse_rates(args.rate), nat=parse_hosts(args.nat))
        lab = Lab(topology).__enter__()
        lab.detach()
        for host in range(1, topology.hosts + 1):
            nat = f" behind {topology.router_ns(host)}, seen as {topology.seen_addr(host)}" if host in topology.nat else ""
            print(f"{topology.host_ns(host)}  {topology.addr(host)}{nat}")
        return 0
    except (LabError, TopologyError) as exc:
        print(f"netlab: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
