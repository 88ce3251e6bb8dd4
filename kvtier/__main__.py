"""Command line: ``kvtier demo [options]`` and ``kvtier bench [options]``
(or ``python -m kvtier ...``)."""

from __future__ import annotations

import sys

USAGE = "usage: kvtier {demo,bench} [--help | options]"


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help"):
        print(USAGE)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "demo":
        from kvtier.demo import main as demo_main

        return demo_main(rest)
    if command == "bench":
        from kvtier.bench import main as bench_main

        return bench_main(rest)
    print(f"kvtier: unknown command {command!r}\n{USAGE}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
