"""to-maxtext: tree paths, shapes and dtypes as MaxText expects, round trips of weights and Adam moments for every
family, storage chunks for a mesh, and one optax step from the converted Adam state.

MaxText's own model code checks the logits in tests/e2e/test_maxtext_model_code.py (one device and MaxText's own
4-device sharding, with negative controls). The JAX forward written from MaxText's conventions
(tests/harness/maxtext_reference.py) is kept only where the tests do not run MaxText: the optax step. From a
real DeepSpeed checkpoint, and reshard-orbax run as a subprocess: tests/e2e/test_maxtext_e2e.py.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from deepspeed_ext.checkpoint.families import get_family, maxtext_family_names, plain_blocks
from deepspeed_ext.checkpoint.maxtext import ModelDims, plan_leaves, write_maxtext

from harness.environments import require
from harness.tiers import sampled

jax = require("jax", "the [maxtext] extra")
ocp = require("orbax.checkpoint", "the [maxtext] extra")
from harness.maxtext import MESH_SHAPE, convert, hf_model, restore_on_mesh, sized_config, torch_adam_state  # noqa: E402

LLAMA_SCANNED = {
    "token_embedder/embedding": (256, 64),
    "decoder/decoder_norm/scale": (64, ),
    "decoder/logits_dense/kernel": (64, 256),
    "decoder/layers/pre_self_attention_layer_norm/scale": (64, 2),
    "decoder/layers/post_self_attention_layer_norm/scale": (64, 2),
    "decoder/layers/self_attention/query/kernel": (64, 2, 4, 16),
    "decoder/layers/self_attention/key/kernel": (64, 2, 2, 16),
    "decoder/layers/self_attention/value/kernel": (64, 2, 2, 16),
    "decoder/layers/self_attention/out/kernel": (4, 2, 16, 64),
    "decoder/layers/mlp/wi_0/kernel": (64, 2, 128),
    "decoder/layers/mlp/wi_1/kernel": (64, 2, 128),
    "decoder/layers/mlp/wo/kernel": (128, 2, 64),
}


def _stored(items) -> dict[str, tuple[tuple[int, ...], str]]:
    metadata = ocp.PyTreeCheckpointer().metadata(items).item_metadata.tree
    flat = ocp.tree.to_flat_dict(metadata["params"]["params"], sep="/")
    return {name: (tuple(m.shape), str(np.dtype(m.dtype))) for name, m in flat.items()}


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_llama_tree_paths_shapes_and_dtypes_are_maxtexts(tmp_path, dtype):
    items, _ = convert(hf_model("llama"), "llama", tmp_path / "out", dtype=dtype)
    assert items == tmp_path / "out" / "0" / "items"
    assert _stored(items) == {name: (shape, dtype) for name, shape in LLAMA_SCANNED.items()}
    custom = ocp.StandardCheckpointer().metadata(tmp_path / "out" / "0").custom_metadata
    assert custom["scan_layers"] is True and custom["deepspeed_ext"]["family"] == "llama"


def test_llama_unscanned_tree(tmp_path):
    items, _ = convert(hf_model("llama"), "llama", tmp_path / "out", scan_layers=False)
    stored = _stored(items)
    expected = {}
    for name, shape in LLAMA_SCANNED.items():
        if "/layers/" in name:
            for layer in range(2):
                expected[name.replace("/layers/", f"/layers_{layer}/")] = (shape[0], *shape[2:])
        else:
            expected[name] = shape
    assert stored == {name: (shape, "float32") for name, shape in expected.items()}
    assert ocp.StandardCheckpointer().metadata(tmp_path / "out" / "0").custom_metadata["scan_layers"] is False


def _ulps(a: np.ndarray, b: np.ndarray) -> int:
    return int(np.abs(a.view(np.int32).astype(np.int64) - b.view(np.int32).astype(np.int64)).max())


def assert_round_trip(family: str, name: str, got: np.ndarray, want: np.ndarray, state: str = "fp32") -> bool:
    """MaxText and back is bit-exact but where the MaxText form is computed: the query kernel (and bias) of
    families that bake in 1/sqrt(D) comes back within 1 ulp, and gemma3's 1 + w norms within 1 + w's rounding.
    Returns whether it was inexact."""
    # Indices (DeepSeek-V4's hash table) come back in the buffer's int64, the rest in fp32.
    assert got.shape == want.shape and got.dtype == (np.int64 if want.dtype.kind == "i" else np.float32), name
    if np.array_equal(got, want):
        return False
    if get_family(family).query_scaled and ".q_proj." in name:
        assert _ulps(got, want) <= 1, (name, state)
    elif family == "gemma3" and name.endswith("norm.weight") and state == "fp32":
        assert np.abs(got - want).max() <= 2**-23 * (1 + np.abs(want).max()), name
    else:
        raise AssertionError(f"{name} ({state}) changed on the round trip")
    return True


#: Every family of the registry with a MaxText mapping, scanned and unscanned, at its tiny depth, and one layer deeper,
#: scanned, where the family's MaxText layers are not one plain stack: counts that are not whole cycles (gpt-oss's
#: pairs, gemma3's sixes, olmo3's and llama4's fours) and an odd MoE stack for deepseek-v3 (a plain stack holds any
#: depth; unscanned, every layer is a block of its own, whatever the depth).
ROUND_TRIPS = [(family, scan_layers, deeper) for family in maxtext_family_names() for scan_layers in (True, False)
               for deeper in (False, True)
               if not deeper or (scan_layers and get_family(family).layer_blocks is not plain_blocks)]


#: The fast tier's sample: a plain stack, MLA with an odd MoE stack, gemma's transforms unscanned, a refused depth.
FAST_ROUND_TRIPS = [("llama", True, False), ("deepseek-v3", True, True), ("gemma3", False, False),
                    ("gpt-oss", True, True)]


@pytest.mark.parametrize("family, scan_layers, deeper", sampled(ROUND_TRIPS, FAST_ROUND_TRIPS))
def test_round_trip_is_exact_but_the_scaled_query(tmp_path, family, scan_layers, deeper):
    """HF/universal tensors -> MaxText (fp32) -> back: bit-exact, except the query kernel of families that
    bake in 1/sqrt(D), within 1 ulp (head_dim 8 here: sqrt(8) is not a power of two), and gemma3's norms.
    A depth scanned MaxText cannot hold (gpt-oss: whole pairs; olmo3, llama4, qwen3.5-moe: whole cycles of four) is
    refused by the writer with the way out (written unscanned it reads back like any other:
    test_odd_depth_written_unscanned_reads_back_through_every_command)."""
    from deepspeed_ext.checkpoint.maxtext import MaxTextCheckpoint, stored_model_info
    from deepspeed_ext.errors import CheckpointError
    depth = sized_config(family, 8).num_hidden_layers + 1 if deeper else None
    if family == "gemma4" and deeper:
        # transformers makes Gemma 4's last layer global, so only whole cycles are MaxText's pattern, scanned or not
        # (nor does transformers build the tiny config a layer deeper: its new global layer has no head size).
        config = {**sized_config(family, 8).to_dict(), "num_hidden_layers": depth, "layer_types": None}
        with pytest.raises(CheckpointError, match="not a pattern MaxText builds"):
            get_family(family).layer_blocks(config, scan_layers)
        return
    model = hf_model(family, head_dim=8, num_layers=depth)
    # DeepSeek-V4 one layer deeper is transformers' default pattern, whose layers after the hash-routed ones do not
    # start MaxText's cycle (a heavily compressed layer, then a compressed sparse one).
    whole_cycles = {"gpt-oss": 2, "olmo3": 4, "llama4": 4, "qwen3.5-moe": 4, "deepseek-v4": 2}
    if scan_layers and family in whole_cycles and deeper:
        with pytest.raises(CheckpointError, match=f"not whole cycles of {whole_cycles[family]}.*--no-scan-layers"):
            convert(model, family, tmp_path / "out", scan_layers=True)
        assert not (tmp_path / "out").exists()
        return
    items, _ = convert(model, family, tmp_path / "out", scan_layers=scan_layers)
    stored = stored_model_info(items)
    assert stored["family"] == family and stored["model_config"]["num_attention_heads"] == 64 // 8
    source = MaxTextCheckpoint(items, get_family(family), stored["model_config"])
    assert source.scan_layers == scan_layers
    assert source.summary()["state"].startswith("parameters only")
    original = {name: p.detach().numpy() for name, p in model.named_parameters()}
    original.update((name, b.numpy()) for name, b in model.named_buffers() if name in model.state_dict())
    assert list(source.layouts) and sorted(source.layouts) == sorted(original)
    inexact = [name for name, want in original.items()
               if assert_round_trip(family, name, source.hf_tensor(name), want)]
    if get_family(family).query_scaled:
        assert inexact, "the query kernel should have met a rounding (else this test proves less than it says)"
    assert_fingerprints_are_what_a_read_returns(tmp_path / "out", sorted(original), with_moments=False)


#: Each family with a transform of its own (biases, 1 + w norms, the scaled embedding, interleaved experts, MLA heads,
#: Qwen3.5's fused DeltaNet projections; Qwen3-Next's nested stacks are in STREAMED, moments included), scanned in
#: fp32; the unscanned layout where the layer blocks are not one stack; bf16 where scales round.
MOMENT_CASES = [(family, True, "float32") for family in ("qwen2", "mixtral", "gemma3", "gpt-oss", "deepseek-v3",
                                                          "qwen3.5-moe", "deepseek-v4")] + [
    ("gpt-oss", False, "float32"), ("deepseek-v3", False, "float32"), ("gemma3", True, "bfloat16"),
    ("mixtral", True, "bfloat16")]


@pytest.mark.parametrize("family, scan_layers, dtype", sampled(
    MOMENT_CASES, [("qwen2", True, "float32"), ("gpt-oss", False, "float32")],
    ids=lambda case: f"{case[0]}-{'scanned' if case[1] else 'unscanned'}-{case[2]}"))
def test_adam_moments_round_trip_for_every_family(tmp_path, family, scan_layers, dtype):
    """--with-optimizer: each family's Adam moments -> optax's state -> back, through every transform (biases,
    1 + w norms, the scaled embedding, interleaved experts); bit-exact but the pre-scaled query's."""
    from deepspeed_ext.checkpoint.maxtext import MaxTextCheckpoint
    model = hf_model(family, head_dim=8)
    optimizer = torch_adam_state(model)
    params = dict(model.named_parameters())
    config = json.loads(model.config.to_json_string(use_diff=False))

    buffers = {name: b for name, b in model.named_buffers() if name in model.state_dict()}

    def load(name, state="fp32"):
        if name in buffers:  # DeepSeek's router bias (and V4's hash table): no optimizer state, zero moments
            buffer = buffers[name].numpy()
            return buffer.copy() if state == "fp32" else np.zeros(buffer.shape, buffer.dtype)
        if state != "fp32" and params[name] not in optimizer.state:  # never a gradient (V4's indexer): zero moments
            return np.zeros(params[name].shape, np.float32)
        tensor = params[name] if state == "fp32" else optimizer.state[params[name]][state]
        return tensor.detach().numpy().copy()

    shapes = {n: tuple(p.shape) for n, p in [*params.items(), *buffers.items()]}
    items = write_maxtext(load, shapes, get_family(family), ModelDims.from_config(config), tmp_path / "out",
                          dtype=dtype, progress=False, model_config=config, with_optimizer=True, optimizer_step=2,
                          scan_layers=scan_layers)
    source = MaxTextCheckpoint(items, get_family(family), config)
    assert source.has_optimizer and source.optimizer_step == 2
    state = source.summary()["state"]
    assert state.startswith("full train state") and "load_full_state_path" in state
    flat = ocp.tree.to_flat_dict(ocp.PyTreeCheckpointer().metadata(items).item_metadata.tree, sep="/")
    aux = sorted(name for name in flat if name.startswith("nnx_aux/model/"))
    # Variables outside params also where MaxText's full-state restore reads them: DeepSeek's router bias, V4's hash
    # table.
    outside = sorted("nnx_aux/model/" + name.split("/", 2)[2] for name in flat
                     if name.startswith("params/") and not name.startswith("params/params/"))
    assert aux == outside and bool(outside) == family.startswith("deepseek"), (aux, outside)
    if dtype == "float32":
        for name in shapes:
            for state in ("fp32", "exp_avg", "exp_avg_sq"):
                assert_round_trip(family, name, source.hf_tensor(name, state), load(name, state), state)
    assert_fingerprints_are_what_a_read_returns(items.parent.parent, sorted(shapes), with_moments=True)


