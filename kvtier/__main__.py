"""Command line: ``python -m kvtier demo [options]`` and ``python -m kvtier bench [options]``.

The demo is ``examples/serving_loop.py`` of a source checkout (what ``make demo``
runs); it is an example to read and copy, so it is not installed with the package.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

USAGE = "usage: python -m kvtier {demo,bench} [--help | options]"


def _load_example(name: str):  # type: ignore[no-untyped-def]
    path = Path(__file__).resolve().parent.parent / "examples" / f"{name}.py"
    if not path.is_file():
        raise SystemExit(
            f"kvtier: {path} not found; the demo runs from a source checkout of kvtier "
            "(git clone, then `make demo`)"
        )
    spec = importlib.util.spec_from_file_location(f"kvtier_example_{name}", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "demo":
        return int(_load_example("serving_loop").main(rest))
    if command == "bench":
        from kvtier.bench import main as bench_main

        return bench_main(rest)
    print(f"kvtier: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
