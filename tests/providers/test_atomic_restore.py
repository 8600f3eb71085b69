"""A restore that fails leaves the live state exactly as it was (issue 11 item 3).

Each test saves a real checkpoint through a runner, moves the live state on (more training, other
RNG draws, other counters), then restores into providers that do not fit the checkpoint in one
way, and compares every tensor, object and generator state with what it was before the restore.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from tierstate import (
    ModuleProvider,
    ObjectItem,
    ObjectProvider,
    OptimizerProvider,
    RestoreError,
    RNGProvider,
    Runner,
    StatefulProvider,
    TensorDictProvider,
    TensorItem,
)


class EMAProvider:
    """The README's example of a user provider: no ``check``, copies its tensors one by one."""

    def __init__(self, shadow: dict[str, torch.Tensor], decay: float) -> None:
        self.shadow, self.decay = shadow, decay

    def describe(self) -> list:
        return [TensorItem(f"shadow/{k}", t) for k, t in self.shadow.items()] + [ObjectItem("decay", self.decay)]

    def restore(self, state: Any) -> None:
        for k, t in self.shadow.items():
            t.copy_(state[f"shadow/{k}"])
        self.decay = state["decay"]


class Trainer:
    """A model with its optimizer, scheduler and side state, in one of the shapes the tests need."""

    def __init__(self, seed: int, hidden: int = 16, groups: int = 1, ema_width: int = 3) -> None:
        torch.manual_seed(seed)
        self.model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, hidden), nn.Linear(hidden, 4))
        params = list(self.model.parameters())
        split = [params[:2], params[2:]] if groups == 2 else [params]
        self.opt = torch.optim.AdamW([{"params": p} for p in split], lr=1e-2)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)
        self.ema = EMAProvider({"a": torch.randn(5), "b": torch.randn(ema_width)}, decay=0.9)
        self.counters = {"step": seed}
        self.train(2)

    def train(self, steps: int) -> None:
        for _ in range(steps):
            x = torch.randn(4, 8)
            self.opt.zero_grad()
            self.model(x).pow(2).mean().backward()
            self.opt.step()
            self.sched.step()
            self.counters["step"] += 1

    def providers(self) -> dict[str, Any]:
        return {
            "model": ModuleProvider(self.model),
            "optim": OptimizerProvider(self.opt),
            "sched": StatefulProvider(self.sched),
            "ema": self.ema,
            "rng": RNGProvider(cuda=False),
            "trainer": ObjectProvider(self.counters),
        }

    def everything(self) -> dict[str, Any]:
        """Copies of every value a restore could touch, generator states included."""
        tensors = {f"model/{k}": v.clone() for k, v in self.model.state_dict().items()}
        for index, (param, state) in enumerate(self.opt.state.items()):
            tensors |= {f"optim/{index}/{k}": v.clone() for k, v in state.items()}
            tensors[f"optim/{index}/is"] = param.detach().clone()
        tensors |= {f"ema/{k}": v.clone() for k, v in self.ema.shadow.items()}
        tensors["rng/torch"] = torch.get_rng_state()
        objects = {
            "groups": [{k: v for k, v in g.items() if k != "params"} for g in self.opt.param_groups],
            "sched": self.sched.state_dict(),
            "decay": self.ema.decay,
            "counters": dict(self.counters),
            "python": random.getstate(),
            "numpy": repr(np.random.get_state()),
        }
        return {"tensors": tensors, "objects": objects}


def assert_unchanged(trainer: Trainer, before: dict[str, Any]) -> None:
    after = trainer.everything()
    assert after["tensors"].keys() == before["tensors"].keys()
    changed = [k for k, v in before["tensors"].items() if not torch.equal(after["tensors"][k], v)]
    assert changed == [], f"changed by the failed restore: {changed}"
    assert after["objects"] == before["objects"]


@pytest.fixture
def saved(make_runner: Callable[..., Runner]) -> Callable[[Trainer], Runner]:
    """A checkpoint of ``Trainer(seed=0)`` at step 1; returns a function registering another trainer."""
    source = Trainer(seed=0)
    with make_runner() as runner:
        runner.register(**source.providers())
        runner.checkpoint(1).result()

    def restoring_into(trainer: Trainer, **extra: Any) -> Runner:
        runner = make_runner()
        runner.register(**trainer.providers(), **extra)
        return runner

    return restoring_into


