"""The ``gradpress`` command line.

Each subcommand lives in its own module under ``gradpress/commands/`` and
exposes ``register(subparsers)``, which adds its parser and sets
``func=callable(args) -> int``. Adding a command means adding a file.
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import gradpress.commands as commands_pkg
from gradpress.compress import plugins


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gradpress",
        description="Communication-efficient data-parallel training: compress what workers exchange.",
    )
    from gradpress import __version__

    parser.add_argument("--version", action="version", version=f"gradpress {__version__}")
    # also before the command (`gradpress --plugin M compare ...`): argparse otherwise took M for the command
    # ("invalid choice: 'M'"); its own dest, since a command's default (None) would overwrite a shared one
    parser.add_argument("--plugin", action="append", dest="leading_plugins", default=None, metavar="MODULE",
                        help="as each command's --plugin (import MODULE here and in every worker); repeatable")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in sorted(pkgutil.iter_modules(commands_pkg.__path__), key=lambda m: m.name):
        module = importlib.import_module(f"gradpress.commands.{mod.name}")
        module.register(sub)
    for command in sub.choices.values():
        plugins.add_option(command)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        plugins.add([*(args.leading_plugins or []), *(getattr(args, "plugins", None) or [])])  # and $GRADPRESS_PLUGINS
        return int(args.func(args) or 0)
    except ValueError as exc:
        print(f"{command_name(args)}: error: {exc}", file=sys.stderr)
        return 2


def command_name(args: argparse.Namespace) -> str:
    """``gradpress train``, ``gradpress bench e2e``: the command an error line names."""
    words = [args.command, getattr(args, "bench_command", None)]
    return " ".join(["gradpress", *(w for w in words if w)])


if __name__ == "__main__":
    sys.exit(main())
