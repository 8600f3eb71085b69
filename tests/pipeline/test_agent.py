"""The node agent (pipeline/agent.py): flushes out of the memory tier in a process of its own that outlives
the trainer, one per node, gone once no trainer is attached and nothing is left.

Every trainer here is a real process; the agent is the real ``tierstate agent`` the runner starts. A test
waits for the agent to end by watching its process (its pid, read from its lock), never by sleeping.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import REPO
from launch import process_gone
from tierstate import cli
from tierstate.pipeline.agent import AgentFiles, agent_pid
from tierstate.pipeline.config import parse_config
from tierstate.pipeline.runner import Runner
from tierstate.providers import TensorDictProvider
from tierstate.tiers.reading.stored import StoredCheckpoint
from tierstate.tiers.storage.filesystem import FilesystemTier

MiB = 1 << 20


def _layout(root: Path, bandwidth: str | None = None, linger: float = 120.0) -> dict[str, Any]:
    return {
        "tiers": {
            "memory": {"kind": "memory", "path": str(root / "memory"), "size": "64MiB", "retention": {"keep_last": 1}},
            "nvme": {"path": str(root / "nvme"), "flush": {"every": 1, "bandwidth": bandwidth},
                     "retention": {"keep_last": 3}},
        },
        "chunk_size": "1MiB", "host_cache": {"size": "4MiB"}, "agent": {"enabled": True, "linger": linger},
    }  # fmt: skip


def _agent(root: Path) -> int | None:
    return agent_pid(AgentFiles.of(parse_config(_layout(root))))


def _state(step: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((MiB,), float(step)), "b": torch.arange(7) + step}


def test_the_runner_leaves_the_flushes_to_an_agent_that_ends_with_it(tmp_path, capsys):
    runner = Runner.from_dict(_layout(tmp_path))
    state = _state(0)
    runner.register(model=TensorDictProvider(state))
    pid = _agent(tmp_path)
    assert pid is not None and pid != os.getpid(), "no agent process runs"
    for step in range(1, 5):
        state.update(_state(step))
        handle = runner.checkpoint(step)
        assert handle.tier_futures["nvme"].result(timeout=60) == tmp_path / "nvme" / f"step-{step}"
    assert cli.main(["ls", f"--tier=memory={tmp_path / 'memory'}", f"--tier=nvme={tmp_path / 'nvme'}"]) == 0
    said = capsys.readouterr().out.splitlines()
    running = f"agent on memory: running (pid {pid}), 1 trainer(s) attached (pids {os.getpid()}); log "
    assert any(line.startswith(running) for line in said), said
    assert said[-1].startswith("slots on memory: rank 0: 1 free file(s), ")  # the pool capture writes into
    runner.close()
    assert runner.flush_failures == []
    assert process_gone(pid, 30), "the agent outlived its last trainer with nothing left to flush"
    nvme = FilesystemTier("nvme", tmp_path / "nvme")
    assert nvme.steps() == [2, 3, 4]
    for step in nvme.steps():
        read = StoredCheckpoint(nvme.step_dir(step), step).read()
        assert torch.equal(read["model/w"], _state(step)["w"])
    assert FilesystemTier("memory", tmp_path / "memory").steps() == [4]
    assert cli.main(["ls", f"--tier=memory={tmp_path / 'memory'}"]) == 0
    said = capsys.readouterr().out.splitlines()
    assert said[-1].startswith("agent on memory: not running, 0 trainer(s) attached"), said  # closed: no pool left


# A trainer that checkpoints steps 1..4 with the agent on and prints each durable step, then waits to be killed.
_TRAINER = """
import json, sys, torch
from tierstate.pipeline.runner import Runner
from tierstate.providers import TensorDictProvider
runner = Runner.from_dict(json.loads(open(sys.argv[1]).read()))
state = {"w": torch.zeros(4 << 20)}
runner.register(model=TensorDictProvider(state))
for step in range(1, 5):
    state["w"].fill_(step)
    runner.checkpoint(step).result()
    print(step, flush=True)
