"""app/progress.py: plain lines (one per tenth) off a terminal, a rich bar only while
bytes move on one, nothing with enabled=False; and a long import shows it."""

from __future__ import annotations

import io
import threading

import pytest
from rich.console import Console

from compushare.app.progress import Progress, plain_line

pytestmark = pytest.mark.unit


def _console(terminal: bool) -> Console:
    return Console(file=io.StringIO(), force_terminal=terminal, width=100, color_system=None)


def test_off_a_terminal_one_line_per_tenth():
    console = _console(False)
    with Progress(console=console) as shown:
        shown.stage("fetching blocks 0:4 of abc")
        for done in range(0, 1001, 7):
            shown.update(done, 1000)
        shown.update(1000, 1000)
    lines = console.file.getvalue().splitlines()
    assert lines[0] == "fetching blocks 0:4 of abc ..."
    assert [line.split(": ")[1].split("%")[0] for line in lines[1:]] == [str(10 * i) for i in range(1, 11)]
    assert all(line.startswith("fetching blocks 0:4 of abc: ") and " of 1.0 kB" in line for line in lines[1:])


def test_a_new_stage_counts_afresh_and_nothing_to_do_says_nothing():
    console = _console(False)
    with Progress(console=console) as shown:
        shown.update(5, 0)  # total 0: nothing to fetch
        shown.stage("converting")
        shown.update(10, 10)
        shown.stage("writing")
        shown.update(5, 10)
    lines = console.file.getvalue().splitlines()
    assert [line.split(" (")[0] for line in lines] == ["converting ...", "converting: 100%", "writing ...",
                                                       "writing: 50%"]


def test_plain_line_says_rate_and_time_left():
    assert plain_line("fetching x", 12_000_000, 30_000_000, 3.0) == \
        "fetching x: 40% (12.0 MB of 30.0 MB, 4.0 MB/s, 4 s left)"
    assert plain_line("x", 3_000_000_000, 3_000_000_000, 1.0) == "x: 100% (3.00 GB of 3.00 GB, 3.00 GB/s)"


def test_on_a_terminal_a_bar_lives_only_while_bytes_move():
    console = _console(True)
    shown = Progress(console=console)
    shown.stage("fetching the head of abc")
    shown.update(0, 1000)
    assert shown._bar is not None  # noqa: SLF001
    worker = threading.Thread(target=shown.update, args=(500, 1000))  # updates may come from threads
    worker.start()
    worker.join()
    shown.update(1000, 1000)
    assert shown._bar is None  # noqa: SLF001  done: the terminal is free for what follows
    shown.update(1000, 1000)
    assert shown._bar is None  # noqa: SLF001
    text = console.file.getvalue()
    assert "fetching the head of abc" in text and "1.0/1.0 kB" in text


def test_disabled_shows_nothing_and_for_step_names_its_step_once():
    console = _console(False)
    quiet = Progress(console=console, enabled=False)
    quiet.stage("x")
    quiet.update(5, 10)
    assert console.file.getvalue() == ""
    shown = Progress(console=console)
    step = shown.for_step("fetching y")
    step(0, 10)
    step(10, 10)
    assert console.file.getvalue().splitlines()[0] == "fetching y ..."
    assert console.file.getvalue().count("fetching y ...") == 1