def assert_fingerprints_are_what_a_read_returns(root, names, with_moments) -> None:
    """The fingerprints to-maxtext recorded are those of the tensors a read returns (after every transform and
    the stored dtype's rounding), to summation order: the reader hands them on to be enforced."""
    from deepspeed_ext.checkpoint.fingerprint import Fingerprint
    from deepspeed_ext.checkpoint.formats import open_checkpoint
    source = open_checkpoint(root)
    recorded = source.info.fingerprints
    assert recorded is not None and sorted(recorded.tensors) == names and recorded.rounding == 0.0
    checked = 0
    for tensor in source.tensors():
        for state in ("fp32", "exp_avg", "exp_avg_sq") if with_moments else ("fp32", ):
            saved = recorded.get(tensor.name, state)
            if saved is None:  # a buffer outside the optimizer (DeepSeek's router bias, V4's hash table): no moments
                assert state != "fp32" and tensor.name.endswith((".e_score_correction_bias", ".tid2eid")), (
                    tensor.name, state)
                continue
            found = Fingerprint.of(tensor.load(state))
            assert saved.agrees(found), (tensor.name, state, saved, found)
            checked += 1
    assert checked >= len(names)


@pytest.mark.parametrize("family", ["llama", "qwen3-moe"])
def test_mesh_aligned_chunks_are_one_device_shard(tmp_path, family):
    """--mesh: every array's storage chunk is one device's shard on that mesh (one layer thick for scanned
    stacks, which are written a layer at a time), and the arrays are the same as without --mesh."""
    from deepspeed_ext.checkpoint.maxtext import shard_shape, storage_chunk
    model = hf_model(family)
    plain, leaves = convert(model, family, tmp_path / "plain")
    params = {name: p.detach().float().numpy() for name, p in model.named_parameters()}
    config = json.loads(model.config.to_json_string(use_diff=False))
    mesh = {"fsdp": 2, "tensor": 2, "expert": 2} if family == "qwen3-moe" else MESH_SHAPE
    aligned = write_maxtext(lambda name, state="fp32": params[name], {n: a.shape for n, a in params.items()},
                            get_family(family), ModelDims.from_config(config), tmp_path / "aligned", dtype="float32",
                            progress=False, mesh=mesh)
    import tensorstore as ts
    split = 0
    for leaf in leaves:
        # Orbax records no storage metadata for numpy leaves: ask the zarr3 array in the OCDBT store itself.
        array = ts.open({"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": f"file://{aligned}"},
                         "path": "params.params." + ".".join(leaf.path)}).result()
        expected = storage_chunk(leaf, mesh)
        assert all(c <= s for c, s in zip(expected, shard_shape(leaf, mesh), strict=True))
        layout = array.chunk_layout
        assert tuple(array.shape) == leaf.shape
        assert tuple(layout.write_chunk.shape) == expected and tuple(layout.read_chunk.shape) == expected, leaf.name
        split += expected != leaf.shape
    assert split >= len(leaves) // 2
    a, b = (ocp.tree.to_flat_dict(restore_on_mesh(items, leaves), sep="/") for items in (plain, aligned))
    for name in a:
        assert np.array_equal(np.asarray(a[name]), np.asarray(b[name])), name


