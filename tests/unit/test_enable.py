"""deepspeed_ext.enable(): the explicit switch that lets the Trainer's and Accelerate's deepspeed.initialize
apply the config's deepspeed_ext section (the runs themselves: tests/e2e/test_trainers.py)."""

import deepspeed

import deepspeed_ext
from deepspeed_ext import runtime
from deepspeed_ext.runtime import init as runtime_init


def test_enable_is_explicit_idempotent_and_reversible():
    original = deepspeed.initialize
    assert deepspeed.initialize is original and not runtime.enabled()
    try:
        deepspeed_ext.enable()
        wrapped = deepspeed.initialize
        assert wrapped is not original and runtime.enabled()
        deepspeed_ext.enable()  # a second call keeps one wrapper
        assert deepspeed.initialize is wrapped
        # deepspeed_ext.initialize reaches DeepSpeed's own function, not the wrapper (no double tagging)
        assert runtime_init._deepspeed_initialize() is original
    finally:
        deepspeed_ext.disable()
    assert deepspeed.initialize is original and not runtime.enabled()
