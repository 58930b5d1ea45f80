"""Digests of every conversion's output, to show a refactoring changed no output byte.

    .venv/bin/python bench/digests.py --workdir /tmp/digests --save before.json   # on the old code
    .venv/bin/python bench/digests.py --workdir /tmp/digests --compare before.json  # on the new code

Trains small checkpoints with the demo's training script (once per workdir: TP=2 Llama at ZeRO-0, ZeRO-1 and
ZeRO-3, and a TP=2 Qwen3-MoE at ZeRO-1), runs every command that writes on them and on each other's outputs,
and records the sha256 of every output file (and of ``inspect --json``'s text). Exit 1 if ``--compare`` finds
a difference.

Orbax names its OCDBT data files at random and writes the commit time into ``_CHECKPOINT_METADATA``: for a
MaxText output the arrays are compared instead (each array's dtype, shape, storage chunk and bytes, read back
with tensorstore), ``_CHECKPOINT_METADATA`` without its timestamps, and our manifest without the randomly named
files; every other file byte for byte.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import io
import json
import shutil
import sys
from pathlib import Path

from deepspeed_ext.demo.runner import torchrun_train

ORBAX_STEP_METADATA = "_CHECKPOINT_METADATA"
MANIFEST = "deepspeed_ext.manifest.json"


def _orbax_random(rel: str) -> bool:
    """OCDBT's data and manifest files, named at random (their content is compared array by array)."""
    parts = rel.split("/")
    return "d" in parts[:-1] or parts[-1] == "manifest.ocdbt"

SOURCES = {
    "llama_zero0": ["--family", "llama", "--zero", "0", "--dtype", "bf16"],
    "llama_zero1": ["--family", "llama", "--zero", "1", "--dtype", "bf16"],
    "llama_zero3": ["--family", "llama", "--zero", "3", "--dtype", "bf16"],
    "moe_zero1": ["--family", "qwen3_moe", "--zero", "1", "--dtype", "bf16"],
}


def conversions(ckpt: dict[str, Path], out: Path) -> list[tuple[str, list[str]]]:
    """``(case, argv)`` in dependency order: later cases read earlier cases' outputs."""
    cases = []
    for name, save_dir in ckpt.items():
        cases += [
            (f"{name}/universal", ["to-universal", str(save_dir), "-o", str(out / name / "universal")]),
            (f"{name}/hf", ["to-hf", str(save_dir), "-o", str(out / name / "hf")]),
            (f"{name}/maxtext", ["to-maxtext", str(save_dir), "-o", str(out / name / "maxtext")]),
            (f"{name}/inspect", ["inspect", str(save_dir), "--json"]),
        ]
    z1 = out / "llama_zero1"
    cases += [
        ("llama_zero1/hf_fp32", ["to-hf", str(ckpt["llama_zero1"]), "-o", str(z1 / "hf_fp32"), "--dtype", "float32",
                                 "--max-shard-size", "100KB"]),
        ("llama_zero1/maxtext_opt", ["to-maxtext", str(ckpt["llama_zero1"]), "-o", str(z1 / "maxtext_opt"),
                                     "--with-optimizer", "--mesh", "fsdp=2,tensor=2", "--no-scan-layers",
                                     "--dtype", "float32"]),
        ("llama_zero1/universal_hf", ["to-hf", str(z1 / "universal"), "-o", str(z1 / "universal_hf")]),
        ("llama_zero1/universal_maxtext", ["to-maxtext", str(z1 / "universal"), "-o", str(z1 / "universal_maxtext")]),
        ("llama_zero1/universal_inspect", ["inspect", str(z1 / "universal"), "--json"]),
        ("llama_zero1/hf_universal", ["from-hf", str(z1 / "hf"), "-o", str(z1 / "hf_universal")]),
        ("llama_zero1/hf_universal_fp32", ["from-hf", str(z1 / "hf_fp32"), "-o", str(z1 / "hf_universal_fp32"),
                                           "--dtype", "float32"]),
        ("llama_zero1/hf_maxtext", ["to-maxtext", str(z1 / "hf"), "-o", str(z1 / "hf_maxtext")]),
        ("llama_zero1/hf_inspect", ["inspect", str(z1 / "hf"), "--json"]),
        ("llama_zero1/maxtext_universal", ["from-maxtext", str(z1 / "maxtext_opt"), "-o",
                                           str(z1 / "maxtext_universal")]),
        ("llama_zero1/maxtext_hf", ["to-hf", str(z1 / "maxtext" / "0" / "items"), "-o", str(z1 / "maxtext_hf")]),
        ("llama_zero1/maxtext_inspect", ["inspect", str(z1 / "maxtext"), "--json"]),
        ("llama_zero1/resharded", ["reshard-orbax", str(z1 / "maxtext"), "-o", str(z1 / "resharded"), "--mesh",
                                   "fsdp=2,tensor=2"]),
        ("moe_zero1/hf_universal", ["from-hf", str(out / "moe_zero1" / "hf"), "-o",
                                    str(out / "moe_zero1" / "hf_universal")]),
        ("moe_zero1/maxtext_hf", ["to-hf", str(out / "moe_zero1" / "maxtext"), "-o",
                                  str(out / "moe_zero1" / "maxtext_hf")]),
    ]
    return cases


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def digest_tree(root: Path) -> dict[str, str]:
    found = {}
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        rel = path.relative_to(root).as_posix()
        if _orbax_random(rel):
            continue
        if path.name == ORBAX_STEP_METADATA:
            meta = {k: v for k, v in json.loads(path.read_text()).items() if not k.endswith("timestamp_nsecs")}
            found[rel] = _sha(json.dumps(meta, sort_keys=True).encode())
        elif path.name == MANIFEST and any(_orbax_random(f) for f in json.loads(path.read_text())["files"]):
            manifest = json.loads(path.read_text())
            manifest["files"] = {f: e for f, e in manifest["files"].items()
                                 if not _orbax_random(f) and not f.endswith(ORBAX_STEP_METADATA)}
            found[rel] = _sha(json.dumps(manifest, sort_keys=True).encode())
        else:
            found[rel] = _sha(path.read_bytes())
    for items in sorted(p.parent for p in root.rglob("items/_METADATA")):
        found.update(digest_orbax_arrays(items, prefix=items.relative_to(root).as_posix()))
    return found


