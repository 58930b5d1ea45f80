"""The config section and the weights-only loader (no engine needed). The CLI's error paths, run as a
subprocess, are in tests/e2e/test_config_and_errors_e2e.py."""

import pytest
import torch

from deepspeed_ext.checkpoint import serialization
from deepspeed_ext.config import ExtConfig, load_ds_config
from deepspeed_ext.errors import CheckpointError


def test_config_section_defaults_and_validation(tmp_path):
    assert not ExtConfig.from_ds_config({}).universal_checkpoint.enabled
    cfg = ExtConfig.from_ds_config({"deepspeed_ext": {"universal_checkpoint": {"enabled": True}}})
    assert cfg.universal_checkpoint.enabled and cfg.universal_checkpoint.restore == "deepspeed_ext"
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['enabeld'\]"):
        ExtConfig.from_ds_config({"deepspeed_ext": {"universal_checkpoint": {"enabeld": True}}})
    with pytest.raises(ValueError, match="must be one of"):
        ExtConfig.from_ds_config({"deepspeed_ext": {"universal_checkpoint": {"restore": "magic"}}})
    path = tmp_path / "ds.json"
    path.write_text('{"deepspeed_ext": {"universal_checkpoint": {"enabled": true}}}')
    assert load_ds_config(str(path))["deepspeed_ext"]["universal_checkpoint"]["enabled"] is True


def test_plain_deepspeed_accepts_the_section():
    from deepspeed.runtime.config import DeepSpeedConfig
    config = DeepSpeedConfig({"train_batch_size": 1, "deepspeed_ext": {"universal_checkpoint": {"enabled": True}}})
    assert config.train_batch_size == 1


class _Payload:
    """Would create a file when unpickled by a loader that runs code."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_loader_refuses_code_in_pickles(tmp_path):
    marker = tmp_path / "pwned"
    bad = tmp_path / "bad.pt"
    torch.save({"param": torch.zeros(2), "x": _Payload(str(marker))}, bad)
    with pytest.raises(CheckpointError, match="refused to unpickle"):
        serialization.load(bad)
    assert not marker.exists()


def test_loader_reads_deepspeed_types_and_reports_corrupt_files(tmp_path):
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    good = tmp_path / "good.pt"
    torch.save({"s": LossScaler(1.0), "z": ZeroStageEnum(2), "f": fragment_address(numel=3, start=4)}, good)
    data = serialization.load(good)
    assert data["z"] == ZeroStageEnum.gradients and data["f"].numel == 3 and data["s"].cur_scale == 1.0
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:50])
    with pytest.raises(CheckpointError, match="truncated.pt: cannot read torch file"):
        serialization.load(truncated)
    with pytest.raises(CheckpointError, match="missing.pt: file not found"):
        serialization.load(tmp_path / "missing.pt")
