"""``runner.register(model=model, optim=opt, sched=scheduler, sampler=s)``: plain training objects
are wrapped in the provider that fits, a plain optimizer is attached, explicit providers still work."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch

from tierstate import TierstateError
from tierstate.pipeline.registration import RegistrationError
from tierstate.pipeline.runner import Runner
from tierstate.providers import ModuleProvider, OptimizerProvider, StatefulProvider, TensorDictProvider, TensorItem


class Sampler:
    """A data sampler with DCP's Stateful protocol and nothing else."""

    def __init__(self) -> None:
        self.epoch, self.index, self.order = 0, 0, list(range(8))

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": self.epoch, "index": self.index, "order": list(self.order)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch, self.index, self.order = state["epoch"], state["index"], list(state["order"])


def _training() -> tuple[torch.nn.Module, torch.optim.Optimizer, Any, Sampler]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.BatchNorm1d(32), torch.nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    return model, opt, sched, Sampler()


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, sampler: Sampler) -> None:
    model(torch.randn(16, 32)).square().mean().backward()
    opt.step()
    opt.zero_grad()
    sched.step()
    sampler.index += 16
    sampler.epoch += sampler.index // 64
    sampler.order.reverse()


def _values(model: torch.nn.Module, opt: torch.optim.Optimizer, sched: Any, sampler: Sampler) -> dict[str, Any]:
    return {
        "model": {k: v.clone() for k, v in model.state_dict().items()},
        "moments": [s["exp_avg_sq"].clone() for s in opt.state.values()],
        "steps": [s["step"].clone() for s in opt.state.values()],
        "lr": [g["lr"] for g in opt.param_groups],
        "sched": sched.state_dict(),
        "sampler": sampler.state_dict(),
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    return (
        all(torch.equal(a["model"][k], b["model"][k]) for k in a["model"])
        and all(torch.equal(x, y) for x, y in zip(a["moments"], b["moments"], strict=True))
        and all(torch.equal(x, y) for x, y in zip(a["steps"], b["steps"], strict=True))
        and a["lr"] == b["lr"] and a["sched"] == b["sched"] and a["sampler"] == b["sampler"]
    )  # fmt: skip


def test_plain_objects_are_checkpointed_and_restored(make_runner: Callable[..., Runner]) -> None:
    model, opt, sched, sampler = _training()
    runner = make_runner()
    runner.register(model=model, optim=opt, sched=sched, sampler=sampler)
    kinds = {name: type(provider) for name, provider in runner.providers.children.items()}
    assert kinds == {
        "model": ModuleProvider, "optim": OptimizerProvider, "sched": StatefulProvider, "sampler": StatefulProvider,
    }  # fmt: skip
    for _ in range(3):
        _train_step(model, opt, sched, sampler)
    saved = _values(model, opt, sched, sampler)
    runner.checkpoint(3).result()
    for _ in range(2):
        _train_step(model, opt, sched, sampler)
    assert not _same(saved, _values(model, opt, sched, sampler))
    runner.restore(3)
    assert _same(saved, _values(model, opt, sched, sampler))


def test_a_plain_optimizer_is_attached_so_its_tensors_are_captured_lazily(make_runner: Callable[..., Runner]) -> None:
    model, opt, sched, sampler = _training()
    runner = make_runner()
    runner.register(model=model, optim=opt)
    assert runner.attached == (opt,)
    _train_step(model, opt, sched, sampler)
    handle = runner.checkpoint(1)
    # Only the BatchNorm buffers (running mean, var, batch count) are copied before checkpoint()
    # returns; parameters and AdamW moments wait for the attached optimizer's step pre-hook.
    assert handle.snapshot.tensors == 3 and handle.snapshot.uncovered == ()
    handle.result()


class OwnOptimizerProvider(StatefulProvider):
    """A user's provider of an optimizer, no subclass of OptimizerProvider: it offers the capability alone."""

    def __init__(self, opt: torch.optim.Optimizer) -> None:
        super().__init__(opt)
        self.opt = opt

    def describe(self) -> list[Any]:
        items = super().describe()
        for item in items:
            if isinstance(item, TensorItem):
                item.changes = "step"
        return items

    def optimizer_to_attach(self) -> torch.optim.Optimizer:
        return self.opt


def test_a_provider_that_owns_an_optimizer_has_it_attached_whatever_its_class(
    make_runner: Callable[..., Runner],
) -> None:
    model, opt, sched, sampler = _training()
    runner = make_runner()
    runner.register(model=model, optim=OwnOptimizerProvider(opt))
    assert runner.attached == (opt,)
    _train_step(model, opt, sched, sampler)
    saved = _values(model, opt, sched, sampler)
    handle = runner.checkpoint(1)
    assert handle.snapshot.tensors == 3 and handle.snapshot.uncovered == ()  # the moments wait for the step
    handle.result()
    _train_step(model, opt, sched, sampler)
    runner.restore(1)
    now = _values(model, opt, sched, sampler)
    assert _same({**now, **{k: saved[k] for k in ("model", "moments", "steps", "lr")}}, now)


def test_explicit_providers_keep_working(make_runner: Callable[..., Runner]) -> None:
    model, opt, sched, sampler = _training()
    runner = make_runner()
    provider = OptimizerProvider(opt)
    runner.register(model=ModuleProvider(model), optim=provider, sched=StatefulProvider(sched), sampler=sampler)
    assert runner.providers.children["optim"] is provider and runner.attached == (opt,)
    _train_step(model, opt, sched, sampler)
    saved = _values(model, opt, sched, sampler)
    runner.checkpoint(1).result()
    _train_step(model, opt, sched, sampler)
    runner.restore(1)
    assert _same(saved, _values(model, opt, sched, sampler))


def test_a_wrapped_optimizer_is_registered_and_attached_as_the_one_inside(make_runner: Callable[..., Runner]) -> None:
    accelerate = pytest.importorskip("accelerate")
    from accelerate.optimizer import AcceleratedOptimizer

    accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    runner = make_runner()
    runner.register(optim=AcceleratedOptimizer(opt))
    provider = runner.providers.children["optim"]
    assert isinstance(provider, OptimizerProvider) and provider.optimizer is opt
    assert runner.attached == (opt,)


def test_what_fits_no_provider_is_refused_and_nothing_is_registered(make_runner: Callable[..., Runner]) -> None:
    model, *_ = _training()
    runner = make_runner()
    with pytest.raises(RegistrationError, match=r"register\(step=\.\.\.\): an int cannot be checkpointed; pass an nn"):
        runner.register(model=model, step=5)
    assert dict(runner.providers.children) == {}  # not half registered
    with pytest.raises(TypeError, match=r"register\(counters=\.\.\.\): a dict .*ObjectProvider\(d\)"):
        runner.register(counters={"step": 1})
    with pytest.raises(TierstateError, match=r"TensorDictProvider"):
        runner.register(ema=torch.zeros(3))
    runner.register(model=model, ema=TensorDictProvider({"w": torch.zeros(3)}))
    assert set(runner.providers.children) == {"model", "ema"}
