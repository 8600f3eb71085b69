"""Two nodes, for real: two ``torchrun`` launches (one rank each) with their own NVMe directory.

Each launch is a node (``TIERSTATE_NODE=n0`` / ``n1``); checkpoints go to a memory tier
(``nodes/{node}/memory``), then to NVMe (``nodes/{node}/nvme``, scope: node) and the PFS, one
directory both see. The ranks train a DDP model with per-rank RNG (see tests/nodes_worker.py),
checkpoint at steps 2 and 4, and later pairs of launches restore, each rank from its nearest copy,
with more of the node-local copies wiped each time.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

from conftest import REPO
from launch import run_side_by_side
from tierstate import cli
from tierstate.tiers.ops.migrate import migrate
from tierstate.tiers.ops.verify import verify_step
from tierstate.tiers.storage.faults import ENV as FAULT_ENV
from tierstate.tiers.storage.filesystem import FilesystemTier
from tierstate.tiers.storage.peers import kept_for, returned_from

Launched = tuple[list[str], dict[str, str]]  # a command and its environment
WORKER = REPO / "tests" / "nodes_worker.py"
LAUNCH_TIMEOUT_S = 120

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo"),
]


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def launch(workdir: Path, scenario: str, port: int, node: int, env: dict[str, str] | None = None) -> Launched:
    """The torchrun command of ``node`` running ``scenario``, and its environment."""
    command = [
        sys.executable, "-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", f"--node_rank={node}",
        "--master_addr=127.0.0.1", f"--master_port={port}", str(WORKER), str(workdir), scenario,
    ]  # fmt: skip
    return command, {**os.environ, "TIERSTATE_NODE": f"n{node}", **(env or {})}


def two_ranks(workdir: Path, *scenarios: str, killed: bool = False) -> None:
    """Both "nodes" run ``scenarios`` as plain processes (rank and world from the environment, no
    torchrun agent: quicker to start), and succeed (or, ``killed``, SIGKILL themselves at the end)."""
    port = free_port()
    ranks = []
    for rank in (0, 1):
        env = {**os.environ, "TIERSTATE_NODE": f"n{rank}", "RANK": str(rank), "WORLD_SIZE": "2",
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}  # fmt: skip
        ranks.append(([sys.executable, str(WORKER), str(workdir), *scenarios], env))
    ended = run_side_by_side(ranks, f"NODES-DONE {scenarios[-1]}", LAUNCH_TIMEOUT_S, REPO)
    for rank, end in enumerate(ended):
        well = (end.recorded and end.returncode == -signal.SIGKILL) if killed else end.succeeded
        assert well, f"rank {rank}, {scenarios}:\n{end.output[-6000:]}"


def two_nodes(workdir: Path, scenario: str) -> None:
    """Both nodes run ``scenario`` to the end and succeed."""
    port = free_port()
    nodes = [launch(workdir, scenario, port, node) for node in (0, 1)]
    ended = run_side_by_side(nodes, f"NODES-DONE {scenario}", LAUNCH_TIMEOUT_S, REPO, agents=True)
    for node, end in enumerate(ended):
        assert end.succeeded, f"node n{node}, {scenario}:\n{end.output[-6000:]}"


def facts(workdir: Path, scenario: str, ranks: tuple[int, ...] = (0, 1)) -> list[dict]:
    return [json.loads((workdir / scenario / f"rank-{rank}.json").read_text()) for rank in ranks]


def nvme(workdir: Path, node: str) -> FilesystemTier:
    return FilesystemTier("nvme", workdir / "nodes" / node / "nvme", "node")


def memory(workdir: Path, node: str) -> FilesystemTier:
    return FilesystemTier("memory", workdir / "nodes" / node / "memory", "node")


@pytest.fixture(scope="module")
def trained(tmp_path_factory: pytest.TempPathFactory) -> Path:
    workdir = tmp_path_factory.mktemp("nodes")
    two_nodes(workdir, "train")
    held = {node: memory(workdir, node).steps() for node in ("n0", "n1")}
    (workdir / "memory-after-train.json").write_text(json.dumps(held))
    shutil.rmtree(memory(workdir, "n1").root)  # n1 rebooted: its memory tier is gone
    two_nodes(workdir, "resume")  # a new job on the same nodes
    shutil.rmtree(memory(workdir, "n0").root)  # n0 rebooted too
    shutil.rmtree(nvme(workdir, "n1").root)  # and n1 was replaced: its NVMe is empty
    two_nodes(workdir, "resume-again")
    return workdir


def test_each_node_commits_its_own_part_in_its_memory_then_on_its_own_nvme(trained):
    for rank, seen in enumerate(facts(trained, "train")):
        assert seen["paths"] == [str(memory(trained, f"n{rank}").step_dir(s)) for s in (2, 4)]
        assert seen["on_nvme"] == [True, True]
    # keep_last: 1, and step 2 reached NVMe and the PFS: only step 4 stayed in memory
    assert json.loads((trained / "memory-after-train.json").read_text()) == {"n0": [4], "n1": [4]}
    tier = nvme(trained, "n0")  # (n1's was wiped before the last restart)
    assert tier.steps() == [2, 4]
    files = sorted(p.name for p in tier.step_dir(4).iterdir())
    assert files == ["manifest.json", "rank-00000.data", "rank-00000.index", "verified.json"]  # a copy: verified
    part = tier.manifest(4)
    assert part.node_part is not None
    assert (part.node_part.node, part.node_part.ranks, part.node_part.nodes) == ("n0", [0], ["n0", "n1"])
    assert list(part.files) == ["rank-00000.data"]
    assert part.items["rng/torch"].kind == "per_rank" and "model/module.0.weight" in part.items
    assert verify_step(tier, 4).ok


def test_the_pfs_gets_the_global_checkpoint_and_every_rank_hears_of_it(trained):
    pfs = FilesystemTier("pfs", trained / "pfs")
    assert pfs.steps() == [2, 4]
    for step in (2, 4):
        manifest = pfs.manifest(step)
        assert manifest.node_part is None and manifest.world_size == 2
        assert sorted(manifest.files) == ["rank-00000.data", "rank-00001.data"]
        assert manifest.items == nvme(trained, "n0").manifest(step).items
        assert verify_step(pfs, step).ok
    for seen in facts(trained, "train"):
        assert seen["persisted"] == [True, True] and seen["flush_errors"] == []


def test_restart_restores_each_rank_from_its_nearest_copy_and_resumes_the_same_losses(trained):
    reference = facts(trained, "train")
    # n1's memory gone: rank 0 reads its memory, rank 1 its NVMe; then n0's memory and n1's NVMe gone:
    # rank 0 reads its NVMe, rank 1 the PFS. Every rank knows which tier served each.
    for scenario, served in (("resume", ["memory", "nvme"]), ("resume-again", ["nvme", "pfs"])):
        for rank, (before, after) in enumerate(zip(reference, facts(trained, scenario), strict=True)):
            assert after["step"] == 4
            assert (after["tier"], after["tier_by_rank"]) == (served[rank], served), scenario
            assert after["losses"] == before["losses"], scenario
    assert reference[0]["losses"] != reference[1]["losses"]  # each rank its own data: RNG per rank came back


def test_the_cli_lists_and_verifies_one_nodes_view(trained, capsys):
    tiers = ["--tier", f"nvme={trained / 'nodes' / '{node}' / 'nvme'}", "--tier", f"pfs={trained / 'pfs'}"]
    assert cli.main(["ls", "--json", "--node", "n0", *tiers]) == 0
    listed = [(e["tier"], e["step"], e["node"]) for e in json.loads(capsys.readouterr().out)]
    assert listed == [("nvme", 2, "n0"), ("nvme", 4, "n0"), ("pfs", 2, None), ("pfs", 4, None)]
    assert cli.main(["ls", "--node", "n0", *tiers]) == 0
    assert "verified, flushed, node n0's part (ranks 0)" in capsys.readouterr().out  # verified: a flushed copy
    assert cli.main(["verify", "--node", "n0", *tiers]) == 0


def test_a_node_killed_during_its_flush_leaves_no_global_checkpoint_until_its_part_is_there(tmp_path):
    port = free_port()
    survivor = launch(tmp_path, "train-last", port, 0)
    killed = launch(tmp_path, "train-last", port, 1, {FAULT_ENV: "migrate.frame@1"})  # SIGKILL in its first flush
    ran, died = run_side_by_side([survivor, killed], "NODES-DONE", LAUNCH_TIMEOUT_S, REPO, agents=True)
    assert died.returncode != 0, died.output[-3000:]
    assert ran.recorded, ran.output[-6000:]  # then its agent waited for n1's in the exit barrier, and was stopped
    pfs = FilesystemTier("pfs", tmp_path / "pfs")
    assert pfs.steps() == []  # n0's part of step 8 is there, n1's is not: no global checkpoint
    assert (pfs.partial_dir(8) / "node-n0.part").is_file()
    assert not (pfs.partial_dir(8) / "node-n1.part").exists()
    (survivor_facts,) = facts(tmp_path, "train-last", (0,))
    assert survivor_facts["persisted"] == [False]
    assert "step 8 is not on tier pfs" in survivor_facts["flush_errors"][0]
    assert "node(s) n1" in survivor_facts["flush_errors"][0]
    assert nvme(tmp_path, "n1").steps() == [8]  # n1 committed step 8 before it died flushing it

    report = migrate(8, nvme(tmp_path, "n1"), pfs)  # n1's part, flushed again: the last one
    assert report.outcome == "copied" and report.waiting_for == []
    assert pfs.steps() == [8] and verify_step(pfs, 8).ok
    assert sorted(pfs.manifest(8).files) == ["rank-00000.data", "rank-00001.data"]


# --- peer copies (replicas: 1 on the NVMe tier) ---------------------------------------------------


@pytest.fixture(scope="module")
def peered(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Train with peer copies; then n1 is replaced (its NVMe empty) and the PFS copy is gone too."""
    workdir = tmp_path_factory.mktemp("peers")
    two_nodes(workdir, "train-peers")
    copies = {}
    for node, other in (("n0", "n1"), ("n1", "n0")):
        tier = kept_for(nvme(workdir, node), other)
        part = tier.manifest(4).node_part
        copies[node] = {
            "steps": tier.steps(),
            "of": part.node if part else None,
            "verified": [verify_step(tier, step).ok for step in tier.steps()],
            "files": sorted(p.name for p in tier.step_dir(4).iterdir()),
        }
    (workdir / "peer-copies.json").write_text(json.dumps(copies))
    shutil.rmtree(nvme(workdir, "n1").root)  # n1 replaced: its own part and its copy of n0's are gone
    shutil.rmtree(workdir / "pfs")  # and the PFS lost the checkpoints
    two_nodes(workdir, "resume-peers")
    return workdir


