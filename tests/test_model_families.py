"""Model features beyond the plain Llama: q/k/v biases (Qwen2) and q/k norms + tied embeddings (Qwen3)."""

import sys

import pytest
import torch

from deepspeed_ext.checkpoint import serialization
from deepspeed_ext.demo.runner import run_logged
from e2e import assert_losses_continue, assert_universal_matches_live

pytestmark = pytest.mark.e2e


@pytest.mark.parametrize("target_tp", [1, 3])
def test_qwen2_qkv_biases_tp2_resumes(scenarios, target_tp):
    qwen2 = scenarios("qwen2_tp2", tp=2, family="qwen2")
    if target_tp == 1:
        assert_universal_matches_live(qwen2)
        bias = serialization.load(qwen2.universal_dir / "zero" / "model.layers.0.self_attn.k_proj.bias" / "fp32.pt")
        assert bias["param"].shape == (16, ) and bias["cat_dim"] == 0
    assert_losses_continue(qwen2, qwen2.resume(target_tp))


@pytest.fixture(scope="module")
def qwen3(scenarios):
    return scenarios("qwen3_tied_tp2", tp=2, family="qwen3")


@pytest.mark.parametrize("target_tp", [1, 3])
def test_qwen3_tied_embeddings_tp2_resumes(qwen3, target_tp):
    if target_tp == 1:
        assert_universal_matches_live(qwen3)
    assert_losses_continue(qwen3, qwen3.resume(target_tp))


def test_tied_embedding_is_held_in_full_where_upstream_writes_a_shard(qwen3, tmp_path):
    """Disagreement with upstream 0.19.8, named: parameter ``lm_head.weight`` of a tied Qwen3 at TP=2.

    Upstream writes ``zero/lm_head.weight`` as one rank's [51, 64] vocab shard that no model can load as
    lm_head. We are right: the tie makes lm_head *be* ``model.embed_tokens.weight``, which we hold in
    full ([101, 64], bit-identical to upstream's own embedding) and which restores both ends of the tie.
    """
    ours = qwen3.universal_dir / "zero"
    assert not (ours / "lm_head.weight").exists()
    embed = serialization.load(ours / "model.embed_tokens.weight" / "fp32.pt")["param"]
    assert embed.shape == (101, 64)

    upstream = tmp_path / "upstream"
    run_logged([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", str(qwen3.tag_dir),
                "--output_folder", str(upstream), "--num_extract_workers", "1", "--num_merge_workers", "1"],
               tmp_path / "upstream.log")
    assert torch.equal(serialization.load(upstream / "zero" / "model.embed_tokens.weight" / "fp32.pt")["param"],
                       embed)
    lm_head = serialization.load(upstream / "zero" / "lm_head.weight" / "fp32.pt")["param"]
    assert lm_head.shape == (51, 64), "upstream now writes lm_head differently: update this test and the docs"
    assert not torch.equal(lm_head, embed[:51])  # a bf16-rounded shard, not even the tied rows' fp32 values
