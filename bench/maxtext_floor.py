"""The least work a bf16 to-maxtext can do, as a floor for bench/marginal_cp.py: no checks, no TP merge, no manifest.

Every 2-D bf16 weight of a DeepSpeed tag's model-states files (each TP rank's slice, memory-mapped) is laid out
the way MaxText's kernels hold it (transposed: torch keeps ``[out, in]``, MaxText ``[in, out]``) by torch's
transposing copy and written with tensorstore as zarr3 in one OCDBT store, uncompressed, two writes in flight,
stacked over the layers one layer per chunk (as to-maxtext writes them). ``--no-transpose`` writes the weights as
they lie (a copy's floor). ``--files`` writes the same zarr3 arrays without tensorstore and without OCDBT: a
``zarr.json`` and one plain file per chunk (``c/<layer>/0/0``, the zarr v3 default chunk keys) per array, each
chunk laid out and written by one of two threads: what a writer of our own would pay. The other tensors (norms,
buffers) are left out: a few MB.

    python bench/maxtext_floor.py TAG_DIR OUT [--no-transpose] [--files]

bench/marginal_cp.py runs it beside ``cp -r`` and to-maxtext: what any writer of MaxText's layout pays per byte on
this machine, whatever it checks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

#: Threads of --files, each laying out and writing one chunk at a time (as many more chunks wait queued).
FILE_WRITERS = 2


def weight_stacks(tag_dir: Path) -> Iterator[tuple[Path, dict[str, list[Any]]]]:
    """Each model-states file with its 2-D bf16 weights (memory-mapped), stacked over the layers as MaxText's
    scanned layout stacks them: one list per weight of a layer."""
    import torch

    from deepspeed_ext.checkpoint import serialization
    for path in sorted(tag_dir.glob("mp_rank_*_model_states.pt")):
        stacks: dict[str, list[torch.Tensor]] = {}
        for name, weight in serialization.load(path)["module"].items():
            if weight.dim() == 2 and weight.dtype == torch.bfloat16:
                stacks.setdefault(re.sub(r"\.\d+\.", ".layers.", name), []).append(weight)
        yield path, stacks


async def write_all(tag_dir: Path, out: Path, transpose: bool) -> int:
    import ml_dtypes
    import tensorstore as ts
    import torch

    context = ts.Context()
    written, pending = 0, []
    for path, stacks in weight_stacks(tag_dir):
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


def zarr3_metadata(shape: list[int], chunk: list[int]) -> dict[str, Any]:
    """A zarr v3 array's ``zarr.json``: bf16, uncompressed little-endian chunks, default chunk keys."""
    return {"zarr_format": 3, "node_type": "array", "shape": shape, "data_type": "bfloat16",
            "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": chunk}},
            "chunk_key_encoding": {"name": "default", "configuration": {"separator": "/"}},
            "fill_value": 0.0, "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}]}


def write_files(tag_dir: Path, out: Path, transpose: bool) -> int:
    """The same arrays as :func:`write_all`, as plain zarr3 files written by us (no tensorstore, no OCDBT)."""
    import torch

    def write_chunk(target: Path, weight: torch.Tensor) -> int:
        laid = weight.t().contiguous() if transpose else weight  # the mapped source is already contiguous
        data = laid.view(torch.uint8).numpy().reshape(-1)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            done = 0
            while done < data.nbytes:
                done += os.write(fd, data[done:])
        finally:
            os.close(fd)
        return data.nbytes

    written, pending = 0, []
    with ThreadPoolExecutor(FILE_WRITERS) as pool:
        for path, stacks in weight_stacks(tag_dir):
            for key, weights in stacks.items():
                array = out / path.stem / key
                shape = list(weights[0].t().shape if transpose else weights[0].shape)
                array.mkdir(parents=True)
                (array / "zarr.json").write_text(json.dumps(zarr3_metadata([len(weights), *shape], [1, *shape])))
                for layer, weight in enumerate(weights):
                    chunk_dir = array / "c" / str(layer) / "0"
                    chunk_dir.mkdir(parents=True)
                    pending.append(pool.submit(write_chunk, chunk_dir / "0", weight))
                    if len(pending) >= 2 * FILE_WRITERS:
                        written += pending.pop(0).result()
        written += sum(future.result() for future in pending)
    return written


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("tag_dir", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--no-transpose", action="store_true")
    p.add_argument("--files", action="store_true", help="plain zarr3 files written by us: no tensorstore, no OCDBT")
    args = p.parse_args()
    args.out.mkdir(parents=True)
    tag_dir, out, transpose = args.tag_dir.resolve(), args.out.resolve(), not args.no_transpose
    written = write_files(tag_dir, out, transpose) if args.files else asyncio.run(write_all(tag_dir, out, transpose))
    print(f"{written / 2**30:.2f} GiB of bf16 weights written to {args.out}")


if __name__ == "__main__":
    main()
