"""DeepSeek-V4 to MaxText's deepseek4: what MaxText would compute otherwise is refused in one line before anything is
written, the hash-routing table keeps its exact indices (fp32 in every checkpoint dtype, int64 read back), and a
hyper-connection norm scale MaxText trained away from 1 (transformers' norm has no weight) is refused on the way back.

The round trips and MaxText's own forward on the output are in test_maxtext.py and
tests/e2e/test_maxtext_model_code.py, as for every family."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepspeed_ext.checkpoint.families import get_family
from deepspeed_ext.errors import CheckpointError
from harness.environments import require

ocp = require("orbax.checkpoint", "the [maxtext] extra")
from harness.maxtext import convert, hf_model, sized_config  # noqa: E402

FAMILY = get_family("deepseek-v4")


def _config(**changes):
    config = {**sized_config("deepseek-v4", 16).to_dict(), **changes}
    if "rope_scaling" in changes:  # a release's spelling: transformers derives rope_parameters from it
        del config["rope_parameters"]
    return config


#: Configs MaxText 0.2.5's deepseek4 computes otherwise than transformers, and what the refusal names.
UNLIKE_MAXTEXT = {
    "yarn": (dict(rope_scaling={"type": "yarn", "factor": 16, "original_max_position_embeddings": 16,
                                "beta_fast": 32, "beta_slow": 1}), "compressed layers' RoPE is yarn"),
    "csa_rate": (dict(compress_rates={"compressed_sparse_attention": 8, "heavily_compressed_attention": 128}),
                 "compressed sparse layers compress by 8"),
    "hash_after_top_k": (dict(mlp_layer_types=["moe", "hash_moe", "moe", "moe", "moe", "moe"]),
                         "hash-routed layers are not the first ones"),
    "hc_eps": (dict(hc_eps=1e-5), "hc_eps 1e-05"),
    "softmax_router": (dict(scoring_func="softmax"), "router scores by softmax"),
}


@pytest.mark.parametrize("case", list(UNLIKE_MAXTEXT))
@pytest.mark.parametrize("scan_layers", [True, False])
def test_configs_maxtext_computes_otherwise_are_refused_in_one_line(case, scan_layers):
    changes, named = UNLIKE_MAXTEXT[case]
    with pytest.raises(CheckpointError) as refused:
        FAMILY.layer_blocks(_config(**changes), scan_layers)
    message = str(refused.value)
    assert len(message.splitlines()) == 1 and named in message and "MaxText 0.2.5's deepseek4" in message, message


def test_scanned_needs_maxtexts_cycle_after_the_hash_layers():
    """Scanned, MaxText builds the layers after the hash-routed ones as blocks of a heavily compressed layer at 128
    and a compressed sparse one: another compression, or a layer short of a whole block, is refused with the way out
    (unscanned holds both)."""
    base = _config()
    short = _config(num_hidden_layers=5, layer_types=base["layer_types"][:5],
                    mlp_layer_types=base["mlp_layer_types"][:5])
    hca8 = _config(compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8})
    for config in (short, hca8):
        with pytest.raises(CheckpointError, match="not whole cycles of 2.*--no-scan-layers"):
            FAMILY.layer_blocks(config, True)
        assert len(FAMILY.layer_blocks(config, False)) == config["num_hidden_layers"]
    blocks = FAMILY.layer_blocks(base, True)
    assert [(b.path, b.layers, b.kind) for b in blocks] == [
        ("layers_0", (0, ), "sliding/hash"), ("layers_1", (1, ), "csa/hash"),
        ("scanned_blocks/layers_0", (2, 4), "hca/top_k"), ("scanned_blocks/layers_1", (3, 5), "csa/top_k")]


def test_hash_table_is_fp32_in_a_bf16_checkpoint_and_comes_back_int64(tmp_path):
    from deepspeed_ext.checkpoint.maxtext import MaxTextCheckpoint
    model = hf_model("deepseek-v4", head_dim=8)
    items, _ = convert(model, "deepseek-v4", tmp_path / "out", scan_layers=False, dtype="bfloat16")
    tree = ocp.PyTreeCheckpointer().metadata(items).item_metadata.tree["params"]
    dtypes = {name: str(np.dtype(m.dtype)) for name, m in ocp.tree.to_flat_dict(tree, sep="/").items()}
    tables = {name: dtype for name, dtype in dtypes.items() if name.startswith("Tid2EidVar/")}
    assert sorted(tables) == [f"Tid2EidVar/decoder/layers_{i}/mlp/MoeBlock_0/tid2eid" for i in range(2)]
    assert set(tables.values()) == {"float32"} and dtypes["params/token_embedder/embedding"] == "bfloat16"
    source = MaxTextCheckpoint(items, FAMILY, model.config.to_dict())
    for layer in range(2):
        name = f"model.layers.{layer}.mlp.gate.tid2eid"
        got = source.hf_tensor(name)
        assert got.dtype == np.int64 and np.array_equal(got, model.get_buffer(name).numpy())
    assert {t.name: t.dtype for t in source.tensors()}[name] == torch.int64


def test_a_hash_table_of_other_values_than_expert_indices_is_refused(tmp_path):
    model = hf_model("deepseek-v4", head_dim=8)
    model.get_buffer("model.layers.1.mlp.gate.tid2eid")[5, 0] = model.config.n_routed_experts
    with pytest.raises(CheckpointError, match=r"tid2eid\) holds values that are not expert indices 0\.\.7"):
        convert(model, "deepseek-v4", tmp_path / "out", scan_layers=False)
    assert not (tmp_path / "out").exists()


def test_a_trained_hyper_connection_norm_scale_is_refused_on_the_way_back():
    """MaxText's hyper-connections normalize with a scale (written as ones) that transformers' do not have: read back
    only while it is all ones; its Adam moments are MaxText's own and are dropped."""
    from deepspeed_ext.checkpoint.maxtext import ModelDims
    from deepspeed_ext.checkpoint.maxtext.transforms import from_maxtext, to_maxtext
    dims = ModelDims.from_config(_config())
    fn = np.random.default_rng(0).standard_normal((24, 256)).astype(np.float32)
    ones = to_maxtext("hc_norm", fn, dims, FAMILY)
    assert np.array_equal(ones, np.ones(256, np.float32))
    assert from_maxtext("hc_norm", ones, dims, FAMILY).shape == (0, 256)
    assert not to_maxtext("hc_norm", fn, dims, FAMILY, "exp_avg").any()
    with pytest.raises(CheckpointError, match=r"mhc_norm/scale\) is not 1"):
        from_maxtext("hc_norm", np.full(256, 1.5, np.float32), dims, FAMILY)
