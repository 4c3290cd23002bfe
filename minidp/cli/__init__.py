"""The minidp command line: ``python -m minidp <command>`` (or ``minidp <command>``).

Each command lives in its own module, which provides ``add_arguments(parser)`` and ``run(args)``;
this file only wires them into one ``argparse`` parser. Only the module of the command being run
is imported, so a command's dependencies (matplotlib for ``trace``, say) never slow down another.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Optional, Sequence

# command -> (module that implements it, one-line help)
COMMANDS = {
    "demo": ("minidp.cli.demo", "train a small CNN with data parallelism on built-in data"),
    "devices": ("minidp.cli.devices", "list the devices this process sees: ids, names, memory, utilisation"),
    "verify": ("minidp.cli.verify", "check minidp against a single-device reference on every zoo model"),
    "trace": ("minidp.cli.trace", "trace one training step of a zoo model: table, Chrome trace, timeline PNG"),
    "bench": ("minidp.cli.bench", "time minidp against stock PyTorch and a single device, as ratios"),
}


def build_parser(command_name: Optional[str] = None) -> argparse.ArgumentParser:
    """The parser; with ``command_name``, only that command's module is imported and given arguments."""
    parser = argparse.ArgumentParser(prog="minidp", description="Data parallelism for PyTorch, step by step.")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for name, (module_name, help_text) in COMMANDS.items():
        command = commands.add_parser(name, help=help_text, description=help_text)
        if command_name in (None, name):
            module = importlib.import_module(module_name)
            module.add_arguments(command)
            command.set_defaults(run=module.run)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # The command is the first word that is not an option (the top-level parser has only --help).
    command_name = next((a for a in argv if not a.startswith("-")), "")
    args = build_parser(command_name).parse_args(argv)
    return args.run(args) or 0
