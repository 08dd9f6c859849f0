"""Every command the README and the docs show still works: each ``lightning-drafts`` line parses with the
installed parser (``fit`` / ``validate`` through LightningCLI with ``--print_config``, the others through
their argparse parser), each script a ``python`` line runs exists, and each Python block runs.

The quickstart commands themselves run in ``tests/cli/test_command.py``; the notebook block (marked
``<!-- notebook-example -->``) in ``tests/cli/test_notebook.py``.
"""

from __future__ import annotations

import contextlib
import io
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from lightning_drafts.cli.main import ARGPARSE_COMMANDS, SUBCOMMANDS, argparse_parser, run_cli

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
FENCE = re.compile(r"^(<!-- notebook-example -->\n)?```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
# Subcommands that read config overrides (dotted options) beside their own.
TAKES_OVERRIDES = {"capture", "evaluate", "regenerate"}


@dataclass(frozen=True)
class Block:
    page: str
    language: str
    text: str
    notebook: bool


def blocks() -> list[Block]:
    found = []
    for page in PAGES:
        for match in FENCE.finditer(page.read_text()):
            found.append(
                Block(str(page.relative_to(ROOT)), match.group(2), match.group(3), bool(match.group(1)))
            )
    return found


def shell_commands() -> list[tuple[str, list[str]]]:
    """``(page, argv)`` of every command of the shell blocks: continuation lines joined, comments dropped,
    ``&&`` chains split."""
    commands = []
    for block in blocks():
        if block.language not in ("bash", "sh", "shell"):
            continue
        for line in block.text.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if words:
                    commands.append((block.page, words))
    return commands


def lightning_drafts_commands() -> list[tuple[str, list[str]]]:
    """The arguments after ``lightning-drafts`` (or ``-m lightning_drafts``), de-duplicated."""
    found: dict[tuple[str, ...], str] = {}
    for page, words in shell_commands():
        starts = [0] if words[0] == "lightning-drafts" else []
        starts += [i for i in range(1, len(words)) if words[i] == "lightning_drafts" and words[i - 1] == "-m"]
        if starts:
            found.setdefault(tuple(words[starts[0] + 1 :]), page)
    return [(page, list(args)) for args, page in found.items()]


COMMANDS = lightning_drafts_commands()


def test_the_docs_show_every_subcommand():
    shown = {args[0] for _, args in COMMANDS if args}
    assert set(SUBCOMMANDS) <= shown, f"no page shows {sorted(set(SUBCOMMANDS) - shown)}"


@pytest.mark.parametrize(("page", "args"), COMMANDS, ids=[" ".join(a)[:80] for _, a in COMMANDS])
def test_a_documented_command_parses(page, args):
    command, rest = args[0], args[1:]
    assert command in SUBCOMMANDS, f"{page}: lightning-drafts {command!r} is no subcommand"
    where = f"{page}: lightning-drafts {shlex.join(args)}"
    if command in ARGPARSE_COMMANDS:
        parser = argparse_parser(command)
        with _parse_errors(where):
            if command in TAKES_OVERRIDES:
                _, extra = parser.parse_known_args(rest)
                bad = [word for word in extra if word.startswith("-") and "." not in word.split("=")[0]]
                assert not bad, f"{where}: {bad} are neither its options nor config overrides"
            else:
                parser.parse_args(rest)
        return
    out, argv = io.StringIO(), sys.argv
    sys.argv = ["lightning-drafts"]
    try:
        with contextlib.redirect_stdout(out), pytest.raises(SystemExit) as exit_:
            run_cli([command, *rest, "--print_config"])
    finally:
        sys.argv = argv
    assert exit_.value.code in (0, None), f"{where}: exit {exit_.value.code}"
    assert "model:" in out.getvalue() and "trainer:" in out.getvalue(), f"{where} printed no config"


@contextlib.contextmanager
def _parse_errors(where: str):
    stderr = io.StringIO()
    try:
        with contextlib.redirect_stderr(stderr):
            yield
    except SystemExit as error:
        pytest.fail(f"{where}: {stderr.getvalue().strip() or error}")


def test_every_script_the_docs_run_exists():
    scripts = set()
    for page, words in shell_commands():
        for i, word in enumerate(words):
            if (
                word in ("python", "python3", "bash")
                and i + 1 < len(words)
                and not words[i + 1].startswith("-")
            ):
                scripts.add((page, words[i + 1]))
    assert scripts, "the docs run no script"
    missing = [f"{page}: {script}" for page, script in sorted(scripts) if not (ROOT / script).is_file()]
    assert not missing, missing


PYTHON = [b for b in blocks() if b.language == "python" and not b.notebook]


@pytest.mark.parametrize("block", PYTHON, ids=[f"{b.page}:{i}" for i, b in enumerate(PYTHON)])
def test_a_documented_python_block_runs(block, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    exec(compile(block.text, block.page, "exec"), {"__name__": "__docs__"})
