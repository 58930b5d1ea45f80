"""The converting commands: to-universal, to-maxtext, from-maxtext, to-hf, from-hf, reshard-orbax."""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from deepspeed_ext.cli.common import (CONFIG_HELP, TAG_HELP, collect_garbage_again, command_parser, mtp_option,
                                      paragraph, read_source, say_error, write_output, writer_options)

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

    def open_source() -> Any:
        return read_source(checkpoint, args.tag, reads="deepspeed", command="to-universal")

    def write(source: Any) -> Any:
        return write_output(source, output, "universal", args, distributed=args.distributed, **options)

    done = _on_every_rank("to-universal", open_source, write) if args.distributed else (source := open_source(),
                                                                                         write(source))
    if isinstance(done, int):
        return done
    source, out = done
    _say_universal_written(args, source, out)
    return 0


def _on_every_rank(command: str, open_source: Callable[[], Any], write: Callable[[Any], Any]
                   ) -> tuple[Any, Path] | int:
    """Open the source and write its universal form on every rank of a torchrun job, the ranks joined in a gloo
    group that splits the parameters between them (one host, or several sharing a file system: the ranks find each
    other through torchrun's rendezvous). Returns rank 0's (source, output), or an exit code: 0 on the other ranks,
    2 where a rank could not open the source (every rank has the same one line; rank 0 says it)."""
    import torch.distributed as dist
    if "RANK" not in os.environ:
        raise ValueError(f"--distributed runs under torchrun (torchrun --nproc_per_node K -m deepspeed_ext "
                         f"{command} --distributed ...)")
    from deepspeed_ext.checkpoint.collective import RefusedOnEveryRank, on_every_rank
    dist.init_process_group("gloo")
    try:
        # Every rank opens the checkpoint; one that cannot is heard by all (the same one line everywhere). The
        # write agrees on its own failures at its own points.
        source = on_every_rank(open_source)
        out = write(source)
    except RefusedOnEveryRank as exc:
        # torchrun stops the other ranks as soon as one exits with an error: every rank has the same message,
        # rank 0 says it, then all exit together.
        if dist.get_rank() == 0:
            say_error(str(exc))
        dist.barrier()
        return 2
    finally:
        dist.destroy_process_group()
    return (source, out) if int(os.environ["RANK"]) == 0 else 0


def _say_universal_written(args: argparse.Namespace, source: Any, out: Path) -> None:
    if not args.quiet:
        info = source.info
        print(f"wrote universal checkpoint {out} ({len(info.layouts)} parameters, "
              f"TP={info.tp_degree} x DP={info.dp_degree}, ZeRO-{info.zero_stage}, metadata: {info.metadata})")


def cmd_to_maxtext(args: argparse.Namespace) -> int:
    from deepspeed_ext.checkpoint.maxtext import parse_mesh
    from deepspeed_ext.checkpoint.maxtext.orbax_io import import_orbax
    source = read_source(args.source, args.tag, args.config, args.family, libraries=import_orbax, mtp=args.mtp)
    if args.with_optimizer:
        from deepspeed_ext.checkpoint.adapter_export import adapter_model, refuse_optimizer_export
        if adapter_model(source) is not None:
            refuse_optimizer_export(source)
    items = write_output(source, args.output, "maxtext", args, family=args.family, scan_layers=args.scan_layers,
                   dtype=args.dtype, mesh=parse_mesh(args.mesh) if args.mesh is not None else None,
                   with_optimizer=args.with_optimizer, compression=args.compression, ocdbt=args.ocdbt,
                   **_adapter_options(args))
    if not args.quiet:
        from deepspeed_ext.checkpoint.families import get_family, infer_family
        family = get_family(args.family) if args.family else infer_family(source.info.model_config or {})
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
    from deepspeed_ext.checkpoint.maxtext.reader import MaxTextCheckpoint
    source = read_source(args.source, None, args.config, args.family, reads="maxtext", command="from-maxtext")
    assert isinstance(source, MaxTextCheckpoint)  # the one format from-maxtext reads
    if args.with_optimizer:
        source.require_optimizer()
    elif source.optimizer_kind == "other":
        print(f"note: {source.given}: {source.state_description}; the resumed run starts its optimizer fresh",
              file=sys.stderr)
    info = source.info
    out = write_output(source, args.output, "universal", args, progress_label="from-maxtext", check_config_fit=True)
    if not args.quiet:
        optimizer = (f"Adam state at step {source.optimizer_step}" if info.has_optimizer else
                     "fresh optimizer state: the checkpoint holds parameters only" if source.optimizer_kind == "none"
                     else "fresh optimizer state: the checkpoint's is not optax adamw's")
        print(f"wrote universal checkpoint {out} ({len(info.layouts)} parameters, family {source.family.name}, "
              f"{optimizer}); resume with \"checkpoint\": {{\"load_universal\": true}} at any TP degree")
    return 0


