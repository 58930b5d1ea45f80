"""Our to-maxtext output, restored through MaxText's own loader (load_parameters_path) into MaxText's own model
(MaxText 0.2.5's code in .venv-maxtext, built by scripts/setup-maxtext.sh), gives transformers' logits.

MaxText is configured with what deepspeed-ext prints for the checkpoint (maxtext.maxtext_settings)."""

from __future__ import annotations

import pytest
import torch

from deepspeed_ext.checkpoint.families import maxtext_family_names
from deepspeed_ext.demo.models import VARIANTS
from harness.families import ONE_BY_ONE
from harness.maxtext import base_family, convert, hf_model, max_kl, maxtext_logits, torch_logits

#: Per-token KL bounds (issue 17), and argmax equal.
KL = {"float32": 1e-4, "bfloat16": 1e-3}
#: Every family of the registry with a MaxText mapping, and the test variants of one (deepseek-v3-yarn).
FAMILIES = [*maxtext_family_names(), *VARIANTS]
#: Families whose MaxText layers are one plain stack of one decoder layer (named ``layers_<i>`` unscanned, whatever
#: the family): llama stands for them unscanned.
PLAIN_STACKS = ("llama3.1", "mistral", "qwen2", "qwen3", "qwen3-moe", "mixtral")
#: bf16, written with --mesh fsdp=2,tensor=2 storage chunks and restored onto MaxText's own sharding of a 4-device
#: CPU mesh: a family per kind of transform that bf16 rounds or the mesh splits (the pre-scaled query, gemma's 1 + w
#: norms and scaled embedding, MLA and its MoE, interleaved experts with biases and sinks, a plain MoE). The later
#: families are written with a mesh in test_recent_families_e2e.py's MaxText round trip.
SHARDED_BF16 = ("llama", "gemma3", "deepseek-v3", "gpt-oss", "mixtral")
#: fp32 scanned for every family, and unscanned for every family but the plain stacks llama stands for, on one
#: device. The test variants in fp32, scanned where MaxText scans them: DeepSeek-V3 with its own yarn RoPE and
#: Kimi-K2 (only the MaxText settings differ), Gemma 4 as the E2B (unscanned) and the 26B are.
CASES = [(family, scan, dtype) for family in FAMILIES if family not in VARIANTS
         for scan, dtype in ((True, "float32"), (False, "float32"), (True, "bfloat16"))
         if (dtype == "bfloat16" and family in SHARDED_BF16)
         or (dtype == "float32" and (scan or family not in PLAIN_STACKS))]
assert set(PLAIN_STACKS) | set(SHARDED_BF16) <= set(ONE_BY_ONE)


def _scanned_in_maxtext(variant: str) -> bool:
    """Whether MaxText scans the variant's layers (Gemma 4's small-model decoder does not)."""
    from deepspeed_ext.checkpoint.families import get_family
    from deepspeed_ext.demo.models import tiny_config
    from deepspeed_ext.errors import CheckpointError
    try:
        get_family(base_family(variant)).layer_blocks(tiny_config(variant, maxtext_head_dim=16).to_dict(), True)
    except CheckpointError:
        return False
    return True


CASES += [(variant, _scanned_in_maxtext(variant), "float32") for variant in VARIANTS]


#: Unscanned, every layer is a block of its own: one cycle of the layer pattern holds every kind of layer. The
#: hybrid Qwen families' MaxText configs have two cycles (Qwen3-Next two layers more) for the scanned stacks' order;
#: unscanned, their one cycle compiles in a third of the time.
UNSCANNED_DEPTH = {"qwen3-next": 4, "qwen3.5-moe": 4}


@pytest.mark.parametrize("family, scan_layers, dtype", CASES,
                         ids=[f"{f}-{'scanned' if s else 'unscanned'}-{d}" for f, s, d in CASES])
def test_maxtext_forward_on_our_output_matches_transformers(family, scan_layers, dtype, tmp_path):
    model = hf_model(family, num_layers=None if scan_layers else UNSCANNED_DEPTH.get(family))
    sharded = dtype == "bfloat16"
    items, _ = convert(model, family, tmp_path / "maxtext", scan_layers=scan_layers, dtype=dtype,
                       mesh={"fsdp": 2, "tensor": 2} if sharded else None)
    logits = maxtext_logits(items, model, family, scan_layers, tmp_path, sharded=sharded)
    assert_matches_transformers(model, family, items, logits, dtype, f"{family} scan_layers={scan_layers} {dtype}")


def assert_matches_transformers(model, family: str, items, logits, dtype: str, label: str) -> None:
    """MaxText's ``logits`` within the KL bar of ``dtype`` of transformers' on the same tokens, argmax equal; for bf16
    against the weights the checkpoint holds, read back into transformers' model."""
    if dtype == "bfloat16":
        from deepspeed_ext.checkpoint.families import get_family
        from deepspeed_ext.checkpoint.maxtext import MaxTextCheckpoint, stored_model_info
        stored = MaxTextCheckpoint(items, get_family(base_family(family)), stored_model_info(items)["model_config"])
        with torch.no_grad():
            for name, param in model.named_parameters():
                param.copy_(torch.from_numpy(stored.hf_tensor(name)))
    reference = torch_logits(model)
    kl = max_kl(reference, logits)
    print(f"{label}: max per-token KL {kl:.2e}")
    assert kl <= KL[dtype]
    assert (reference.argmax(-1).numpy() == logits.argmax(-1)).all()


@pytest.mark.parametrize("mistake", ["no_query_scale", "no_rope_interleave"])
def test_negative_controls_fail_the_kl_bar(tmp_path, mistake):
    """The check above can fail: a conversion that leaves out one convention moves MaxText's KL far above the bar
    (llama's pre-scaled query; llama3.1's adjacent-pair RoPE order)."""
    import dataclasses

    from deepspeed_ext.checkpoint.families import get_family
    family = "llama3.1" if mistake == "no_rope_interleave" else "llama"
    wrong = dataclasses.replace(get_family(family), **({"query_scaled": False} if mistake == "no_query_scale" else
                                                       {"rope_interleaved": False}))
    model = hf_model(family)
    items, _ = convert(model, wrong, tmp_path / "maxtext")
    kl = max_kl(torch_logits(model), maxtext_logits(items, model, family, True, tmp_path))
    print(f"{mistake}: max per-token KL {kl:.2e}")
    assert kl > 1e-3


@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_maxtext_loads_chunk_files_outside_ocdbt(tmp_path, compression):
    """--no-ocdbt (each array a directory of chunk files; uncompressed, deepspeed-ext writes the files itself):
    MaxText's own loader, configured as for any checkpoint, restores it onto its 4-device sharding and its forward
    gives transformers' logits on the weights the checkpoint holds."""
    model = hf_model("qwen3")
    items, _ = convert(model, "qwen3", tmp_path / "maxtext", dtype="bfloat16", mesh={"fsdp": 2, "tensor": 2},
                       ocdbt=False, compression=compression)
    assert not list(items.rglob("manifest.ocdbt")) and list(items.glob("*/c/0/*"))
    logits = maxtext_logits(items, model, "qwen3", True, tmp_path, sharded=True)
    assert_matches_transformers(model, "qwen3", items, logits, "bfloat16",
                                f"qwen3 --no-ocdbt --compression {compression}")
