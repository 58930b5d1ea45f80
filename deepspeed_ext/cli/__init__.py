"""``deepspeed-ext`` command line (also ``python -m deepspeed_ext``): :mod:`.main` (the parser and how a command
runs), :mod:`.common` (what commands share), :mod:`.convert` (the converting commands), :mod:`.tools` (inspect,
verify, compare). The formats' own parts (which format a command reads, what to do with another) are their
registry entries' (:mod:`deepspeed_ext.checkpoint.formats`)."""

from __future__ import annotations

from deepspeed_ext.cli.main import build_parser, main

__all__ = ["build_parser", "main"]
