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


def test_leaf_restores_parse_the_tree_metadata_once(tmp_path):
    """``leaf_checkpointer``: restoring a saved tree leaf by leaf parses its metadata file once, not once per leaf
    (Orbax's own restore does, which made reading a checkpoint quadratic in its leaves), and every leaf comes back
    as saved."""
    try:
        import numpy as np
        import orbax.checkpoint as ocp
    except ImportError:
        unavailable("orbax-checkpoint is not installed here (the [maxtext] extra)")
    from deepspeed_ext.checkpoint import orbax_private
    from deepspeed_ext.checkpoint.maxtext.orbax_io import restore_leaf
    assert orbax_private.metadata_reuse_problems() == []
    tree = {"params": {f"layer_{i}": {"kernel": np.arange(6, dtype=np.float32).reshape(2, 3) + i,
                                      "scale": np.full(3, i, dtype=np.float32)} for i in range(12)},
            "step": 7}
    items = tmp_path / "items"
    ocp.Checkpointer(ocp.PyTreeCheckpointHandler(use_ocdbt=True, use_zarr3=True)).save(items, tree)
    saved = ocp.PyTreeCheckpointer().metadata(items).item_metadata.tree
    impl = orbax_private.leaf_checkpointer()._handler._handler_impl
    parse = type(impl)._read_metadata_file
    parsed = []

    async def counted(self, directory):
        parsed.append(directory)
        return await parse(self, directory)

    type(impl)._read_metadata_file = counted
    try:
        checkpointer = orbax_private.leaf_checkpointer()  # wraps the counting method
        for i in range(12):
            for leaf in ("kernel", "scale"):
                value = restore_leaf(checkpointer, items, saved, ("params", f"layer_{i}", leaf), np.ndarray)
                np.testing.assert_array_equal(value, tree["params"][f"layer_{i}"][leaf])
        assert int(np.asarray(restore_leaf(checkpointer, items, saved, ("step", ), int))) == 7
    finally:
        type(impl)._read_metadata_file = parse
    assert len(parsed) == 1, parsed


def test_writes_on_a_thread_end_before_a_cancellation_gets_through():
    """``write_on_a_thread``: every write runs, a failed one is raised; cancelled while writing, it returns only
    once the thread has stopped and the writes were closed (nothing still writes into a staging directory that the
    caller then removes)."""
    import asyncio
    import threading
    import time

    from deepspeed_ext.checkpoint.orbax_private import write_on_a_thread

    state = {"running": 0, "done": 0, "closed": False}
    lock = threading.Lock()
    first_started = threading.Event()

    def writes(count: int, fail_at: int | None = None):
        try:
            for i in range(count):
                with lock:
                    state["running"] += 1
                first_started.set()
                time.sleep(0.02)
                with lock:
                    state["running"] -= 1
                if i == fail_at:
                    raise OSError(28, "No space left on device")
                state["done"] += 1
                yield i
        finally:
            state["closed"] = True

    asyncio.run(write_on_a_thread(writes(5)))
    assert state == {"running": 0, "done": 5, "closed": True}

    state.update(done=0, closed=False)
    try:
        asyncio.run(write_on_a_thread(writes(5, fail_at=2)))
    except OSError as exc:
        assert exc.errno == 28
    else:
        raise AssertionError("the failed write was not raised")
    assert state == {"running": 0, "done": 2, "closed": True}

    async def cancelled_while_writing() -> None:
        task = asyncio.ensure_future(write_on_a_thread(writes(50)))
        while not first_started.is_set():
            await asyncio.sleep(0.001)
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            with lock:
                assert state["running"] == 0 and state["closed"]
        else:
            raise AssertionError("the cancellation did not get through")

    state.update(done=0, closed=False)
    first_started.clear()
    asyncio.run(cancelled_while_writing())
    assert state["done"] < 50
