"""An attached optimizer's state taken as last listed at the request and listed again in the background
(pipeline/plan_cache.py ``Resolve``): every checkpoint still holds the state at its request, whatever the
optimizer does to its state tensors between checkpoints and whatever the trainer does right after one.

These runners leave the capture check off (it fingerprints every lazy tensor at the request, so it lists
everything on the trainer's thread, and nothing is deferred)."""

from __future__ import annotations

import copy
import threading
from collections.abc import Callable
from typing import Any

import pytest
import torch
from tied_lm import TiedLM

from tierstate import CheckpointFailed, ModuleProvider, OptimizerProvider, Runner

DEFERRED = {"policies__check_capture": False}
SLOW = {**DEFERRED, "host_cache__size": "2MiB", "chunk_size": "1MiB", "pipeline__stages__persist__bandwidth": "40MB"}


class OutOfPlaceMomentum(torch.optim.Optimizer):
    """Momentum SGD written as some hand-made optimizers are: a new momentum tensor at every step (the
    state's outline, its mapping and length, stays the same), and from ``counted_from`` on a step counter
    added to each parameter's state (new keys, same outline)."""

    def __init__(self, params: Any, lr: float = 0.1, counted_from: int = 3) -> None:
        super().__init__(params, {"lr": lr})
        self.steps = 0
        self.counted_from = counted_from

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        self.steps += 1
        for group in self.param_groups:
            for p in group["params"]:
                state = self.state[p]
                buf = state.get("buf")
                state["buf"] = p.grad.clone() if buf is None else buf * 0.9 + p.grad  # another object each step
                if self.steps >= self.counted_from:
                    state["count"] = torch.tensor(float(self.steps))
                p.add_(state["buf"], alpha=-group["lr"])


class WatchedOptimizer(OptimizerProvider):
    """An OptimizerProvider that records on which threads the runner lists its state in the background."""

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        super().__init__(optimizer)
        self.relisted_on: list[str] = []

    def relisted(self) -> Any:
        self.relisted_on.append(threading.current_thread().name)
        return super().relisted()


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))


def _train(model: torch.nn.Module, optimizer: torch.optim.Optimizer, seed: int) -> None:
    generator = torch.Generator().manual_seed(seed)
    optimizer.zero_grad(set_to_none=True)
    model(torch.randn(4, model[0].in_features, generator=generator)).square().mean().backward()
    optimizer.step()


def _state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return copy.deepcopy({"model": model.state_dict(), "optim": optimizer.state_dict()})


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def _restored(
    make_runner: Callable[..., Runner], optimizer_class: type, step: int, model: torch.nn.Module | None = None
) -> dict[str, Any]:
    """Step ``step`` restored into a fresh model (``_model``'s shape unless given) and optimizer, in another
    runner on the same tiers (the writer closed first: one open runner of a process writes a tier)."""
    model = _model(seed=99) if model is None else model
    optimizer = optimizer_class(model.parameters(), lr=0.1)
    with make_runner(**DEFERRED) as runner:
        runner.register(model=ModuleProvider(model), optim=OptimizerProvider(optimizer))
        runner.restore(step)
    return _state(model, optimizer)


def test_an_optimizer_that_replaces_its_state_tensors_is_saved_as_requested(
    make_runner: Callable[..., Runner],
) -> None:
    model = _model()
    optimizer = OutOfPlaceMomentum(model.parameters(), lr=0.1, counted_from=3)
    provider = WatchedOptimizer(optimizer)
    runner = make_runner(**DEFERRED)
    runner.register(model=ModuleProvider(model), optim=provider)
    expected, handles = {}, {}
    for step in range(1, 6):
        _train(model, optimizer, seed=step)
        handles[step] = runner.checkpoint(step)
        expected[step] = _state(model, optimizer)
        _train(model, optimizer, seed=100 + step)  # right after the request: waits for the capture
    for handle in handles.values():
        handle.result()
    # Listed in the background, never on the trainer's thread, once a plan existed to defer to.
    assert provider.relisted_on and all(name.startswith("tierstate") for name in provider.relisted_on)
    runner.close()
    names = {}
    for step in range(1, 6):
        got = _restored(make_runner, OutOfPlaceMomentum, step)
        assert _same(got, expected[step]), step
        names[step] = set(got["optim"]["state"][0])
    assert names[1] == {"buf"} and names[5] == {"buf", "count"}  # new keys: the skeleton named them


def test_load_state_dict_right_after_a_request_waits_for_its_capture(make_runner: Callable[..., Runner]) -> None:
    def big() -> torch.nn.Module:
        return torch.nn.Sequential(torch.nn.Linear(512, 1024), torch.nn.Linear(1024, 8))  # ~2 MB of parameters

    model = big()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-3)
    other_model = copy.deepcopy(model)
    other = torch.optim.Adam(other_model.parameters(), lr=1e-3)
    for seed in range(3):
        _train(other_model, other, seed=50 + seed)  # another run's optimizer state
    runner = make_runner(**SLOW)  # capture of ~6 MB through a 2 MiB cache drained at 40 MB/s: ~0.1 s
    runner.register(model=ModuleProvider(model), optim=OptimizerProvider(optimizer))
    _train(model, optimizer, seed=1)
    runner.checkpoint(1).result()
    _train(model, optimizer, seed=2)
    handle = runner.checkpoint(2)
    expected = _state(model, optimizer)
    optimizer.load_state_dict(other.state_dict())  # replaces every state tensor the plan took as listed
    assert handle.captured  # the load waited for the capture of the state it replaced
    handle.result()
    runner.close()
    got = _restored(make_runner, torch.optim.Adam, 2, big())
    assert _same(got, expected)
    assert not _same(got["optim"]["state"], other.state_dict()["state"])