def test_each_node_keeps_a_verified_copy_of_its_partners_part_on_its_nvme(peered):
    copies = json.loads((peered / "peer-copies.json").read_text())
    for node, other in (("n0", "n1"), ("n1", "n0")):
        seen = copies[node]
        assert (seen["steps"], seen["of"], seen["verified"]) == ([2, 4], other, [True, True]), node
        rank = other[1]
        assert seen["files"] == ["manifest.json", f"rank-0000{rank}.data", f"rank-0000{rank}.index", "verified.json"]
    for seen in facts(peered, "train-peers"):
        assert seen["flush_errors"] == [] and seen["on_nvme"] == [True, True]


def test_a_replaced_node_restores_its_part_from_its_partners_copy_without_the_pfs(peered):
    reference, resumed = facts(peered, "train-peers"), facts(peered, "resume-peers")
    for rank, (before, after) in enumerate(zip(reference, resumed, strict=True)):
        assert after["step"] == 4
        assert after["tier_by_rank"] == ["nvme", "nvme (peer n0)"]
        assert after["tier"] == after["tier_by_rank"][rank]
        assert after["losses"] == before["losses"]
    back = returned_from(nvme(peered, "n1"), "n0")  # n0 sent n1's part back; n1 keeps it, verified
    assert back.steps() == [4] and verify_step(back, 4).ok
    assert FilesystemTier("pfs", peered / "pfs").steps() == []