sys.stdin.read()
"""


def test_a_killed_trainers_committed_checkpoints_reach_nvme_through_the_agent(tmp_path):
    """16 MiB a step at 16 MB/s to NVMe: when the trainer dies, steps are committed in memory and not flushed;
    the agent flushes every one of them without a restart, then ends (no restart within its linger)."""
    layout = _layout(tmp_path, bandwidth="16MB", linger=0.5)
    config = tmp_path / "layout.json"
    config.write_text(json.dumps(layout))
    trainer = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, str(config)], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert trainer.stdout is not None
    durable = [int(trainer.stdout.readline()) for _ in range(4)]
    nvme = FilesystemTier("nvme", tmp_path / "nvme")
    memory = FilesystemTier("memory", tmp_path / "memory")
    behind = [step for step in durable if step not in nvme.steps()]
    pid = _agent(tmp_path)
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    assert behind, "every step was flushed before the kill: the test would prove nothing"
    assert pid is not None and process_gone(pid, 60), "the agent did not finish and end after its trainer died"
    assert set(durable) - set(nvme.steps()) <= {1}  # keep_last 3 on NVMe: step 1 may be pruned once 4 is there
    assert nvme.steps()[-1] == 4 and memory.steps() == [4]
    for step in nvme.steps():
        read = StoredCheckpoint(nvme.step_dir(step), step).read()
        assert torch.equal(read["model/w"], torch.full((4 << 20,), float(step)))


def test_a_restarted_trainer_reattaches_to_the_agent_its_crash_left(tmp_path):
    """The agent outlives a killed trainer by its linger: the restart finds it, starts none, and restores; once
    that runner closes the agent ends at once (the linger is for crashes)."""
    config = tmp_path / "layout.json"
    config.write_text(json.dumps(_layout(tmp_path)))
    trainer = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, str(config)], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert trainer.stdout is not None
    assert [int(trainer.stdout.readline()) for _ in range(4)] == [1, 2, 3, 4]
    pid = _agent(tmp_path)
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    nvme = FilesystemTier("nvme", tmp_path / "nvme")
    deadline = time.monotonic() + 60
    while nvme.steps() != [2, 3, 4] and time.monotonic() < deadline:
        time.sleep(0.05)  # the agent is another process: its progress is only seen on the tier
    assert nvme.steps() == [2, 3, 4] and not process_gone(pid, 1.0), "the agent ended before a restart could come"
    runner = Runner.from_dict(_layout(tmp_path))
    assert _agent(tmp_path) == pid, "the restart started an agent of its own"
    state = {"w": torch.zeros(4 << 20)}
    runner.register(model=TensorDictProvider(state))
    assert runner.restore().step == 4 and bool((state["w"] == 4).all())
    runner.close()
    assert pid is not None and process_gone(pid, 30)


def test_an_agent_whose_tier_was_removed_stops_instead_of_lingering(tmp_path):
    """A job's tiers deleted after its trainer died (a benchmark's next trial, a cleanup): the lingering agent
    stops, so it neither works on what a new job puts at that path nor keeps a new runner from starting its own."""
    config = tmp_path / "layout.json"
    config.write_text(json.dumps(_layout(tmp_path)))  # linger 120 s
    trainer = subprocess.Popen(
        [sys.executable, "-c", _TRAINER, str(config)], cwd=REPO, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert trainer.stdout is not None
    assert int(trainer.stdout.readline()) == 1
    pid = _agent(tmp_path)
    trainer.send_signal(signal.SIGKILL)
    trainer.wait()
    shutil.rmtree(tmp_path / "memory")
    assert pid is not None and process_gone(pid, 30), "the agent of a removed tier lingered on"


def test_a_second_agent_on_a_node_leaves_the_flushes_to_the_first(tmp_path):
    runner = Runner.from_dict(_layout(tmp_path))
    runner.register(model=TensorDictProvider(_state(0)))
    first = _agent(tmp_path)
    try:
        files = AgentFiles.of(parse_config(_layout(tmp_path)))
        second = subprocess.run(
            [sys.executable, "-m", "tierstate", "agent", "--config", str(files.config)], cwd=REPO, capture_output=True,
            text=True, timeout=60,
        )  # fmt: skip
        assert second.returncode == 0, second.stderr
        assert f"an agent runs on this node already (pid {first})" in second.stderr
        assert _agent(tmp_path) == first
    finally:
        runner.close()
    assert first is not None and process_gone(first, 30)


def test_an_agent_that_died_is_started_again_at_the_next_commit(tmp_path):
    runner = Runner.from_dict(_layout(tmp_path))
    state = _state(0)
    runner.register(model=TensorDictProvider(state))
    first = _agent(tmp_path)
    assert first is not None
    os.kill(first, signal.SIGKILL)
    assert process_gone(first, 30)
    for step in (1, 2):
        state.update(_state(step))
        runner.checkpoint(step).tier_futures["nvme"].result(timeout=60)
    again = _agent(tmp_path)
    assert again is not None and again != first
    runner.close()
    assert runner.flush_failures == [] and process_gone(again, 30)
    assert FilesystemTier("nvme", tmp_path / "nvme").steps() == [1, 2]


def test_an_agent_killed_mid_flush_is_started_again_and_the_step_arrives_whole(tmp_path):
    """16 MiB at 8 MB/s: the agent is SIGKILLed while its copy of step 1 is a partial directory on NVMe; the next
    commit starts another, which copies step 1 again from the start, and both steps arrive whole."""
    runner = Runner.from_dict(_layout(tmp_path, bandwidth="8MB"))
    state = {"w": torch.full((4 << 20,), 1.0)}
    runner.register(model=TensorDictProvider(state))
    first = _agent(tmp_path)
    assert first is not None
    handles = [runner.checkpoint(1)]
    partial = tmp_path / "nvme" / "step-1.partial"
    deadline = time.monotonic() + 60
    while not partial.exists():
        assert time.monotonic() < deadline, "the agent never started copying step 1"
        time.sleep(0.01)  # the agent is another process: its progress is only seen on the tier
    os.kill(first, signal.SIGKILL)
    assert process_gone(first, 30)
    state["w"].fill_(2.0)
    handles.append(runner.checkpoint(2))  # its commit finds the agent dead and starts another
    for handle in handles:
        handle.tier_futures["nvme"].result(timeout=120)
    again = _agent(tmp_path)
    runner.close()
    assert again is not None and again != first and runner.flush_failures == []
    nvme = FilesystemTier("nvme", tmp_path / "nvme")
    assert nvme.steps() == [1, 2] and not partial.exists()
    for step in (1, 2):
        read = StoredCheckpoint(nvme.step_dir(step), step).read()
        assert torch.equal(read["model/w"], torch.full((4 << 20,), float(step)))
    assert process_gone(again, 30)


@pytest.mark.parametrize("enabled", [True])
def test_the_agent_config_is_the_runners(tmp_path, enabled):
    """What the runner writes for its agent reads back as the very config it runs."""
    config = parse_config(_layout(tmp_path))
    assert config.agent.enabled is enabled
    dumped = parse_config(json.loads(json.dumps(config.model_dump(mode="json", by_alias=True))))
    assert dumped == config
