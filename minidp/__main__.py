"""The minidp command line: ``python -m minidp <command>`` (or ``minidp <command>``).

Each command lives in its own module, which provides ``add_arguments(parser)`` and ``run(args)``;
this file only wires them into one ``argparse`` parser.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

# command -> (module that implements it, one-line help)
COMMANDS = {
    "demo": ("minidp.demo", "train a small CNN with data parallelism on built-in data"),
    "bench": ("minidp.bench", "time minidp against stock PyTorch and a single device, as ratios"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="minidp", description="Data parallelism for PyTorch, step by step.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        command = commands.add_parser(name, help=help_text, description=help_text)
        module = importlib.import_module(module_name)
        module.add_arguments(command)
        command.set_defaults(run=module.run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    return args.run(args) or 0


if __name__ == "__main__":
    sys.exit(main())
