"""A fork server for the node processes tests start.

Starting `python -m compushare node` costs about 3 s of CPU before the node does
anything: importing torch, transformers and py-libp2p. Integration tests start a
hundred and more nodes, so on a 2-core machine that import was the largest part of
`make test`. The server imports all of it once, then forks one process per node: each
is still a separate process with its own pid, session, log and environment, running
`compushare node` as the console command does, from the point where the imports are
done. `COMPUSHARE_TEST_FORK=0` starts every node with a plain exec instead.

Run as a script, this file is the server (JSON lines on stdin and stdout); imported,
`spawn` starts a node through the worker's server and returns a Popen-like handle.
"""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import sys
import threading
from pathlib import Path

ENABLED = os.environ.get("COMPUSHARE_TEST_FORK", "1") != "0"


# -- the server (its own process) -----------------------------------------------------

def _serve() -> None:
    from compushare.gc_policy import pause_during_startup

    pause_during_startup()  # as `compushare`'s main() does while it imports
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # a Ctrl-C meant for the tests is not for it
    import compushare.app.cli as cli
    import compushare.app.node  # noqa: F401  torch, transformers, libp2p: the expensive part

    if threading.active_count() != 1:  # forking would leave a thread's locks behind in the child
        raise SystemExit(f"fork server: {threading.active_count()} threads after the imports")
    requests, replies = sys.stdin.buffer, sys.stdout.buffer
    exits: dict[int, int] = {}
    for line in requests:
        request = json.loads(line)
        _reap(exits)
        if request["op"] == "spawn":
            pid = os.fork()
            if pid == 0:
                _child(cli, request)  # never returns
            reply = {"pid": pid}
        else:  # "poll"; with "reap", the child has ended: wait for its status
            pid = request["pid"]
            if request.get("reap") and pid not in exits:
                exits[pid] = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
            reply = {"returncode": exits.get(pid)}
        replies.write(json.dumps(reply).encode() + b"\n")
        replies.flush()


def _reap(exits: dict[int, int]) -> None:
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        exits[pid] = os.waitstatus_to_exitcode(status)


def _child(cli, request: dict) -> None:
    code = 1
    try:
        os.setsid()  # as start_node's start_new_session: its own session and process group
        log = os.open(request["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.close(null)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        signal.signal(signal.SIGINT, signal.default_int_handler)
        sys.argv = request["argv"]
        try:
            cli.main()
            code = 0
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


# -- the client (in the test process) -------------------------------------------------

class Forked:
    """A node forked by the server: the parts of subprocess.Popen that tests use."""

    def __init__(self, server: _Server, pid: int, args: list[str]) -> None:
        self._server, self.pid, self.args, self.returncode = server, pid, args, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self._server.returncode(self.pid)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.poll() is None:
            try:  # not our child: a pidfd becomes readable when the process ends
                pidfd = os.pidfd_open(self.pid)
            except ProcessLookupError:  # ended and reaped by the server already
                pidfd = None
            if pidfd is not None:
                try:
                    if not select.select([pidfd], [], [], timeout)[0]:
                        raise subprocess.TimeoutExpired(self.args, timeout)
                finally:
                    os.close(pidfd)
            self.returncode = self._server.returncode(self.pid, reap=True)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class _Server:
    def __init__(self) -> None:
        self._lock = threading.Lock()  # tests start nodes from trio's worker threads too
        self._proc: subprocess.Popen | None = None

    def _call(self, request: dict) -> dict:
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                # The trailing words are for the children, which inherit the command line:
                # tools recognise a node process by it (app/swarm.is_our_node).
                self._proc = subprocess.Popen([sys.executable, __file__, "compushare", "node"], stdin=subprocess.PIPE,
                                              stdout=subprocess.PIPE, cwd=Path(__file__).parent,
                                              start_new_session=True)
            self._proc.stdin.write(json.dumps(request).encode() + b"\n")
            self._proc.stdin.flush()
            line = self._proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the fork server exited with {self._proc.wait()}")
        return json.loads(line)

    def spawn(self, cmd: list[str], log: Path) -> Forked:
        argv = ["compushare"] + cmd[cmd.index("compushare") + 1:]  # after `python -m compushare`
        pid = self._call({"op": "spawn", "argv": argv, "env": dict(os.environ), "cwd": os.getcwd(),
                          "log": str(log)})["pid"]
        return Forked(self, pid, cmd)

    def returncode(self, pid: int, *, reap: bool = False) -> int | None:
        return self._call({"op": "poll", "pid": pid, "reap": reap})["returncode"]

    def close(self) -> None:
        with self._lock:
            if self._proc is not None:
                self._proc.stdin.close()
                self._proc.wait(timeout=30)
                self._proc = None


SERVER = _Server()


def spawn(cmd: list[str], data_dir: Path):
    """What app.swarm.start_node does for `cmd` (`python -m compushare node ...`), forked
    from the server; a plain start_node where forking is off or `cmd` is another command."""
    from compushare.app.swarm import start_node
    from compushare.config import STATE_FILE

    if not ENABLED or cmd[:3] != [sys.executable, "-m", "compushare"] or cmd[3] != "node":
        return start_node(cmd, data_dir)
    data_dir.mkdir(parents=True, exist_ok=True)
    (data_dir / STATE_FILE).unlink(missing_ok=True)
    return SERVER.spawn(cmd, data_dir / "node.log")


if __name__ == "__main__":
    _serve()
