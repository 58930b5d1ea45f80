"""``deepspeed-ext`` command line (also ``python -m deepspeed_ext``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any
from collections.abc import Sequence

from deepspeed_ext.checkpoint.formats import ALREADY_UNIVERSAL
from deepspeed_ext.errors import DeepSpeedExtError


#: What a command says when it is given a format it does not read (the formats it reads map to "").
_TO_UNIVERSAL_READS = {
    "deepspeed": "",
    "universal": ALREADY_UNIVERSAL,
    "huggingface": "a Hugging Face checkpoint: convert it with from-hf",
    "maxtext": "a MaxText (Orbax) checkpoint: convert it with from-maxtext",
}
_FROM_HF_READS = {
    "deepspeed": "a DeepSpeed checkpoint, not a Hugging Face one: convert it with to-universal or to-hf",
    "universal": "already a universal checkpoint, not a Hugging Face one: from-hf is not needed",
    "maxtext": "a MaxText (Orbax) checkpoint, not a Hugging Face one: convert it with from-maxtext",
    "huggingface": "",
}
_FROM_MAXTEXT_READS = {
    "deepspeed": "a DeepSpeed checkpoint, not a MaxText one: convert it with to-universal or to-maxtext",
    "universal": "already a universal checkpoint, not a MaxText one: from-maxtext is not needed",
    "huggingface": "a Hugging Face checkpoint, not a MaxText one: convert it with from-hf or to-maxtext",
    "maxtext": "",
}


def _open(path: str, tag: str | None = None, config: str | None = None, family: str | None = None,
          **options: Any) -> Any:
    # The registry's opener (the API's, plus ``accept``: which command reads the formats this one does not).
    from deepspeed_ext.checkpoint.formats import open_checkpoint
    _say_which_trainer_checkpoint(path, tag)
    return open_checkpoint(path, tag=tag, config=config, family=family, **options)


def _say_which_trainer_checkpoint(path: str, tag: str | None = None) -> None:
    """Name the checkpoint-N a Trainer output_dir stands for (on stderr: stdout may be JSON)."""
    from deepspeed_ext.checkpoint.formats import checkpoint_path
    chosen = checkpoint_path(path) if tag is None and Path(path).is_dir() else Path(path)
    if chosen != Path(path):
        print(f"deepspeed-ext: {path}: a Hugging Face Trainer output directory; reading its newest checkpoint, "
              f"{chosen}", file=sys.stderr)


def _write(source: Any, output: str | None, to: str, args: argparse.Namespace, **options: Any) -> Any:
    """``convert(source, output, to=to)`` with the options every writing command shares."""
    from deepspeed_ext.api import convert
    return convert(source, output, to=to, overwrite=args.overwrite, progress=not args.quiet,
                   check_finite=args.check_finite, **options)


def cmd_to_universal(args: argparse.Namespace) -> int:
    source = _open(args.checkpoint, args.tag, accept=_TO_UNIVERSAL_READS)
    if args.distributed:
        import torch.distributed as dist
        if "RANK" not in os.environ:
            raise ValueError("--distributed runs under torchrun (torchrun --nproc_per_node K -m deepspeed_ext "
                             "to-universal --distributed ...)")
        dist.init_process_group("gloo")
        try:
            out = _write(source, args.output, "universal", args, distributed=True)
        finally:
            dist.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return 0
    else:
        out = _write(source, args.output, "universal", args)
    if not args.quiet:
        info = source.info
        print(f"wrote universal checkpoint {out} ({len(info.layouts)} parameters, "
              f"TP={info.tp_degree} x DP={info.dp_degree}, ZeRO-{info.zero_stage}, metadata: {info.metadata})")
    return 0


def cmd_to_maxtext(args: argparse.Namespace) -> int:
    from deepspeed_ext.checkpoint.maxtext import parse_mesh
    source = _open(args.source, args.tag, args.config, args.family)
    items = _write(source, args.output, "maxtext", args, family=args.family, scan_layers=args.scan_layers,
                   dtype=args.dtype, mesh=parse_mesh(args.mesh) if args.mesh else None,
                   with_optimizer=args.with_optimizer)
    if not args.quiet:
        from deepspeed_ext.checkpoint.families import get_family, infer_family
        family = get_family(args.family) if args.family else infer_family(source.info.model_config)
        print(f"wrote MaxText checkpoint {items} (family {family.name}, scan_layers={args.scan_layers}, "
              f"{args.dtype}); load it with load_parameters_path={items}")
    return 0


def cmd_from_maxtext(args: argparse.Namespace) -> int:
    from deepspeed_ext.checkpoint.hf import check_fits_config
    source = _open(args.source, None, args.config, args.family, accept=_FROM_MAXTEXT_READS)
    info = source.info
    check_fits_config(info.model_config, {name: layout.shape for name, layout in info.layouts.items()},
                      str(args.source))
    out = _write(source, args.output, "universal", args)
    if not args.quiet:
        optimizer = (f"Adam state at step {source.optimizer_step}" if info.has_optimizer else
                     "fresh optimizer state")
        print(f"wrote universal checkpoint {out} ({len(info.layouts)} parameters, family {source.family.name}, "
              f"{optimizer}); resume with \"checkpoint\": {{\"load_universal\": true}} at any TP degree")
    return 0


def cmd_to_hf(args: argparse.Namespace) -> int:
    source = _open(args.source, args.tag, args.config, args.family)
    out = _write(source, args.output, "hf", args, dtype=args.dtype, max_shard_size=args.max_shard_size)
    if not args.quiet:
        print(f"wrote HF checkpoint {out}; load it with AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


def cmd_from_hf(args: argparse.Namespace) -> int:
    source = _open(args.source, None, args.config, dtype=args.dtype, accept=_FROM_HF_READS)
    out = _write(source, args.output, "universal", args)
    if not args.quiet:
        print(f"wrote universal checkpoint {out} ({len(source.info.layouts)} parameters, fresh optimizer state); "
              "train from it with \"checkpoint\": {\"load_universal\": true} at any TP degree")
    return 0


def cmd_reshard_orbax(args: argparse.Namespace) -> int:
    from deepspeed_ext.checkpoint.maxtext import parse_mesh, reshard_orbax
    from deepspeed_ext.checkpoint.formats import MAXTEXT, detect_all, maxtext_items
    from deepspeed_ext.errors import CheckpointError
    if MAXTEXT not in detect_all(args.source):
        raise CheckpointError(f"{args.source}: not a MaxText (Orbax) checkpoint (no _METADATA, no <step>/items)")
    items, whole = reshard_orbax(maxtext_items(Path(args.source)), args.output, parse_mesh(args.mesh),
                                 overwrite=args.overwrite, progress=not args.quiet, protect=[args.source])
    if whole:
        print(f"kept whole (no known MaxText logical axes): {', '.join(whole)}", file=sys.stderr)
    if not args.quiet:
        print(f"wrote {items} with storage chunks aligned to mesh {args.mesh}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    source = _open(args.checkpoint, args.tag, args.config, args.family)
    summary: dict[str, Any] = source.summary()
    layouts = source.info.layouts
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


def cmd_verify(args: argparse.Namespace) -> int:
    from deepspeed_ext.api import verify
    _say_which_trainer_checkpoint(args.path)
    report = verify(args.path, config=args.config, family=args.family)
    for line in report.lines():
        print(line)
    return 0 if report.ok else 1


def _writer_options(p: argparse.ArgumentParser, convert: bool = True) -> None:
    """Options every command that writes a checkpoint shares (``convert``: it reads tensors from a source)."""
    p.add_argument("--overwrite", action="store_true", help="replace an existing output")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar or summary")
    if convert:
        p.add_argument("--check-finite", action="store_true",
                       help="check every tensor for NaN/Inf; if any has them, name the parameters and write nothing")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepspeed-ext", description="Universal checkpoints for DeepSpeed AutoTP.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks on errors")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("to-universal", help="merge TP slices and ZeRO partitions into DeepSpeed's universal layout")
    p.add_argument("checkpoint", help="save dir (uses its 'latest' file) or a tag directory")
    p.add_argument("--tag", help="tag to convert (default: the 'latest' file)")
    p.add_argument("-o", "--output", help="output save directory: OUT/<tag>_universal and OUT/latest_universal, "
                   "loadable with engine.load_checkpoint(OUT) (default: beside the tag, <save dir>/<tag>_universal "
                   "and <save dir>/latest_universal)")
    p.add_argument("--distributed", action="store_true",
                   help="run under torchrun: the ranks split the parameters (torch.distributed, gloo) and write "
                   "the same output a single process would")
    _writer_options(p)
    p.set_defaults(func=cmd_to_universal)

    p = sub.add_parser("to-maxtext", help="write an Orbax checkpoint in MaxText's layout")
    p.add_argument("source", help="a DeepSpeed checkpoint (save or tag dir), a universal checkpoint or an HF "
                   "model directory")
    p.add_argument("-o", "--output", required=True, help="output root; MaxText loads <output>/0/items")
    p.add_argument("--tag")
    p.add_argument("--family", help="model family (default: inferred from the model config)")
    p.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True,
                   help="stack decoder layers on axis 1 as MaxText's scan_layers=true expects (default)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--mesh", help="target mesh, e.g. fsdp=16,tensor=2: storage chunks become one device's shard "
                   "under MaxText's sharding rules (axes: fsdp, tensor, expert, stage)")
    p.add_argument("--with-optimizer", action="store_true",
                   help="also write the Adam moments as MaxText's optax adamw state (opt_state)")
    p.add_argument("--config", help="HF config.json (default: the model config saved with the checkpoint)")
    _writer_options(p)
    p.set_defaults(func=cmd_to_maxtext)

    p = sub.add_parser("from-maxtext", help="a MaxText Orbax checkpoint back into the universal form")
    p.add_argument("source", help="the MaxText checkpoint: its root, a step directory or <root>/<step>/items")
    p.add_argument("-o", "--output", required=True, help="output save directory: OUT/<tag>_universal and "
                   "OUT/latest_universal, loadable with engine.load_checkpoint(OUT)")
    p.add_argument("--config", help="HF config.json (default: the one to-maxtext recorded)")
    p.add_argument("--family", help="model family (default: recorded, else inferred from the config)")
    _writer_options(p)
    p.set_defaults(func=cmd_from_maxtext)

    p = sub.add_parser("to-hf", help="write a Hugging Face checkpoint (config.json + sharded safetensors)")
    p.add_argument("source", help="a DeepSpeed checkpoint (save or tag dir), a universal checkpoint or a MaxText "
                   "checkpoint (<root> or <root>/0/items)")
    p.add_argument("-o", "--output", required=True, help="output directory")
    p.add_argument("--tag")
    p.add_argument("--dtype", choices=["source", "bfloat16", "float32"], default="source",
                   help="weights dtype (default: the dtype the source model had)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file (default 5GB)")
    p.add_argument("--config", help="HF config.json (default: the model config saved with the checkpoint)")
    p.add_argument("--family", help="MaxText sources: model family (default: recorded or inferred)")
    _writer_options(p)
    p.set_defaults(func=cmd_to_hf)

    p = sub.add_parser("from-hf", help="a Hugging Face checkpoint (safetensors) into the universal form")
    p.add_argument("source", help="HF model directory: config.json and *.safetensors (with or without an index)")
    p.add_argument("-o", "--output", required=True, help="output save directory: OUT/global_step0_universal and "
                   "OUT/latest_universal, loadable with engine.load_checkpoint(OUT)")
    p.add_argument("--config", help="HF config.json (default: the directory's config.json)")
    p.add_argument("--dtype", choices=["source", "bfloat16", "float32"], default="source",
                   help="dtype of the stored weights (default: the files' dtype)")
    _writer_options(p)
    p.set_defaults(func=cmd_from_hf)

    p = sub.add_parser("reshard-orbax", help="re-chunk a MaxText Orbax checkpoint for a target mesh, array by array")
    p.add_argument("source", help="the MaxText checkpoint: its root, a step directory or <root>/<step>/items")
    p.add_argument("-o", "--output", required=True, help="output root; the result is <output>/0/items")
    p.add_argument("--mesh", required=True, help="target mesh, e.g. fsdp=16,tensor=2,expert=4")
    _writer_options(p, convert=False)
    p.set_defaults(func=cmd_reshard_orbax)

    p = sub.add_parser("verify", help="check a checkpoint: a converted one (universal, HF or MaxText) against its "
                       "manifest, a DeepSpeed one file by file; every tensor's shape, dtype and finiteness")
    p.add_argument("path", help="a checkpoint directory (any format; for MaxText the root or <root>/0/items)")
    p.add_argument("--config", help="HF config.json where the checkpoint has none (MaxText, HF)")
    p.add_argument("--family", help="MaxText: model family (default: recorded or inferred)")
    p.set_defaults(func=cmd_verify)

    p = sub.add_parser("inspect", help="describe a checkpoint (DeepSpeed, universal, HF or MaxText)")
    p.add_argument("checkpoint")
    p.add_argument("--tag")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--config", help="HF config.json where the checkpoint has none (MaxText, HF)")
    p.add_argument("--family", help="MaxText: model family (default: recorded or inferred)")
    p.set_defaults(func=cmd_inspect)
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
    parser = build_parser()
    args = parser.parse_args(argv)
    if "--debug" in (argv if argv is not None else sys.argv):
        args.debug = True
    if not args.debug:
        _quiet_library_warnings()
    if argv is None:  # run as the program (not called from Python code, whose own Ctrl-C handling stays)
        from deepspeed_ext.checkpoint.output import exit_on_interrupt
        exit_on_interrupt()
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, rather than at exit
        return code
    except BrokenPipeError:
        # The reader of our stdout went away (`inspect | head`): not an error. Point stdout at /dev/null so
        # the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        return _interrupted()
    except (DeepSpeedExtError, ValueError, OSError) as exc:
        if args.debug:
            raise
        print(f"deepspeed-ext: error: {exc}", file=sys.stderr)
        return 2


def _interrupted() -> int:
    """A KeyboardInterrupt that reached here (main() called without the signal handler, from a thread):
    every writer has unwound and removed its staging directory; say so in one line (exit 130, as shells do)."""
    from deepspeed_ext.checkpoint.output import discard_in_flight
    discard_in_flight()
    print("deepspeed-ext: interrupted; nothing was written", file=sys.stderr)
    return 130
