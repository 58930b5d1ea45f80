"""The zarr3 chunk files deepspeed-ext writes itself (to-maxtext --no-ocdbt --compression none) are byte for byte the
files tensorstore writes for the same array under Orbax's zarr3 metadata, edge chunks included, and tensorstore
reads them back; any other layout is left to tensorstore."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest

from deepspeed_ext.checkpoint.manifest import file_checksum
from deepspeed_ext.checkpoint.zarr3_shards import ChunkFiles
from deepspeed_ext.errors import CheckpointError

from harness.environments import require

ts = require("tensorstore", "the [maxtext] extra")
ml_dtypes = require("ml_dtypes", "the [maxtext] extra")


def orbax_metadata(shape, chunk, zstd=False):
    """What Orbax 0.12.8 gives a zarr3 array (tensorstore_utils._build_zarr3_metadata), written out here so that the
    test pins the format and not Orbax's builder."""
    inner = [{"name": "bytes", "configuration": {"endian": "little"}}]
    if zstd:
        inner.append({"name": "zstd", "configuration": {"level": 3}})
    return {"shape": list(shape), "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": list(chunk)}},
            "codecs": [{"name": "sharding_indexed", "configuration": {
                "chunk_shape": list(chunk), "codecs": inner,
                "index_codecs": [{"name": "bytes", "configuration": {"endian": "little"}}, {"name": "crc32c"}],
                "index_location": "end"}}]}


def open_array(path, shape, chunk, dtype, zstd=False, kvstore=None):
    return ts.open({"driver": "zarr3", "kvstore": kvstore or {"driver": "file", "path": str(path)},
                    "metadata": orbax_metadata(shape, chunk, zstd)}, dtype=dtype, create=True, open=True).result()


def chunk_files(root):
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# (shape, chunk, slabs): slabs as numpy indexes, covering the array; some cover several chunks, some reach an edge
# chunk the shape does not fill (7 % 4, 10 % 4).
CASES = [
    ((3, 2, 8), (3, 1, 8), [(slice(None), 0, slice(None)), (slice(None), 1, slice(None))]),
    ((7, 10), (4, 4), [(slice(0, 4), slice(None)), (slice(4, 7), slice(0, 8)), (slice(4, 7), slice(8, 10))]),
    ((5, 2, 6), (5, 1, 2), [(slice(None), layer, slice(a, a + 2)) for layer in (0, 1) for a in (0, 2, 4)]),
    ((9,), (4,), [(slice(0, 8),), (slice(8, None),)]),
]


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
@pytest.mark.parametrize("shape, chunk, slabs", CASES, ids=[str(c[0]) for c in CASES])
def test_chunk_files_are_tensorstores_own_bytes(tmp_path, shape, chunk, slabs, dtype):
    rng = np.random.default_rng(0)
    np_dtype = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
    data = (rng.standard_normal(shape) + 3).astype(np_dtype)  # no chunk equals the fill value
    theirs = open_array(tmp_path / "tensorstore", shape, chunk, dtype)
    for index in slabs:
        theirs[index].write(data[index]).result()
    ours_store = open_array(tmp_path / "ours", shape, chunk, dtype)
    reported = {}
    files = ChunkFiles.of(ours_store.spec().to_json(), ours_store.dtype.numpy_dtype)
    assert files is not None
    files = dataclasses.replace(files, written=lambda relative, size, crc: reported.setdefault(relative, (size, crc)))
    written = sum(files.write_slab(index, np.ascontiguousarray(data[index])) for index in slabs)
    ours, reference = chunk_files(tmp_path / "ours"), chunk_files(tmp_path / "tensorstore")
    assert ours == reference  # zarr.json and every chunk file
    assert written == sum(len(v) for k, v in ours.items() if k != "zarr.json")
    # Each file's size and CRC-32C, summed as it was written, are a manifest's entry for it as it lies on the disk.
    assert reported == {relative: (len(content), file_checksum(tmp_path / "ours" / relative))
                        for relative, content in ours.items() if relative != "zarr.json"}
    read = open_array(tmp_path / "ours", shape, chunk, dtype).read().result()
    assert np.array_equal(read.view(np.uint8), data.view(np.uint8))


def test_a_torn_chunk_file_fails_to_read(tmp_path):
    """The index's CRC-32C catches a file cut short (or damaged at its end), as tensorstore checks its own."""
    store = open_array(tmp_path / "a", (4, 4), (2, 4), "float32")
    files = ChunkFiles.of(store.spec().to_json(), store.dtype.numpy_dtype)
    files.write_slab((slice(None), slice(None)), np.ones((4, 4), np.float32))
    chunk = tmp_path / "a" / "c" / "1" / "0"
    chunk.write_bytes(chunk.read_bytes()[:-3])
    with pytest.raises(ValueError):
        open_array(tmp_path / "a", (4, 4), (2, 4), "float32").read().result()


def test_other_layouts_are_left_to_tensorstore(tmp_path):
    """Compressed chunks, an OCDBT store, chunk keys with another separator: not this module's format."""
    compressed = open_array(tmp_path / "z", (4, 4), (2, 4), "float32", zstd=True)
    assert ChunkFiles.of(compressed.spec().to_json(), np.float32) is None
    in_ocdbt = open_array(None, (4, 4), (2, 4), "float32",
                          kvstore={"driver": "ocdbt", "base": f"file://{tmp_path / 'o'}", "path": "a/"})
    assert ChunkFiles.of(in_ocdbt.spec().to_json(), np.float32) is None
    plain = open_array(tmp_path / "p", (4, 4), (2, 4), "float32").spec().to_json()
    assert ChunkFiles.of(plain, np.float32) is not None
    dotted = json.loads(json.dumps(plain))
    dotted["metadata"]["chunk_key_encoding"] = {"name": "default", "configuration": {"separator": "."}}
    assert ChunkFiles.of(dotted, np.float32) is None
    smaller_inner = json.loads(json.dumps(plain))
    smaller_inner["metadata"]["codecs"][0]["configuration"]["chunk_shape"] = [1, 4]
    assert ChunkFiles.of(smaller_inner, np.float32) is None


def test_a_slab_that_cuts_a_chunk_is_refused(tmp_path):
    store = open_array(tmp_path / "a", (8, 4), (4, 4), "float32")
    files = ChunkFiles.of(store.spec().to_json(), store.dtype.numpy_dtype)
    with pytest.raises(CheckpointError, match="does not cover whole chunks"):
        files.write_slab((slice(2, 6), slice(None)), np.zeros((4, 4), np.float32))
    with pytest.raises(CheckpointError, match="a slab of float64"):
        files.write_slab((slice(0, 4), slice(None)), np.zeros((4, 4), np.float64))


def test_each_chunk_file_and_its_directory_are_synced(tmp_path, monkeypatch):
    """As tensorstore's file store syncs every file it writes (file_io_sync), so do we: a chunk on the disk is whole
    before the checkpoint is published."""
    import os
    synced = []
    fsync = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: synced.append(os.readlink(f"/proc/self/fd/{fd}")) or fsync(fd))
    store = open_array(tmp_path / "a", (4, 4), (2, 4), "float32")
    files = ChunkFiles.of(store.spec().to_json(), store.dtype.numpy_dtype)
    files.write_slab((slice(None), slice(None)), np.ones((4, 4), np.float32))
    chunks = [str(tmp_path / "a" / "c" / str(i) / "0") for i in (0, 1)]
    assert sorted(synced) == sorted(chunks + [str(tmp_path / "a" / "c" / str(i)) for i in (0, 1)])
