"""Command line: ``kvtier COMMAND [options]`` (or ``python -m kvtier ...``).

``kvtier --help`` lists the commands, ``kvtier COMMAND --help`` a command's
options, ``kvtier --version`` the version. Each command parses its own
options; this parser only picks the command.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable

# name -> (one line for --help, the module whose main(argv) runs it)
COMMANDS: dict[str, tuple[str, str]] = {
    "demo": ("serve a hybrid model's requests through kvtier, check every byte, and print what moved", "kvtier.demo"),
    "bench": ("measure kvtier against the raw copy of the same pages, in one process", "kvtier.bench"),
}


def parser() -> argparse.ArgumentParser:
    from kvtier import __version__

    ap = argparse.ArgumentParser(
        prog="kvtier",
        description="Move pages of an LLM's KV cache between GPU memory, pinned host memory and a shared store.",
        epilog="`kvtier COMMAND --help` lists a command's options.",
    )
    ap.add_argument("--version", action="version", version=f"kvtier {__version__}")
    commands = ap.add_subparsers(dest="command", metavar="COMMAND", title="commands", required=True)
    for name, (line, _) in COMMANDS.items():
        # add_help=False: `kvtier demo --help` is the command's own help, with all its options.
        commands.add_parser(name, help=line, description=line, add_help=False)
    return ap


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else list(argv)
    ap = parser()
    if not args:
        ap.print_help(sys.stderr)
        return 2
    # Options before the command belong here (--help, --version); the rest is the command's.
    head = 0
    while head < len(args) and args[head].startswith("-"):
        head += 1
    chosen = ap.parse_args(args[: head + 1])
    module = __import__(COMMANDS[chosen.command][1], fromlist=["main"])
    run: Callable[[list[str]], int] = module.main
    return run(args[head + 1 :])


if __name__ == "__main__":
    sys.exit(main())
