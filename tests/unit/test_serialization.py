"""serialization: page release, files mapped whatever their size, and thread-safe loads and saves. A failed write
(a full disk, in a subprocess under RLIMIT_FSIZE) is in tests/e2e/test_serialization_e2e.py."""

import pytest
import torch

from deepspeed_ext.checkpoint import serialization
from deepspeed_ext.checkpoint.manifest import file_checksum
from deepspeed_ext.errors import CheckpointError


def _rss_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmRSS:"))


def test_release_pages_drops_mapped_pages_and_keeps_the_data(tmp_path):
    path = tmp_path / "big.pt"
    serialization.save({"flat": torch.arange(16 * 2**20, dtype=torch.float32)}, path)  # 64 MiB
    flat = serialization.load(path)["flat"]
    expected_sum = float(flat.double().sum())  # touches every page
    before = _rss_kib()
    mappings = serialization.file_mappings(path)
    assert mappings, "torch.load(mmap=True) should map the file"
    serialization.release_pages(flat, mappings)
    assert before - _rss_kib() > 48 * 1024  # most of the 64 MiB left the resident set
    assert float(flat.double().sum()) == expected_sum  # and reads back from the file unchanged


def test_release_pages_ignores_memory_outside_the_mappings(tmp_path):
    path = tmp_path / "small.pt"
    serialization.save({"x": torch.ones(1024)}, path)
    mapped = serialization.load(path)  # keeps the file mapped
    mappings = serialization.file_mappings(path)
    assert mappings
    heap = torch.arange(4 * 2**20, dtype=torch.float32)  # ordinary memory: madvise would zero it
    serialization.release_pages(heap, mappings)
    assert torch.equal(heap, torch.arange(4 * 2**20, dtype=torch.float32))
    assert mapped["x"].sum() == 1024


def _memory_and_swap_bytes() -> int:
    with open("/proc/meminfo") as meminfo:
        fields = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in meminfo}
    return fields["MemTotal"] + fields.get("SwapTotal", 0)


def test_a_file_larger_than_memory_and_swap_is_mapped_and_read(tmp_path):
    """An optimizer partition larger than the machine's memory plus swap (405B's shapes at TP=2 ZeRO-1: 57 GB):
    torch.load(mmap=True)'s private writable mapping of it is refused outright under Linux's default overcommit
    rule; ours (unreserved, torch_mapped) is mapped, read where touched, and stays out of the resident set. The file
    is sparse (torch.save's skip_data around a fake tensor): no disk."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from deepspeed_ext.checkpoint import torch_mapped
    assert torch_mapped.unsupported() is None
    size = 2 * _memory_and_swap_bytes()
    with FakeTensorMode():
        flat = torch.empty(size // 4, dtype=torch.float32)
    path = tmp_path / "partition.pt"
    with torch.serialization.skip_data(materialize_fake_tensors=True):
        torch.save({"fp32_flat": flat}, path)
    assert path.stat().st_size > size and path.stat().st_blocks * 512 < 2**20  # holes
    with open("/proc/sys/vm/overcommit_memory") as mode:
        if mode.read().strip() == "0":  # the heuristic: one mapping past memory and swap is refused
            with pytest.raises(RuntimeError, match="Cannot allocate memory"):
                torch.load(path, mmap=True, weights_only=True)
    before = _rss_kib()
    loaded = serialization.load(path)["fp32_flat"]
    assert loaded.numel() == size // 4 and loaded.dtype == torch.float32
    assert float(loaded[-2**20:].abs().sum()) == 0.0 and float(loaded[:2**20].abs().sum()) == 0.0
    assert _rss_kib() - before < 64 * 1024
    first = serialization.mapped_location(loaded)
    assert first is not None and serialization.mapped_location(loaded[2**20:]) == (path, first[1] + 4 * 2**20)


def test_a_mapped_file_keeps_no_descriptor_and_is_unmapped_with_its_last_tensor(tmp_path):
    """A universal checkpoint's thousands of files stay loaded at once: a mapping holds no open descriptor (the
    process's limit is often 1024), and goes when the last tensor viewing it goes, a slice included."""
    import gc
    import os
    paths = []
    for i in range(40):
        paths.append(tmp_path / f"{i}.pt")
        serialization.save({"x": torch.full((1000,), float(i)), "y": torch.arange(i + 1)}, paths[-1])
    descriptors = len(os.listdir("/proc/self/fd"))
    loaded = [serialization.load(path) for path in paths]
    assert len(os.listdir("/proc/self/fd")) <= descriptors
    assert all(float(obj["x"].sum()) == 1000.0 * i and obj["y"].numel() == i + 1 for i, obj in enumerate(loaded))
    kept = loaded[7]["x"][10:20]
    del loaded
    gc.collect()
    assert serialization.file_mappings(paths[7]) and not serialization.file_mappings(paths[8])
    assert float(kept.sum()) == 70.0
    del kept
    gc.collect()
    assert not serialization.file_mappings(paths[7])


