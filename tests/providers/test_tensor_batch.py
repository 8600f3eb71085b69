"""``tensor_batch()`` of modules and optimizers lists exactly what ``describe()`` describes (the plan cache
relies on it to skip describing 10^5 items), and declines what it cannot list faithfully."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from tierstate.providers.items import ObjectItem, TensorBatch, TensorItem
from tierstate.providers.module import ModuleProvider
from tierstate.providers.optimizer import OptimizerProvider


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.BatchNorm1d(5), nn.Linear(5, 6), nn.Linear(6, 3))
    model[2].weight.requires_grad_(False)  # frozen: its changes are "never"
    return model


def _train(model: nn.Module, optimizer: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 6)).pow(2).mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.dtype, a.shape, a.stride(), a.storage_offset(), a.untyped_storage().data_ptr()) == (
        b.dtype, b.shape, b.stride(), b.storage_offset(), b.untyped_storage().data_ptr()
    )  # fmt: skip


def _assert_lists_describe(batch: TensorBatch, described: list[Any]) -> None:
    """The batch's tensors are describe()'s tensor items (same keys in order, memory and changes); its others
    are describe()'s remaining items, alike."""
    by_key = {item.key: item for item in described}
    assert len(batch.keys) == len(batch.tensors)
    assert sorted([*batch.keys, *(item.key for item in batch.others)]) == sorted(by_key)
    tensor_keys = [item.key for item in described if isinstance(item, TensorItem) and item.key in set(batch.keys)]
    assert list(batch.keys) == tensor_keys
    for index, (key, tensor) in enumerate(zip(batch.keys, batch.tensors, strict=True)):
        item = by_key[key]
        assert isinstance(item, TensorItem) and _same_memory(item.tensor, tensor), key
        assert batch.changes_of(index) == item.changes, key
    for other in batch.others:
        item = by_key[other.key]
        if isinstance(other, ObjectItem):
            assert isinstance(item, ObjectItem) and item.value == other.value, other.key
        else:
            assert isinstance(item, TensorItem) and _same_memory(item.tensor, other.tensor), other.key
            assert item.changes == other.changes


OPTIMIZERS: dict[str, Callable[[list[dict[str, Any]]], torch.optim.Optimizer]] = {
    "adam": lambda groups: torch.optim.Adam(groups, lr=1e-2),
    "adamw-tensor-lr": lambda groups: torch.optim.AdamW(groups, lr=torch.tensor(1e-2)),
    "sgd-momentum": lambda groups: torch.optim.SGD(groups, lr=0.1, momentum=0.9),
    "rmsprop": lambda groups: torch.optim.RMSprop(groups, lr=1e-2, centered=True),
    "adagrad": lambda groups: torch.optim.Adagrad(groups, lr=1e-2),
}


@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_an_optimizer_lists_what_it_describes(name: str) -> None:
    model = _model()
    groups = [
        {"params": [*model[0].parameters(), *model[2].parameters()]},  # model[2].weight frozen: no state
        {"params": list(model[3].parameters()), "weight_decay": 0.1},
    ]
    optimizer = OPTIMIZERS[name](groups)
    provider = OptimizerProvider(optimizer)
    before = provider.tensor_batch()  # no state yet (Adagrad's is made by its constructor)
    assert before is not None and len(before.keys) == sum(map(len, optimizer.state.values()))
    assert [other.key for other in before.others][-1] == "skeleton"
    _assert_lists_describe(before, provider.describe())
    for _ in range(2):
        _train(model, optimizer)
        batch = provider.tensor_batch()
        assert batch is not None and batch.keys
        _assert_lists_describe(batch, provider.describe())


def test_learning_rates_are_listed_afresh_and_the_state_layout_is_reused() -> None:
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.5)
    provider = OptimizerProvider(optimizer)
    _train(model, optimizer)
    first = provider.tensor_batch()
    scheduler.step()
    _train(model, optimizer)
    second = provider.tensor_batch()
    assert first is not None and second is not None
    assert second.keys is first.keys  # the same structure: keys not built again
    lrs = [other.value["param_groups"][0]["lr"] for other in (first.others[-1], second.others[-1])]  # type: ignore[union-attr]
    assert lrs == [1e-2, 5e-3]
    _assert_lists_describe(second, provider.describe())


def test_a_new_parameter_group_renames_the_state() -> None:
    model = _model()
    optimizer = torch.optim.Adam(model[3].parameters(), lr=1e-2)
    provider = OptimizerProvider(optimizer)
    _train(model, optimizer)
    first = provider.tensor_batch()
    optimizer.param_groups.insert(0, {**optimizer.param_groups[0], "params": list(model[0].parameters())})
    _train(model, optimizer)
    second = provider.tensor_batch()
    assert first is not None and second is not None and second.keys != first.keys
    _assert_lists_describe(second, provider.describe())


def test_optimizers_it_cannot_list_faithfully_are_described() -> None:
    model = _model()
    lbfgs = torch.optim.LBFGS(model.parameters())

    def closure() -> torch.Tensor:
        lbfgs.zero_grad()
        loss = model(torch.randn(4, 6)).pow(2).mean()
        loss.backward()
        return loss

    lbfgs.step(closure)
    assert OptimizerProvider(lbfgs).tensor_batch() is None  # int counters in its state

    hooked = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    _train(model, hooked)
    provider = OptimizerProvider(hooked)
    assert provider.tensor_batch() is not None
    hooked.register_state_dict_post_hook(lambda _opt, state: state)
    assert provider.tensor_batch() is None  # a hook may change what state_dict() returns


class _Counted(nn.Module):
    """A module with extra state (an object entry in its state dict)."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = nn.Linear(3, 3)
        self.calls = 0

    def get_extra_state(self) -> dict[str, int]:
        return {"calls": self.calls}

    def set_extra_state(self, state: dict[str, int]) -> None:
        self.calls = state["calls"]


def test_a_module_lists_what_it_describes() -> None:
    model = _model()
    tied = nn.Sequential(nn.Embedding(7, 4), nn.Linear(4, 7, bias=False))
    tied[1].weight = tied[0].weight  # one parameter under two keys
    for module in (model, tied, _Counted()):
        provider = ModuleProvider(module)
        batch = provider.tensor_batch()
        _assert_lists_describe(batch, provider.describe())
        assert all(tensor is value for tensor, value in zip(batch.tensors, _live_values(module), strict=True))


def _live_values(module: nn.Module) -> list[torch.Tensor]:
    return [v for v in module.state_dict(keep_vars=True).values() if isinstance(v, torch.Tensor)]


def test_an_unfrozen_parameter_is_no_longer_listed_as_never_changing() -> None:
    model = _model()
    provider = ModuleProvider(model)
    index = list(model.state_dict()).index("2.weight")
    assert provider.tensor_batch().changes_of(index) == "never"
    model[2].weight.requires_grad_(True)
    batch = provider.tensor_batch()
    assert batch.changes_of(index) == "step"
    _assert_lists_describe(batch, provider.describe())
