"""Both spellings of every long option: ``--max-shard-size`` and ``--max_shard_size``, ``--input_folder`` (upstream
``ds_to_universal``'s) and ``--input-folder``. A user who spells an option the other way gets the option, not the
top-level usage."""

from __future__ import annotations

import argparse
from collections.abc import Sequence


def respelled(parser: argparse.ArgumentParser, argv: Sequence[str]) -> list[str]:
    """``argv`` with each long option the parser does not know under its own spelling written the way it does
    (``_`` and ``-`` swapped after the leading ``--``); the subcommand's options once its name has been seen.
    Everything after ``--`` is left as it is."""
    known = _options(parser)
    commands = _subparsers(parser)
    out: list[str] = []
    for index, token in enumerate(argv):
        if token == "--":
            return out + list(argv[index:])
        if token in commands:
            known = known | _options(commands[token])
        out.append(_respelled(token, known))
    return out


def _respelled(token: str, known: set[str]) -> str:
    if not token.startswith("--") or token == "--":
        return token
    name, equals, value = token.partition("=")
    if name in known:
        return token
    for other in (name[:2] + name[2:].replace("_", "-"), name[:2] + name[2:].replace("-", "_")):
        if other in known:
            return other + equals + value
    return token


def _options(parser: argparse.ArgumentParser) -> set[str]:
    return {option for action in parser._actions for option in action.option_strings}


def _subparsers(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def subcommand_parser(parser: argparse.ArgumentParser, name: str | None) -> argparse.ArgumentParser:
    """The parser of subcommand ``name``; ``parser`` itself where there is none."""
    return _subparsers(parser).get(name or "", parser)
