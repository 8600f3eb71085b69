"""The memory tier: checkpoints in host shared memory that outlive the process, bounded in size.

Its directory is a real tmpfs one under /dev/shm where there is one (removed after the test), else
under tmp_path: the tier works on any directory, tmpfs is what makes it RAM.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import REPO
from tierstate import cli
from tierstate.pipeline.config import ConfigError, parse_config
from tierstate.pipeline.restore import nearest_first
from tierstate.pipeline.runner import Runner
from tierstate.providers import TensorDictProvider
from tierstate.tiers.storage.filesystem import FilesystemTier
from tierstate.tiers.storage.nodes import NODE_ENV

WORKER = REPO / "tests" / "memory_worker.py"
MiB = 1 << 20


def memory_runner(memory: Path, nvme: Path, size: str, flush: dict | None = None) -> Runner:
    return Runner.from_dict({
        "chunk_size": "1MiB",
        "host_cache": {"size": "8MiB"},
        "tiers": {
            "memory": {"kind": "memory", "path": str(memory), "size": size, "retention": {"keep_last": 1}},
            "nvme": {"path": str(nvme), "flush": flush or {"every": 1}},
        },
    })  # fmt: skip


def state(mib: int) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(mib * MiB // 4)}


# --- config -------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("memory", "expected"),
    [
        ({"kind": "memory"}, "tiers.memory.size: a memory tier needs a size bound"),
        ({"kind": "memory", "size": "1GiB", "scope": "shared", "retention": {"keep_last": 1}},
         "tiers.memory.scope: a memory tier is each node's own host memory"),
        ({"kind": "memory", "size": "1GiB"},
         "tiers.memory.retention: a tier with a size bound (1.0GiB) needs a retention"),
        ({"kind": "ram", "size": "1GiB"}, "tiers.memory.kind:"),
    ],
)  # fmt: skip
def test_a_memory_tier_must_be_bounded_node_scoped_and_pruned(tmp_path: Path, memory: dict, expected: str) -> None:
    with pytest.raises(ConfigError) as caught:
        parse_config({"tiers": {"memory": {"path": str(tmp_path / "m"), **memory}}}, source="my.yaml")
    assert f"my.yaml: {expected}" in str(caught.value)


def test_a_memory_tier_is_node_scoped_by_default_and_restore_looks_at_node_tiers_first(tmp_path: Path) -> None:
    config = parse_config({
        "tiers": {
            "pfs": {"path": str(tmp_path / "pfs")},
            "nvme": {"path": str(tmp_path / "nvme"), "scope": "node"},
            "memory": {"kind": "memory", "path": str(tmp_path / "m"), "size": "1GiB", "retention": {"keep_last": 1}},
        },
    })  # fmt: skip
    assert config.tiers["memory"].scope == "node"
    tiers = [FilesystemTier(name, tier.path, tier.scope) for name, tier in config.tiers.items()]
    assert [t.name for t in nearest_first(tiers)] == ["nvme", "memory", "pfs"]


# --- the size bound -----------------------------------------------------------------------------


def test_a_memory_tier_too_small_for_one_checkpoint_plus_the_next_fails_naming_the_key(
    memory_dir: Path, tmp_path: Path
) -> None:
    runner = memory_runner(memory_dir, tmp_path / "nvme", size="6MiB")
    runner.register(weights=TensorDictProvider(state(4)))
    handle = runner.checkpoint(1)
    assert handle.exception() is not None
    text = str(handle.exception())
    assert "tiers.memory.size: 6.0MiB cannot hold this job's checkpoints" in text
    assert "keep_last=1" in text and "raise size" in text
    assert FilesystemTier("memory", memory_dir).steps() == []
    runner.close()


def test_with_keep_last_1_the_memory_tier_holds_one_checkpoint_plus_the_one_in_flight(
    memory_dir: Path, tmp_path: Path
) -> None:
    """NVMe flushes at 16 MB/s (0.26 s a checkpoint) while checkpoints are asked back to back: each
    new one must wait until the copy before the last has reached NVMe and been pruned from memory."""
    size = 12 * MiB  # two 4 MiB checkpoints (plus margins), not three
    runner = memory_runner(memory_dir, tmp_path / "nvme", size="12MiB", flush={"every": 1, "bandwidth": "16MB"})
    runner.register(weights=TensorDictProvider(state(4)))
    memory = FilesystemTier("memory", memory_dir)
    held = []
    for step in range(1, 6):
        runner.checkpoint(step).result()  # committed in memory
        held.append(memory.steps())
        assert memory.bytes_used() <= size
    runner.close()
    assert all(len(steps) <= 2 for steps in held), held
    assert any(len(steps) == 2 for steps in held), held  # the older copy was still on its way to NVMe
    assert memory.steps() == [5]
    assert FilesystemTier("nvme", tmp_path / "nvme").steps() == [1, 2, 3, 4, 5]


# --- restore from the nearest good copy ---------------------------------------------------------


def test_restore_reads_memory_first_and_falls_back_on_a_corrupt_copy(memory_dir: Path, tmp_path: Path) -> None:
    saved = state(2)
    runner = memory_runner(memory_dir, tmp_path / "nvme", size="16MiB")
    runner.register(weights=TensorDictProvider({k: v.clone() for k, v in saved.items()}))
    runner.checkpoint(3).tier_futures["nvme"].result()
    runner.close()

    live = {"w": torch.zeros_like(saved["w"])}
    runner = memory_runner(memory_dir, tmp_path / "nvme", size="16MiB")
    runner.register(weights=TensorDictProvider(live))
    result = runner.restore()
    assert (result.step, result.tier, result.tier_by_rank) == (3, "memory", ("memory",))
    assert torch.equal(live["w"], saved["w"])

    data = memory_dir / "step-3" / "rank-00000.data"
    with data.open("r+b") as f:  # one flipped bit in the first frame
        f.seek(4096 + 100)
        byte = f.read(1)
        f.seek(4096 + 100)
        f.write(bytes([byte[0] ^ 1]))
    live["w"].zero_()
    result = runner.restore()
    assert (result.step, result.tier, result.tier_by_rank) == (3, "nvme", ("nvme",))
    assert "step 3 on tier memory" in result.problems[0] and "checksum" in result.problems[0]
    assert torch.equal(live["w"], saved["w"])
    runner.close()


# --- the CLI on a node's view -------------------------------------------------------------------


def test_the_cli_reads_node_scoped_tiers_as_the_node_named_by_node(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv(NODE_ENV, "n1")
    nvme = {"path": str(tmp_path / "{node}" / "nvme"), "scope": "node"}
    runner = Runner.from_dict({"chunk_size": "1MiB", "host_cache": {"size": "4MiB"}, "tiers": {"nvme": nvme}})
    runner.register(weights=TensorDictProvider(state(1)))
    runner.checkpoint(7).result()
    runner.close()
    monkeypatch.setenv(NODE_ENV, "n0")  # the CLI runs elsewhere; --node says whose view
    tier = f"nvme={tmp_path / '{node}' / 'nvme'}"
    assert cli.main(["ls", "--json", "--tier", tier, "--node", "n1"]) == 0
    [entry] = json.loads(capsys.readouterr().out)
    assert (entry["tier"], entry["step"], entry["state"]) == ("nvme", 7, "committed")
    assert cli.main(["verify", "--tier", tier, "--node", "n1"]) == 0
    assert cli.main(["ls", "--tier", tier]) == 2  # n0 (from the environment) has no such directory
    assert f"{tmp_path / 'n0' / 'nvme'}" in capsys.readouterr().err


# --- a real process killed, a real restart -------------------------------------------------------


def run_worker(workdir: Path, memory: Path, mode: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(WORKER), str(workdir), str(memory), mode],
        cwd=REPO, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip


@pytest.mark.slow
def test_a_trainer_killed_before_the_nvme_commit_restarts_from_memory(memory_dir: Path, tmp_path: Path) -> None:
    reference = tmp_path / "reference"
    reference.mkdir()
    done = run_worker(reference, reference / "memory", "train")
    assert done.returncode == 0, done.stdout + done.stderr
    expected = json.loads((reference / "train.json").read_text())["losses"]

    workdir = tmp_path / "crashed"
    workdir.mkdir()
    killed = run_worker(workdir, memory_dir, "crash")
    assert killed.returncode == -9, killed.stdout + killed.stderr  # SIGKILL while copying step 4 to NVMe
    nvme = FilesystemTier("nvme", workdir / "nvme")
    assert nvme.steps() == [2]  # step 4 never committed there
    assert 4 in FilesystemTier("memory", memory_dir).steps()  # but it did in memory, which outlived the process

    resumed = run_worker(workdir, memory_dir, "resume")
    assert resumed.returncode == 0, resumed.stdout + resumed.stderr
    facts = json.loads((workdir / "resume.json").read_text())
    assert (facts["step"], facts["tier"], facts["tier_by_rank"]) == (4, "memory", ["memory"])
    assert facts["losses"] == expected