def test_a_damaged_peer_copy_is_refused_on_both_sides_and_the_replaced_node_reads_the_pfs(tmp_path):
    two_ranks(tmp_path, "train-peers", "damage-peer-copy", "resume-peers")
    reference, resumed = facts(tmp_path, "train-peers"), facts(tmp_path, "resume-peers")
    for before, after in zip(reference, resumed, strict=True):
        assert (after["step"], after["tier_by_rank"]) == (4, ["nvme", "pfs"])
        assert after["losses"] == before["losses"]
    back = returned_from(nvme(tmp_path, "n1"), "n0")
    assert back.steps() == [] and back.partials() == []  # the copy sent back failed its checksums: not published


def test_a_peer_copy_of_a_step_retention_already_replaced_is_skipped_not_failed(tmp_path):
    two_ranks(tmp_path, "train-peers-pruned")
    for node, other, seen in zip(("n0", "n1"), ("n1", "n0"), facts(tmp_path, "train-peers-pruned"), strict=True):
        assert seen["on_nvme_when_sent"] == [4]  # step 2 was gone when its copy's turn came
        assert seen["flush_errors"] == []
        copy = kept_for(nvme(tmp_path, node), other)
        assert copy.steps() == [4] and verify_step(copy, 4).ok


def test_peer_copies_a_killed_run_left_unsent_are_sent_by_the_next_runs_first_commit(tmp_path):
    two_ranks(tmp_path, "train-peers-killed", killed=True)
    for node, other in (("n0", "n1"), ("n1", "n0")):
        assert nvme(tmp_path, node).steps() == [2, 4]
        assert kept_for(nvme(tmp_path, node), other).steps() == []  # killed before the copies' turn
    two_ranks(tmp_path, "resume-peers-save")
    for node, other, seen in zip(("n0", "n1"), ("n1", "n0"), facts(tmp_path, "resume-peers-save"), strict=True):
        assert (seen["restored"], seen["flush_errors"]) == ([4, "nvme"], [])
        copy = kept_for(nvme(tmp_path, node), other)
        assert copy.steps() == [2, 4, 6]  # the two left unsent, oldest first, then the new run's own
        assert all(verify_step(copy, step).ok for step in copy.steps())
        assert copy.manifest(2).node_part is not None and copy.manifest(2).node_part.node == other


