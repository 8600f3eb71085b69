"""When ``maybe_checkpoint`` checkpoints (pipeline/cadence.py): every N steps, or ``every: auto``.

The arithmetic runs on a given clock (each call's ``now``), with real handles of a real runner, so the
intervals are exact; a real training loop then shows the runner's own calls: the forced flush steps, the
first automatic checkpoint, and the config's errors.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tierstate import ConfigError, Runner, TensorDictProvider
from tierstate.pipeline.cadence import Cadence
from tierstate.pipeline.handle import CheckpointHandle
from tierstate.tiers.storage.filesystem import FilesystemTier


@pytest.fixture
def runner(tmp_path: Path):
    with Runner.from_dict({"tiers": {"nvme": {"path": str(tmp_path / "nvme"), "retention": {"keep_last": 2}}},
                           "chunk_size": "1MiB", "host_cache": {"size": "4MiB"}}) as runner:  # fmt: skip
        runner.register(model=TensorDictProvider({"w": torch.ones(1000)}))
        yield runner


def _durable(runner: Runner, step: int) -> CheckpointHandle:
    handle = runner.checkpoint(step)
    handle.result()
    for future in handle.tier_futures.values():
        future.result()
    return handle


def _train(
    cadence: Cadence, runner: Runner, steps: int, cost: float = 0.25, flushed: tuple[int, float] = (0, 0.0)
) -> list[int]:
    """Call ``cadence`` once per step of 1 s, a step that overlaps a checkpoint costing ``cost`` more (a multiple of
    ``flushed[0]``: ``flushed[1]`` more still, its flush); the steps it checkpointed (each durable and flushed
    before the next call)."""
    now, taken = 0.0, []
    for step in range(1, steps + 1):
        if taken and taken[-1] == step - 1:
            now += cost + (flushed[1] if flushed[0] and (step - 1) % flushed[0] == 0 else 0.0)
        now += 1.0
        if cadence.due(step, now):
            cadence.taken(step, _durable(runner, step), requested=now)
            taken.append(step)
    return taken


def test_auto_spaces_checkpoints_by_their_measured_cost_within_the_budget(runner: Runner) -> None:
    # Steps of 1 s, a checkpoint costing 0.25 s, a budget of 1/32: 0.25 / (1/32 * 1 s) = 8 steps apart. The first
    # comes after the 3 steps of warm-up, the second after as many more (nothing measured yet).
    cadence = Cadence("auto", budget=1 / 32, warmup=3, forced=[], agree=lambda mine: [mine])
    assert _train(cadence, runner, 30) == [4, 7, 15, 23]
    assert cadence.interval == 8
    # Twice the budget: half the interval.
    runner.start_fresh(set_aside=True)
    cadence = Cadence("auto", budget=1 / 16, warmup=3, forced=[], agree=lambda mine: [mine])
    assert _train(cadence, runner, 20) == [4, 7, 11, 15, 19]


def test_what_the_flushes_cost_is_taken_out_of_the_budget_first(runner: Runner, caplog) -> None:
    # 1 s steps, a budget of 1/16: 0.0625 s per step. A checkpoint into memory costs 0.25 s, so alone it would be
    # every 4 steps; the one flushed every 10 steps costs 0.25 s more, 0.025 s per step, which leaves 0.0375 s:
    # 0.25 / 0.0375 = 6.7, so 7 steps apart.
    cadence = Cadence("auto", budget=1 / 16, warmup=3, forced=[10], agree=lambda mine: [mine])
    taken = _train(cadence, runner, 60, flushed=(10, 0.25))
    assert cadence.interval == 7
    assert {10, 20, 30, 40, 50, 60} <= set(taken)
    assert taken[-4:] == [47, 50, 57, 60]
    # Flushes costing 1 s more each, 0.1 s per step, are over the budget alone: only their steps are
    # checkpointed, and the log says how much less often they would fit.
    runner.start_fresh(set_aside=True)
    cadence = Cadence("auto", budget=1 / 16, warmup=3, forced=[10], agree=lambda mine: [mine])
    with caplog.at_level("WARNING", logger="tierstate.cadence"):
        taken = _train(cadence, runner, 60, flushed=(10, 1.0))
    assert cadence.interval == 10
    assert [s for s in taken if s > 20] == [30, 40, 50, 60]
    [warning] = [r.getMessage() for r in caplog.records if r.name == "tierstate.cadence"]
    assert "flushes every 10 steps cost 12.5% of training alone, over the budget of 6.2%" in warning
    assert "raise flush.every about 2.0x" in warning


def test_the_largest_interval_any_rank_proposes_is_every_rank_s(runner: Runner) -> None:
    cadence = Cadence("auto", budget=1 / 32, warmup=1, forced=[], agree=lambda mine: [mine, 20])
    assert _train(cadence, runner, 50) == [2, 22, 42]
    assert cadence.interval == 20


def test_flush_multiples_are_always_checkpointed_and_every_n_is_plain_multiples(runner: Runner) -> None:
    auto = Cadence("auto", budget=0.03, warmup=100, forced=[5, 7], agree=lambda mine: [mine])
    assert [s for s in range(1, 22) if auto.due(s, now=float(s))] == [5, 7, 10, 14, 15, 20, 21]
    fixed = Cadence(4, budget=0.03, warmup=3, forced=[5], agree=lambda mine: [mine])
    assert [s for s in range(1, 13) if fixed.due(s, now=float(s))] == [4, 8, 12]


def test_a_training_loop_checkpoints_on_flush_steps_and_after_the_warm_up(tmp_path: Path, memory_dir: Path) -> None:
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    config = {
        "chunk_size": "1MiB", "host_cache": {"size": "4MiB"}, "cadence": {"every": "auto", "warmup": 2},
        "tiers": {"memory": {"kind": "memory", "path": str(memory_dir), "size": "16MiB", "retention": {"keep_last": 1}},
                  "nvme": {"path": str(tmp_path / "nvme"), "flush": {"every": 4}, "retention": {"keep_last": 8}}},
    }  # fmt: skip
    taken = []
    with Runner.from_dict(config) as runner:
        runner.register(model=model, optim=optimizer)
        for step in range(1, 13):
            model(torch.randn(8, 64)).sum().backward()
            optimizer.step()
            optimizer.zero_grad()
            handle = runner.maybe_checkpoint(step)
            if handle is not None:
                assert handle.step == step
                taken.append(step)
    assert taken[0] == 3  # the call after two timed steps
    assert {4, 8, 12} <= set(taken)  # NVMe's cadence kept
    assert FilesystemTier("nvme", tmp_path / "nvme").steps() == [4, 8, 12]  # flushed by close()


@pytest.mark.parametrize(
    ("cadence", "said"),
    [({"every": 0}, "cadence.every"), ({"every": "often"}, "cadence.every"), ({"budget": 0}, "cadence.budget"),
     ({"budget": 1.5}, "cadence.budget"), ({"warmup": 0}, "cadence.warmup"), ({"evry": 3}, "cadence.evry")],
)  # fmt: skip
def test_a_wrong_cadence_is_refused_naming_its_key(tmp_path: Path, cadence: dict, said: str) -> None:
    with pytest.raises(ConfigError, match=said.replace(".", r"\.")):
        Runner.from_dict({"tiers": {"nvme": {"path": str(tmp_path)}}, "cadence": cadence})