STREAMED = [("llama3.1", True, None), ("qwen2", False, None), ("qwen3-moe", True, MESH_SHAPE), ("gemma3", True, None),
            ("gpt-oss", True, None), ("deepseek-v3", True, MESH_SHAPE), ("qwen3-next", True, MESH_SHAPE)]


@pytest.mark.parametrize("family, scan_layers, mesh", sampled(STREAMED, [("llama3.1", True, None),
                                                                       ("qwen3-moe", True, MESH_SHAPE)]))
def test_streamed_in_row_blocks_equals_whole(tmp_path, family, scan_layers, mesh):
    """Each tensor is transformed and written in blocks of HF rows (8 KiB blocks here: every tensor over two
    blocks takes several): the arrays, Adam moments included, equal those written whole, every write covers whole
    storage chunks (under a mesh each chunk lies inside one device's shard), and the recorded read-back
    fingerprints agree."""
    import tensorstore as ts

    from deepspeed_ext.checkpoint.formats import open_checkpoint
    from deepspeed_ext.checkpoint.maxtext import shard_shape
    model = hf_model(family, head_dim=8)
    optimizer = torch_adam_state(model)
    params = dict(model.named_parameters())
    buffers = {name: b for name, b in model.named_buffers() if name in model.state_dict()}
    config = json.loads(model.config.to_json_string(use_diff=False))
    fam, dims = get_family(family), ModelDims.from_config(config)
    shapes = {n: tuple(p.shape) for n, p in [*params.items(), *buffers.items()]}
    calls: list[tuple[str, str, int, int]] = []

    def load(name, state="fp32"):
        if name in buffers:
            return buffers[name].numpy().copy() if state == "fp32" else np.zeros(buffers[name].shape, np.float32)
        tensor = params[name] if state == "fp32" else optimizer.state[params[name]][state]
        return tensor.detach().numpy().copy()

    def load_rows(name, state, first, last):
        calls.append((name, state, first, last))
        return torch.from_numpy(load(name, state)[first:last].reshape(-1).copy())

    written = {}
    block = 8192
    for label, block_bytes in (("whole", 1 << 40), ("streamed", block)):
        written[label] = write_maxtext(load, shapes, fam, dims, tmp_path / label, dtype="float32", progress=False,
                                       model_config=config, with_optimizer=True, optimizer_step=2,
                                       scan_layers=scan_layers, mesh=mesh, load_rows=load_rows,
                                       block_bytes=block_bytes)
    # All but the small variables stacked on axis 0 (DeepSeek's router bias), which are written whole.
    assert {name for name, *_ in calls} | set(buffers) == set(shapes)
    partial = [c for c in calls if c[3] - c[2] < shapes[c[0]][0]]
    larger = {name for name, shape in shapes.items() if shape[0] > 1 and 4 * np.prod(shape) > 2 * block}
    assert larger and larger <= {name for name, *_ in partial}, "every tensor over two blocks is read in pieces"
    whole, streamed = (ocp.tree.to_flat_dict(ocp.PyTreeCheckpointer().restore(written[k]), sep="/")
                       for k in ("whole", "streamed"))
    assert whole.keys() == streamed.keys()
    for key, value in whole.items():
        assert np.array_equal(np.asarray(value), np.asarray(streamed[key])), key
    split = 0
    for leaf in plan_leaves(fam, dims, shapes, scan_layers):
        root = f"params.{leaf.collection}."
        array = ts.open({"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": f"file://{written['streamed']}"},
                         "path": root + ".".join(leaf.path)}).result()
        chunk = tuple(array.chunk_layout.write_chunk.shape)
        limit = shard_shape(leaf, mesh) if mesh else leaf.shape
        assert all(s % c == 0 or s == limit_axis for c, s, limit_axis in zip(chunk, limit, leaf.shape, strict=True)
                   if mesh), (leaf.name, chunk, limit)
        split += chunk != (limit if not leaf.stacked else tuple(1 if a == leaf.scan_axis else s
                                                               for a, s in enumerate(limit)))
    assert split >= 3
    found = [open_checkpoint(written[k].parent.parent).info.fingerprints for k in ("whole", "streamed")]
    assert found[0] is not None and found[1] is not None
    assert sorted(found[0].tensors) == sorted(found[1].tensors)
    for name, states in found[0].tensors.items():
        for state, fingerprint in states.items():
            assert fingerprint.agrees(found[1].tensors[name][state]), (name, state)


