"""Every command's --help at 80 columns reads as written: the command tree is walked,
so a new command is checked without being named here."""

from __future__ import annotations

import inspect
import re

import pytest
import typer
from typer.testing import CliRunner

from compushare.app.cli import app

pytestmark = pytest.mark.unit

WIDTH = 80
SLACK = 10  # a line this much shorter than the width, that ended where the source line did, was not forced to
ENV = {"COLUMNS": str(WIDTH), "NO_COLOR": "1", "TERM": "dumb", "FORCE_COLOR": None, "PY_COLORS": None}


def _walk(command, path=()):
    """(path, command) for the root and every command and sub-command, hidden ones too."""
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _walk(sub, (*path, name))


COMMANDS = list(_walk(typer.main.get_command(app)))


def _paragraphs(text: str | None) -> list[str]:
    """The paragraphs of a docstring or help= string, each with its source line breaks."""
    text = inspect.cleandoc(text or "").partition("\f")[0]
    return [p.strip("\n") for p in re.split(r"\n\s*\n", text) if p.strip()]


def _flat(text: str) -> str:
    """Whitespace and panel borders collapsed (a word broken at its hyphen joined again)."""
    return re.sub(r"-\s+", "-", " ".join(re.sub(r"[│╭╮╰╯─]", " ", text).split()))


def _shown(command) -> list[str]:
    """The source texts `command`'s help shows: its own, its visible options' and arguments',
    and the first paragraph of each visible sub-command's."""
    texts = [command.help or ""] + [p.help or "" for p in command.params if not getattr(p, "hidden", False)]
    subs = [sub for sub in getattr(command, "commands", {}).values() if not sub.hidden]
    return [p for text in texts for p in _paragraphs(text)] + [_paragraphs(sub.short_help or sub.help)[0]
                                                               for sub in subs if sub.short_help or sub.help]


def _help(path) -> str:
    result = CliRunner().invoke(app, [*path, "--help"], env=ENV, terminal_width=WIDTH, color=False)
    assert result.exit_code == 0, result.output
    return re.sub(r"\x1b\[[0-9;]*[A-Za-z]", "", result.output)


def _unforced_breaks(paragraph: str, output: str) -> list[str]:
    """Output lines that end where a source line of `paragraph` did although the next word fitted."""
    rows = [line.rstrip(" │") for line in output.splitlines()]
    words = [row.replace("│", " ").split() for row in rows]
    found = []
    lines = paragraph.splitlines()
    for before, after in zip(lines, lines[1:]):
        last, first = before.split()[-1], after.split()[0]
        found += [rows[i] for i in range(len(rows) - 1)
                  if words[i][-1:] == [last] and words[i + 1][:1] == [first]
                  and len(rows[i]) + 1 + len(first) <= WIDTH - SLACK]
    return found


@pytest.mark.parametrize("path, command", COMMANDS, ids=[" ".join(p) or "compushare" for p, _ in COMMANDS])
def test_help_reads_as_written(path, command):
    output = _help(path)
    assert [line for line in output.splitlines() if len(line) > WIDTH] == []
    flat = _flat(output)
    for paragraph in _shown(command):
        for bracketed in re.findall(r"\[[^\[\]]*\]", paragraph):
            assert _flat(bracketed) in flat, f"{bracketed!r} lost (read as markup?)"
        assert _flat(paragraph) in flat, f"not shown whole and in order: {paragraph!r}"
        assert _unforced_breaks(paragraph, output) == [], "broken where the source line was, not at the width"
    assert "<bool>" not in output
    for option in command.params:
        if getattr(option, "is_flag", False) and not option.hidden:
            for name in (*option.opts, *option.secondary_opts):
                pattern = re.escape(name) + r"(?![\w-])(?:[\s,/|]+-{1,2}[\w-]+)*\s+<[^>]*>"
                assert not re.search(pattern, output), f"flag {name} shown with a metavar"
