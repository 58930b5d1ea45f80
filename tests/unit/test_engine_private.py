"""The fence around DeepSpeed's live-engine internals checks the installed release up front."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from deepspeed_ext import runtime
from deepspeed_ext.checkpoint import engine_private
from deepspeed_ext.config import ExtConfig
from deepspeed_ext.errors import DeepSpeedExtError


@pytest.fixture
def fresh_check():
    engine_private.check_installed_deepspeed.cache_clear()
    yield
    engine_private.check_installed_deepspeed.cache_clear()


def test_the_installed_deepspeed_has_everything_the_fence_reads(fresh_check):
    assert engine_private.missing_deepspeed_parts() == []
    engine_private.check_installed_deepspeed()


@pytest.mark.parametrize("module, owner, attribute, named", [
    ("deepspeed.utils.tensor_fragment", "tensor_fragment", "get_hp_fragment", "tensor_fragment.get_hp_fragment"),
    ("deepspeed.runtime.zero.stage3", "DeepSpeedZeroOptimizer_Stage3", "get_local_fp32_param",
     "DeepSpeedZeroOptimizer_Stage3.get_local_fp32_param"),
    ("deepspeed.utils", None, "safe_set_local_fp32_param", "deepspeed.utils.safe_set_local_fp32_param"),
])
def test_a_release_without_a_part_fails_at_initialize_in_one_line_naming_it(fresh_check, monkeypatch, module,
                                                                            owner, attribute, named):
    import importlib
    target = importlib.import_module(module)
    if owner is not None:
        target = getattr(target, owner)
    monkeypatch.delattr(target, attribute)
    # attach() is what initialize runs on the engine DeepSpeed built: the check comes before anything is touched.
    untouchable = SimpleNamespace()
    with pytest.raises(DeepSpeedExtError) as raised:
        runtime.attach(untouchable, ExtConfig())
    message = str(raised.value)
    assert "\n" not in message and named in message and "is missing" in message, message
    assert vars(untouchable) == {}


def test_a_dataclass_field_that_disappears_is_named(fresh_check, monkeypatch):
    import dataclasses
    import importlib
    module = importlib.import_module("deepspeed.utils.tensor_fragment")  # deepspeed.utils.tensor_fragment: the class
    narrowed = dataclasses.make_dataclass("tensor_fragment", [f.name for f in dataclasses.fields(module.tensor_fragment)
                                                               if f.name != "hp_fragment_address"])
    for method in ("get_hp_fragment", "set_optim_state_fragment"):
        setattr(narrowed, method, getattr(module.tensor_fragment, method))
    monkeypatch.setattr(module, "tensor_fragment", narrowed)
    assert engine_private.missing_deepspeed_parts() == [
        "deepspeed.utils.tensor_fragment.tensor_fragment.hp_fragment_address (used for where a ZeRO-1/2 fragment "
        "lies in its flat partition)"]
