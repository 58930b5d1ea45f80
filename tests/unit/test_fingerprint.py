"""Resume fingerprints: the sums, their tolerance, their JSON form, the comparison; the config switch."""

from __future__ import annotations

import pytest
import torch

from deepspeed_ext.checkpoint import fingerprint
from deepspeed_ext.checkpoint.fingerprint import Fingerprint, Fingerprints, compare, mismatch_message
from deepspeed_ext.config import ExtConfig
from deepspeed_ext.errors import CheckpointError


def _tensor(seed: int, shape=(300, 70)) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def test_sums_are_float64_and_independent_of_chunking(monkeypatch):
    x = _tensor(0)
    whole = Fingerprint.of(x)
    wide = x.double()
    assert whole.numel == x.numel()
    assert whole.total == pytest.approx(float(wide.sum()), abs=1e-9 * float(wide.abs().sum()))
    assert whole.total_sq == pytest.approx(float((wide * wide).sum()), rel=fingerprint.SUMMATION_RTOL)
    monkeypatch.setattr(fingerprint, "ROW_ELEMENTS", 7)
    assert Fingerprint.of(x).agrees(whole)
    assert Fingerprint.of(x.to(torch.bfloat16)).agrees(Fingerprint.of(x.to(torch.bfloat16).double()))


def test_narrow_tensors_are_widened_chunk_by_chunk_to_the_same_sums(monkeypatch):
    """bf16/fp16 are widened to float32 a few rows at a time (into a buffer each thread keeps); the rows are the
    float32 tensor's, so the sums are its sums."""
    assert fingerprint.CONVERT_ELEMENTS % fingerprint.ROW_ELEMENTS == 0
    x = _tensor(3, shape=(1000, 70))
    for dtype in (torch.bfloat16, torch.float16):
        narrow = x.to(dtype)
        whole = Fingerprint.of(narrow.float())
        monkeypatch.setattr(fingerprint, "CONVERT_ELEMENTS", fingerprint.ROW_ELEMENTS)  # 18 chunks
        chunked = Fingerprint.of(narrow)
        monkeypatch.undo()
        assert chunked.numel == whole.numel and chunked.agrees(whole)
        assert chunked.total == pytest.approx(whole.total, rel=1e-12, abs=1e-9)
        assert chunked.total_sq == pytest.approx(whole.total_sq, rel=1e-12)


def test_threads_widening_at_once_each_get_their_own_sums():
    """Each thread widens into a buffer of its own: sums taken on four threads at once, many times over, are
    each tensor's own, bit for bit."""
    from concurrent.futures import ThreadPoolExecutor
    tensors = [_tensor(seed, shape=(900, 70)).to(torch.bfloat16) for seed in range(8)]
    expected = [fingerprint.partial_sums(t) for t in tensors]
    assert expected == [fingerprint.partial_sums(t.float()) for t in tensors]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            assert list(pool.map(fingerprint.partial_sums, tensors)) == expected


def test_slices_summed_in_any_split_agree_with_the_whole():
    """What the all-reduce does: partial sums of TP slices and DP partitions, added in another order."""
    x = _tensor(1)
    parts = [fingerprint.partial_sums(piece) for piece in torch.split(x.reshape(-1), 997)]
    added = Fingerprint(*[type(v)(sum(p[i] for p in reversed(parts))) for i, v in enumerate(parts[0])])
    assert added.agrees(Fingerprint.of(x))


@pytest.mark.parametrize("damage", ["another tensor", "zeroed", "one rank's slice twice", "one element changed"])
def test_damage_is_seen(damage):
    x = _tensor(2)
    y = x.clone()
    if damage == "another tensor":
        y = _tensor(3)
    elif damage == "zeroed":
        y.zero_()
    elif damage == "one rank's slice twice":
        y[150:] = y[:150]
    else:
        y[7, 7] += 5.0
    assert not Fingerprint.of(y).agrees(Fingerprint.of(x))


def test_a_permutation_is_not_seen():
    """Documented limit: sums do not see order."""
    x = _tensor(4)
    assert Fingerprint.of(x.flip(0)).agrees(Fingerprint.of(x))


def test_one_rounding_in_a_lower_precision_is_within_the_declared_rounding_only():
    x = _tensor(5).double()
    rounded = (x * (1 + 2.0**-9)).float()  # every element moved by about one bf16 unit roundoff
    exact, through = Fingerprint.of(x), Fingerprint.of(rounded)
    assert not exact.agrees(through)
    assert exact.agrees(through, rounding=2.0**-8)
    assert exact.agrees(Fingerprint.of(x.float()))  # one fp32 rounding is within the summation tolerance


def test_different_counts_never_agree():
    assert not Fingerprint(3, 0.0, 0.0).agrees(Fingerprint(4, 0.0, 0.0))


def test_json_round_trip_and_malformed_input():
    record = Fingerprints(step=7, global_steps=7)
    record.add("w", "fp32", Fingerprint.of(_tensor(6)))
    record.add("w", "exp_avg", Fingerprint.of(_tensor(7)))
    again = Fingerprints.from_json(record.to_json())
    assert again.tensors == record.tensors and (again.step, again.global_steps) == (7, 7)
    for bad in ({"tensors": {"w": {"fp32": [1, 2]}}}, {"tensors": 3}, {"format": 99, "tensors": {}},
                {"tensors": {"w": {"fp32": [1, 2, 3, 4]}}}):
        with pytest.raises(CheckpointError, match="some.json"):
            Fingerprints.from_json(bad, "some.json")


