"""``deepspeed-ext`` command line (also ``python -m deepspeed_ext``)."""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any, NoReturn
from collections.abc import Callable, Sequence

from deepspeed_ext.checkpoint.locate import ALREADY_UNIVERSAL
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
          libraries: Callable[[], None] | None = None, **options: Any) -> Any:
    """The registry's opener (the API's, plus ``accept``: which command reads the formats this one does not).
    ``libraries``: imports the command goes on to need, made once the source is open (bad input is named first)
    and before the garbage collector is back on (:func:`main`)."""
    from deepspeed_ext.checkpoint.formats import open_checkpoint
    _say_which_trainer_checkpoint(path, tag)
    source = open_checkpoint(path, tag=tag, config=config, family=family, **options)
    if libraries is not None:
        libraries()
    _collect_garbage_again()
    for note in getattr(source, "notes", ()):  # what an HF release was read as (its text model, its MTP layer)
        print(f"deepspeed-ext: {path}: {note}", file=sys.stderr)
    return source


#: Whether :func:`main` turned the garbage collector off (see there) and nothing has turned it on again yet.
_COLLECTOR_HELD = False


def _collect_garbage_again(freeze: bool = True) -> None:
    """Turn the garbage collector back on where :func:`main` turned it off while the libraries were imported.
    ``freeze``: with what is alive now (modules, classes, functions: nothing that dies) frozen first, so no
    collection walks it again."""
    global _COLLECTOR_HELD
    if _COLLECTOR_HELD:
        _COLLECTOR_HELD = False
        if freeze:
            gc.freeze()
        gc.enable()


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
    if args.input_folder and args.checkpoint and args.input_folder != args.checkpoint:
        raise ValueError("give the checkpoint once: as CHECKPOINT or as --input_folder")
    if args.output and args.output_folder:
        raise ValueError("give the output once: -o/--output (a save directory) or --output_folder (the universal "
                         "directory itself)")
    checkpoint = args.checkpoint or args.input_folder
    if not checkpoint:
        raise ValueError("to-universal needs a checkpoint (CHECKPOINT or --input_folder)")
    output, options = args.output, {}
    if args.output_folder:
        output, options = args.output_folder, {"tag_directory": True}
    if args.distributed:
        import torch.distributed as dist
        if "RANK" not in os.environ:
            raise ValueError("--distributed runs under torchrun (torchrun --nproc_per_node K -m deepspeed_ext "
                             "to-universal --distributed ...)")
        from deepspeed_ext.checkpoint.collective import RefusedOnEveryRank, on_every_rank
        dist.init_process_group("gloo")
        try:
            # Every rank opens the checkpoint; one that cannot is heard by all (the same one line everywhere).
            source = on_every_rank(lambda: _open(checkpoint, args.tag, accept=_TO_UNIVERSAL_READS))
            out = _write(source, output, "universal", args, distributed=True, **options)
        except RefusedOnEveryRank as exc:
            # torchrun stops the other ranks as soon as one exits with an error: every rank has the same message,
            # rank 0 says it, then all exit together.
            if dist.get_rank() == 0:
                _say_error(str(exc))
            dist.barrier()
            return 2
        finally:
            dist.destroy_process_group()
        if int(os.environ["RANK"]) != 0:
            return 0
    else:
        source = _open(checkpoint, args.tag, accept=_TO_UNIVERSAL_READS)
        out = _write(source, output, "universal", args, **options)
    _say_universal_written(args, source, out)
    return 0


def _say_universal_written(args: argparse.Namespace, source: Any, out: Path) -> None:
    if not args.quiet:
        info = source.info
        print(f"wrote universal checkpoint {out} ({len(info.layouts)} parameters, "
              f"TP={info.tp_degree} x DP={info.dp_degree}, ZeRO-{info.zero_stage}, metadata: {info.metadata})")