def cmd_to_hf(args: argparse.Namespace) -> int:
    source = read_source(args.source, args.tag, args.config, args.family, mtp=args.mtp)
    out = write_output(source, args.output, "hf", args, dtype=args.dtype, max_shard_size=args.max_shard_size,
                 tokenizer=args.tokenizer, quantize=args.quantize, fp8_block=_fp8_block(args.fp8_block),
                 fp8_edge_tiles=args.fp8_edge_tiles, like=args.like, **_adapter_options(args))
    if args.quiet:
        return 0
    from deepspeed_ext.checkpoint.adapter_export import adapter_model
    adapters = adapter_model(source, args.adapter_config)
    if adapters is not None and not args.merge:
        chosen = adapters.choose(args.adapter or (), str(args.source))
        print(f"wrote PEFT adapter {out} ({'; '.join(adapters.adapters[a].describe() for a in chosen)}); load it with "
              f"PeftModel.from_pretrained(base_model, {str(out)!r}); --merge writes the merged model")
    else:
        merged = " (the adapters merged into the base)" if adapters is not None else ""
        print(f"wrote HF checkpoint {out}{merged}; load it with AutoModelForCausalLM.from_pretrained({str(out)!r})")
    return 0


def _adapter_options(args: argparse.Namespace) -> dict[str, Any]:
    """The adapter options a command was given (docs/adapters.md), for ``convert``."""
    found: dict[str, Any] = {}
    if getattr(args, "merge", False):
        found["merge"] = True
    if getattr(args, "adapter", None):
        found["adapters"] = tuple(args.adapter)
    if getattr(args, "base", None):
        found["base"] = args.base
    if getattr(args, "adapter_config", None):
        found["adapter_config"] = args.adapter_config
    return found


def adapter_arguments(p: argparse.ArgumentParser, merge: bool) -> None:
    """The options of a command that exports adapter checkpoints (peft LoRA: docs/adapters.md)."""
    group = p.add_argument_group("adapter checkpoints (peft LoRA)")
    if merge:
        group.add_argument("--merge", action="store_true", help="write the merged model (base + scale * B @ A per "
                           "adapted layer) instead of the PEFT adapter directory")
    group.add_argument("--adapter", action="append", metavar="NAME", help="the adapter to write or merge (repeat for "
                       "several; default: the active ones)")
    group.add_argument("--base", help="the base model as an HF directory: its weights are merged into (checked "
                       "against the checkpoint's frozen copy)")
    group.add_argument("--adapter-config", help="an adapter_config.json, for a checkpoint that records no peft config")


def _fp8_block(text: str) -> tuple[int, int]:
    """``--fp8-block ROWSxCOLS``."""
    try:
        rows, cols = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise ValueError(f"--fp8-block must be ROWSxCOLS, e.g. 128x128, not {text!r}") from None
    if rows <= 0 or cols <= 0:
        raise ValueError(f"--fp8-block must be positive, not {text!r}")
    return rows, cols


