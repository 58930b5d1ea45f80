"""Our tags vs DeepSpeed's own (``ds_autotp_universal_checkpoint_meta``) on the real engine."""

import json
import sys
from pathlib import Path

import pytest

from harness.runner import run_logged

WORKER = Path(__file__).parents[1] / "harness" / "workers" / "compare_tags.py"


FAMILIES = ["llama", "phi3", "qwen3"]
#: Per TP degree, the directory of every family's comparison: one torchrun per degree builds each family's engine
#: in turn (a torchrun's start is most of a run's time here).
_COMPARED: dict[int, Path] = {}


def _compared(tp: int, tmp_path_factory: pytest.TempPathFactory) -> Path:
    if tp not in _COMPARED:
        out = tmp_path_factory.mktemp(f"tags_tp{tp}")
        run_logged([sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={tp}",
                    str(WORKER), *(arg for family in FAMILIES for arg in ("--family", family)), "--out", str(out)],
                   out / "worker.log")
        _COMPARED[tp] = out
    return _COMPARED[tp]


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("tp", [2, 3, 4])
def test_our_schema_and_upstream_metadata_describe_the_same_slices(family, tp, tmp_path_factory):
    result = json.loads((_compared(tp, tmp_path_factory) / f"{family}.json").read_text())
    sharded = {name for name, r in result.items() if r["ours"]["partition_type"] != "replicated"}
    assert {name for name, r in result.items() if r["has_upstream_meta"]} == sharded
    # 2 layers x (q, k, v, o, gate, up, down) + lm_head; phi3 fuses q/k/v and gate/up: 2 x 4 + lm_head;
    # qwen3 ties lm_head to the embedding, which AutoTP then shards over the vocabulary.
    assert len(sharded) == {"llama": 15, "phi3": 9, "qwen3": 15}[family], sorted(sharded)
    for name, r in result.items():
        assert r["tagged"], name
        assert r["same_as_upstream"], f"{name}: ours {r['ours']} vs DeepSpeed {r['upstream']}"
        assert r["same_as_rule"], f"{name}: layer-frozen sizes differ from our shard-size rule"
        assert r["same_as_uc_info"], f"{name}: layout rebuilt from universal_checkpoint_info differs"
    if family == "phi3":
        qkv = result["model.layers.0.self_attn.qkv_proj.weight"]["ours"]
        assert qkv["sub_param_sizes"] == [64, 16, 16]
        gate_up = result["model.layers.0.mlp.gate_up_proj.weight"]["ours"]
        assert gate_up["sub_param_sizes"] == [160, 160]
    vocab_name = "model.embed_tokens.weight" if family == "qwen3" else "lm_head.weight"
    assert family != "qwen3" or "lm_head.weight" not in result  # tied: one parameter
    vocab = result[vocab_name]["ours"]
    assert vocab["role"] == "vocab" and vocab["partition_dim"] == 0 and sum(vocab["shard_widths"][0]) == 101
