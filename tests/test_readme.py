"""The README's Python examples run as written.

Every ```python block of README.md is a complete program, or is marked as a
fragment of the text around it by an HTML comment on the line before its fence:

    <!-- fragment -->

Complete programs run here, each in a fresh interpreter in an empty directory
with kvtier from the wheel built from this tree (as a user gets it), and must exit 0 (they use small sizes so that they do). A program that needs
something this machine may lack says so instead (``<!-- needs: vllm -->``) and
is skipped, with the reason, when that is not importable. Fragments must at
least parse (top-level ``await`` allowed: they continue a program's body).

A program proves what its text claims: it asserts it, or the lines right after
its closing fence say what it prints, each checked as a whole line of its output:

    <!-- prints: 80 tokens: 64 from the store, compute from token 64 on -->
"""

from __future__ import annotations

import ast
import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from test_package import wheel  # noqa: F401 - the fixture: the wheel of this tree, installed outside it

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
MARK = re.compile(r"<!--\s*(fragment|needs:\s*([\w.,\s]+?))\s*-->\s*$")
PRINTS = re.compile(r"\n<!-- prints: (.*) -->$", re.M)


def printed(text: str, end: int) -> tuple[str, ...]:
    """The ``<!-- prints: ... -->`` lines right after a closing fence."""
    out = []
    while m := PRINTS.match(text, end):
        out.append(m[1])
        end = m.end()
    return tuple(out)


def blocks() -> list[tuple[int, str, str, tuple[str, ...], tuple[str, ...]]]:
    """(line, kind, code, needs, prints) per python block; kind is "program" or "fragment"."""
    text = README.read_text()
    out = []
    for m in FENCE.finditer(text):
        line = text.count("\n", 0, m.start()) + 1
        before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
        mark = MARK.search(before)
        kind, needs = "program", ()
        if mark is not None and mark[1] == "fragment":
            kind = "fragment"
        elif mark is not None:
            needs = tuple(n.strip() for n in mark[2].split(","))
        out.append((line, kind, m[1], needs, printed(text, m.end())))
    return out


BLOCKS = blocks()
PROGRAMS = [b for b in BLOCKS if b[1] == "program"]


def test_the_readme_has_programs_and_every_block_is_marked_or_runs() -> None:
    # A README whose examples are all fragments would pass the tests below vacuously.
    assert len(PROGRAMS) >= 8, [b[0] for b in BLOCKS]
    for line, kind, code, _, prints in BLOCKS:
        if kind == "fragment":
            ast.parse(code, filename=f"README.md:{line}")  # top-level await parses in 3.8+
            assert not prints, f"README.md:{line}: a fragment does not run; what it prints is never checked"
        else:
            tree = ast.parse(code, filename=f"README.md:{line}")
            asserts = any(isinstance(node, ast.Assert) for node in ast.walk(tree))
            assert asserts or prints, f"README.md:{line}: a program that neither asserts nor says what it prints"
            assert "asyncio.run(" in code or "anyio.run(" in code or "await " not in code, (
                f"README.md:{line}: a program with await must run its coroutine; mark it <!-- fragment --> otherwise"
            )


@pytest.mark.parametrize(("line", "code", "needs", "prints"), [(b[0], b[2], b[3], b[4]) for b in PROGRAMS],
                         ids=[f"README.md:{b[0]}" for b in PROGRAMS])
def test_a_readme_program_runs_as_written(
    line: int, code: str, needs: tuple[str, ...], prints: tuple[str, ...], tmp_path: Path,
    wheel: tuple[Path, Path],
) -> None:
    missing = [n for n in needs if importlib.util.find_spec(n) is None]
    if missing:
        pytest.skip(f"README.md:{line} needs {', '.join(missing)}")
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(wheel[1]), "OMP_NUM_THREADS": "1"}  # the installed wheel, not the tree
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, f"README.md:{line} exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    lines = [s.rstrip() for s in out.stdout.splitlines()]
    for want in prints:
        assert want in lines, f"README.md:{line} says it prints {want!r}; it printed:\n{out.stdout[-2000:]}"


SERVE = re.compile(r"^vllm serve MODEL --kv-transfer-config '(.*?)'$", re.S | re.M)


def test_the_vllm_serve_lines_say_what_the_python_configuration_says() -> None:
    """docs/vllm.md's KVTransferConfig(...) block, evaluated, equals the JSON of
    every `vllm serve --kv-transfer-config` line in it and in the README."""
    doc = (ROOT / "docs" / "vllm.md").read_text()
    call = next(
        node for m in FENCE.finditer(doc) for node in ast.walk(ast.parse(m[1]))
        if isinstance(node, ast.Call) and getattr(node.func, "id", "") == "KVTransferConfig"
    )
    python = {k.arg: eval(compile(ast.Expression(k.value), "docs/vllm.md", "eval"), {}) for k in call.keywords}
    lines = SERVE.findall(doc) + SERVE.findall(README.read_text())
    assert len(lines) == 2, lines
    for line in lines:
        assert json.loads(line) == python
    try:  # `vllm` may resolve to tests/vllm, a namespace package, where vLLM is not installed
        from vllm.config import KVTransferConfig
    except ImportError:
        return
    KVTransferConfig(**json.loads(lines[0]))
