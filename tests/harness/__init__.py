"""Test helpers shared by tests/unit and tests/e2e (no tests here): the launchers for torchrun and the CLI,
the end-to-end scenarios, the small checkpoints the CLI tests build, and the MaxText reference forward.

Importable as ``harness`` (pytest.ini: ``pythonpath = tests``)."""
