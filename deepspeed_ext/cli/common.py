"""What every command shares: opening the source through the registry, writing through the API, the options and
help texts several commands take, and the one-line error."""

from __future__ import annotations

import argparse
import gc
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

from deepspeed_ext.checkpoint.source import CheckpointSource, HasNotes

def read_source(path: str, tag: str | None = None, config: str | None = None, family: str | None = None,
                libraries: Callable[[], None] | None = None, **options: Any) -> CheckpointSource:
    """The registry's opener (the API's, plus ``reads`` and ``command``: the one format a command reads, and the
    command, for the line it says when given another: :func:`~deepspeed_ext.checkpoint.formats.not_read`).
    ``libraries``: imports the command goes on to need, made once the source is open (bad input is named first)
    and before the garbage collector is back on (:func:`~.main.main`)."""
    from deepspeed_ext.checkpoint.formats import open_checkpoint
    say_which_trainer_checkpoint(path, tag)
    source = open_checkpoint(path, tag=tag, config=config, family=family, **options)
    if libraries is not None:
        libraries()
    collect_garbage_again()
    for note in source.notes if isinstance(source, HasNotes) else ():  # what an HF release was read as
        print(f"deepspeed-ext: {path}: {note}", file=sys.stderr)
    return source


#: Whether :func:`~.main.main` turned the garbage collector off (see there) and nothing has turned it on again yet.
_COLLECTOR_HELD = False


def hold_collector() -> None:
    """Turn the garbage collector off until :func:`collect_garbage_again` (see :func:`~.main.main`)."""
    global _COLLECTOR_HELD
    if gc.isenabled():
        gc.disable()
        _COLLECTOR_HELD = True


def collect_garbage_again(freeze: bool = True) -> None:
    """Turn the garbage collector back on where :func:`main` turned it off while the libraries were imported.
    ``freeze``: with what is alive now (modules, classes, functions: nothing that dies) frozen first, so no
    collection walks it again."""
    global _COLLECTOR_HELD
    if _COLLECTOR_HELD:
        _COLLECTOR_HELD = False
        if freeze:
            gc.freeze()
        gc.enable()


def say_which_trainer_checkpoint(path: str, tag: str | None = None) -> None:
    """Name the checkpoint-N a Trainer output_dir stands for (on stderr: stdout may be JSON)."""
    from deepspeed_ext.checkpoint.formats import checkpoint_path
    chosen = checkpoint_path(path) if tag is None and Path(path).is_dir() else Path(path)
    if chosen != Path(path):
        print(f"deepspeed-ext: {path}: a Hugging Face Trainer output directory; reading its newest checkpoint, "
              f"{chosen}", file=sys.stderr)


def write_output(source: CheckpointSource, output: str | None, to: str, args: argparse.Namespace, **options: Any) -> Any:
    """``convert(source, output, to=to)`` with the options every writing command shares."""
    from deepspeed_ext.api import convert
    return convert(source, output, to=to, overwrite=args.overwrite, progress=not args.quiet,
                   check_finite=args.check_finite, **options)


def global_options(p: argparse.ArgumentParser, subcommand: bool) -> None:
    """--debug and --quiet, accepted before the subcommand and after it (a subcommand's copy leaves the value
    alone unless given there)."""
    default: Any = argparse.SUPPRESS if subcommand else False
    p.add_argument("--debug", action="store_true", default=default,
                   help="on an error, show the full traceback instead of one line")
    p.add_argument("-q", "--quiet", action="store_true", default=default,
                   help="no progress bar, no summary; errors are still reported")


def writer_options(p: argparse.ArgumentParser, convert: bool = True) -> None:
    """Options every command that writes a checkpoint shares (``convert``: it reads tensors from a source)."""
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing output (once the new one is complete; never the source)")
    if convert:
        p.add_argument("--check-finite", action="store_true",
                       help="check every tensor for NaN/Inf; if any has them, name the parameters and write nothing")


FAMILY_HELP = "model family, one of: {families} (default: recorded with the checkpoint, else inferred from the model config)"


TAG_HELP = "the DeepSpeed tag to read, e.g. global_step1000 (default: the one the 'latest' file names)"


CONFIG_HELP = "an HF config.json to use (default: the model config saved with the checkpoint)"


def command_parser(sub: Any, name: str, summary: str, description: str, examples: str, extra: str | None = None
             ) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        name, help=summary, description=f"{summary[0].upper()}{summary[1:]}.\n\n{description}",
        epilog="examples:\n" + "\n".join(f"  {line.strip()}" for line in examples.strip().splitlines()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    global_options(p, subcommand=True)
    p.set_defaults(extra=extra)
    return p


def paragraph(text: str) -> str:
    import textwrap
    return textwrap.fill(" ".join(text.split()), width=100)


def mtp_option(p: argparse.ArgumentParser, keep: bool = False) -> None:
    p.add_argument("--mtp", choices=["drop", "keep"] if keep else ["drop"],
                   help="HF sources: what to do with decoder layers past num_hidden_layers (DeepSeek-V3's "
                   "multi-token-prediction layer): drop them" + (", or keep them (written back untouched into the HF "
                   "output)" if keep else "") + "; without it such a checkpoint is refused")


def say_error(message: str) -> None:
    """``deepspeed-ext: error: MESSAGE`` on stderr in one write, so the ranks of a torchrun (unbuffered, one
    pipe) never run their lines together."""
    sys.stderr.write(f"deepspeed-ext: error: {message}\n")
    sys.stderr.flush()


def leave_distributed(code: int) -> NoReturn:
    """End the program of a ``--distributed`` rank whose work is done (published, or refused on every rank). Its
    gloo process group leaves a C++ thread behind that aborts the interpreter's teardown now and then ("terminate
    called without an active exception"), turning a finished conversion into exit code 1 under torchrun (1 run in
    4 here): flush, and leave without the teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