def test_threads_loading_and_saving_keep_the_allow_list_and_the_crc_setting(tmp_path):
    """Writer threads load and save concurrently: each load still admits the allow-listed DeepSpeed types, and
    the process-wide CRC switch is back to the caller's value afterwards."""
    from concurrent.futures import ThreadPoolExecutor

    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    torch.save({"loss_scaler": LossScaler(4.0), "tensor": torch.ones(3)}, tmp_path / "optim.pt")
    before = torch.utils.serialization.config.save.compute_crc32
    with ThreadPoolExecutor(4) as pool:
        loaded = list(pool.map(lambda _: serialization.load(tmp_path / "optim.pt"), range(64)))
        list(pool.map(lambda i: serialization.save(torch.full((1 << 18, ), float(i)), tmp_path / f"{i}.pt"),
                      range(32)))
    assert all(isinstance(state["loss_scaler"], LossScaler) for state in loaded)
    assert torch.utils.serialization.config.save.compute_crc32 == before
    for i in range(32):
        assert torch.equal(serialization.load(tmp_path / f"{i}.pt"), torch.full((1 << 18, ), float(i)))
    # torch keeps the CRC switch per thread: a file saved on a worker thread has the same bytes as on this one.
    (tmp_path / "main").mkdir()
    for i in range(32):
        serialization.save(torch.full((1 << 18, ), float(i)), tmp_path / "main" / f"{i}.pt")
        assert (tmp_path / "main" / f"{i}.pt").read_bytes() == (tmp_path / f"{i}.pt").read_bytes(), i


def test_deepspeed_objects_read_without_deepspeed_are_written_back_as_deepspeeds_own(tmp_path):
    """A process that has not imported DeepSpeed reads its objects as stand-ins (no import of seconds for a
    command that only reads); what it saves holds DeepSpeed's own classes again, field for field, without importing
    DeepSpeed either: the file is byte for byte what saving DeepSpeed's own objects writes."""
    import subprocess
    import sys

    from deepspeed.checkpoint.universal_checkpoint import SubparamShape
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address
    scaler = DynamicLossScaler(init_scale=2.0**16, scale_window=1000, min_scale=1.0, delayed_shift=2,
                               consecutive_hysteresis=False)
    scaler.cur_iter, scaler.last_overflow_iter = 7, 3
    saved = {"zero_stage": ZeroStageEnum.gradients, "loss_scaler": scaler,
             "mappings": [{"w": fragment_address(numel=12, start=4)}],
             "shape": SubparamShape(patterns=["x"], shape=(2, 3), partition_dim=0), "tensor": torch.arange(5.0)}
    torch.save(saved, tmp_path / "optim.pt")
    script = f"""
import sys
from deepspeed_ext.checkpoint import serialization
state = serialization.load({str(tmp_path / "optim.pt")!r})
assert "deepspeed" not in sys.modules, "reading imported DeepSpeed"
assert state["zero_stage"] == 2 and state["zero_stage"] + 1 == 3
assert state["loss_scaler"].cur_scale == 2.0**16 and state["loss_scaler"].cur_iter == 7
assert state["mappings"][0]["w"].start == 4 and state["mappings"][0]["w"].numel == 12
assert "fragment_address" in repr(state["mappings"][0]["w"])
serialization.save(state, {str(tmp_path / "again.pt")!r})
assert "deepspeed" not in sys.modules, "writing imported DeepSpeed"
"""
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-2000:]
    again = serialization.load(tmp_path / "again.pt")
    assert type(again["zero_stage"]) is ZeroStageEnum and again["zero_stage"] == ZeroStageEnum.gradients
    assert type(again["loss_scaler"]) is DynamicLossScaler and vars(again["loss_scaler"]) == vars(scaler)
    address = again["mappings"][0]["w"]
    assert type(address) is fragment_address and (address.numel, address.start) == (12, 4)
    assert type(again["shape"]) is SubparamShape and again["shape"] == saved["shape"]
    assert torch.equal(again["tensor"], saved["tensor"])
    (tmp_path / "real").mkdir()  # torch names the zip's records after the file: the same name
    serialization.save(saved, tmp_path / "real" / "again.pt")
    assert (tmp_path / "real" / "again.pt").read_bytes() == (tmp_path / "again.pt").read_bytes()


@pytest.mark.parametrize("dtype, shape, block", [(torch.float32, (1000, 37), 999), (torch.bfloat16, (1000, 37), 333),
                                                 (torch.float32, (7, ), 7), (torch.float32, (0, 4), 1)])
def test_a_tensor_written_in_blocks_is_the_file_torch_save_writes(tmp_path, dtype, shape, block):
    """``save_streamed`` fills the tensor's storage block by block, never holding it whole: the same bytes as
    ``save`` of the whole tensor, and the CRC-32C it returns is the file's."""
    full = torch.randn(shape).to(dtype)
    placeholder = torch.empty(shape, dtype=dtype)
    path = tmp_path / "fp32.pt"
    checksum = serialization.save_streamed({"param": placeholder, "cat_dim": 0}, placeholder,
                                           torch.split(full.reshape(-1), block), path)
    streamed = path.read_bytes()
    serialization.save({"param": full, "cat_dim": 0}, path)
    assert streamed == path.read_bytes()
    assert checksum == file_checksum(path)
    loaded = serialization.load(path)
    assert torch.equal(loaded["param"], full) and loaded["cat_dim"] == 0


def test_blocks_that_do_not_fill_the_tensor_leave_no_file(tmp_path):
    placeholder = torch.empty(10)
    path = tmp_path / "fp32.pt"
    with pytest.raises(CheckpointError, match=r"fp32.pt: the blocks hold 36 bytes, the tensor 40"):
        serialization.save_streamed({"param": placeholder}, placeholder, [torch.ones(9)], path)
    assert not list(tmp_path.iterdir())


def test_without_skip_data_the_tensor_is_filled_and_saved_whole(tmp_path, monkeypatch):
    """torch < 2.5 has no ``skip_data``: the same file, the tensor held whole."""
    full = torch.randn(100, 7)
    placeholder = torch.empty(full.shape)
    monkeypatch.delattr(torch.serialization, "skip_data")
    path = tmp_path / "fp32.pt"
    checksum = serialization.save_streamed({"param": placeholder}, placeholder, torch.split(full.reshape(-1), 64), path)
    assert checksum == file_checksum(path) and torch.equal(serialization.load(path)["param"], full)