def test_compare_names_the_parameter_the_state_and_both_values():
    saved = Fingerprints(step=3, global_steps=3)
    live = Fingerprints(step=4, global_steps=3)
    for name in ("a", "b"):
        for state, seed in (("fp32", 10), ("exp_avg", 11)):
            saved.add(name, state, Fingerprint.of(_tensor(seed)))
            live.add(name, state, Fingerprint.of(_tensor(seed)))
    live.add("b", "exp_avg", Fingerprint.of(torch.zeros(300, 70)))
    del live.tensors["a"]["fp32"]
    checked, mismatches = compare(saved, live)
    assert checked == 6
    assert {(m.name, m.state) for m in mismatches} == {("a", "fp32"), ("b", "exp_avg"), ("optimizer", "step")}
    message = mismatch_message("/ckpt/tag", mismatches, checked)
    assert message.startswith("/ckpt/tag: resume fingerprints disagree for 3 of 6 checked states")
    assert "'b' exp_avg: recorded sum=" in message and "found sum=0 " in message and "'a' fp32" in message
    assert "'optimizer' step: recorded 3, found 4" in message
    checked, mismatches = compare(saved.subset(["a"]), live, states=["exp_avg"], check_step=False)
    assert (checked, mismatches) == (1, [])


def test_config_switch():
    section = {"deepspeed_ext": {"universal_checkpoint": {"enabled": True}}}
    assert ExtConfig.from_ds_config(section).universal_checkpoint.fingerprints == "error"
    for mode in ("warn", "off"):
        section["deepspeed_ext"]["universal_checkpoint"]["fingerprints"] = mode
        assert ExtConfig.from_ds_config(section).universal_checkpoint.fingerprints == mode
    section["deepspeed_ext"]["universal_checkpoint"]["fingerprints"] = True
    with pytest.raises(ValueError, match="fingerprints' must be one of"):
        ExtConfig.from_ds_config(section)


@pytest.mark.parametrize("scale", [1.0, 1e-12, 1e-20, 1e-30])
def test_tiny_and_heavy_tailed_values_sum_to_the_float64_reference_in_any_split(scale):
    """Adam's second moment: heavy-tailed and, for rarely updated rows, so small that float32 squares underflow
    (1e-20 squares to 1e-40). The sums stay within the tolerance of the float64 reference, whole and in blocks
    that cut the float32 rows elsewhere, so a resharded or streamed read agrees with the record."""
    torch.manual_seed(5)
    x = ((torch.randn(3 * 4096 + 123) * torch.exp(torch.randn(3 * 4096 + 123) * 2)) ** 2) * scale
    wide = x.double()
    reference = Fingerprint(x.numel(), float(wide.sum()), float((wide * wide).sum()))
    whole = Fingerprint.of(x)
    assert whole.agrees(reference), (whole, reference)
    parts = [fingerprint.partial_sums(piece) for piece in torch.split(x, 1000)]
    blocks = Fingerprint(sum(p[0] for p in parts), sum(p[1] for p in parts), sum(p[2] for p in parts))
    assert blocks.agrees(whole), (blocks, whole)


def test_the_module_weights_are_checked_only_where_both_sides_hold_them():
    """A save records the module's bf16 weights beside the masters; a side that holds no separate copy (a ZeRO-3
    engine, a universal checkpoint, a writer that read the masters) is not short of a state, one that holds a
    different copy is caught, and a missing master is still a mismatch."""
    from deepspeed_ext.checkpoint.states import MASTER_WEIGHTS, MODULE_WEIGHTS

    master, module = Fingerprint(4, 1.0, 2.0), Fingerprint(4, 1.0, 2.001)
    recorded = Fingerprints()
    recorded.add("w", MASTER_WEIGHTS, master)
    recorded.add("w", MODULE_WEIGHTS, module)
    masters_only = Fingerprints()
    masters_only.add("w", MASTER_WEIGHTS, master)
    assert compare(recorded, masters_only) == (1, [])
    both = Fingerprints()
    both.add("w", MASTER_WEIGHTS, master)
    both.add("w", MODULE_WEIGHTS, Fingerprint(4, 1.0, 2.5))
    checked, mismatches = compare(recorded, both)
    assert checked == 2 and [(m.name, m.state) for m in mismatches] == [("w", MODULE_WEIGHTS)]
    module_only = Fingerprints()
    module_only.add("w", MODULE_WEIGHTS, module)
    checked, mismatches = compare(recorded, module_only)
    assert checked == 2 and [(m.state, m.found) for m in mismatches] == [(MASTER_WEIGHTS, "nothing")]


@pytest.mark.parametrize("dtype, scale, numel", [(torch.float32, 1.0, 3 * 4096 + 17), (torch.bfloat16, 1.0, 70000),
                                                  (torch.float32, 1e-30, 2 * 4096 + 3), (torch.float32, 1e25, 9000),
                                                  (torch.float64, 1.0, 5000), (torch.float32, 0.0, 8192)])
def test_sums_kept_on_the_device_agree_with_the_hosts(dtype, scale, numel):
    """What an accelerator's tensors are summed with (no value leaves the device until every tensor is summed,
    the squares always scaled by a power of two) gives the fingerprint the host's sums give: tiny, huge, narrow,
    wide and all-zero tensors alike. Run here on CPU tensors, as its arithmetic does not depend on the device."""
    generator = torch.Generator().manual_seed(numel)
    tensor = (torch.randn(numel, generator=generator, dtype=torch.float64) ** 3 * scale).to(dtype)
    host = Fingerprint(*fingerprint.partial_sums(tensor))
    device = fingerprint.partial_sums_on_device(tensor)
    assert device.dtype == torch.float64 and device.shape == (3, )
    kept = Fingerprint(int(device[0]), float(device[1]), float(device[2]))
    assert kept.numel == numel and host.agrees(kept) and kept.agrees(host), (host, kept)
    if scale == 0.0:
        assert float(device[1]) == float(device[2]) == 0.0
