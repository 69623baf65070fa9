"""The argument parser every ``epd-proxy`` command uses.

Two departures from argparse's defaults, both for command lines that stay what they
mean: no abbreviated flags (``--no-kv-reus`` would silently change meaning the day a
second flag starts with it), and a mistake answered with the error and a one-line
hint rather than the whole usage, which for ``serve`` is some seventy lines that push
the error itself off the screen.
"""

from __future__ import annotations

import argparse
from typing import NoReturn


class Parser(argparse.ArgumentParser):
    """``argparse.ArgumentParser`` without abbreviations, its errors in two lines (exit 2).
    Subparsers made from it are of this class too."""

    def __init__(self, *args, **kwargs) -> None:
        kwargs["allow_abbrev"] = False
        super().__init__(*args, **kwargs)
        self.commands: dict[str, Parser] = {}  # a command line's subcommands, by name (cli.build_parser)

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n  (see '{self.prog} --help')\n")

