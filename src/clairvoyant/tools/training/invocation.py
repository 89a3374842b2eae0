"""The command line a model card names: the options of a run that decide what it made."""

from __future__ import annotations

import argparse
import shlex
from collections.abc import Callable, Collection
from typing import Any

__all__ = ["command_line"]


def command_line(
    command: str,
    add_arguments: Callable[[argparse.ArgumentParser], None],
    args: argparse.Namespace,
    *,
    ignore: Collection[str] = (),
) -> str:
    """``clairvoyant COMMAND`` and every option of ``args`` that differs from its default (a
    flag when set), in the parser's order; options named in ``ignore`` (destinations, e.g.
    ``threads``) are left out."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    words = ["clairvoyant", command]
    for action in parser._actions:
        if not action.option_strings or action.dest in ignore or action.dest == "help":
            continue
        value: Any = getattr(args, action.dest, action.default)
        if value == action.default:
            continue
        flag = action.option_strings[-1]
        if action.nargs == 0:
            words.append(flag)
        elif isinstance(value, list | tuple):
            words += [flag, *(str(v) for v in value)]
        else:
            words += [flag, str(value)]
    return shlex.join(words)
