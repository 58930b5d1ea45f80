"""Our to-maxtext output, restored through MaxText's own loader (load_parameters_path) into MaxText's own model
(MaxText 0.2.5's code in .venv-maxtext, built by scripts/setup-maxtext.sh), gives transformers' logits."""

from __future__ import annotations

import pytest

from harness.maxtext import convert, hf_model, max_kl, maxtext_logits, torch_logits

#: Per-token KL bound in fp32 (issue 17), and argmax equal.
KL_FP32 = 1e-4


@pytest.mark.parametrize("scan_layers", [True, False], ids=["scanned", "unscanned"])
@pytest.mark.parametrize("family", ["llama", "llama3.1", "mistral", "qwen3", "qwen3-moe", "qwen2", "mixtral", "gemma3",
                                    "gpt-oss"])
def test_maxtext_forward_on_our_output_matches_transformers(family, scan_layers, tmp_path):
    model = hf_model(family)
    items, _ = convert(model, family, tmp_path / "maxtext", scan_layers=scan_layers)
    logits = maxtext_logits(items, model, family, scan_layers, tmp_path)
    reference = torch_logits(model)
    kl = max_kl(reference, logits)
    print(f"{family} scan_layers={scan_layers}: max per-token KL {kl:.2e}")
    assert kl <= KL_FP32
    assert (reference.argmax(-1).numpy() == logits.argmax(-1)).all()