def _leave_distributed(code: int) -> NoReturn:
    """End the program of a ``--distributed`` rank whose work is done (published, or refused on every rank). Its
    gloo process group leaves a C++ thread behind that aborts the interpreter's teardown now and then ("terminate
    called without an active exception"), turning a finished conversion into exit code 1 under torchrun (1 run in
    4 here): flush, and leave without the teardown."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def cmd_to_maxtext(args: argparse.Namespace) -> int:
    from deepspeed_ext.checkpoint.maxtext import parse_mesh
    from deepspeed_ext.checkpoint.maxtext.orbax_io import import_orbax
    source = _open(args.source, args.tag, args.config, args.family, libraries=import_orbax, mtp=args.mtp)
    items = _write(source, args.output, "maxtext", args, family=args.family, scan_layers=args.scan_layers,
                   dtype=args.dtype, mesh=parse_mesh(args.mesh) if args.mesh is not None else None,
                   with_optimizer=args.with_optimizer, compression=args.compression, ocdbt=args.ocdbt)
    if not args.quiet:
        from deepspeed_ext.checkpoint.families import get_family, infer_family
        family = get_family(args.family) if args.family else infer_family(source.info.model_config)
        loading = (f"resume MaxText training from the full state (parameters, Adam moments, step) with "
                   f"load_full_state_path={items}, or load the parameters alone with load_parameters_path={items}"
                   if args.with_optimizer else f"load it with load_parameters_path={items} (parameters only: "
                   "--with-optimizer writes the full state, for load_full_state_path)")
        print(f"wrote MaxText checkpoint {items} (family {family.name}, scan_layers={args.scan_layers}, "
              f"{args.dtype}); {loading}")
        from deepspeed_ext.checkpoint.maxtext import maxtext_settings, settings_text
        from deepspeed_ext.errors import CheckpointError
        try:
            settings = settings_text(maxtext_settings(family, source.info.model_config or {}, args.scan_layers))
            print(f"the model, in MaxText's settings: {settings}")
        except CheckpointError as exc:
            print(f"no MaxText settings for this model: {exc}")
        if args.with_optimizer:
            from deepspeed_ext.checkpoint.maxtext import continuation_settings
            info = source.info
            optimizer, notes = continuation_settings(info.optimizer_settings, info.global_step, info.dp_degree,
                                                     family, info.model_config)
            if optimizer:
                print(f"the optimizer, in MaxText's settings (continues the run at step {info.global_step}): "
                      f"{settings_text(optimizer)}; and steps=<the step the MaxText run stops at>")
            for note in notes:
                print(f"  note: {note}")
    return 0


def cmd_from_maxtext(args: argparse.Namespace) -> int:
    source = _open(args.source, None, args.config, args.family, accept=_FROM_MAXTEXT_READS)
    if args.with_optimizer:
        source.require_optimizer()
    elif source.optimizer_kind == "other":
        print(f"note: {source.given}: {source.state_description}; the resumed run starts its optimizer fresh",
              file=sys.stderr)
    info = source.info
    out = _write(source, args.output, "universal", args, progress_label="from-maxtext", check_config_fit=True)
    if not args.quiet:
        optimizer = (f"Adam state at step {source.optimizer_step}" if info.has_optimizer else
                     "fresh optimizer state: the checkpoint holds parameters only" if source.optimizer_kind == "none"
                     else "fresh optimizer state: the checkpoint's is not optax adamw's")
        print(f"wrote universal checkpoint {out} ({len(info.layouts)} parameters, family {source.family.name}, "
              f"{optimizer}); resume with \"checkpoint\": {{\"load_universal\": true}} at any TP degree")
    return 0


def cmd_to_hf(args: argparse.Namespace) -> int:
    source = _open(args.source, args.tag, args.config, args.family, mtp=args.mtp)
    out = _write(source, args.output, "hf", args, dtype=args.dtype, max_shard_size=args.max_shard_size,
                 tokenizer=args.tokenizer, quantize=args.quantize, fp8_block=_fp8_block(args.fp8_block),
                 fp8_edge_tiles=args.fp8_edge_tiles, like=args.like)
    if not args.quiet:
        print(f"wrote HF checkpoint {out}; load it with AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


def _fp8_block(text: str) -> tuple[int, int]:
    """``--fp8-block ROWSxCOLS``."""
    try:
        rows, cols = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--fp8-block must be ROWSxCOLS, e.g. 128x128, not {text!r}") from None
    if rows <= 0 or cols <= 0:
        raise ValueError(f"--fp8-block must be positive, not {text!r}")
    return rows, cols


def _mtp_option(p: argparse.ArgumentParser, keep: bool = False) -> None:
    p.add_argument("--mtp", choices=["drop", "keep"] if keep else ["drop"],
                   help="HF sources: what to do with decoder layers past num_hidden_layers (DeepSeek-V3's "
                   "multi-token-prediction layer): drop them" + (", or keep them (written back untouched into the HF "
                   "output)" if keep else "") + "; without it such a checkpoint is refused")


def cmd_from_hf(args: argparse.Namespace) -> int:
    source = _open(args.source, None, args.config, dtype=args.dtype, mtp=args.mtp, accept=_FROM_HF_READS)
    out = _write(source, args.output, "universal", args, progress_label="from-hf")
    if not args.quiet:
        print(f"wrote universal checkpoint {out} ({len(source.info.layouts)} parameters, fresh optimizer state); "
              "train from it with \"checkpoint\": {\"load_universal\": true} at any TP degree")
    return 0


def cmd_reshard_orbax(args: argparse.Namespace) -> int:
    from deepspeed_ext.checkpoint.maxtext import parse_mesh, reshard_orbax
    from deepspeed_ext.checkpoint.formats import detect_all
    from deepspeed_ext.checkpoint.locate import MAXTEXT, maxtext_items
    from deepspeed_ext.errors import CheckpointError
    if MAXTEXT not in detect_all(args.source):
        raise CheckpointError(f"{args.source}: not a MaxText (Orbax) checkpoint (no _METADATA, no <step>/items)")
    from deepspeed_ext.checkpoint.maxtext.orbax_io import import_orbax
    import_orbax()
    _collect_garbage_again()
    items, whole = reshard_orbax(maxtext_items(Path(args.source)), args.output, parse_mesh(args.mesh),
                                 overwrite=args.overwrite, progress=not args.quiet, protect=[args.source])
    if whole:
        print(f"kept whole (no known MaxText logical axes): {', '.join(whole)}", file=sys.stderr)
    if not args.quiet:
        print(f"wrote {items} with storage chunks aligned to mesh {args.mesh}")
    return 0


def cmd_inspect(args: argparse.Namespace) -> int:
    source = _open(args.checkpoint, args.tag, args.config, args.family, mtp=args.mtp)
    summary: dict[str, Any] = source.summary()
    layouts = source.info.layouts
    from deepspeed_ext.checkpoint.formats import FORMATS
    full_tensors = FORMATS[source.info.format].holds_full_tensors
    if args.json:
        # DeepSpeed and universal checkpoints: the fp32 masters (and moments; the module's dtypes are in the
        # summary). A format of full tensors (HF, MaxText): each tensor's own dtype, from its metadata.
        dtypes = ({tensor.name: str(tensor.dtype).removeprefix("torch.") for tensor in source.tensors()}
                  if full_tensors else {})
        summary["parameters"] = {name: {"dtype": dtypes.get(name, "float32"), **layout.to_json()}
                                 for name, layout in layouts.items()}
        print(json.dumps(summary, indent=1))
        return 0
    for key, value in summary.items():
        print(f"{key:>18}: {value}")
    # HF and MaxText checkpoints hold full tensors: there is no TP layout to describe (not "replicated").
    width = max((len(n) for n in layouts), default=0)
    print(f"{'parameters':>18}:" + (" full tensors (the format has no tensor-parallel layout)" if full_tensors else ""))
    for name, layout in layouts.items():
        print(f"  {name:<{width}}  {str(list(layout.shape)):<14}" + ("" if full_tensors else f" {layout.describe()}"))
    return 0


def cmd_verify(args: argparse.Namespace) -> int:
    from deepspeed_ext.api import verify
    _collect_garbage_again()
    _say_which_trainer_checkpoint(args.path)
    report = verify(args.path, config=args.config, family=args.family, strict=args.strict)
    for line in report.lines():
        print(line)
    return 0 if report.ok else 1


def cmd_compare(args: argparse.Namespace) -> int:
    from deepspeed_ext.checkpoint.compare import Tolerance, compare_sources, logits_report
    if args.atol < 0 or args.rtol < 0 or args.ulp < 0:
        raise ValueError("--atol, --rtol and --ulp must not be negative")
    a = _open(args.a, config=args.config, family=args.family, mtp=args.mtp)
    b = _open(args.b, config=args.config, family=args.family, mtp=args.mtp)
    report = compare_sources(a, b, Tolerance(args.atol, args.rtol, args.ulp), progress=not args.quiet and not args.json)
    if args.logits:
        report.logits = logits_report(a, b)
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        print("\n".join(report.lines()))
    return 0 if report.ok else 1


def _global_options(p: argparse.ArgumentParser, subcommand: bool) -> None:
    """--debug and --quiet, accepted before the subcommand and after it (a subcommand's copy leaves the value
    alone unless given there)."""
    default: Any = argparse.SUPPRESS if subcommand else False
    p.add_argument("--debug", action="store_true", default=default,
                   help="on an error, show the full traceback instead of one line")
    p.add_argument("-q", "--quiet", action="store_true", default=default,
                   help="no progress bar, no summary; errors are still reported")


def _writer_options(p: argparse.ArgumentParser, convert: bool = True) -> None:
    """Options every command that writes a checkpoint shares (``convert``: it reads tensors from a source)."""
    p.add_argument("--overwrite", action="store_true",
                   help="replace an existing output (once the new one is complete; never the source)")
    if convert:
        p.add_argument("--check-finite", action="store_true",
                       help="check every tensor for NaN/Inf; if any has them, name the parameters and write nothing")


_FAMILY_HELP = "model family, one of: {families} (default: recorded with the checkpoint, else inferred from the model config)"
_TAG_HELP = "the DeepSpeed tag to read, e.g. global_step1000 (default: the one the 'latest' file names)"
_CONFIG_HELP = "an HF config.json to use (default: the model config saved with the checkpoint)"


def _command(sub: Any, name: str, summary: str, description: str, examples: str, extra: str | None = None
             ) -> argparse.ArgumentParser:
    p: argparse.ArgumentParser = sub.add_parser(
        name, help=summary, description=f"{summary[0].upper()}{summary[1:]}.\n\n{description}",
        epilog="examples:\n" + "\n".join(f"  {line.strip()}" for line in examples.strip().splitlines()),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _global_options(p, subcommand=True)
    p.set_defaults(extra=extra)
    return p


def _paragraph(text: str) -> str:
    import textwrap
    return textwrap.fill(" ".join(text.split()), width=100)


def build_parser() -> argparse.ArgumentParser:
    from deepspeed_ext.checkpoint.families import family_names
    family_help = _FAMILY_HELP.format(families=", ".join(family_names()))
    parser = argparse.ArgumentParser(
        prog="deepspeed-ext", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Universal checkpoints for DeepSpeed AutoTP + ZeRO: convert, inspect and verify checkpoints "
        "between DeepSpeed,\nDeepSpeed's universal layout, Hugging Face safetensors and MaxText (Orbax).",
        epilog="Run 'deepspeed-ext COMMAND --help' for a command's options and examples.")
    parser.add_argument("--version", action="store_true",
                        help="print the versions of deepspeed-ext, DeepSpeed and torch, and which extras are installed")
    _global_options(parser, subcommand=False)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    _add_to_universal(sub)
    _add_to_maxtext(sub, family_help)
    _add_from_maxtext(sub, family_help)
    _add_to_hf(sub, family_help)
    _add_from_hf(sub)
    _add_reshard_orbax(sub)
    _add_verify(sub, family_help)
    _add_compare(sub, family_help)
    _add_inspect(sub, family_help)
    return parser


def _add_to_universal(sub: Any) -> None:
    p = _command(sub, "to-universal", "merge TP slices and ZeRO partitions into DeepSpeed's universal layout", _paragraph("""
        Reads a DeepSpeed checkpoint saved at any TP x DP degree and ZeRO stage and writes one full tensor per
        parameter, with its fp32 master weights and Adam moments, in the layout upstream's ds_to_universal
        writes. Resume from it at any TP/DP degree with "checkpoint": {"load_universal": true}. The source is
        never modified. Takes ds_to_universal's own options too (--input_folder, --output_folder), so scripts
        switch by changing the program name."""), """
        deepspeed-ext to-universal checkpoints/              # writes checkpoints/global_stepN_universal + latest_universal
        deepspeed-ext to-universal checkpoints/ -o universal/
        deepspeed-ext to-universal --input_folder ckpt/global_step3 --output_folder ckpt/global_step3_universal""")
    p.add_argument("checkpoint", nargs="?", help="a DeepSpeed save directory (its 'latest' file names the tag), a "
                   "tag directory, or a Hugging Face Trainer output_dir / checkpoint-N folder")
    p.add_argument("--tag", help=_TAG_HELP)
    p.add_argument("-o", "--output", help="output save directory: OUT/<tag>_universal and OUT/latest_universal, "
                   "loadable with engine.load_checkpoint(OUT) (default: beside the tag, <save dir>/<tag>_universal "
                   "and <save dir>/latest_universal)")
    p.add_argument("--distributed", action="store_true",
                   help="run under torchrun: the ranks split the parameters (torch.distributed, gloo) and write "
                   "the same output a single process would")
    compat = p.add_argument_group("upstream ds_to_universal's options")
    compat.add_argument("--input_folder", help="the DeepSpeed tag directory (same as CHECKPOINT)")
    compat.add_argument("--output_folder", help="the universal directory itself; latest_universal naming it is "
                        "written beside it, as ds_to_universal does (instead of -o)")
    for option in ("--num_extract_workers", "--num_merge_workers"):
        compat.add_argument(option, type=int, help="accepted and ignored: deepspeed-ext streams tensor by tensor")
    for option in ("--keep_temp_folder", "--no_strict", "--inject_missing_state"):
        compat.add_argument(option, action="store_true", help="accepted and ignored: there is no temporary "
                            "folder, every output is checked, and missing state is an error")
    _writer_options(p)
    p.set_defaults(func=cmd_to_universal)


def _add_to_maxtext(sub: Any, family_help: str) -> None:
    p = _command(sub, "to-maxtext", "write an Orbax checkpoint in MaxText's layout", _paragraph("""
        Converts a DeepSpeed, universal or Hugging Face checkpoint into the parameter tree MaxText's own model
        code builds for the family (optionally with the Adam moments as MaxText's optax state), stored with
        Orbax at OUT/0/items. --mesh pre-shards the storage for a target device mesh."""), """
        deepspeed-ext to-maxtext checkpoints/ -o maxtext/
        deepspeed-ext to-maxtext checkpoints/ -o maxtext/ --with-optimizer --mesh fsdp=8,tensor=2""", extra="maxtext")
    p.add_argument("source", help="a DeepSpeed checkpoint (save or tag dir), a universal checkpoint or an HF "
                   "model directory")
    p.add_argument("-o", "--output", required=True, help="output root; MaxText loads <output>/0/items")
    p.add_argument("--tag", help=_TAG_HELP)
    p.add_argument("--family", help=family_help)
    p.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=True,
                   help="stack decoder layers on axis 1 as MaxText's scan_layers=true expects (default)")
    p.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16",
                   help="dtype of the parameters written (default bfloat16, MaxText's weight_dtype for "
                   "inference; float32 for training); Adam moments are always float32")
    p.add_argument("--mesh", help="target mesh as AXIS=SIZE pairs, e.g. fsdp=16,tensor=2: storage chunks become "
                   "one device's shard under MaxText's sharding rules (any MaxText mesh axis; parameters are "
                   "split over fsdp, tensor, expert and stage)")
    p.add_argument("--with-optimizer", action="store_true",
                   help="also write the Adam moments as MaxText's optax adamw state (opt_state)")
    p.add_argument("--compression", choices=["zstd", "none"], default="zstd",
                   help="each storage chunk's codec: zstd (default, as MaxText writes its own) or none (larger "
                   "files, written and restored without (de)compressing: docs/maxtext.md)")
    p.add_argument("--ocdbt", action=argparse.BooleanOptionalAction, default=True,
                   help="all arrays in one OCDBT store, as MaxText writes (default); --no-ocdbt: each array a "
                   "directory of chunk files, written by deepspeed-ext itself with --compression none "
                   "(docs/maxtext.md)")
    p.add_argument("--config", help=_CONFIG_HELP)
    _mtp_option(p)
    _writer_options(p)
    p.set_defaults(func=cmd_to_maxtext)


def _add_from_maxtext(sub: Any, family_help: str) -> None:
    p = _command(sub, "from-maxtext", "a MaxText Orbax checkpoint back into the universal form", _paragraph("""
        Reads a MaxText checkpoint (parameters, and the Adam state when it has one) and writes DeepSpeed's
        universal layout, which DeepSpeed resumes from at any TP degree with "checkpoint":
        {"load_universal": true}."""), """
        deepspeed-ext from-maxtext maxtext/ -o universal/
        deepspeed-ext from-maxtext run/checkpoints/1000/items -o universal/ --config config.json""",
                 extra="maxtext")
    p.add_argument("source", help="the MaxText checkpoint: its root, a step directory or <root>/<step>/items")
    p.add_argument("-o", "--output", required=True, help="output save directory: OUT/<tag>_universal and "
                   "OUT/latest_universal, loadable with engine.load_checkpoint(OUT)")
    p.add_argument("--config", help="an HF config.json describing the model (default: the one to-maxtext recorded)")
    p.add_argument("--family", help=family_help)
    p.add_argument("--with-optimizer", action="store_true",
                   help="the run must continue its optimizer: refuse a checkpoint without optax adamw's state "
                   "(parameters only, or another MaxText optimizer's) instead of writing a fresh one")
    _writer_options(p)
    p.set_defaults(func=cmd_from_maxtext)


def _add_to_hf(sub: Any, family_help: str) -> None:
    p = _command(sub, "to-hf", "write a Hugging Face checkpoint (config.json + sharded safetensors)", _paragraph("""
        Writes what save_pretrained would: config.json, the weights as safetensors (sharded, with an index,
        above --max-shard-size), generation_config.json, and the tokenizer files of the checkpoint's folder
        (or of --tokenizer). Unlike DeepSpeed's zero_to_fp32.py, which gathers ZeRO partitions into one fp32
        state dict of a single TP degree, to-hf also merges TP slices, keeps the model's dtype (bf16 stays
        bf16) and writes a folder AutoModelForCausalLM.from_pretrained loads."""), """
        deepspeed-ext to-hf checkpoints/ -o hf/
        deepspeed-ext to-hf trainer_out/ -o hf/ --dtype bfloat16 --max-shard-size 2GB
        deepspeed-ext to-hf checkpoints/ -o hf/ --tokenizer path/to/tokenizer""", extra="hf")
    p.add_argument("source", help="a DeepSpeed checkpoint (save or tag dir), a Trainer output_dir, a universal "
                   "checkpoint, an HF model directory (to re-shard it) or a MaxText checkpoint (<root> or "
                   "<root>/0/items)")
    p.add_argument("-o", "--output", required=True, help="output directory")
    p.add_argument("--tag", help=_TAG_HELP)
    p.add_argument("--dtype", choices=["source", "bfloat16", "float32"], default="source",
                   help="weights dtype (default: the dtype the source model had)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 2GB or 500MB (default 5GB)")
    p.add_argument("--tokenizer", help="a directory whose tokenizer files (tokenizer.json, tokenizer_config.json, "
                   "...) to add to the output")
    p.add_argument("--quantize", choices=["fp8", "mxfp4"],
                   help="write quantized weights as releases ship them: fp8 = block FP8 (e4m3 with a "
                   "weight_scale_inv per tile, DeepSeek-V3's format) of every linear weight that is whole tiles; "
                   "mxfp4 = gpt-oss's experts (*_blocks, *_scales)")
    p.add_argument("--fp8-block", default="128x128", help="--quantize fp8: the tile, ROWSxCOLS (default 128x128)")
    p.add_argument("--fp8-edge-tiles", action="store_true",
                   help="--quantize fp8: also quantize weights that are not whole tiles, with partial tiles at the "
                   "edges, as DeepSeek-V3's release does (transformers 5.22 misreads those; by default they stay "
                   "unquantized and are listed in modules_to_not_convert)")
    p.add_argument("--like", help="the original release's HF directory: write its layout (a multimodal model's "
                   "naming and config), with the tensors the trained model lacks (vision tower, projector, "
                   "multi-token-prediction layer) copied from it")
    _mtp_option(p, keep=True)
    p.add_argument("--config", help=_CONFIG_HELP)
    p.add_argument("--family", help="MaxText sources: " + family_help)
    _writer_options(p)
    p.set_defaults(func=cmd_to_hf)


def _add_from_hf(sub: Any) -> None:
    p = _command(sub, "from-hf", "a Hugging Face checkpoint (safetensors) into the universal form", _paragraph("""
        Reads an HF model directory (config.json and *.safetensors, with or without an index) and writes
        DeepSpeed's universal layout with fresh optimizer state: start DeepSpeed AutoTP training from
        pretrained weights at any TP degree with "checkpoint": {"load_universal": true}."""), """
        deepspeed-ext from-hf Llama-3.1-8B/ -o universal/
        deepspeed-ext from-hf model/ -o universal/ --dtype float32""", extra="hf")
    p.add_argument("source", help="HF model directory: config.json and *.safetensors (with or without an index)")
    p.add_argument("-o", "--output", required=True, help="output save directory: OUT/global_step0_universal and "
                   "OUT/latest_universal, loadable with engine.load_checkpoint(OUT)")
    p.add_argument("--config", help="an HF config.json to use (default: the directory's config.json)")
    p.add_argument("--dtype", choices=["source", "bfloat16", "float32"], default="source",
                   help="dtype of the stored weights (default: the files' dtype; block-FP8 and MXFP4 weights: the "
                   "dtype transformers dequantizes them to)")
    _mtp_option(p)
    _writer_options(p)
    p.set_defaults(func=cmd_from_hf)


def _add_reshard_orbax(sub: Any) -> None:
    p = _command(sub, "reshard-orbax", "re-chunk a MaxText Orbax checkpoint for a target mesh, array by array",
                 _paragraph("""
        Rewrites each array of a MaxText checkpoint with storage chunks of one device's shard under the
        target mesh, so that each host reads only its own bytes when MaxText restores it. Values are
        unchanged."""), """
        deepspeed-ext reshard-orbax maxtext/ -o maxtext-fsdp16/ --mesh fsdp=16,tensor=2""", extra="maxtext")
    p.add_argument("source", help="the MaxText checkpoint: its root, a step directory or <root>/<step>/items")
    p.add_argument("-o", "--output", required=True, help="output root; the result is <output>/0/items")
    p.add_argument("--mesh", required=True, help="target mesh as AXIS=SIZE pairs, e.g. fsdp=16,tensor=2,expert=4 "
                   "(any MaxText mesh axis)")
    _writer_options(p, convert=False)
    p.set_defaults(func=cmd_reshard_orbax)


def _add_verify(sub: Any, family_help: str) -> None:
    p = _command(sub, "verify", "check a checkpoint's files and tensors", _paragraph("""
        A converted checkpoint (universal, HF or MaxText) is checked against the manifest deepspeed-ext wrote
        with it (every file's size and CRC32C), a DeepSpeed one file by file; then every tensor's shape,
        dtype and finiteness. Files added beside an output (a README, a tokenizer) are reported as not
        covered by the manifest without failing, unless --strict. Exit status 0 when it is sound, 1
        otherwise."""), """
        deepspeed-ext verify universal/
        deepspeed-ext verify hf/ --strict""")
    p.add_argument("path", help="a checkpoint directory (any format; for MaxText the root or <root>/0/items)")
    p.add_argument("--strict", action="store_true",
                   help="files the manifest does not list are problems too (default: reported, exit 0)")
    p.add_argument("--config", help="an HF config.json where the checkpoint has none (MaxText, HF)")
    p.add_argument("--family", help="MaxText: " + family_help)
    p.set_defaults(func=cmd_verify)


def _add_compare(sub: Any, family_help: str) -> None:
    p = _command(sub, "compare", "compare two checkpoints of any formats, tensor by tensor", _paragraph("""
        Lines both checkpoints' tensors up by their Hugging Face names (MaxText's through the family registry)
        and, for each tensor and state both have (fp32 master, exp_avg, exp_avg_sq, step), reports shapes,
        dtypes, the largest absolute and relative difference and the largest difference in ulps of the lower
        of the two precisions. Names only one side has are listed. An element is within tolerance when it is
        at most --ulp ulps away or |a-b| <= --atol + --rtol*|b|; the defaults ask for equality in the lower
        precision. --logits also runs transformers' model of each side on fixed tokens. Exit status 0 within
        tolerance, 1 otherwise."""), """
        deepspeed-ext compare ckpt/ ckpt_universal/
        deepspeed-ext compare ckpt/ hf/ --json
        deepspeed-ext compare hf/ maxtext/ --ulp 2 --logits""")
    p.add_argument("a", help="a checkpoint directory (any format)")
    p.add_argument("b", help="another checkpoint directory (any format)")
    p.add_argument("--atol", type=float, default=0.0, help="absolute tolerance per element (default 0)")
    p.add_argument("--rtol", type=float, default=0.0, help="relative tolerance per element (default 0)")
    p.add_argument("--ulp", type=int, default=0,
                   help="ulps of the lower precision an element may differ by (default 0: equal in it)")
    p.add_argument("--logits", action="store_true",
                   help="also compare transformers' logits of both on fixed tokens (per-token KL, argmax agreement)")
    p.add_argument("--json", action="store_true", help="the report as JSON on stdout")
    _mtp_option(p)
    p.add_argument("--config", help="an HF config.json for a side that has none (MaxText, HF)")
    p.add_argument("--family", help="MaxText: " + family_help)
    p.set_defaults(func=cmd_compare)


def _add_inspect(sub: Any, family_help: str) -> None:
    p = _command(sub, "inspect", "describe a checkpoint (DeepSpeed, universal, HF or MaxText)", _paragraph("""
        Prints the format, step, TP x DP degree, ZeRO stage, dtypes, model config and every parameter's shape
        and tensor-parallel layout, plus how to resume from it. Reads metadata only."""), """
        deepspeed-ext inspect checkpoints/
        deepspeed-ext inspect checkpoints/global_step1000 --json | jq .parameters""")
    p.add_argument("checkpoint", help="a checkpoint directory in any format (a DeepSpeed save or tag directory, "
                   "a Trainer output_dir, a universal, HF or MaxText checkpoint)")
    p.add_argument("--tag", help=_TAG_HELP)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _mtp_option(p)
    p.add_argument("--config", help="an HF config.json where the checkpoint has none (MaxText, HF)")
    p.add_argument("--family", help="MaxText: " + family_help)
    p.set_defaults(func=cmd_inspect)


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
    # Importing torch, DeepSpeed, JAX and Orbax creates millions of objects that live as long as the process; the
    # collections their creation triggered found next to nothing but walked them all (1-2 s of each command on a
    # 2-core VM, docs/performance.md). The collector is off until the source is open (_open) or the command starts
    # its work, and on again whatever happens before that.
    global _COLLECTOR_HELD
    if argv is None and gc.isenabled():  # the program itself; a caller in Python keeps its collector as it is
        gc.disable()
        _COLLECTOR_HELD = True
    try:
        return _run(argv)
    finally:
        _collect_garbage_again(freeze=False)  # a command that ended before its source was open


def _idle_openmp_workers_sleep() -> None:
    """``OMP_WAIT_POLICY=PASSIVE`` unless the user chose a policy: torch's OpenMP workers then sleep between
    parallel operations instead of spinning, by default, for a while after each. A conversion runs many short
    operations between the work of its other threads (tensorstore's writers, the checksum and content-check
    threads), and the spinning took the cores those threads needed: a bf16 to-maxtext of 608M parameters on a
    2-core VM ran 10.3 / 9.0 s with spinning workers and 8.5 / 7.2 s with sleeping ones (user CPU 11.8 / 11.1
    against 8.4 / 7.2 s; docs/performance.md). libgomp reads the policy once, when torch loads it."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


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
        if not args.quiet and sys.stderr.isatty() and args.func is not cmd_inspect:
            print(f"deepspeed-ext {args.command}: loading libraries...", file=sys.stderr, flush=True)
        code = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, rather than at exit
        if argv is None and getattr(args, "distributed", False):
            _leave_distributed(code)  # the program itself; a caller in Python gets the code back
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
        _say_error(_os_error_line(exc) if isinstance(exc, OSError) else str(exc))
        return 2
    except (KeyError, TypeError, AttributeError, IndexError, AssertionError) as exc:
        # A structure no reader check anticipated: still one line, naming the input, never a traceback.
        if args.debug:
            traceback.print_exc()
        inputs = [str(getattr(args, name)) for name in ("source", "checkpoint", "input_folder", "a", "b")
                  if getattr(args, name, None) is not None]
        where = ", ".join(dict.fromkeys(inputs)) or args.command
        print(f"deepspeed-ext: error: {where}: unexpected content ({type(exc).__name__}: {exc}); the checkpoint is "
              "damaged or in a layout deepspeed-ext does not know (--debug shows where)", file=sys.stderr)
        return 2


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


def _say_error(message: str) -> None:
    """``deepspeed-ext: error: MESSAGE`` on stderr in one write, so the ranks of a torchrun (unbuffered, one
    pipe) never run their lines together."""
    sys.stderr.write(f"deepspeed-ext: error: {message}\n")
    sys.stderr.flush()


def _interrupted() -> int:
    """A KeyboardInterrupt that reached here (main() called without the signal handler, from a thread):
    every writer has unwound and removed its staging directory; say so in one line (exit 130, as shells do)."""
    from deepspeed_ext.checkpoint.output import discard_in_flight
    discard_in_flight()
    print("deepspeed-ext: interrupted; nothing was written", file=sys.stderr)
    return 130
