"""serialization: a failed write (RLIMIT_FSIZE in a subprocess stands in for a full disk)."""

import subprocess
import sys


def test_a_full_disk_is_one_clear_error_and_leaves_no_file(tmp_path):
    """RLIMIT_FSIZE stands in for a full disk: the write fails with CheckpointError naming the file."""
    script = (
        "import resource, sys, torch\n"
        "from deepspeed_ext.checkpoint import serialization\n"
        "from deepspeed_ext.errors import CheckpointError\n"
        "resource.setrlimit(resource.RLIMIT_FSIZE, (64 * 1024, 64 * 1024))\n"
        f"target = {str(tmp_path / 'big.pt')!r}\n"
        "try:\n"
        "    serialization.save({'param': torch.zeros(1 << 20)}, target)\n"
        "except CheckpointError as exc:\n"
        "    print(exc)\n"
        "    sys.exit(3)\n")
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert proc.returncode == 3, proc.stderr
    assert proc.stdout.startswith(f"{tmp_path / 'big.pt'}: cannot write: ") and "disk full" in proc.stdout
    assert list(tmp_path.iterdir()) == []
