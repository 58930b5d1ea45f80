"""The commands that read without converting: inspect, verify, compare."""

from __future__ import annotations

import argparse
import json
from typing import Any

from deepspeed_ext.cli.common import (TAG_HELP, collect_garbage_again, command_parser, mtp_option, paragraph,
                                      read_source, say_which_trainer_checkpoint)

def cmd_inspect(args: argparse.Namespace) -> int:
    source = read_source(args.checkpoint, args.tag, args.config, args.family, mtp=args.mtp, base=args.base)
    summary: dict[str, Any] = source.summary()
    from deepspeed_ext.checkpoint.adapter_export import adapter_model
    adapters = adapter_model(source)
    if adapters is not None:  # a peft model's checkpoint: what its adapters are (docs/adapters.md)
        summary.update(adapters.summary())
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
    collect_garbage_again()
    say_which_trainer_checkpoint(args.path)
    report = verify(args.path, config=args.config, family=args.family, strict=args.strict)
    for line in report.lines():
        print(line)
    return 0 if report.ok else 1


def cmd_compare(args: argparse.Namespace) -> int:
    from deepspeed_ext.checkpoint.compare import Tolerance, compare_sources, logits_report
    if args.atol < 0 or args.rtol < 0 or args.ulp < 0:
        raise ValueError("--atol, --rtol and --ulp must not be negative")
    a = read_source(args.a, config=args.config, family=args.family, mtp=args.mtp)
    b = read_source(args.b, config=args.config, family=args.family, mtp=args.mtp)
    report = compare_sources(a, b, Tolerance(args.atol, args.rtol, args.ulp), progress=not args.quiet and not args.json)
    if args.logits:
        report.logits = logits_report(a, b)
    if args.json:
        print(json.dumps(report.to_json(), indent=1))
    else:
        print("\n".join(report.lines()))
    return 0 if report.ok else 1


def add_verify(sub: Any, family_help: str) -> None:
    p = command_parser(sub, "verify", "check a checkpoint's files and tensors", paragraph("""
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


def add_compare(sub: Any, family_help: str) -> None:
    p = command_parser(sub, "compare", "compare two checkpoints of any formats, tensor by tensor", paragraph("""
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
    mtp_option(p)
    p.add_argument("--config", help="an HF config.json for a side that has none (MaxText, HF)")
    p.add_argument("--family", help="MaxText: " + family_help)
    p.set_defaults(func=cmd_compare)


def add_inspect(sub: Any, family_help: str) -> None:
    p = command_parser(sub, "inspect", "describe a checkpoint (DeepSpeed, universal, HF or MaxText)", paragraph("""
        Prints the format, step, TP x DP degree, ZeRO stage, dtypes, model config and every parameter's shape
        and tensor-parallel layout, plus how to resume from it. Reads metadata only."""), """
        deepspeed-ext inspect checkpoints/
        deepspeed-ext inspect checkpoints/global_step1000 --json | jq .parameters""")
    p.add_argument("checkpoint", help="a checkpoint directory in any format (a DeepSpeed save or tag directory, "
                   "a Trainer output_dir, a universal, HF or MaxText checkpoint)")
    p.add_argument("--tag", help=TAG_HELP)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    mtp_option(p)
    p.add_argument("--config", help="an HF config.json where the checkpoint has none (MaxText, HF)")
    p.add_argument("--base", help="a PEFT adapter directory's base model (an HF directory; default: the local "
                   "directory its base_model_name_or_path names)")
    p.add_argument("--family", help="MaxText: " + family_help)
    p.set_defaults(func=cmd_inspect)