def test_optimizer_state_that_comes_to_alias_a_parameter_fails_that_checkpoint_only(
    make_runner: Callable[..., Runner],
) -> None:
    class Aliasing(OutOfPlaceMomentum):
        """From its third step on, keeps a view of the parameter as its ``buf`` state: another tensor object
        on the parameter's memory, whose aliasing a reused plan does not check per checkpoint."""

        @torch.no_grad()
        def step(self, closure: Any = None) -> None:
            super().step(closure)
            if self.steps >= 3:
                for p in self.param_groups[0]["params"]:
                    self.state[p]["buf"] = p.view_as(p)

    model = _model()
    optimizer = Aliasing(model.parameters(), lr=0.1, counted_from=100)
    runner = make_runner(**DEFERRED)
    runner.register(model=ModuleProvider(model), optim=OptimizerProvider(optimizer))
    for step in (1, 2):
        _train(model, optimizer, seed=step)
        runner.checkpoint(step).result()
    _train(model, optimizer, seed=3)
    with pytest.raises(CheckpointFailed, match="optimizer state of 'optim' now shares memory"):
        runner.checkpoint(3).result()
    expected = _state(model, optimizer)
    runner.checkpoint(4).result()  # planned afresh, on the trainer's thread
    runner.close()
    got = _restored(make_runner, Aliasing, 4)
    assert _same(got["model"], expected["model"])
    assert all(_same(got["optim"]["state"][i]["buf"], expected["optim"]["state"][i]["buf"]) for i in range(4))
    assert runner.steps()["nvme"] == [1, 2, 4]


def test_a_state_value_that_stops_being_a_tensor_fails_that_checkpoint_clearly(
    make_runner: Callable[..., Runner],
) -> None:
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=0.1)
    runner = make_runner(**DEFERRED)
    runner.register(model=ModuleProvider(model), optim=OptimizerProvider(optimizer))
    _train(model, optimizer, seed=1)
    runner.checkpoint(1).result()
    _train(model, optimizer, seed=2)
    first = next(iter(optimizer.state.values()))
    first["step"] = 2.0  # a float where a tensor was, names and outline unchanged
    with pytest.raises(CheckpointFailed, match=r"optimizer 'optim': state 'state/0/step' is now a float"):
        runner.checkpoint(2).result()
    expected = _state(model, optimizer)
    runner.checkpoint(3).result()  # described item by item on the trainer's thread: the float is an object
    runner.close()
    got = _restored(make_runner, torch.optim.Adam, 3)
    assert _same(got["model"], expected["model"])
    assert float(got["optim"]["state"][0]["step"]) == 2.0  # Adam's load_state_dict makes it a tensor again
    for index, saved in expected["optim"]["state"].items():
        assert _same(got["optim"]["state"][index]["exp_avg_sq"], saved["exp_avg_sq"]), index


def test_a_tied_model_beside_an_optimizer_that_replaces_its_state_keeps_both_keys(
    make_runner: Callable[..., Runner],
) -> None:
    model = TiedLM(seed=0)
    optimizer = OutOfPlaceMomentum(model.parameters(), lr=0.1, counted_from=3)
    runner = make_runner(**DEFERRED)
    runner.register(model=ModuleProvider(model), optim=OptimizerProvider(optimizer))

    def train(seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        optimizer.zero_grad(set_to_none=True)
        model(torch.randint(0, 32, (4,), generator=generator)).square().mean().backward()
        optimizer.step()

    expected = {}
    for step in range(1, 5):  # from step 2 the plan is reused, and replanned in the background for new state
        train(seed=step)
        handle = runner.checkpoint(step)
        expected[step] = _state(model, optimizer)
        train(seed=100 + step)
        handle.result()
    runner.close()
    for step in range(1, 5):
        fresh = TiedLM(seed=99)
        fresh_optimizer = OutOfPlaceMomentum(fresh.parameters(), lr=0.1)
        with make_runner(**DEFERRED) as reader:
            reader.register(model=ModuleProvider(fresh), optim=OptimizerProvider(fresh_optimizer))
            reader.restore(step)
        assert _same(_state(fresh, fresh_optimizer), expected[step]), step
        assert fresh.head.weight is fresh.emb.weight


def test_optimizer_state_that_comes_to_be_a_parameter_itself_is_saved_as_its_alias(
    make_runner: Callable[..., Runner],
) -> None:
    class Holding(OutOfPlaceMomentum):
        """From its third step on, keeps the parameter object itself as its ``buf`` state (one tensor, two keys)."""

        @torch.no_grad()
        def step(self, closure: Any = None) -> None:
            super().step(closure)
            if self.steps >= 3:
                for p in self.param_groups[0]["params"]:
                    self.state[p]["buf"] = p

    model = _model()
    optimizer = Holding(model.parameters(), lr=0.1, counted_from=100)
    runner = make_runner(**DEFERRED)
    runner.register(model=ModuleProvider(model), optim=OptimizerProvider(optimizer))
    for step in (1, 2, 3):  # 3 replans the reused plan in the background: the state is the parameters now
        _train(model, optimizer, seed=step)
        runner.checkpoint(step).result()
    expected = _state(model, optimizer)
    runner.close()
    got = _restored(make_runner, Holding, 3)
    assert _same(got["model"], expected["model"])
    assert all(_same(got["optim"]["state"][i]["buf"], expected["optim"]["state"][i]["buf"]) for i in range(4))
