"""Which test files test which families: the ten of 2025 have files and tests of their own
(tests/e2e/test_model_families.py and the MaxText test files); every other family of the registry, 2025-26's and any
added later, runs every path in tests/e2e/test_recent_families_e2e.py."""

from __future__ import annotations

from deepspeed_ext.checkpoint.families import family_names

ONE_BY_ONE = ("llama", "llama3.1", "mistral", "qwen2", "qwen3", "qwen3-moe", "mixtral", "gemma3", "gpt-oss",
              "deepseek-v3")
RECENT = [family for family in family_names() if family not in ONE_BY_ONE]
