"""to-maxtext from a real DeepSpeed TP=2 checkpoint (directly and via universal), and reshard-orbax run as a
subprocess. The way back to a resume (at TP=1, 2 and 3, through MaxText's own training too) is in
tests/e2e/test_maxtext_continue_e2e.py; the rest in tests/unit/test_maxtext.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import torch

from deepspeed_ext.checkpoint.families import get_family
from deepspeed_ext.checkpoint.maxtext import ModelDims, plan_leaves, write_maxtext

from harness.environments import require

jax = require("jax", "the [maxtext] extra")
ocp = require("orbax.checkpoint", "the [maxtext] extra")

from harness.maxtext import (MESH_SHAPE, TOKENS, hf_model, max_kl, maxtext_logits, restore_on_mesh,  # noqa: E402
                             torch_adam_state)


def test_deepspeed_checkpoint_to_maxtext_directly_and_via_universal(scenarios, tmp_path):
    """A TP=2 ZeRO-1 DeepSpeed checkpoint converts on the fly (no universal copy) to the same arrays as its
    universal form, and MaxText's own forward on them matches the PyTorch model holding the trained fp32 weights."""
    from deepspeed_ext.checkpoint.universal import UniversalCheckpoint
    from deepspeed_ext.demo.models import build_model
    from harness.runner import cli

    tp2 = scenarios("tp2_zero1_bf16", tp=2)
    outputs = {}
    for kind, source in (("deepspeed", tp2.save_dir), ("universal", tp2.universal_dir)):
        out = tmp_path / kind
        cli(["to-maxtext", str(source), "-o", str(out), "--dtype", "float32", "--quiet"], tmp_path / f"{kind}.log")
        outputs[kind] = out / "0" / "items"

    model = build_model("llama")
    universal = UniversalCheckpoint(tp2.universal_dir)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(universal.load(name))
    config = json.loads(model.config.to_json_string(use_diff=False))
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    leaves = plan_leaves(get_family("llama"), ModelDims.from_config(config), shapes, True)
    restored = {kind: restore_on_mesh(items, leaves) for kind, items in outputs.items()}
    flat = {kind: ocp.tree.to_flat_dict(tree, sep="/") for kind, tree in restored.items()}
    assert flat["deepspeed"].keys() == flat["universal"].keys()
    for name, array in flat["deepspeed"].items():
        assert np.array_equal(np.asarray(array), np.asarray(flat["universal"][name])), name
    tokens = [t % 101 for t in TOKENS]
    logits = maxtext_logits(outputs["deepspeed"], model, "llama", True, tmp_path, tokens=tokens)
    with torch.no_grad():
        reference = model(input_ids=torch.tensor([tokens])).logits[0]
    assert max_kl(reference, logits) <= 1e-5


