"""The least work a bf16 to-maxtext can do, as a floor for bench/marginal.py: no checks, no TP merge, no manifest.

Every 2-D bf16 weight of a DeepSpeed tag's model-states files (each TP rank's slice, memory-mapped) is laid out
the way MaxText's kernels hold it (transposed: torch keeps ``[out, in]``, MaxText ``[in, out]``) by torch's
transposing copy and written with tensorstore as zarr3 in one OCDBT store, uncompressed, two writes in flight,
stacked over the layers one layer per chunk (as to-maxtext writes them). ``--no-transpose`` writes the weights as
they lie (a copy's floor). The other tensors (norms, buffers) are left out: a few MB.

    python bench/maxtext_floor.py TAG_DIR OUT [--no-transpose]

bench/marginal.py runs it beside ``cp -r`` and to-maxtext: what any writer of MaxText's layout pays per byte on
this machine, whatever it checks.
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path


async def write_all(tag_dir: Path, out: Path, transpose: bool) -> int:
    import re

    import ml_dtypes
    import tensorstore as ts
    import torch

    from deepspeed_ext.checkpoint import serialization

    context = ts.Context()
    written, pending = 0, []
    for path in sorted(tag_dir.glob("mp_rank_*_model_states.pt")):
        # As MaxText's scanned layout stacks them: one array per weight of a layer, one layer per chunk.
        stacks: dict[str, list[torch.Tensor]] = {}
        for name, weight in serialization.load(path)["module"].items():
            if weight.dim() == 2 and weight.dtype == torch.bfloat16:
                stacks.setdefault(re.sub(r"\.\d+\.", ".layers.", name), []).append(weight)
        for key, weights in stacks.items():
            shape = weights[0].t().shape if transpose else weights[0].shape
            chunk = [1, *shape]
            store_path = {"driver": "ocdbt", "base": f"file://{out}", "path": f"{path.stem}/{key}"}
            spec = {"driver": "zarr3", "kvstore": store_path,
                    "metadata": {"shape": [len(weights), *shape], "data_type": "bfloat16",
                                 "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
                                 "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}]},
                    "create": True}
            store = await ts.open(spec, context=context)
            for layer, weight in enumerate(weights):
                laid = weight.t().contiguous() if transpose else weight.clone()
                array = laid.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
                pending.append(store[layer].write(array, can_reference_source_data_indefinitely=True))
                if len(pending) >= 2:
                    await pending.pop(0)
                written += array.nbytes
    for write in pending:
        await write
    return written


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tag_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--no-transpose", action="store_true")
    args = p.parse_args()
    args.out.mkdir(parents=True)
    written = asyncio.run(write_all(args.tag_dir.resolve(), args.out.resolve(), not args.no_transpose))
    print(f"{written / 2**30:.2f} GiB of bf16 weights written to {args.out}")


if __name__ == "__main__":
    main()
