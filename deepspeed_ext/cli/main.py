"""``deepspeed-ext`` command line (also ``python -m deepspeed_ext``): the parser, and how a command runs (the
libraries' startup, early refusals, errors in one line)."""

from __future__ import annotations

import argparse
import os
import sys
import traceback
from collections.abc import Sequence
from pathlib import Path

from deepspeed_ext.cli import convert, tools
from deepspeed_ext.cli.common import (FAMILY_HELP, collect_garbage_again, global_options, hold_collector, leave_distributed,
                                      say_error)
from deepspeed_ext.errors import DeepSpeedExtError

def build_parser() -> argparse.ArgumentParser:
    from deepspeed_ext.checkpoint.families import family_names
    family_help = FAMILY_HELP.format(families=", ".join(family_names()))
    parser = argparse.ArgumentParser(
        prog="deepspeed-ext", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Universal checkpoints for DeepSpeed AutoTP + ZeRO: convert, inspect and verify checkpoints "
        "between DeepSpeed,\nDeepSpeed's universal layout, Hugging Face safetensors and MaxText (Orbax).",
        epilog="Run 'deepspeed-ext COMMAND --help' for a command's options and examples.")
    parser.add_argument("--version", action="store_true",
                        help="print the versions of deepspeed-ext, DeepSpeed and torch, and which extras are installed")
    global_options(parser, subcommand=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    convert.add_to_universal(sub)
    convert.add_to_maxtext(sub, family_help)
    convert.add_from_maxtext(sub, family_help)
    convert.add_to_hf(sub, family_help)
    convert.add_from_hf(sub)
    convert.add_reshard_orbax(sub)
    tools.add_verify(sub, family_help)
    tools.add_compare(sub, family_help)
    tools.add_inspect(sub, family_help)
    return parser


def _quiet_library_warnings() -> None:
    """Orbax logs routine notices as absl WARNINGs, and failures of its worker threads as ERRORs with their
    tracebacks before it re-raises them; without --debug the error is then our one line."""
    try:
        from absl import logging as absl_logging
    except ImportError:
        return
    absl_logging.set_verbosity(absl_logging.FATAL)


def main(argv: Sequence[str] | None = None) -> int:
    # Conversion is pure CPU work. Without this, importing DeepSpeed probes for an accelerator and prints
    # its finding on stdout, which would corrupt `inspect --json`.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if argv is None:  # the program itself: torch is not loaded yet (a caller in Python keeps its environment)
        _idle_openmp_workers_sleep()
        _keep_freed_blocks_mapped()
    # Importing torch, DeepSpeed, JAX and Orbax creates millions of objects that live as long as the process; the
    # collections their creation triggered found next to nothing but walked them all (1-2 s of each command on a
    # 2-core VM, docs/performance.md). The collector is off until the source is open (read_source) or the command starts
    # its work, and on again whatever happens before that.
    if argv is None:  # the program itself; a caller in Python keeps its collector as it is
        hold_collector()
    try:
        return _run(argv)
    finally:
        collect_garbage_again(freeze=False)  # a command that ended before its source was open


def _idle_openmp_workers_sleep() -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` unless the user chose a policy: torch's OpenMP workers then sleep between
    parallel operations instead of spinning, by default, for a while after each. A conversion runs many short
    operations between the work of its other threads (tensorstore's writers, the checksum and content-check
    threads), and the spinning took the cores those threads needed: a bf16 to-maxtext of 608M parameters on a
    2-core VM ran 10.3 / 9.0 s with spinning workers and 8.5 / 7.2 s with sleeping ones (user CPU 11.8 / 11.1
    against 8.4 / 7.2 s; docs/performance.md). libgomp reads the policy once, when torch loads it."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


#: glibc's mallopt parameters, and the values the program sets: blocks up to 32 MiB come from the heap, and up to
#: 128 MiB of freed memory stays in each arena.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_TRIM_THRESHOLD_BYTES, _MMAP_THRESHOLD_BYTES = 128 << 20, 32 << 20


def _keep_freed_blocks_mapped() -> None:
    """Freed blocks stay in the heap for the next: a conversion streams its tensors in blocks of a few MiB, each
    allocated and freed on a writer thread, and glibc by default maps blocks that large afresh (a worker thread's
    arena also hands its free top back), so each block's pages were faulted in and zeroed again: a block-FP8 from-hf
    spent 7-8 of its 12-14 CPU-seconds in the kernel, 5 with the blocks kept (docs/performance.md). Bounded: 128 MiB
    of free memory an arena at most. Left as it is for a caller in Python (its process's allocator is its own) and
    where the C library has no mallopt (musl, macOS)."""
    import ctypes
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (AttributeError, OSError):
        return
    mallopt(_M_MMAP_THRESHOLD, _MMAP_THRESHOLD_BYTES)
    mallopt(_M_TRIM_THRESHOLD, _TRIM_THRESHOLD_BYTES)


def _run(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    from deepspeed_ext.option_spelling import respelled, subcommand_parser
    args, unknown = parser.parse_known_args(respelled(parser, sys.argv[1:] if argv is None else argv))
    if unknown:  # said with the subcommand's usage, whose options the user was after
        subcommand_parser(parser, args.command).error(f"unrecognized arguments: {' '.join(unknown)}")
    if args.version:
        from deepspeed_ext.extras import describe
        print("\n".join(describe()))
        return 0
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if not args.debug:
        _quiet_library_warnings()
    if argv is None:  # run as the program (not called from Python code, whose own Ctrl-C handling stays)
        from deepspeed_ext.checkpoint.output import exit_on_interrupt
        exit_on_interrupt()
    try:
        if args.extra is not None:  # before anything is read or written
            from deepspeed_ext.extras import require
            require(args.extra, args.command)
        _refuse_a_missing_tag_early(args)
        _refuse_the_output_early(args)
        if not args.quiet and sys.stderr.isatty() and args.func is not tools.cmd_inspect:
            print(f"deepspeed-ext {args.command}: loading libraries...", file=sys.stderr, flush=True)
        code: int = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, rather than at exit
        if argv is None and getattr(args, "distributed", False):
            leave_distributed(code)  # the program itself; a caller in Python gets the code back
        return code
    except BrokenPipeError:
        # The reader of our stdout went away (`inspect | head`): not an error. Point stdout at /dev/null so
        # the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        return _interrupted()
    except (DeepSpeedExtError, ValueError, OSError) as exc:
        if args.debug:  # the traceback too, and the same exit status as without --debug
            traceback.print_exc()
        say_error(_os_error_line(exc) if isinstance(exc, OSError) else str(exc))
        return 2
    except (KeyError, TypeError, AttributeError, IndexError, AssertionError) as exc:
        # A structure no reader check anticipated: still one line, naming the input, never a traceback.
        if args.debug:
            traceback.print_exc()
        inputs = [str(getattr(args, name)) for name in ("source", "checkpoint", "input_folder", "a", "b")
                  if getattr(args, name, None) is not None]
        where = ", ".join(dict.fromkeys(inputs)) or args.command
        print(f"deepspeed-ext: error: {where}: unexpected content ({type(exc).__name__}: {exc}, raised at "
              f"{_raised_at(exc)}); the checkpoint is damaged or in a layout deepspeed-ext does not know, or this is "
              "a defect of deepspeed-ext (--debug shows the traceback to report)", file=sys.stderr)
        return 2


def _raised_at(exc: BaseException) -> str:
    """``file:line`` of the innermost frame that raised ``exc`` (a path below a site-packages or the package's
    parent shortened to the module's): with the exception's own words, what tells a damaged input from a defect."""
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return "an unknown place"
    filename = frames[-1].filename.replace(os.sep, "/")
    for marker, kept in (("/site-packages/", ""), ("/deepspeed_ext/", "deepspeed_ext/")):
        if marker in filename:
            filename = kept + filename.rsplit(marker, 1)[1]
            break
    return f"{filename}:{frames[-1].lineno}"


def _refuse_a_missing_tag_early(args: argparse.Namespace) -> None:
    """A DeepSpeed save directory (a ``latest`` file, no universal one) whose tag, named by ``--tag`` or by
    ``latest``, is not there: refused before the libraries load, in the reader's own line. Anything else is left to
    the reader, which tells the formats apart."""
    source = getattr(args, "source", None) or getattr(args, "checkpoint", None) or getattr(args, "input_folder", None)
    if source is None or not (Path(source) / "latest").is_file() or (Path(source) / "latest_universal").exists():
        return
    from deepspeed_ext.checkpoint.deepspeed.files import find_tag_dir
    find_tag_dir(source, getattr(args, "tag", None))  # raises the line the reader would; the reader checks the rest


def _refuse_the_output_early(args: argparse.Namespace) -> None:
    """The refusals of an output that need no library (it exists, it is the source or lies in it): said before
    torch and the rest load (seconds), as the writer would say them once it had."""
    output = getattr(args, "output", None)
    source = getattr(args, "source", None) or getattr(args, "checkpoint", None) or getattr(args, "input_folder", None)
    if output is None or source is None or getattr(args, "distributed", False):
        return
    from deepspeed_ext.checkpoint.output import prepare
    prepare(output, [source], overwrite=bool(getattr(args, "overwrite", False)))


def _os_error_line(exc: OSError) -> str:
    """An operating system's refusal as ``PATH: problem`` (an output in ``/proc``, a directory not writable), the
    path as the user named it: a staging directory's name is the output's with ``.partial`` added."""
    if exc.filename is None or exc.filename2 is not None or not exc.strerror:
        return str(exc)  # two paths (a copy): the message names both, in the system's words
    return f"{str(exc.filename).removesuffix('.partial')}: {exc.strerror}"


def _interrupted() -> int:
    """A KeyboardInterrupt that reached here (main() called without the signal handler, from a thread):
    every writer has unwound and removed its staging directory; say so in one line (exit 130, as shells do)."""
    from deepspeed_ext.checkpoint.output import discard_in_flight
    discard_in_flight()
    print("deepspeed-ext: interrupted; nothing was written", file=sys.stderr)
    return 130
