"""The README's Python examples, and those of the pages under docs/, run as written.

Every ```python block of README.md and of docs/*.md (docs/deepseek_v4.md's run
in tests/test_presets.py) is a complete program, or a fragment of the text
around it, which a reader sees: its first line says so,

    # Fragment: part of an engine's code, not a whole program.

Complete programs run here, each in a fresh interpreter in an empty directory
with kvtier from the wheel built from this tree (as a user gets it), and must
exit 0 (they use small sizes so that they do); they also pass `mypy --strict`
against that wheel, as an engine author's code would. A program that needs
something this machine may lack says so instead (``<!-- needs: vllm -->`` on
the line before its fence) and is skipped, with the reason, when that is not
importable. Fragments must at least parse (top-level ``await`` allowed: they
continue a program's body).

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
PAGES = [README, *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "deepseek_v4.md")]
FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
MARK = re.compile(r"<!--\s*needs:\s*([\w.,\s]+?)\s*-->\s*$")
FRAGMENT = "# Fragment"
PRINTS = re.compile(r"\n<!-- prints: (.*) -->$", re.M)


def printed(text: str, end: int) -> tuple[str, ...]:
    """The ``<!-- prints: ... -->`` lines right after a closing fence."""
    out = []
    while m := PRINTS.match(text, end):
        out.append(m[1])
        end = m.end()
    return tuple(out)


def blocks() -> list[tuple[str, str, str, tuple[str, ...], tuple[str, ...]]]:
    """(where, kind, code, needs, prints) per python block of every page; kind is
    "program" or "fragment", where is "README.md:LINE" or "docs/PAGE.md:LINE"."""
    out = []
    for page in PAGES:
        text = page.read_text()
        name = page.relative_to(ROOT).as_posix()
        for m in FENCE.finditer(text):
            line = text.count("\n", 0, m.start()) + 1
            before = text[: m.start()].rstrip("\n").rsplit("\n", 1)[-1]
            mark = MARK.search(before)
            kind = "fragment" if m[1].startswith(FRAGMENT) else "program"
            needs = tuple(n.strip() for n in mark[1].split(",")) if mark is not None else ()
            out.append((f"{name}:{line}", kind, m[1], needs, printed(text, m.end())))
    return out


BLOCKS = blocks()
PROGRAMS = [b for b in BLOCKS if b[1] == "program"]


def test_the_readme_has_programs_and_every_block_is_marked_or_runs() -> None:
    # Pages whose examples are all fragments would pass the tests below vacuously.
    assert len(PROGRAMS) >= 10, [b[0] for b in BLOCKS]
    assert sum(b[0].startswith("README.md:") for b in PROGRAMS) >= 2
    for where, kind, code, needs, prints in BLOCKS:
        if kind == "fragment":
            ast.parse(code, filename=where)  # top-level await parses in 3.8+
            assert not prints, f"{where}: a fragment does not run; what it prints is never checked"
            assert not needs, f"{where}: a fragment does not run; it needs nothing"
        else:
            tree = ast.parse(code, filename=where)
            asserts = any(isinstance(node, ast.Assert) for node in ast.walk(tree))
            assert asserts or prints, f"{where}: a program that neither asserts nor says what it prints"
            assert "asyncio.run(" in code or "anyio.run(" in code or "await " not in code, (
                f"{where}: a program with await must run its coroutine; start it with a {FRAGMENT} line otherwise"
            )


# What kvtier itself requires (pyproject's dependencies): a program may import these
# without a marker; anything else outside the standard library is named in its
# `<!-- needs: ... -->` line, so that a machine without it skips the program
# instead of failing it.
REQUIRED = {"kvtier", "torch", "anyio", "numpy", "xxhash"}


def test_a_program_that_imports_an_optional_package_says_it_needs_it() -> None:
    unmarked = []
    for where, kind, code, needs, _ in PROGRAMS:
        for node in ast.walk(ast.parse(code, filename=where)):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {n.split(".")[0] for n in names}:
                if top not in REQUIRED and top not in sys.stdlib_module_names and top not in needs:
                    unmarked.append(f"{where} imports {top} without <!-- needs: {top} -->")
    assert not unmarked, unmarked


def test_fragment_markers_are_visible() -> None:
    """A marker in an HTML comment is invisible to a reader: a block that is not
    a whole program says so in its own first line."""
    for page in [*PAGES, ROOT / "docs" / "deepseek_v4.md"]:
        assert "<!-- fragment" not in page.read_text(), f"{page.name}: an invisible fragment marker"


@pytest.mark.parametrize(("where", "code", "needs", "prints"), [(b[0], b[2], b[3], b[4]) for b in PROGRAMS],
                         ids=[b[0] for b in PROGRAMS])
def test_a_readme_program_runs_as_written(
    where: str, code: str, needs: tuple[str, ...], prints: tuple[str, ...], tmp_path: Path,
    wheel: tuple[Path, Path],
) -> None:
    missing = [n for n in needs if importlib.util.find_spec(n) is None]
    if missing:
        pytest.skip(f"{where} needs {', '.join(missing)}")
    script = tmp_path / "example.py"
    script.write_text(code)
    env = {**os.environ, "PYTHONPATH": str(wheel[1]), "OMP_NUM_THREADS": "1"}  # the installed wheel, not the tree
    out = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, f"{where} exited {out.returncode}:\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    lines = [s.rstrip() for s in out.stdout.splitlines()]
    for want in prints:
        assert want in lines, f"{where} says it prints {want!r}; it printed:\n{out.stdout[-2000:]}"


# mypy reads torch's own annotations in full: 316 s on a 2-core machine at load
# average 9 with torch 2.14.1+cu130. The limit is its subprocess's, not the
# suite's 120 s (a slow machine is not a failed check).
@pytest.mark.build
@pytest.mark.timeout(900)
def test_the_programs_pass_strict_mypy_against_the_wheel(tmp_path: Path, wheel: tuple[Path, Path]) -> None:
    """Engine authors type-check their code: every complete program passes
    `mypy --strict` with kvtier read from the installed wheel (its py.typed)."""
    pytest.importorskip("mypy")
    files = {}
    for i, (where, _, code, _, _) in enumerate(PROGRAMS):
        path = tmp_path / f"program_{i}.py"
        path.write_text(code)
        files[path.name] = where
    env = {**os.environ, "MYPYPATH": str(wheel[1])}
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "--ignore-missing-imports", "--no-incremental",
         "--python-version", "3.10", *sorted(files)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600, check=False,
    )
    errors = "\n".join(
        f"{files.get(line.split(':', 1)[0], '?')}: {line}" for line in out.stdout.splitlines() if ": error:" in line
    )
    assert out.returncode == 0, errors or out.stdout + out.stderr


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