def digest_orbax_arrays(items: Path, prefix: str) -> dict[str, str]:
    """``{prefix/array:<leaf>: sha256 of dtype, shape, storage chunk and bytes}`` for every array in the item."""
    import numpy as np
    import orbax.checkpoint as ocp
    import tensorstore as ts
    tree = ocp.PyTreeCheckpointer().metadata(items).item_metadata.tree
    found = {}
    for name in sorted(ocp.tree.to_flat_dict(tree, sep=".")):
        spec = {"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": f"file://{items}"}, "path": name}
        try:
            array = ts.open(spec).result()
        except ValueError:  # a scalar Orbax keeps in its metadata (hashed with _METADATA)
            continue
        data = np.asarray(array.read().result())
        chunk = array.chunk_layout.write_chunk.shape  # None for a 0-d array
        chunk = tuple(chunk) if chunk is not None else None
        found[f"{prefix}/array:{name}"] = _sha(f"{data.dtype}{data.shape}{chunk}".encode() + data.tobytes())
    return found


def train_sources(workdir: Path) -> dict[str, Path]:
    ckpt = {}
    for name, args in SOURCES.items():
        save_dir = workdir / "sources" / name
        if not (save_dir / "latest").is_file():
            shutil.rmtree(save_dir, ignore_errors=True)
            print(f"training {name}", flush=True)
            torchrun_train(2, ["--tp", "2", *args, "--steps", "2", "--save-dir", str(save_dir), "--save-at", "2"],
                           workdir / "logs" / f"{name}.log")
        ckpt[name] = save_dir
    return ckpt


def main() -> int:
    from deepspeed_ext.cli import main as cli
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workdir", required=True, help="trained checkpoints are kept here between runs")
    group = p.add_mutually_exclusive_group(required=True)
    group.add_argument("--save", help="write the digests here (JSON)")
    group.add_argument("--compare", help="compare with digests saved earlier")
    args = p.parse_args()
    workdir = Path(args.workdir)
    ckpt = train_sources(workdir)
    out = workdir / "outputs"
    shutil.rmtree(out, ignore_errors=True)
    digests: dict[str, dict[str, str]] = {}
    for case, argv in conversions(ckpt, out):
        text = io.StringIO()
        with contextlib.redirect_stdout(text):
            code = cli([*argv, "-q"] if argv[0] != "inspect" else argv)
        if code != 0:
            raise SystemExit(f"{case}: deepspeed-ext {' '.join(argv)} exited {code}")
        if argv[0] == "inspect":
            digests[case] = {"stdout": hashlib.sha256(text.getvalue().encode()).hexdigest()}
        else:
            digests[case] = digest_tree(Path(argv[argv.index("-o") + 1]))
        print(f"{case}: {len(digests[case])} file(s)", flush=True)
    if args.save:
        Path(args.save).write_text(json.dumps(digests, indent=1, sort_keys=True))
        print(f"{sum(map(len, digests.values()))} digests of {len(digests)} conversions written to {args.save}")
        return 0
    before = json.loads(Path(args.compare).read_text())
    differ = [f"{case}/{f}" for case in sorted(set(before) | set(digests))
              for f in sorted(set(before.get(case, {})) | set(digests.get(case, {})))
              if before.get(case, {}).get(f) != digests.get(case, {}).get(f)]
    for line in differ:
        print(f"differs: {line}")
    print(f"{len(differ)} of {sum(map(len, digests.values()))} files differ across {len(digests)} conversions")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