def test_row_blocks_cover_whole_chunks():
    """The streaming plan: blocks are whole multiples of the chunk, a chunk under a mesh divides the device's
    shard, and a block never exceeds the budget by more than one unit."""
    from deepspeed_ext.checkpoint.maxtext import row_blocks
    dims = ModelDims(num_layers=2, head_dim=128, tied=False, hidden_size=4096, num_heads=32)
    embed = row_blocks("copy", "fp32", (128256, 4096), dims, None, 32 << 20)
    assert (embed.axis, embed.unit, embed.units, embed.chunk, embed.step) == (0, 1, 128256, 2048, 2048)
    assert sum(b - a for a, b in embed.ranges()) == 128256
    query = row_blocks("query", "exp_avg", (4096, 4096), dims, None, 8 << 20)
    assert (query.axis, query.unit, query.units, query.chunk) == (1, 128, 32, 4)
    sharded = row_blocks("copy", "fp32", (128256, 4096), dims, (128256 // 16, 4096), 32 << 20)
    assert (128256 // 16) % sharded.chunk == 0 and sharded.step % sharded.chunk == 0 and sharded.step <= 2048
    prime = row_blocks("copy", "fp32", (2 * 8009, 4096), dims, (8009, 4096), 32 << 20)  # no divisor near the block
    assert prime.chunk == 8009
    assert row_blocks("query_bias", "fp32", (4096, ), dims, None).axis == 0


def test_parameters_only_and_full_state_are_told_apart_in_one_line(tmp_path, capsys):
    """A parameters-only checkpoint where a full train state is needed (to-maxtext --with-optimizer from HF weights,
    from-maxtext --with-optimizer of a parameters-only MaxText checkpoint) is refused in one line saying which it is
    and which MaxText setting reads it; nothing is written. inspect says which a MaxText checkpoint is."""
    from deepspeed_ext.cli import main
    model = hf_model("llama", head_dim=8)
    model.save_pretrained(tmp_path / "hf")
    capsys.readouterr()
    assert main(["to-maxtext", str(tmp_path / "hf"), "-o", str(tmp_path / "full"), "--with-optimizer",
                 "--quiet"]) != 0
    error = capsys.readouterr().err.strip()
    assert "parameters only" in error and "load_full_state_path" in error and "load_parameters_path" in error
    assert len(error.splitlines()) == 1 and not (tmp_path / "full").exists()

    assert main(["to-maxtext", str(tmp_path / "hf"), "-o", str(tmp_path / "params"), "--quiet"]) == 0
    assert main(["inspect", str(tmp_path / "params")]) == 0
    assert "parameters only: MaxText's load_parameters_path" in capsys.readouterr().out
    assert main(["from-maxtext", str(tmp_path / "params"), "-o", str(tmp_path / "back"), "--with-optimizer",
                 "--quiet"]) != 0
    error = capsys.readouterr().err.strip()
    assert "parameters only: MaxText's load_parameters_path" in error and "--with-optimizer" in error
    assert len(error.splitlines()) == 1 and not (tmp_path / "back").exists()
    assert main(["from-maxtext", str(tmp_path / "params"), "-o", str(tmp_path / "back")]) == 0
    assert "fresh optimizer state: the checkpoint holds parameters only" in capsys.readouterr().out


def test_continuation_settings_say_what_maxtexts_adamw_cannot_express():
    """The optimizer settings to-maxtext --with-optimizer prints, from what a DeepSpeed checkpoint saved: torch's
    AdamW maps to MaxText's adamw exactly; what does not map (Adam's L2 weight decay, AMSGrad, groups with their
    own rates, a scheduler, the model's own differences) is said in notes, not hidden."""
    from deepspeed_ext.checkpoint.maxtext import adamw_settings, continuation_settings
    from deepspeed_ext.checkpoint.states import optimizer_settings
    group = {"lr": 3e-4, "betas": (0.9, 0.95), "eps": 1e-6, "weight_decay": 0.1, "amsgrad": False,
             "decoupled_weight_decay": True, "params": [0, 1]}
    saved = optimizer_settings([group], {"optimizer": {"type": "AdamW"}, "gradient_clipping": 1.0,
                                         "gradient_accumulation_steps": 2, "train_micro_batch_size_per_gpu": 4,
                                         "zero_optimization": {"stage": 1}})
    assert saved is not None and "params" not in saved["param_groups"][0] and "zero_optimization" not in saved
    settings, notes = continuation_settings(saved, 100, dp_degree=2)
    assert settings == {**adamw_settings(3e-4, (0.9, 0.95), 1e-6, 0.1, gradient_clipping=1.0),
                        "gradient_accumulation_steps": 2, "dtype": "float32"}
    assert len(notes) == 1 and "global batch 16 sequences" in notes[0]
    coupled = {**group, "decoupled_weight_decay": False, "amsgrad": True}
    _, notes = continuation_settings(optimizer_settings([coupled, {**group, "lr": 1e-3}],
                                                        {"scheduler": {"type": "WarmupLR"}}), 7)
    said = " ".join(notes)
    for words in ("L2 term", "AMSGrad", "differ in lr", "WarmupLR", "rate at step 7"):
        assert words in said, words
    fused = {key: value for key, value in group.items() if key != "decoupled_weight_decay"}  # FusedAdam's groups
    _, notes = continuation_settings(optimizer_settings([fused], {"optimizer": {"type": "Adam", "params": {
        "adam_w_mode": False}}}), 1)
    assert any("L2 term" in note for note in notes)
    settings, notes = continuation_settings(None, 3, family=get_family("llama"),
                                            model_config={"tie_word_embeddings": True})
    assert settings == {} and any("no optimizer settings" in n for n in notes)
    assert any("sqrt(head_dim)" in n for n in notes) and any("bf16" in n for n in notes)


@pytest.mark.parametrize("config, engine, clip_grad, version, expected", [
    ({}, None, None, "0.19.8", 1.0),  # left out: DeepSpeed >= 0.19.3 clips at 1.0
    ({}, None, None, "0.18.8", 0.0),  # before 0.19.3: no clipping
    ({"gradient_clipping": 0.0}, None, None, "0.19.8", 0.0),  # set to 0: none, whatever the default
    ({}, None, 0.5, "0.19.8", 0.5),  # the optimizer's own record (ZeRO-1/2, BF16_Optimizer) over the default
    ({"gradient_clipping": 2.0}, {"gradient_clipping": 0.3}, 2.0, "0.19.8", 0.3),  # what the engine ran, first
], ids=["unset-0.19.8", "unset-0.18.8", "zero", "clip_grad", "engine"])
def test_gradient_clipping_is_what_deepspeed_ran(config, engine, clip_grad, version, expected):
    """The clipping to-maxtext carries into MaxText is the engine's: a config that leaves gradient_clipping out runs
    at the saving release's default (0.19.8 clips at 1.0; the run that continued in MaxText was 1e-2 off at its
    second step when 0 was printed)."""
    from deepspeed_ext.checkpoint.maxtext import continuation_settings
    from deepspeed_ext.checkpoint.states import optimizer_settings
    saved = optimizer_settings([{"lr": 3e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01,
                                 "decoupled_weight_decay": True}], {"train_batch_size": 8, **config}, engine,
                               clip_grad, version, dp_degree=2)
    assert saved is not None and saved["gradient_clipping"] == expected
    # The batch sizes DeepSpeed derives when only the global batch is given, and its precision (fp32: no bf16/fp16).
    assert (saved["gradient_accumulation_steps"], saved["train_micro_batch_size_per_gpu"], saved["dtype"]) == \
        (1, 4, "fp32")
    settings, _ = continuation_settings(saved, 3, dp_degree=2)
    assert settings["gradient_clipping_threshold"] == expected and settings["dtype"] == "float32"
    bf16 = optimizer_settings([{"lr": 1.0}], {"bfloat16": {"enabled": True}, "train_micro_batch_size_per_gpu": 2,
                                              "gradient_accumulation_steps": 3})
    assert bf16 is not None and (bf16["dtype"], bf16["gradient_accumulation_steps"]) == ("bf16", 3)


def test_odd_depth_written_unscanned_reads_back_through_every_command(tmp_path, capsys):
    """A 3-layer gpt-oss (not whole pairs, which scanned MaxText needs for it) written with --no-scan-layers: inspect,
    verify and from-maxtext read it like any other (they once applied the scanned-only constraint to it)."""
    from deepspeed_ext.cli import main
    hf_model("gpt-oss", head_dim=8, num_layers=3).save_pretrained(tmp_path / "hf")
    assert main(["to-maxtext", str(tmp_path / "hf"), "-o", str(tmp_path / "scanned"), "--quiet"]) != 0
    assert "--no-scan-layers" in capsys.readouterr().err and not (tmp_path / "scanned").exists()
    out = tmp_path / "maxtext"
    assert main(["to-maxtext", str(tmp_path / "hf"), "-o", str(out), "--no-scan-layers", "--dtype", "float32",
                 "--quiet"]) == 0
    assert main(["inspect", str(out)]) == 0
    assert main(["verify", str(out)]) == 0
    assert main(["from-maxtext", str(out), "-o", str(tmp_path / "back"), "--quiet"]) == 0
    assert main(["compare", str(tmp_path / "hf"), str(tmp_path / "back")]) == 0


def test_uncompressed_chunks_hold_the_same_arrays(tmp_path):
    """--compression none: every array's zarr3 codecs carry no zstd (they do by default, as MaxText's own saves),
    and what is restored on the mesh is the same as from the compressed checkpoint."""
    import tensorstore as ts

    from deepspeed_ext.errors import CheckpointError
    model = hf_model("llama")
    params = {name: p.detach().float().numpy() for name, p in model.named_parameters()}
    config = json.loads(model.config.to_json_string(use_diff=False))
    written = {}
    for compression in ("zstd", "none"):
        written[compression] = write_maxtext(lambda name, state="fp32": params[name],
                                             {n: a.shape for n, a in params.items()}, get_family("llama"),
                                             ModelDims.from_config(config), tmp_path / compression, progress=False,
                                             compression=compression)
    leaves = convert(model, "llama", tmp_path / "leaves")[1]
    for leaf in leaves:
        for compression in ("zstd", "none"):
            store = {"driver": "ocdbt", "base": f"file://{written[compression]}"}
            array = ts.open({"driver": "zarr3", "kvstore": store,
                             "path": "params.params." + ".".join(leaf.path)}).result()
            codecs = json.dumps(array.spec().to_json()["metadata"]["codecs"])
            assert ("zstd" in codecs) == (compression == "zstd"), (leaf.name, codecs)
    a, b = (ocp.tree.to_flat_dict(restore_on_mesh(written[c], leaves), sep="/") for c in ("zstd", "none"))
    for name in a:
        assert np.array_equal(np.asarray(a[name]), np.asarray(b[name])), name
    with pytest.raises(CheckpointError, match="--compression must be one of zstd, none"):
        write_maxtext(lambda name, state="fp32": params[name], {n: a.shape for n, a in params.items()},
                      get_family("llama"), ModelDims.from_config(config), tmp_path / "bad", compression="lz4")


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_stored_blocks_copied_by_torch_have_numpys_bits(dtype):
    """The writer lays out (and casts) each block through torch: the bits are those numpy's own cast gives, for
    the views the transforms make (transposed, split per head, every other column, reversed, with axes of size 1)
    and for values across float32's range (zeros of both signs, subnormals, bf16 ties, infinities); bf16 blocks
    (the module's weights) are moved bit for bit."""
    import ml_dtypes

    from deepspeed_ext.checkpoint.maxtext.leaves import _contiguous_as

    target = np.dtype(ml_dtypes.bfloat16) if dtype == "bfloat16" else np.dtype(np.float32)
    rng = np.random.default_rng(7)
    block = (rng.standard_normal((96, 70)) * np.float32(10.0) ** rng.integers(-44, 38, (96, 70))).astype(np.float32)
    block[0, :6] = [np.inf, -np.inf, 0.0, -0.0, 1e-45, -3e-39]
    block.view(np.uint32)[1, :8] = 0x3F808000 + np.arange(8, dtype=np.uint32)  # bf16 ties and their neighbours
    views = [block, block.T, block.T.reshape(70, 6, 16), block[:, 1::2], block[::-1], block.T[:, 0::3],
             block[:0], block.astype(np.float64), block.T.reshape(70, 1, 6, 16),
             block.reshape(96, 7, 10).transpose(1, 2, 0), block[:1].T]
    if dtype == "bfloat16":  # the module's weights: bf16 already, moved only
        halves = block.astype(target)
        views += [halves, halves.T, halves.T.reshape(70, 6, 16), halves.T.reshape(70, 1, 6, 16), halves[:, 1::2],
                  halves.reshape(96, 7, 10).transpose(2, 0, 1)]
    for view in views:
        stored = _contiguous_as(view, target)
        expected = np.ascontiguousarray(view, dtype=target)
        assert stored.flags.c_contiguous and stored.dtype == target and stored.shape == view.shape
        bits = np.uint16 if dtype == "bfloat16" else np.uint32
        assert np.array_equal(stored.view(bits), expected.view(bits)), view.strides


def test_coalesced_views_keep_their_elements_in_order():
    """A per-head view of a transposed matrix is the 2-D transpose it is (torch copies that in tiles, the 3-D view
    element by element); any view keeps its elements and their order, size-1 axes dropped."""
    from deepspeed_ext.checkpoint.maxtext.leaves import _coalesced

    matrix = np.arange(96 * 70, dtype=np.float32).reshape(96, 70)
    per_head = matrix.T.reshape(70, 6, 16)
    assert _coalesced(per_head).shape == (70, 96)
    assert _coalesced(matrix).shape == (96 * 70,) and _coalesced(matrix[:1, :1]).shape == (1,)
    for view in (per_head, matrix, matrix.T, matrix[:, 1::2], matrix.T.reshape(70, 1, 6, 16), matrix[:1].T,
                 matrix.reshape(96, 7, 10).transpose(1, 2, 0), matrix[::2, ::5]):
        merged = _coalesced(view)
        assert np.shares_memory(merged, view) and merged.size == view.size
        assert np.array_equal(np.ascontiguousarray(merged).reshape(view.shape), view)


def test_slabs_are_produced_in_order_and_left_cleanly():
    """Slabs are produced PRODUCERS at a time and handed over in order; a failed one is raised in its place, and a
    consumer that stops early (a failed write) returns only once no producer still runs."""
    import threading
    import time
    from concurrent.futures import ThreadPoolExecutor

    from deepspeed_ext.checkpoint.maxtext.leaves import PRODUCERS, _in_order

    running, peak, lock = [0], [0], threading.Lock()

    def produce(item: int) -> int:
        with lock:
            running[0] += 1
            peak[0] = max(peak[0], running[0])
        time.sleep(0.002 * (item % 3))
        with lock:
            running[0] -= 1
        if item == 13:
            raise ValueError("block 13")
        return item * item

    with ThreadPoolExecutor(PRODUCERS) as pool:
        assert list(_in_order(pool, range(12), produce)) == [i * i for i in range(12)]
        assert 1 <= peak[0] <= PRODUCERS
        got = []
        with pytest.raises(ValueError, match="block 13"):
            for value in _in_order(pool, range(20), produce):
                got.append(value)
        assert got == [i * i for i in range(13)]
        slabs = _in_order(pool, range(20), produce)
        next(slabs)
        slabs.close()  # the consumer leaves early
        assert running[0] == 0


def test_whole_tensor_rows_from_two_producers():
    """A source that cannot read ranges is loaded whole once per tensor, by either producer, and each producer's
    rows are its tensor's whatever the other reads meanwhile, however far ahead the other runs."""
    import threading

    from deepspeed_ext.checkpoint.maxtext.writer import _source_loaders
    from deepspeed_ext.checkpoint.tensor import LogicalTensor
    from deepspeed_ext.module_inject.layout import TPLayout

    full = {f"w{i}": torch.randn(64, 33) for i in range(4)}
    loads: list[str] = []

    def tensor(name: str) -> LogicalTensor:
        def loader(state: str) -> torch.Tensor:
            loads.append(name)
            return full[name]

        return LogicalTensor(name=name, shape=(64, 33), layout=TPLayout.replicated((64, 33), 1), states=("fp32",),
                             loader=loader)

    _, load_rows = _source_loaders({name: tensor(name) for name in full})
    wrong: list[tuple[str, int]] = []

    def read(names: list[str]) -> None:
        for name in names:
            for first in range(0, 64, 4):
                if not torch.equal(load_rows(name, "fp32", first, first + 4), full[name][first:first + 4].reshape(-1)):
                    wrong.append((name, first))

    def run(*targets) -> None:
        threads = [threading.Thread(target=target) for target in targets]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()

    run(lambda: read(["w0", "w1"]), lambda: read(["w2", "w3"]))
    assert not wrong and sorted(loads) == sorted(full)

    # One producer stays on a tensor while the other moves through two more: the tensor still being read is kept
    # (dropping the oldest loaded it again). Two producers taking turns on one tensor's blocks load it once.
    _, load_rows = _source_loaders({name: tensor(name) for name in full})
    loads.clear()
    started, moved_on = threading.Event(), threading.Event()

    def slow() -> None:
        load_rows("w2", "fp32", 0, 4)
        started.set()
        moved_on.wait()
        read(["w2"])

    def fast() -> None:
        started.wait()
        read(["w0", "w1"])
        moved_on.set()

    run(slow, fast)
    assert not wrong and sorted(loads) == ["w0", "w1", "w2"]
    loads.clear()
    run(lambda: read(["w3"]), lambda: read(["w3"]))
    assert not wrong and loads == ["w3"]


def test_source_rows_are_read_in_one_range_per_block():
    """The writer's row blocks of a source that reads ranges: one read per block, whatever the block's offset (the
    source's own block grid is cut on multiples of its size), the rows equal to the tensor's, in fp32 (a bf16
    source too); a tensor with no elements per row reads nothing."""
    from deepspeed_ext.checkpoint.maxtext.writer import _source_loaders
    from deepspeed_ext.checkpoint.tensor import LogicalTensor
    from deepspeed_ext.module_inject.layout import TPLayout

    # 1.5M elements: a range across the source's default block grid (1M elements) would be read in two pieces.
    full = {"w": torch.randn(300, 5000), "b": torch.randn(11, 3).to(torch.bfloat16), "empty": torch.zeros(4, 0)}
    reads: list[tuple[str, int, int]] = []

    def tensor(name: str) -> LogicalTensor:
        def range_loader(state: str, low: int, high: int) -> torch.Tensor:
            reads.append((name, low, high))
            return full[name].reshape(-1)[low:high]

        return LogicalTensor(name=name, shape=tuple(full[name].shape), layout=TPLayout.replicated(full[name].shape, 1),
                             states=("fp32",), loader=lambda state: full[name], dtype=full[name].dtype,
                             range_loader=range_loader)

    _, load_rows = _source_loaders({name: tensor(name) for name in full})
    for name, first, last in (("w", 0, 300), ("w", 3, 4), ("w", 150, 250), ("w", 299, 300), ("b", 2, 9)):
        reads.clear()
        rows = load_rows(name, "fp32", first, last)
        row = full[name].shape[1]
        assert reads == [(name, first * row, last * row)]
        assert rows.dtype == torch.float32 and torch.equal(rows, full[name][first:last].float().reshape(-1))
    reads.clear()
    assert load_rows("empty", "fp32", 0, 4).numel() == 0 and not reads


@pytest.mark.parametrize("family", ["llama", "gemma3"])
def test_bf16_leaves_from_the_module_weights_are_the_masters_cast_bit_for_bit(tmp_path, family):
    """Written from module weights (the masters rounded to bf16, as DeepSpeed keeps them) in place of the masters,
    every bf16 leaf holds the same bits: moved (kernels), scaled by a power of two (llama's query by 1/4, gemma3's
    embedding by 8), or made from the masters (gemma3's 1 + w norms). A query block with weights that scale below
    the smallest normal, where rounding twice could differ, comes from the masters, which must round to the module's
    weights: a block where they do not is refused."""
    import math

    from deepspeed_ext.checkpoint.maxtext.writer_options import ModuleWeights
    from deepspeed_ext.checkpoint.states import MODULE_WEIGHTS
    from deepspeed_ext.errors import CheckpointError

    model = hf_model(family)
    params = {name: p.detach().float().numpy().copy() for name, p in model.named_parameters()}
    query = next(name for name in params if name.endswith("self_attn.q_proj.weight"))
    params[query][0, :4] = [2.0e-38, -3.1e-38, 4.7e-37, 1.3e-38]  # normal in fp32, subnormal once scaled by 1/4
    module = {name: torch.from_numpy(array).to(torch.bfloat16) for name, array in params.items()}
    shapes = {name: array.shape for name, array in params.items()}
    config = json.loads(model.config.to_json_string(use_diff=False))
    dims = ModelDims.from_config(config)
    master_reads = []

    def load_rows(name, state, first, last):
        row = math.prod(shapes[name][1:])
        values = module[name] if state == MODULE_WEIGHTS else torch.from_numpy(params[name])
        return values.reshape(-1)[first * row:last * row]

    def master_rows(name, first, last):
        master_reads.append(name)
        return load_rows(name, "fp32", first, last)

    def write(label, module_weights):
        return write_maxtext(lambda name, state="fp32": params[name], shapes, get_family(family), dims,
                             tmp_path / label, progress=False, model_config=config, load_rows=load_rows,
                             block_bytes=4096, module_weights=module_weights)

    written = {label: write(label, weights) for label, weights in
               (("masters", None), ("module", ModuleWeights(frozenset(params), master_rows)))}
    assert master_reads == ([query] if family == "llama" else [])
    leaves = plan_leaves(get_family(family), dims, shapes, True)
    a, b = (ocp.tree.to_flat_dict(restore_on_mesh(written[label], leaves), sep="/") for label in written)
    assert a.keys() == b.keys()
    for name in a:
        assert np.array_equal(np.asarray(a[name]), np.asarray(b[name])), name

    if family == "llama":
        module[query].view(torch.int16)[0, 5] ^= 1  # a module weight that is not its master rounded
        with pytest.raises(CheckpointError, match="the module's bf16 weights are not its fp32 masters rounded"):
            write("refused", ModuleWeights(frozenset(params), master_rows))


def test_chunk_files_outside_ocdbt_hold_the_same_arrays(tmp_path, monkeypatch, capsys):
    """``ocdbt=False`` (--no-ocdbt): each array a directory of chunk files and no OCDBT store. Uncompressed, every
    slab of every streamed leaf is written by deepspeed-ext itself (zarr3_shards; counted here), compressed by
    tensorstore. Restored, parameters and Adam moments equal the OCDBT checkpoint's bit for bit; the read-back
    fingerprints agree; verify, inspect and from-maxtext read it; verify fails on a damaged chunk file. Each slab
    is written by the producer thread that made it (no hand-off to a writer thread)."""
    import threading

    from deepspeed_ext.checkpoint import manifest, zarr3_shards
    from deepspeed_ext.checkpoint.formats import open_checkpoint
    from deepspeed_ext.cli import main
    model = hf_model("qwen3", head_dim=8)
    optimizer = torch_adam_state(model)
    params = dict(model.named_parameters())
    config = json.loads(model.config.to_json_string(use_diff=False))
    shapes = {n: tuple(p.shape) for n, p in params.items()}

    def load(name, state="fp32"):
        tensor = params[name] if state == "fp32" else optimizer.state[params[name]][state]
        return tensor.detach().numpy().copy()

    slabs, writers = [], set()
    write_slab = zarr3_shards.ChunkFiles.write_slab

    def counted_write_slab(self, index, piece):
        slabs.append(self.directory)
        writers.add(threading.current_thread().name.rsplit("_", 1)[0])
        return write_slab(self, index, piece)

    monkeypatch.setattr(zarr3_shards.ChunkFiles, "write_slab", counted_write_slab)
    summed = []  # the files the manifest sums from the disk: those not summed as they were written
    file_checksum = manifest.file_checksum
    monkeypatch.setattr(manifest, "file_checksum", lambda path: summed.append(path) or file_checksum(path))
    written = {}
    for label, ocdbt, compression in (("ocdbt", True, "none"), ("files", False, "none"), ("zstd", False, "zstd")):
        written[label] = write_maxtext(load, shapes, get_family("qwen3"), ModelDims.from_config(config),
                                       tmp_path / label, dtype="float32", progress=False, model_config=config,
                                       with_optimizer=True, optimizer_step=2, mesh=MESH_SHAPE, block_bytes=4096,
                                       ocdbt=ocdbt, compression=compression)
        if label == "files":
            leaves = plan_leaves(get_family("qwen3"), ModelDims.from_config(config), shapes, True)
            assert len(set(slabs)) == 3 * len(leaves) and len(slabs) > 6 * len(leaves)  # weights, mu, nu
            assert writers == {"deepspeed-ext-maxtext-blocks"}, writers
            seen = len(slabs)
            # Our chunk files' manifest entries are their CRC-32C summed as written (none read back), and are the
            # files' own.
            root = written[label].parent.parent
            entries = json.loads((root / manifest.MANIFEST_FILE).read_text())["files"]
            ours = [path for path in written[label].glob("*/c/**/*") if path.is_file()]
            assert ours and not set(ours) & set(summed) and len(entries) == len(set(summed)) + len(ours)
            for path in ours:
                assert entries[path.relative_to(root).as_posix()]["crc32c"] == file_checksum(path)
        summed.clear()
    assert len(slabs) == seen, "compressed chunks are tensorstore's to write"
    for label in ("files", "zstd"):
        assert not list(written[label].rglob("manifest.ocdbt")) and list(written[label].glob("*/c/0/*"))
    trees = {label: ocp.tree.to_flat_dict(ocp.PyTreeCheckpointer().restore(items), sep="/")
             for label, items in written.items()}
    for label in ("files", "zstd"):
        assert trees[label].keys() == trees["ocdbt"].keys()
        for key, value in trees["ocdbt"].items():
            assert np.array_equal(np.asarray(value), np.asarray(trees[label][key])), (label, key)
    found = {label: open_checkpoint(items.parent.parent).info.fingerprints for label, items in written.items()}
    for name, states in found["ocdbt"].tensors.items():
        for state, fingerprint in states.items():
            assert fingerprint.agrees(found["files"].tensors[name][state]), (name, state)
    out = written["files"].parent.parent
    assert main(["verify", str(out)]) == 0 and main(["inspect", str(out)]) == 0
    assert main(["from-maxtext", str(out), "-o", str(tmp_path / "back"), "--quiet"]) == 0
    back = open_checkpoint(tmp_path / "back")
    for tensor in back.tensors():
        assert torch.equal(tensor.load_tensor("fp32"), params[tensor.name].detach()), tensor.name
    chunk = next(written["files"].glob("*mlp*/c/0/0/0"))
    data = bytearray(chunk.read_bytes())
    data[8] ^= 0x40
    chunk.write_bytes(bytes(data))
    capsys.readouterr()
    assert main(["verify", str(out)]) != 0
    report = capsys.readouterr().out
    assert "FAILED" in report and chunk.parent.parent.parent.parent.name + "/c/0/0/0" in report, report


def test_a_lazy_leaf_of_slabs_writes_each_slab_in_order():
    """A lazy leaf given only ``slabs`` still offers ``write_slabs``: each slab handed to the writer in order,
    what each write returns yielded; a leaf produced whole has neither."""
    from deepspeed_ext.checkpoint.maxtext.orbax_io import LazyLeaf

    pieces = [((slice(0, 2), slice(None)), np.full((2, 3), 1.0)), ((slice(2, 4), slice(None)), np.full((2, 3), 2.0))]
    leaf = LazyLeaf((4, 3), np.dtype(np.float64), None, (2, 3), slabs=lambda: iter(pieces))
    seen = []
    assert list(leaf.write_slabs(lambda index, piece: seen.append((index, piece)) or piece.nbytes)) == [48, 48]
    assert [index for index, _ in seen] == [index for index, _ in pieces]
    assert np.array_equal(np.asarray(leaf), np.repeat([1.0, 2.0], 6).reshape(4, 3))
    assert LazyLeaf((2,), np.dtype(np.float32), lambda: np.zeros(2, np.float32)).write_slabs is None


def test_below_finds_nonzero_weights_under_a_power_of_two_from_their_bits():
    """``_below``: whether any nonzero bf16 element is smaller in magnitude than the limit, either sign, zeros
    and -0.0 never, NaN and Inf never; the same answer as comparing the values themselves."""
    from deepspeed_ext.checkpoint.maxtext.leaves import _below

    generator = torch.Generator().manual_seed(0)
    for trial in range(600):
        count = int(torch.randint(1, 40, (1,), generator=generator))
        bits = torch.randint(-32768, 32768, (count,), generator=generator, dtype=torch.int32).to(torch.int16)
        if trial % 3 == 0:  # mostly tiny magnitudes, zeros and -0.0 among them
            bits = torch.where(bits.abs() > 1500, torch.zeros_like(bits), bits)
        values = bits.view(torch.bfloat16)
        wide = values.float().abs()
        for exponent in (-126, -125, -120, -60, 0, 40, 127):
            limit = 2.0 ** exponent
            expected = bool(((wide > 0) & (wide < limit)).any())  # NaN compares false
            assert _below(values.clone(), limit) == expected, (trial, exponent)
    assert not _below(torch.tensor([], dtype=torch.bfloat16), 1.0)
    assert not _below(torch.tensor([0.0, -0.0, float("nan"), float("inf")], dtype=torch.bfloat16), 2.0 ** 100)
    assert _below(torch.tensor([-(2.0 ** -126)], dtype=torch.bfloat16), 2.0 ** -125)
    values = torch.tensor([1.5, -3.0], dtype=torch.bfloat16)
    assert not _below(values, 1.0) and _below(values, 2.0) and torch.equal(values, torch.tensor([1.5, -3.0]).bfloat16())