def cmd_from_hf(args: argparse.Namespace) -> int:
    def open_source() -> Any:
        return read_source(args.source, None, args.config, dtype=args.dtype, mtp=args.mtp, reads="huggingface",
                           command="from-hf", base=args.base)

    def write(source: Any) -> Any:
        return write_output(source, args.output, "universal", args, progress_label="from-hf",
                            distributed=args.distributed)

    done = _on_every_rank("from-hf", open_source, write) if args.distributed else (source := open_source(),
                                                                                    write(source))
    if isinstance(done, int):
        return done
    source, out = done
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
    collect_garbage_again()
    found = maxtext_items(Path(args.source))
    if found is None:
        raise CheckpointError(f"{args.source}: no <step>/items in this MaxText (Orbax) checkpoint")
    items, whole = reshard_orbax(found, args.output, parse_mesh(args.mesh),
                                 overwrite=args.overwrite, progress=not args.quiet, protect=[args.source])
    if whole:
        print(f"kept whole (no known MaxText logical axes): {', '.join(whole)}", file=sys.stderr)
    if not args.quiet:
        print(f"wrote {items} with storage chunks aligned to mesh {args.mesh}")
    return 0


def add_to_universal(sub: Any) -> None:
    p = command_parser(sub, "to-universal", "merge TP slices and ZeRO partitions into DeepSpeed's universal layout", paragraph("""
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
    p.add_argument("--tag", help=TAG_HELP)
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
    writer_options(p)
    p.set_defaults(func=cmd_to_universal)


def add_to_maxtext(sub: Any, family_help: str) -> None:
    p = command_parser(sub, "to-maxtext", "write an Orbax checkpoint in MaxText's layout", paragraph("""
        Converts a DeepSpeed, universal or Hugging Face checkpoint into the parameter tree MaxText's own model
        code builds for the family (optionally with the Adam moments as MaxText's optax state), stored with
        Orbax at OUT/0/items. --mesh pre-shards the storage for a target device mesh."""), """
        deepspeed-ext to-maxtext checkpoints/ -o maxtext/
        deepspeed-ext to-maxtext checkpoints/ -o maxtext/ --with-optimizer --mesh fsdp=8,tensor=2""", extra="maxtext")
    p.add_argument("source", help="a DeepSpeed checkpoint (save or tag dir), a universal checkpoint or an HF "
                   "model directory")
    p.add_argument("-o", "--output", required=True, help="output root; MaxText loads <output>/0/items")
    p.add_argument("--tag", help=TAG_HELP)
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
    p.add_argument("--config", help=CONFIG_HELP)
    mtp_option(p)
    adapter_arguments(p, merge=False)
    writer_options(p)
    p.set_defaults(func=cmd_to_maxtext)


def add_from_maxtext(sub: Any, family_help: str) -> None:
    p = command_parser(sub, "from-maxtext", "a MaxText Orbax checkpoint back into the universal form", paragraph("""
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
    writer_options(p)
    p.set_defaults(func=cmd_from_maxtext)


def add_to_hf(sub: Any, family_help: str) -> None:
    p = command_parser(sub, "to-hf", "write a Hugging Face checkpoint (config.json + sharded safetensors)", paragraph("""
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
    p.add_argument("--tag", help=TAG_HELP)
    p.add_argument("--dtype", choices=["source", "bfloat16", "float32"], default="source",
                   help="weights dtype (default: the dtype the source model had)")
    p.add_argument("--max-shard-size", default="5GB", help="largest safetensors file, e.g. 2GB or 500MB (default 5GB)")
    p.add_argument("--tokenizer", help="a directory whose tokenizer files (tokenizer.json, tokenizer_config.json, "
                   "...) to add to the output")
    p.add_argument("--quantize", choices=["fp8", "mxfp4"],
                   help="write quantized weights as releases ship them: fp8 = block FP8 (e4m3 with a "
                   "weight_scale_inv per tile, DeepSeek-V3's format) of every linear weight that is whole tiles, "
                   "or, --like a DeepSeek-V4 release (or from one, --mtp keep), that release's own format (E8M0 "
                   "power-of-two .scale tensors, FP4 experts); mxfp4 = gpt-oss's experts (*_blocks, *_scales)")
    p.add_argument("--fp8-block", default="128x128", help="--quantize fp8: the tile, ROWSxCOLS (default 128x128)")
    p.add_argument("--fp8-edge-tiles", action="store_true",
                   help="--quantize fp8: also quantize weights that are not whole tiles, with partial tiles at the "
                   "edges, as DeepSeek-V3's release does (transformers 5.22 misreads those; by default they stay "
                   "unquantized and are listed in modules_to_not_convert)")
    p.add_argument("--like", help="the original release's HF directory: write its layout (a multimodal model's "
                   "naming and config), with the tensors the trained model lacks (vision tower, projector, "
                   "multi-token-prediction layer) copied from it")
    mtp_option(p, keep=True)
    p.add_argument("--config", help=CONFIG_HELP)
    p.add_argument("--family", help="MaxText sources: " + family_help)
    adapter_arguments(p, merge=True)
    writer_options(p)
    p.set_defaults(func=cmd_to_hf)


def add_from_hf(sub: Any) -> None:
    p = command_parser(sub, "from-hf", "a Hugging Face checkpoint (safetensors) into the universal form", paragraph("""
        Reads an HF model directory (config.json and *.safetensors, with or without an index) and writes
        DeepSpeed's universal layout with fresh optimizer state: start DeepSpeed AutoTP training from
        pretrained weights at any TP degree with "checkpoint": {"load_universal": true}."""), """
        deepspeed-ext from-hf Llama-3.1-8B/ -o universal/
        deepspeed-ext from-hf model/ -o universal/ --dtype float32
        torchrun --nnodes 2 --nproc-per-node 1 ... -m deepspeed_ext from-hf release/ -o universal/ --distributed""",
                       extra="hf")
    p.add_argument("source", help="HF model directory: config.json and *.safetensors (with or without an index)")
    p.add_argument("-o", "--output", required=True, help="output save directory: OUT/global_step0_universal and "
                   "OUT/latest_universal, loadable with engine.load_checkpoint(OUT)")
    p.add_argument("--config", help="an HF config.json to use (default: the directory's config.json)")
    p.add_argument("--dtype", choices=["source", "bfloat16", "float32"], default="source",
                   help="dtype of the stored weights (default: the files' dtype; block-FP8 and MXFP4 weights: the "
                   "dtype transformers dequantizes them to)")
    mtp_option(p)
    p.add_argument("--base", help="SOURCE is a PEFT adapter directory (adapter_config.json): its base model, an HF "
                   "directory (default: the local directory its base_model_name_or_path names); the output holds "
                   "the PeftModel's parameters, the base frozen (docs/adapters.md)")
    p.add_argument("--distributed", action="store_true",
                   help="run under torchrun, on one host or several sharing a file system: the ranks split the "
                   "tensors (torch.distributed, gloo) and write the same output a single process would")
    writer_options(p)
    p.set_defaults(func=cmd_from_hf)


def add_reshard_orbax(sub: Any) -> None:
    p = command_parser(sub, "reshard-orbax", "re-chunk a MaxText Orbax checkpoint for a target mesh, array by array",
                 paragraph("""
        Rewrites each array of a MaxText checkpoint with storage chunks of one device's shard under the
        target mesh, so that each host reads only its own bytes when MaxText restores it. Values are
        unchanged."""), """
        deepspeed-ext reshard-orbax maxtext/ -o maxtext-fsdp16/ --mesh fsdp=16,tensor=2""", extra="maxtext")
    p.add_argument("source", help="the MaxText checkpoint: its root, a step directory or <root>/<step>/items")
    p.add_argument("-o", "--output", required=True, help="output root; the result is <output>/0/items")
    p.add_argument("--mesh", required=True, help="target mesh as AXIS=SIZE pairs, e.g. fsdp=16,tensor=2,expert=4 "
                   "(any MaxText mesh axis)")
    writer_options(p, convert=False)
    p.set_defaults(func=cmd_reshard_orbax)
