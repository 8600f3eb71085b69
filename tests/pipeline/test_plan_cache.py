"""A reused plan (pipeline/plan_cache.py) saves exactly what a fresh one would, whatever the trainer
does to its tensors between and right after checkpoints: changes values, swaps tensors, adds keys,
changes a tensor's shape or dtype in place."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from tied_lm import TiedLM

from tierstate import CheckpointFailed, ModuleProvider, ObjectProvider, OptimizerProvider, Runner, TensorDictProvider
from tierstate.providers.items import Item

SLOW = {"host_cache__size": "2MiB", "chunk_size": "1MiB", "pipeline__stages__persist__bandwidth": "40MB"}


def _tensors(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return {f"t{i}": torch.randn(16 + i % 3, generator=generator) for i in range(n)}


def _restored(runner: Runner, tensors: dict[str, torch.Tensor], step: int) -> dict[str, torch.Tensor]:
    for t in tensors.values():
        t.zero_()
    runner.restore(step)
    return {k: t.clone() for k, t in tensors.items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]) for k in a)


def test_a_reused_plan_saves_the_values_of_each_request(make_runner: Callable[..., Runner]) -> None:
    tensors = _tensors(3000)
    big = {"big": torch.randn(1 << 20)}  # 4 MiB: capture runs long behind the paced persist
    runner = make_runner(**SLOW)
    runner.register(small=TensorDictProvider(tensors), big=TensorDictProvider(big), step=ObjectProvider(dict))
    expected = {}
    for step in range(1, 4):
        for t in [*tensors.values(), *big.values()]:
            t.add_(1.0)
        expected[step] = {k: t.clone() for k, t in tensors.items()}
        handle = runner.checkpoint(step)
        for t in [*tensors.values(), *big.values()]:  # right after the request, before the capture
            t.mul_(-3.0)
        handle.result()
        assert handle.stats.eager.tensors == 3001
    for step in range(1, 4):
        assert _equal(_restored(runner, tensors, step), expected[step])


def test_swapped_added_and_reshaped_tensors_are_planned_afresh(make_runner: Callable[..., Runner]) -> None:
    tensors = _tensors(50)
    runner = make_runner()
    runner.register(state=TensorDictProvider(tensors))
    runner.checkpoint(1).result()
    tensors["t3"] = torch.randn(7)  # another object under a key
    tensors["new"] = torch.arange(5.0)  # a new key
    tensors["t4"].data = torch.randn(2, 9)  # the same object, another shape
    tensors["t5"].resize_(40).fill_(2.5)  # the same object, resized in place
    expected = {k: t.clone() for k, t in tensors.items()}
    runner.checkpoint(2).result()
    assert _equal(_restored(runner, tensors, 2), expected)


def test_a_dtype_narrowed_in_place_never_saves_a_wrong_dtype(make_runner: Callable[..., Runner]) -> None:
    tensors = _tensors(20)
    runner = make_runner()
    runner.register(state=TensorDictProvider(tensors))
    runner.checkpoint(1).result()
    tensors["t2"].data = tensors["t2"].data.half()  # stack would widen it back to float32 unseen
    with pytest.raises(CheckpointFailed, match="changed in place"):
        runner.checkpoint(2).result()
    expected = {k: t.clone() for k, t in tensors.items()}
    runner.checkpoint(3).result()  # planned afresh
    assert _equal(_restored(runner, tensors, 3), expected)
    assert runner.steps()["nvme"] == [1, 3]


def test_a_reused_plan_mixes_with_described_providers(make_runner: Callable[..., Runner]) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.BatchNorm1d(256))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    ema = _tensors(200, seed=1)
    runner = make_runner(**SLOW)
    runner.register(model=model, optim=opt, ema=TensorDictProvider(ema))

    def train() -> None:
        model(torch.randn(8, 256)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        for t in ema.values():
            t.mul_(0.5)

    expected = {}
    for step in range(1, 4):
        train()
        expected[step] = ({k: v.clone() for k, v in model.state_dict().items()}, {k: t.clone() for k, t in ema.items()})
        handle = runner.checkpoint(step)
        train()  # BatchNorm statistics and the EMA change at once; the optimizer step waits for the capture
        handle.result()
    for step in range(1, 4):
        train()
        assert _equal(_restored(runner, ema, step), expected[step][1])
        assert _equal(dict(model.state_dict()), expected[step][0])


class _Counted:
    """Mixed into a real provider: counts how often the runner describes it item by item."""

    described = 0

    def describe(self) -> list[Item]:
        self.described += 1
        return super().describe()  # type: ignore[misc]


class _CountedModule(_Counted, ModuleProvider):
    pass


class _CountedOptimizer(_Counted, OptimizerProvider):
    pass


class _CountedDict(_Counted, TensorDictProvider):
    pass


def _state_of(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, object]:
    """Model tensors, optimizer state tensors and learning rates, copied."""
    state: dict[str, object] = {f"model/{k}": v.clone() for k, v in model.state_dict().items()}
    for index, (param, values) in enumerate(optimizer.state.items()):
        state |= {f"optim/{index}/{name}/{id(param)}": v.clone() for name, v in values.items()}
    state |= {f"lr/{i}": group["lr"] for i, group in enumerate(optimizer.param_groups)}
    return state


def _same_state(a: dict[str, object], b: dict[str, object]) -> bool:
    def equal(x: object, y: object) -> bool:
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            return x.dtype == y.dtype and torch.equal(x, y)
        return x == y

    return a.keys() == b.keys() and all(equal(a[k], b[k]) for k in a)


def _saved_between_steps(
    runner: Runner, train: Callable[[], None], model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int
) -> dict[int, dict[str, object]]:
    """Train, checkpoint, train again at once (the optimizer step waits for the lazy capture), ``steps``
    times; the state each checkpoint was requested at."""
    expected = {}
    for step in range(1, steps + 1):
        train()
        expected[step] = _state_of(model, opt)
        handle = runner.checkpoint(step)
        train()
        handle.result()
    return expected


def test_a_model_and_its_optimizer_are_described_once_and_saved_as_requested(
    make_runner: Callable[..., Runner],
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.BatchNorm1d(64), torch.nn.Linear(64, 8))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    runner = make_runner(**SLOW)
    module, optim = _CountedModule(model), _CountedOptimizer(opt)
    runner.register(model=module, optim=optim, sched=scheduler)

    def train() -> None:
        model(torch.randn(8, 64)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        scheduler.step()

    expected = _saved_between_steps(runner, train, model, opt, 4)  # BatchNorm buffers change at once
    assert (module.described, optim.described) == (1, 1)  # on the first request; later ones reused the plan
    for step in range(1, 5):
        runner.restore(step)
        assert _same_state(_state_of(model, opt), expected[step]), step
    for step in (5, 6):  # the restore read into the very tensors the plan holds (tiers/reading/livefill.py): reused
        runner.checkpoint(step).result()
    assert (module.described, optim.described) == (1, 1)
    opt.load_state_dict(opt.state_dict())  # a new state mapping holding the very same tensors
    runner.checkpoint(7).result()
    assert (module.described, optim.described) == (1, 1)


def test_a_parameter_unfrozen_for_an_unattached_optimizer_is_copied_at_once(
    make_runner: Callable[..., Runner],
) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 4))
    model[1].weight.requires_grad_(False)  # frozen: planned as never changing, captured lazily
    attached = torch.optim.SGD(model[0].parameters(), lr=0.1)
    runner = make_runner(**SLOW)
    runner.register(model=model, optim=attached)

    def loss() -> torch.Tensor:
        return model(torch.randn(8, 32)).pow(2).mean()

    loss().backward()
    attached.step()
    runner.checkpoint(1).result()
    model[1].weight.requires_grad_(True)
    other = torch.optim.SGD([model[1].weight], lr=10.0)  # not attached: nothing waits for the capture
    loss().backward()
    expected = model[1].weight.detach().clone()
    handle = runner.checkpoint(2)
    other.step()  # right after the request
    handle.result()
    model[1].weight.data.zero_()
    runner.restore(2)
    assert torch.equal(model[1].weight.detach(), expected)


def test_a_parameter_given_new_memory_is_saved_from_it(make_runner: Callable[..., Runner]) -> None:
    model = torch.nn.Linear(16, 16)
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    runner = make_runner()
    runner.register(model=model, optim=opt)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    runner.checkpoint(1).result()
    runner.checkpoint(2).result()  # the plan is reused from here on
    model.weight.data = torch.randn(16, 16)  # the same Parameter object, other memory
    expected = model.weight.detach().clone()
    runner.checkpoint(3).result()
    model.weight.data.zero_()
    runner.restore(3)
    assert torch.equal(model.weight.detach(), expected)


def test_a_strided_parameter_in_a_reused_plan_saves_its_values(make_runner: Callable[..., Runner]) -> None:
    model = torch.nn.Module()
    model.weight = torch.nn.Parameter(torch.randn(64, 32).t())  # not contiguous: capture copies it strided
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    runner = make_runner()
    runner.register(model=model, optim=opt)
    for step in (1, 2, 3):  # 2 and 3 reuse the plan, which holds the parameter itself
        model.weight.grad = torch.ones(32, 64)
        opt.step()
        expected = model.weight.detach().clone()
        runner.checkpoint(step).result()
    model.weight.data.zero_()
    runner.restore(3)
    assert torch.equal(model.weight.detach(), expected)


def test_tied_weights_reuse_the_plan_and_restore_still_tied(make_runner: Callable[..., Runner]) -> None:
    model = TiedLM(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    runner = make_runner(**SLOW)
    module, optim = _CountedModule(model), _CountedOptimizer(opt)
    runner.register(model=module, optim=optim)

    def train() -> None:
        model(torch.randint(0, 32, (8,))).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()

    expected = _saved_between_steps(runner, train, model, opt, 4)
    assert (module.described, optim.described) == (1, 1)  # planned once: the tie is one object under two keys
    for step in range(1, 5):
        runner.restore(step)
        assert _same_state(_state_of(model, opt), expected[step]), step
        assert model.head.weight is model.emb.weight


def test_distinct_views_of_one_memory_are_planned_at_every_checkpoint(make_runner: Callable[..., Runner]) -> None:
    base = torch.randn(64)
    tensors = {"a": base, "b": base[:]}  # two objects, one memory: their alias is not checked per checkpoint
    runner = make_runner()
    provider = _CountedDict(tensors)
    runner.register(state=provider)
    runner.checkpoint(1).result()
    runner.checkpoint(2).result()
    tensors["b"].data = torch.arange(64.0)  # the same object "b", its own memory now: no longer an alias
    expected = {k: t.clone() for k, t in tensors.items()}
    runner.checkpoint(3).result()
    assert provider.described >= 3  # at every checkpoint (a reused plan describes once)
    assert _equal(_restored(runner, tensors, 3), expected)

