"""The guard of the Orbax internals behind shard-aligned writes (deepspeed_ext/checkpoint/orbax_private.py), in
the environment to-maxtext writes from. It runs without jax too: it then fails under CI (the dev environment has
the [maxtext] extra) and skips elsewhere. The same guard in MaxText's own environment:
tests/e2e/test_orbax_guard_e2e.py."""

from __future__ import annotations

from harness.environments import unavailable


def test_orbax_internals_we_rely_on_are_still_there():
    """Fails loudly on an Orbax upgrade that moves the internals behind shard-aligned writes."""
    try:
        import orbax.checkpoint as ocp
    except ImportError:
        unavailable("orbax-checkpoint is not installed here (the [maxtext] extra)")
    from deepspeed_ext.checkpoint.orbax_private import TESTED_ORBAX, check_orbax_internals
    check_orbax_internals()
    assert ocp.__version__ == TESTED_ORBAX, "new Orbax: re-check orbax_private.py, then update TESTED_ORBAX"