def test_a_bf16_export_reads_the_module_weights_to_the_bits_of_the_masters_cast_and_checks_them(scenarios, tmp_path,
                                                                                                 monkeypatch):
    """A bf16 to-maxtext of a TP=2 ZeRO-1 bf16 save reads the module's own bf16 weights, whose fingerprints the save
    recorded, in place of the fp32 masters, and stores the very arrays the masters' cast gives. A module weight that
    no longer fits its record is refused in one line naming it, nothing written; the masters still convert."""
    import shutil

    from deepspeed_ext.checkpoint import commit
    from deepspeed_ext.checkpoint.deepspeed.reader import DeepSpeedCheckpoint
    from deepspeed_ext.checkpoint.formats import open_checkpoint
    from deepspeed_ext.checkpoint.maxtext import MaxTextOptions, write
    from deepspeed_ext.checkpoint.states import MODULE_WEIGHTS
    from deepspeed_ext.demo.models import build_model
    from harness.runner import cli
    from harness.scenario import without_commit_marker

    tp2 = scenarios("tp2_zero1_bf16", tp=2)
    source = open_checkpoint(tp2.save_dir)
    recorded = source.info.fingerprints
    assert recorded is not None and all(recorded.get(name, MODULE_WEIGHTS) is not None for name in source.info.layouts)
    module_reads = []
    real_module_range = DeepSpeedCheckpoint._module_range
    monkeypatch.setattr(DeepSpeedCheckpoint, "_module_range",
                        lambda self, *args: module_reads.append(args) or real_module_range(self, *args))
    items = {}
    for module in (True, False):
        items[module] = write(open_checkpoint(tp2.save_dir), tmp_path / f"module_{module}",
                              MaxTextOptions(progress=False, module_weights=module))
        assert bool(module_reads) == module
        module_reads.clear()

    model = build_model("llama")
    config = json.loads(model.config.to_json_string(use_diff=False))
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    leaves = plan_leaves(get_family("llama"), ModelDims.from_config(config), shapes, True)
    flat = {module: ocp.tree.to_flat_dict(restore_on_mesh(path, leaves), sep="/") for module, path in items.items()}
    assert flat[True].keys() == flat[False].keys()
    for key, array in flat[True].items():
        assert np.array_equal(np.asarray(array), np.asarray(flat[False][key])), key
    # Each records what a read returns (the module path from the sums its source check took): the same record,
    # and from-maxtext, which checks it, reads the output.
    from deepspeed_ext.checkpoint.fingerprint import Fingerprints
    records = [Fingerprints.from_json(json.loads((tmp_path / f"module_{module}" / "0" / "_CHECKPOINT_METADATA")
                                                 .read_text())["custom_metadata"]["deepspeed_ext"]["fingerprints"])
               for module in (True, False)]
    assert records[0].tensors.keys() == records[1].tensors.keys()
    for name, states in records[0].tensors.items():
        assert states["fp32"].agrees(records[1].get(name, "fp32")), name
    cli(["from-maxtext", str(tmp_path / "module_True"), "-o", str(tmp_path / "back"), "--quiet"], tmp_path / "back.log")

    tag = without_commit_marker(Path(shutil.copytree(tp2.tag_dir, tmp_path / "edited" / tp2.tag_dir.name)))
    info_file = tag / commit.UC_INFO_FILE
    info = json.loads(info_file.read_text())
    name = "model.layers.1.self_attn.k_proj.weight"
    info["fingerprints"]["tensors"][name][MODULE_WEIGHTS][1] += 1.0
    info_file.write_text(json.dumps(info))
    proc = cli(["to-maxtext", str(tag), "-o", str(tmp_path / "refused"), "--quiet"], tmp_path / "refused.log",
               check=False)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr
    assert f"'{name}' module: recorded" in lines[0] and not (tmp_path / "refused").exists(), lines[0]
    write(open_checkpoint(tag), tmp_path / "masters", MaxTextOptions(progress=False, module_weights=False))


def test_reshard_orbax_rechunks_array_by_array_and_keeps_everything_else(tmp_path):
    """reshard-orbax: a checkpoint written whole (no --mesh, with Adam state) re-chunked for fsdp=2 x
    tensor=2: same arrays, scalars and custom metadata; every param and moment chunk is one device's shard."""
    import tensorstore as ts
    from deepspeed_ext.checkpoint.maxtext import shard_shape
    from harness.runner import cli
    model = hf_model("llama3.1", head_dim=8)
    optimizer = torch_adam_state(model, steps=1)
    params = dict(model.named_parameters())
    config = json.loads(model.config.to_json_string(use_diff=False))
    fam, dims = get_family("llama3.1"), ModelDims.from_config(config)
    shapes = {name: tuple(p.shape) for name, p in params.items()}

    def load(name, state="fp32"):
        tensor = params[name] if state == "fp32" else optimizer.state[params[name]][state]
        return tensor.detach().numpy().copy()

    source = write_maxtext(load, shapes, fam, dims, tmp_path / "whole", dtype="bfloat16", progress=False,
                           model_config=config, step=7, with_optimizer=True, optimizer_step=1)
    out = tmp_path / "resharded"
    proc = cli(["reshard-orbax", str(source), "-o", str(out), "--mesh", "fsdp=2,tensor=2", "--quiet"],
               tmp_path / "reshard.log")
    assert proc.stderr.count("kept whole") == 0
    resharded = out / "0" / "items"
    before, after = (ocp.PyTreeCheckpointer().restore(items) for items in (source, resharded))
    flat_before, flat_after = (ocp.tree.to_flat_dict(t, sep="/") for t in (before, after))
    assert flat_before.keys() == flat_after.keys()
    for name, value in flat_before.items():
        assert np.asarray(value).dtype == np.asarray(flat_after[name]).dtype, name
        assert np.array_equal(np.asarray(value), np.asarray(flat_after[name])), name
    assert int(after["step"]) == 7 and int(after["opt_state"][0]["count"]) == 1
    custom = (ocp.StandardCheckpointer().metadata(p.parent).custom_metadata for p in (source, resharded))
    assert next(custom) == next(custom)
    for leaf in plan_leaves(fam, dims, shapes, True):
        for root in ("params.params.", "opt_state.0.mu.params.", "opt_state.0.nu.params."):
            array = ts.open({"driver": "zarr3", "kvstore": {"driver": "ocdbt", "base": f"file://{resharded}"},
                             "path": root + ".".join(leaf.path)}).result()
            assert tuple(array.chunk_layout.write_chunk.shape) == shard_shape(leaf, MESH_SHAPE), (root, leaf.name)

