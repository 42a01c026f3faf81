"""Ctrl-C where people press it: in `compushare run` and in a `compushare chat`
reply, while the swarm (the real SmolLM2 on 3 node processes) serves other sessions.
Marked serial: it bounds seconds, so `make test` runs it with nothing else running."""

import contextlib
import re
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from helpers import chat_at_a_terminal

pytestmark = [pytest.mark.slow, pytest.mark.serial]


def _cli(*args):
    return [sys.executable, "-m", "compushare", *args]


def _first_output(proc: subprocess.Popen, timeout: float = 120) -> bytes:
    """The first byte `proc` writes to its stdout (it has started answering)."""
    ready, _, _ = select.select([proc.stdout], [], [], timeout)
    assert ready, f"no output within {timeout:.0f} s"
    first = proc.stdout.read(1)
    assert first, f"exited with {proc.wait(timeout=10)} before answering"
    return first


# A consumer that streams 1,000 tokens whatever the model says (no stop at EOS).
LOADER = """
import sys, trio
from pathlib import Path
from compushare.pipeline.client.consumer import RunRequest, run_prompt
from compushare.pipeline.client.sampling import SamplingParams

def out(text):
    sys.stdout.write(text)
    sys.stdout.flush()

trio.run(lambda: run_prompt(Path(sys.argv[1]), tuple(sys.argv[2:]), RunRequest(
    model="smollm2-135m", prompt="Write a very long story about a castle.",
    params=SamplingParams(max_new_tokens=1000, stop_at_eos=False)), on_text=out))
"""


@contextlib.contextmanager
def _two_other_sessions(swarm: dict, tmp_path: Path):
    """Two long generations by other consumers, streaming through the whole swarm."""
    logs = [(tmp_path / f"load{i}.log").open("wb") for i in range(2)]
    loaders = [subprocess.Popen([sys.executable, "-c", LOADER, str(tmp_path / f"load{i}"), *swarm["bootstrap"]],
                                stdout=subprocess.PIPE, stderr=log) for i, log in enumerate(logs)]
    try:
        for proc in loaders:
            _first_output(proc)
        yield loaders
    finally:
        for proc in loaders:
            if proc.poll() is None:
                proc.kill()
            proc.wait(timeout=10)
        for log in logs:
            log.close()


def test_ctrl_c_stops_run_and_a_chat_reply_at_once_while_two_other_sessions_load_the_swarm(smol_swarm, tmp_path):
    """SIGINT to `compushare run` mid-answer: it exits (130) within 2 s, leaving no
    process behind; Ctrl-C in `compushare chat` mid-reply: the reply stops within 1 s
    and not a character more of it is shown. Meanwhile two other consumers stream
    long generations through the same servers, which go on unharmed."""
    home, swarm = smol_swarm
    with _two_other_sessions(swarm, tmp_path) as loaders:
        proc = subprocess.Popen(
            _cli("run", "--home", str(tmp_path / "cli"), "--swarm-home", str(home), "--max-tokens", "1000",
                 "Write a very long story about a dragon."),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        )
        try:
            _first_output(proc)  # generation has started
            children = psutil.Process(proc.pid).children(recursive=True)
            began = time.monotonic()
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=30)
            run_exit_s = time.monotonic() - began
            assert proc.returncode == 130, proc.stderr.read().decode()[-3000:]
            assert not psutil.pid_exists(proc.pid) or psutil.Process(proc.pid).status() == psutil.STATUS_ZOMBIE
            for child in children:
                assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=5)

        with chat_at_a_terminal(tmp_path / "chat", swarm["bootstrap"][0], "--max-tokens", "1000",
                                home=tmp_path / "home") as child:
            story = "Write a very long story about a dragon who learns to cook."
            child.sendline(story)
            child.expect_exact(story)  # the echo (see the REPL test in test_smollm2.py)
            child.expect(r"\w+ \w+ \w+")  # the reply is streaming
            began = time.monotonic()
            child.sendintr()
            child.expect_exact("[reply cancelled]")
            chat_stop_s = time.monotonic() - began
            child.expect_exact(">>> ")
            assert not re.sub(r"\x1b\[[0-9;?]*[a-zA-Z]", "", child.before).strip()  # nothing more of the reply
        print(f"Ctrl-C: run exited after {run_exit_s:.2f} s, the chat reply stopped after {chat_stop_s:.2f} s")
        assert run_exit_s < 2.0
        assert chat_stop_s < 1.0
        assert all(loader.poll() is None for loader in loaders)  # the other sessions went on
    for node in swarm["nodes"]:  # the swarm is unharmed: every node is still up
        assert psutil.pid_exists(node["pid"])
