"""``deepspeed-ext`` command line (also ``python -m deepspeed_ext``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any
from collections.abc import Sequence

from deepspeed_ext.errors import DeepSpeedExtError


def _open_any(path: str, tag: str | None):
    """A UniversalCheckpoint or a DeepSpeedCheckpoint for ``path`` (+ ``tag``), whichever it is."""
    from deepspeed_ext.checkpoint.deepspeed import DeepSpeedCheckpoint
    from deepspeed_ext.checkpoint.universal import LATEST_UNIVERSAL, ZERO_DIR, UniversalCheckpoint
    root = Path(path)
    target = root / tag if tag else root
    only_universal = (root / LATEST_UNIVERSAL).is_file() and not (root / "latest").is_file() and tag is None
    if (target / ZERO_DIR).is_dir() or only_universal:
        return UniversalCheckpoint(root, tag)
    return DeepSpeedCheckpoint(root, tag)


def cmd_to_universal(args: argparse.Namespace) -> int:
    from deepspeed_ext.checkpoint.deepspeed import DeepSpeedCheckpoint
    from deepspeed_ext.checkpoint.universal import write_universal
    source = DeepSpeedCheckpoint(args.checkpoint, args.tag)
    out = write_universal(source, args.output, overwrite=args.overwrite, progress=not args.quiet)
    if not args.quiet:
        print(f"wrote universal checkpoint {out} ({len(source.layouts)} parameters, "
              f"TP={source.tp_degree} x DP={source.dp_degree}, ZeRO-{source.zero_stage}, "
              f"metadata: {source.metadata_source})")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    ckpt = _open_any(args.checkpoint, args.tag)
    summary: dict[str, Any] = ckpt.summary()
    layouts = {t.name: t.layout for t in ckpt.tensors()}
    if args.json:
        # Master weights and moments are fp32 in both formats; model dtypes are in the summary.
        summary["parameters"] = {name: {"dtype": "float32", **layout.to_json()} for name, layout in layouts.items()}
        print(json.dumps(summary, indent=1))
        return 0
    for key, value in summary.items():
        print(f"{key:>18}: {value}")
    width = max((len(n) for n in layouts), default=0)
    print(f"{'parameters':>18}:")
    for name, layout in layouts.items():
        print(f"  {name:<{width}}  {str(list(layout.shape)):<14} {layout.describe()}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepspeed-ext", description="Universal checkpoints for DeepSpeed AutoTP.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("to-universal", help="merge TP slices and ZeRO partitions into DeepSpeed's universal layout")
    p.add_argument("checkpoint", help="save dir (uses its 'latest' file) or a tag directory")
    p.add_argument("--tag", help="tag to convert (default: the 'latest' file)")
    p.add_argument("-o", "--output", help="output dir (default: <save dir>/<tag>_universal)")
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    p.set_defaults(func=cmd_to_universal)

    p = sub.add_parser("inspect", help="describe a DeepSpeed or universal checkpoint")
    p.add_argument("checkpoint")
    p.add_argument("--tag")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_inspect)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # Conversion is pure CPU work. Without this, importing DeepSpeed probes for an accelerator and prints
    # its finding on stdout, which would corrupt `inspect --json`.
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    parser = build_parser()
    args = parser.parse_args(argv)
    if "--debug" in (argv if argv is not None else sys.argv):
        args.debug = True
    try:
        return args.func(args)
    except (DeepSpeedExtError, ValueError, OSError) as exc:
        if args.debug:
            raise
        print(f"deepspeed-ext: error: {exc}", file=sys.stderr)
        return 2
