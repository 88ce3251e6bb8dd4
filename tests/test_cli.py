"""The command line: `kvtier --help` lists every command with its line,
`--version` prints the package's version, a wrong command is refused."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import kvtier
from kvtier.__main__ import COMMANDS, main

ROOT = Path(__file__).resolve().parent.parent


def test_help_lists_every_command_with_its_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines to the terminal
    assert out.startswith("usage: kvtier [-h] [--version] COMMAND ...")
    assert set(COMMANDS) == {"demo", "bench"}
    for name, (line, _) in COMMANDS.items():
        assert f"{name} {line}" in out


def test_version_is_the_packages() -> None:
    out = subprocess.run([sys.executable, "-m", "kvtier", "--version"], capture_output=True, text=True, cwd=ROOT,
                         timeout=60, check=True)
    assert out.stdout == f"kvtier {kvtier.__version__}\n"


def test_no_command_or_an_unknown_one_is_refused(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: kvtier" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_:
        main(["serve"])
    assert exit_.value.code == 2
    assert "argument COMMAND: invalid choice: 'serve' (choose from" in capsys.readouterr().err


def test_a_commands_help_is_its_own(capsys: pytest.CaptureFixture[str]) -> None:
    for name, option in (("demo", "--concurrency"), ("bench", "--check")):
        with pytest.raises(SystemExit) as exit_:
            main([name, "--help"])
        assert exit_.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith(f"usage: kvtier {name} ") and option in out


def test_the_demos_help_shows_every_default(capsys: pytest.CaptureFixture[str]) -> None:
    from kvtier.demo import Options

    with pytest.raises(SystemExit):
        main(["demo", "--help"])
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps lines to the terminal
    d = Options()
    for option, value in (("--requests", d.requests), ("--concurrency", d.concurrency),
                          ("--pages-per-request", d.pages_per_request), ("--page-size", d.page_size),
                          ("--layout", d.layout), ("--v4-page-size", d.v4_page_size), ("--host-ratio", d.host_ratio),
                          ("--seed", d.seed), ("--storage", d.storage), ("--prompts", d.prompts)):
        assert f"(default: {value})" in out, option
    assert "(default: start a throwaway redis- server)" in out or "(default: start a throwaway redis-server)" in out
