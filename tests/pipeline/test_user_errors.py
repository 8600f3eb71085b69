"""Errors a user meets in the first hour say what is wrong where it is wrong (issue: what a user sees)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tierstate import (
    CheckpointExistsError,
    ProviderNameError,
    RestoreError,
    Runner,
    TensorDictProvider,
    TierstateError,
)


def _model_and_optim() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.StepLR]:
    model = torch.nn.Linear(4, 4)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, optim, torch.optim.lr_scheduler.StepLR(optim, 1)


def test_a_provider_the_checkpoint_lacks_is_named_with_those_it_has(make_runner: Callable[..., Runner]) -> None:
    model, optim, sched = _model_and_optim()
    runner = make_runner()
    runner.register(model=model, optim=optim)
    runner.checkpoint(1).result()
    runner.register(sched=sched)  # added since, or saved under another name
    weights = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    with pytest.raises(RestoreError, match=r"the checkpoint has no provider 'sched' \(it has: model, optim\)"):
        runner.restore(1)
    assert not torch.equal(model.weight, weights)  # nothing applied


def test_a_name_registered_twice_is_a_tierstate_error_and_registers_nothing(make_runner: Callable[..., Runner]) -> None:
    runner = make_runner()
    runner.register(t=TensorDictProvider({"w": torch.ones(2)}))
    with pytest.raises(ProviderNameError, match=r"a provider named 't' is already registered") as raised:
        runner.register(u=TensorDictProvider({"w": torch.ones(2)}), t=TensorDictProvider({"w": torch.zeros(2)}))
    assert isinstance(raised.value, TierstateError) and isinstance(raised.value, ValueError)
    assert list(runner.providers.children) == ["t"]  # u was not registered either


def test_a_repeated_step_fails_at_the_call_and_latest_step_tells_a_first_run(
    make_runner: Callable[..., Runner],
) -> None:
    runner = make_runner()
    runner.register(t=TensorDictProvider({"w": torch.ones(2)}))
    assert runner.latest_step() is None  # a first run
    runner.checkpoint(3).result()
    with pytest.raises(CheckpointExistsError, match=r"checkpoint step 3: tier nvme holds step 3 already"):
        runner.checkpoint(3)
    assert runner.latest_step() == 3
    runner.checkpoint(4).result()  # training goes on
    assert runner.latest_step() == 4


def test_two_runners_in_one_process_on_one_tier_are_two_writers(make_runner: Callable[..., Runner]) -> None:
    """A notebook cell that builds the runner, run twice: the second runner is refused as a second process
    would be (TierInUseError naming this process), and takes the tier once the first is closed."""
    from tierstate import TierInUseError

    first = make_runner()
    first.register(t=TensorDictProvider({"w": torch.ones(2)}))
    first.checkpoint(1).result()
    second = make_runner()
    second.register(t=TensorDictProvider({"w": torch.zeros(2)}))
    refused = second.checkpoint(2)
    refused.wait()
    assert isinstance(refused.error, TierInUseError), refused.error
    assert "already written by another runner of this process" in str(refused.error)
    first.checkpoint(3).result()  # the first goes on
    first.close()
    second.checkpoint(4).result()  # and the second takes over once it is closed
    assert second.steps()["nvme"] == [1, 3, 4]
