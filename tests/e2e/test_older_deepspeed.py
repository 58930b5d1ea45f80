"""The user story on DeepSpeed 0.18.8: AutoTP training, but no AutoTP universal-checkpoint tags upstream.

deepspeed-ext's tags are then the only metadata. Runs in its own virtual environment, which
``scripts/setup.sh`` creates (``.venv-deepspeed-0.18.8``).
"""

import json
from pathlib import Path

import pytest

from deepspeed_ext.checkpoint import serialization
from harness.scenario import assert_losses_continue, assert_universal_matches_live

OLD_PYTHON = Path(__file__).resolve().parents[2] / ".venv-deepspeed-0.18.8" / "bin" / "python"


@pytest.fixture(scope="module")
def old(scenarios):
    assert OLD_PYTHON.exists(), f"{OLD_PYTHON} is missing: run scripts/setup.sh"
    return scenarios("deepspeed_0_18_8_tp2", tp=2, python=str(OLD_PYTHON))


def test_older_deepspeed_checkpoint_has_only_our_tags(old):
    states = serialization.load(old.tag_dir / "mp_rank_00_model_states.pt")
    assert states["ds_version"] == "0.18.8" and "universal_checkpoint_info" not in states
    info = json.loads((old.tag_dir / "deepspeed_ext.json").read_text())
    assert info["versions"]["deepspeed"] == "0.18.8"
    assert info["params"]["model.layers.0.self_attn.o_proj.weight"]["shard_widths"] == [[32, 32]]
    assert info["params"]["lm_head.weight"]["partition_type"] == "replicated"  # 0.18.8 does not shard lm_head
    assert_universal_matches_live(old)


# TP=3 is left out: DeepSpeed 0.18.8's AutoTP itself splits q_proj of this model 22/21/21 rows (not on
# head boundaries), so the model cannot run at TP=3 on that release, with or without deepspeed-ext.
@pytest.mark.parametrize("target_tp", [1, 4])
def test_older_deepspeed_tp2_resumes(old, target_tp):
    assert_losses_continue(old, old.resume(target_tp))