@pytest.mark.parametrize(
    ("shape", "extra", "message"),
    [
        ({"hidden": 24}, {}, r"provider 'model'.*2\.weight: checkpoint float32\[16, 16\], live float32\[24, 16\]"),
        ({"groups": 2}, {}, r"provider 'optim'.*1 parameter group\(s\) of \[6\] parameters, the optimizer 2 of \[2, 4"),
        ({}, {"extra": lambda: TensorDictProvider({"w": torch.ones(3)})}, r"has no provider 'extra' \(it"),
    ],
    ids=["a layer of another shape", "other param groups", "a provider the checkpoint lacks"],
)
def test_a_checked_provider_that_does_not_fit_changes_nothing(saved, shape, extra, message) -> None:
    trainer = Trainer(seed=1, **shape)
    runner = saved(trainer, **{name: make() for name, make in extra.items()})
    before = trainer.everything()
    with pytest.raises(RestoreError, match=message):
        runner.restore("latest")
    assert_unchanged(trainer, before)


def test_a_user_provider_failing_halfway_puts_back_every_provider_restored_before_it(saved) -> None:
    # The EMA provider has no check: it is restored before the checked ones, after the scheduler,
    # the RNG and the counters (also unchecked); its second tensor has another shape, so it fails
    # after overwriting its first. Everything restored until then is put back.
    trainer = Trainer(seed=1, ema_width=7)
    runner = saved(trainer)
    before = trainer.everything()
    expected_draws = (random.random(), torch.rand(2).tolist())
    random.setstate(before["objects"]["python"])
    torch.set_rng_state(before["tensors"]["rng/torch"])
    with pytest.raises(RuntimeError, match="size of tensor") as failure:
        runner.restore("latest")
    assert "while restoring provider 'ema'; the providers without check were put back" in failure.value.__notes__
    assert_unchanged(trainer, before)
    assert (random.random(), torch.rand(2).tolist()) == expected_draws


def test_a_later_provider_that_fails_rolls_back_the_earlier_ones(saved) -> None:
    # "ema" is restored last of the unchecked providers; it holds a tensor the checkpoint lacks, so it
    # fails after the scheduler, the RNG and the counters (and its own first tensors) were restored.
    trainer = Trainer(seed=1)
    trainer.ema.shadow["c"] = torch.zeros(2)
    runner = saved(trainer)
    before = trainer.everything()
    with pytest.raises(KeyError, match="shadow/c"):
        runner.restore("latest")
    assert_unchanged(trainer, before)
    assert torch.equal(trainer.ema.shadow["c"], torch.zeros(2)) and trainer.ema.decay == 0.9


def test_after_a_failed_restore_a_fitting_one_restores_everything(saved) -> None:
    trainer = Trainer(seed=1)
    extra = TensorDictProvider({"w": torch.ones(3)})
    with saved(trainer, extra=extra) as refused, pytest.raises(RestoreError):
        refused.restore("latest")
    assert saved(trainer).restore("latest").step == 1
    expected = Trainer(seed=0).everything()["tensors"]
    restored = trainer.everything()["tensors"]
    assert all(torch.equal(restored[k], v) for k, v in expected.items() if not k.startswith("rng/")), "restored"


class Wrapper(nn.Module):
    """What DistributedDataParallel looks like to ``state_dict()``: the model under ``module.``."""

    def __init__(self, module: nn.Module) -> None:
        super().__init__()
        self.module = module


@pytest.mark.parametrize(
    ("saved_from", "restored_into", "hint"),
    [
        (Wrapper, lambda m: m, "the checkpoint was saved from a DDP-wrapped model and this one is not"),
        (lambda m: m, Wrapper, "this model is DDP-wrapped and the checkpoint's was not"),
    ],
)
def test_keys_differing_by_the_ddp_prefix_are_named(make_runner, saved_from, restored_into, hint) -> None:
    torch.manual_seed(0)
    with make_runner() as runner:
        runner.register(model=ModuleProvider(saved_from(nn.Linear(3, 2))))
        runner.checkpoint(1).result()
    live = nn.Linear(3, 2)
    before = {k: v.clone() for k, v in live.state_dict().items()}
    runner = make_runner()
    runner.register(model=ModuleProvider(restored_into(live)))
    with pytest.raises(RestoreError, match="'module.' prefix") as failure:
        runner.restore("latest")
    assert hint in str(failure.value)
    assert all(torch.equal(live.state_dict()[k], v) for k, v in before.items())


def test_a_tensor_of_another_dtype_but_the_same_bytes_is_refused(make_runner) -> None:
    # A byte copy would take it and scramble the values.
    with make_runner() as runner:
        runner.register(t=TensorDictProvider({"w": torch.arange(2, dtype=torch.float64)}))
        runner.checkpoint(1).result()
    live = torch.full((4,), 7.0)
    runner = make_runner()
    runner.register(t=TensorDictProvider({"w": live}))
    with pytest.raises(RestoreError, match=r"w: checkpoint float64\[2\], live float32\[4\]"):
        runner.restore("latest")
    assert torch.equal(live, torch.full((4,), 7.0))
