"""tools/netlab builds what it says: the delay it is asked for, the rate, home routers
that let connections out and nothing in, and leaves nothing behind. Real namespaces,
real packets (root; `make test` installs the tools)."""

import os
import re
import subprocess
import sys
import time

import pytest

from netlab import Lab, Topology, down, has_netem
from netlab.lab import namespaces

# Labs of network namespaces, one test at a time (make test runs tests in parallel).
pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root"),
              pytest.mark.xdist_group("netns")]
PREFIX = f"t{os.getpid() % 100000}"  # this run's own labs: nobody else's are touched

# A TCP sink: accepts one connection, reads to EOF, prints the peer's address, bytes and seconds.
SINK = """
import socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind(("0.0.0.0", int(sys.argv[1]))); s.listen(1); print("listening", flush=True)
c, peer = s.accept(); start = time.monotonic(); n = 0
while chunk := c.recv(65536):
    n += len(chunk)
print(peer[0], n, time.monotonic() - start, flush=True)
"""
SOURCE = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[4]))
c.sendall(b"x" * int(sys.argv[3])); c.close()
"""


def sink(lab, host, port):
    proc = lab.popen(host, [sys.executable, "-c", SINK, str(port)], stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "listening"
    return proc


def send(lab, host, addr, port, size, timeout=5.0):
    return lab.run(host, [sys.executable, "-c", SOURCE, addr, str(port), str(size), str(timeout)],
                   capture_output=True, text=True, timeout=timeout + 30)


def rtt_ms(lab, src, dst) -> tuple[float, float]:
    """(min, avg) round trip by ping -U (user-to-user time: plain ping under-reports a delayer)."""
    out = lab.run(src, ["ping", "-U", "-c", "5", "-i", "0.2", lab.addr(dst)], capture_output=True, text=True).stdout
    low, avg = re.search(r"= ([\d.]+)/([\d.]+)/", out).groups()
    return float(low), float(avg)


def test_delay_on_ingress_makes_the_round_trip_twice_the_delay():
    with Lab(Topology(PREFIX, hosts=2)) as plain:
        near = rtt_ms(plain, 1, 2)
    with Lab(Topology(PREFIX, hosts=2, delay_ms=15)) as lab:
        assert lab.netem == has_netem(PREFIX)
        far = rtt_ms(lab, 1, 2)
        # TCP crosses the delayer too (queued on INPUT, where it does not throttle TCP).
        receiver = sink(lab, 2, 7000)
        assert send(lab, 1, lab.addr(2), 7000, 4 << 20, timeout=20).returncode == 0
        peer, size, _ = receiver.communicate(timeout=30)[0].split()
        assert (peer, int(size)) == (lab.addr(1), 4 << 20)
    assert near[1] < 5, near
    assert 30 <= far[0] and far[1] < 45, far  # 2 x 15 ms, plus the delayer's own few hundred us


def test_rate_limits_both_ways_per_host():
    mbit = 8
    with Lab(Topology(PREFIX, hosts=3, rates=(f"{mbit}mbit", None, None))) as lab:
        rates = {}
        for src, dst in ((1, 2), (2, 1), (2, 3)):  # host 1's upload, its download, an unshaped pair
            receiver = sink(lab, dst, 7001)
            assert send(lab, src, lab.addr(dst), 7001, 3 << 20, timeout=20).returncode == 0
            _, size, seconds = receiver.communicate(timeout=30)[0].split()
            rates[src, dst] = int(size) * 8 / float(seconds) / 1e6
    for pair in ((1, 2), (2, 1)):
        assert 0.7 * mbit < rates[pair] < 1.1 * mbit, rates
    assert rates[2, 3] > 5 * mbit, rates


def test_a_nat_router_lets_connections_out_and_nothing_in():
    with Lab(Topology(PREFIX, hosts=3, nat=frozenset({3}))) as lab:
        receiver = sink(lab, 1, 7002)  # out: host 3 dials a public host, seen as its router
        assert send(lab, 3, lab.addr(1), 7002, 1000).returncode == 0
        peer, size, _ = receiver.communicate(timeout=30)[0].split()
        assert (peer, size) == ("10.200.0.103", "1000")

        inside = sink(lab, 3, 7003)  # in: nobody reaches a server behind the router
        try:
            # The router's own address answers for itself (nothing listens there), the LAN
            # address has no route from outside: either way the server hears nothing.
            for src, addr in ((1, lab.seen_addr(3)), (1, lab.addr(3)), (2, lab.addr(3))):
                refused = send(lab, src, addr, 7003, 10, timeout=2.0)
                assert refused.returncode != 0
                assert re.search(r"refused|timed out|unreachable", refused.stderr), refused.stderr
        finally:
            inside.kill()
            heard = inside.communicate(timeout=10)[0]
        assert heard == "", heard  # no connection was ever accepted behind the router


def test_leaving_removes_the_namespaces_and_what_ran_in_them():
    other = f"u{os.getpid() % 100000}"
    with Lab(Topology(other, hosts=1)):
        with Lab(Topology(PREFIX, hosts=2, delay_ms=5)) as lab:
            orphan = lab.popen(2, ["sleep", "600"])  # a process its starter forgot
            delayers = [p.pid for p in lab._delayers]
            assert set(lab.topology.namespaces()) <= set(namespaces())
        assert orphan.wait(timeout=10) is not None
        assert not any(os.path.exists(f"/proc/{pid}") and _running(pid) for pid in delayers)
        assert not [ns for ns in namespaces() if lab.topology.owns(ns)]
        assert f"{other}h1" in namespaces()  # another prefix's lab is left alone
    assert down(other) == []


def test_a_lab_left_by_a_killed_run_is_removed_on_the_next_start():
    done = subprocess.run([sys.executable, "-m", "netlab", "up", "--prefix", PREFIX, "--hosts", "2",
                           "--delay-ms", "5"], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert done.returncode == 0, done.stderr
    assert {f"{PREFIX}h1", f"{PREFIX}h2", f"{PREFIX}hub"} <= set(namespaces())
    started = time.monotonic()
    with Lab(Topology(PREFIX, hosts=1)) as lab:  # a smaller lab of the same prefix
        assert sorted(ns for ns in namespaces() if lab.topology.owns(ns)) == [f"{PREFIX}h1", f"{PREFIX}hub"]
    assert time.monotonic() - started < 30
    assert not [ns for ns in namespaces() if lab.topology.owns(ns)]


def _running(pid: int) -> bool:
    try:
        return open(f"/proc/{pid}/stat").read().split(") ")[-1][:1] != "Z"
    except OSError:
        return False