def test_steps_a_killed_run_left_in_memory_reach_nvme_and_then_the_partner(tmp_path):
    two_ranks(tmp_path, "train-memory-peers-killed", killed=True)
    for node, other in (("n0", "n1"), ("n1", "n0")):
        assert (memory(tmp_path, node).steps(), nvme(tmp_path, node).steps()) == ([2, 4], [])  # pinned: due on NVMe
        assert kept_for(nvme(tmp_path, node), other).steps() == []
    two_ranks(tmp_path, "resume-memory-peers-save")
    for node, other, seen in zip(("n0", "n1"), ("n1", "n0"), facts(tmp_path, "resume-memory-peers-save"), strict=True):
        assert (seen["restored"], seen["flush_errors"]) == ([4, "memory"], [])
        assert nvme(tmp_path, node).steps() == [2, 4, 6]  # the resumed flushes, then the new run's own
        copy = kept_for(nvme(tmp_path, node), other)
        assert copy.steps() == [2, 4, 6]  # sent once the resumed flushes had brought steps 2 and 4 to NVMe
        assert all(verify_step(copy, step).ok for step in copy.steps())
        assert memory(tmp_path, node).steps() == [6]  # keep_last: 1, nothing left pinned
    assert FilesystemTier("pfs", tmp_path / "pfs").steps() == [2, 4, 6]
