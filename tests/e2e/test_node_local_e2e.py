"""Checkpoints on node-local storage (DeepSpeed's ``checkpoint.use_node_local_storage``), on two nodes whose ranks
see different directories: two torchrun agents on this machine, each node saving into and loading from its own.

Each node's first rank commits that node's files (its own marker, its own ``latest``); every node holds the
model-states file of each model-parallel rank it runs (DeepSpeed alone writes only local rank 0's, so at TP=2 no
node could resume); each node resumes from its own directory at the saved degrees, exactly; a resharding load
(TP=1), which reads every rank's files, is refused in one line that names node-local storage. docs/reliability.md.
"""

from __future__ import annotations

import json
from pathlib import Path

from deepspeed_ext.checkpoint import commit
from harness.runner import read_losses, torchrun_nodes

NODES, TP = 2, 2  # two ranks per node, TP=2 inside each node, DP=2 across the nodes


def _node_args(root: Path, args: list[str]) -> list[list[str]]:
    """Each node's arguments: ``{node}`` in them becomes the node's number."""
    return [[a.replace("{node}", str(node)) for a in args] for node in range(NODES)]


def test_each_node_commits_its_files_and_resumes_from_them(tmp_path):
    common = ["--tp", str(TP), "--zero", "1", "--dtype", "bf16", "--node-local-storage"]
    # Saved in the background (the copy snapshot): each node's coordinator commits once its node's writers are done.
    torchrun_nodes(TP, _node_args(tmp_path, [*common, "--steps", "4", "--save-dir", str(tmp_path / "node{node}"),
                                             "--save-at", "3", "--async-save", "copy",
                                             "--result", str(tmp_path / "baseline.json")]), tmp_path / "train.log")
    baseline = read_losses(tmp_path / "baseline.json")
    for node in range(NODES):
        save_dir = tmp_path / f"node{node}"
        assert (save_dir / "latest").read_text() == "global_step3"
        tag = save_dir / "global_step3"
        listed = sorted(json.loads((tag / commit.COMMIT_FILE).read_text())["files"])
        # Both TP ranks' model states on every node; the optimizer partitions of this node's DP rank only.
        assert listed == sorted([f"bf16_zero_pp_rank_{node}_mp_rank_0{tp}_optim_states.pt" for tp in range(TP)]
                                + [f"mp_rank_0{tp}_model_states.pt" for tp in range(TP)] + ["deepspeed_ext.json"])
        assert sorted(p.name for p in tag.iterdir()) == sorted([*listed, commit.COMMIT_FILE])
        assert not list(save_dir.glob(".deepspeed_ext-*")), "the staging directory is left behind"

    torchrun_nodes(TP, _node_args(tmp_path, [*common, "--steps", "5", "--load-dir", str(tmp_path / "node{node}"),
                                             "--no-load-universal", "--result", str(tmp_path / "resumed.json")]),
                   tmp_path / "resume.log")
    resumed = read_losses(tmp_path / "resumed.json")
    assert resumed[4] == baseline[4]  # the step after the save, bit for bit: every node restored its ranks' state

    # At TP=1 (one rank a node, DP=2) the resume reshards: it would read files that are on the other node.
    refused = torchrun_nodes(1, _node_args(tmp_path, ["--tp", "1", "--zero", "1", "--dtype", "bf16",
                                                      "--node-local-storage", "--steps", "5", "--load-dir",
                                                      str(tmp_path / "node{node}")]), tmp_path / "reshard.log",
                             check=False)
    assert all(proc.returncode != 0 for proc in refused)
    output = refused[0].stdout + refused[0].stderr
    assert "is missing" in output and "with node-local storage each node holds only its own ranks' files" in output
