"""The DeepSpeed key names deepspeed-ext reads are the ones the installed DeepSpeed writes."""

import deepspeed.checkpoint.constants as upstream

from deepspeed_ext.checkpoint.deepspeed import keys


def test_key_names_match_deepspeed_constants():
    shared = [name for name in dir(keys) if name.isupper() and hasattr(upstream, name)]
    assert len(shared) >= 15  # the comparison covers the names DeepSpeed defines, not an empty set
    assert {name: getattr(keys, name) for name in shared} == {name: getattr(upstream, name) for name in shared}


def test_file_name_patterns_match_deepspeed_prefixes():
    tp, dp = 3, 5
    assert keys.MODEL_STATES_RE.match(f"{upstream.MODEL_FILE_PREFIX}{tp:02d}{upstream.MODEL_FILE_SUFFIX}")
    assert keys.ZERO3_MODEL_STATES_RE.match(f"{upstream.ZERO_FILE_PREFIX}{dp}_mp_rank_{tp:02d}"
                                            f"{upstream.MODEL_FILE_SUFFIX}")
    for prefix in (upstream.ZERO_FILE_PREFIX, upstream.BF16_ZERO_FILE_PREFIX, upstream.FP16_ZERO_FILE_PREFIX):
        match = keys.OPTIM_STATES_RE.match(f"{prefix}{dp}_mp_rank_{tp:02d}{upstream.OPTIM_FILE_SUFFIX}")
        assert match and (int(match.group(2)), int(match.group(3))) == (dp, tp)
