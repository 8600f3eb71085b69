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
from tierstate.providers.optimizer_batch import ListingOrderError


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


def _first_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    return next(iter(optimizer.state.values()))


def _replace_a_moment(optimizer: torch.optim.Optimizer) -> None:
    state = _first_state(optimizer)
    state["exp_avg"] = state["exp_avg"].clone()  # a new object in the same dict


def _reorder_names(optimizer: torch.optim.Optimizer) -> None:
    state = _first_state(optimizer)
    state["step"] = state.pop("step")  # the same names, in another order


def _rename(optimizer: torch.optim.Optimizer) -> None:
    state = _first_state(optimizer)
    state["momentum"] = state.pop("exp_avg")


def _add_name(optimizer: torch.optim.Optimizer) -> None:
    _first_state(optimizer)["max_exp_avg_sq"] = torch.zeros(5)


def _reset_a_state(optimizer: torch.optim.Optimizer) -> None:
    optimizer.state[next(iter(optimizer.state))] = {}


@pytest.mark.parametrize("change", [_replace_a_moment, _reorder_names, _rename, _add_name, _reset_a_state])
def test_every_change_to_an_optimizers_state_is_listed(change: Callable[[torch.optim.Optimizer], None]) -> None:
    """Adam's states share their names, so its values are taken by name: any change of name, count or object
    in any parameter's state must still come out as ``describe()`` has it, each tensor under its own key."""
    model = _model()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    provider = OptimizerProvider(optimizer)
    _train(model, optimizer)
    first = provider.tensor_batch()
    _train(model, optimizer)
    again = provider.tensor_batch()
    assert first is not None and again is not None and again.keys is first.keys
    change(optimizer)
    batch = provider.tensor_batch()
    assert batch is not None
    described = {item.key: item.tensor for item in provider.describe() if isinstance(item, TensorItem)}
    listed = dict(zip(batch.keys, batch.tensors, strict=True))
    assert sorted(listed) == sorted(k for k in described if k.startswith("state/"))
    assert all(_same_memory(tensor, described[key]) for key, tensor in listed.items())


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
    assert ModuleProvider(model).tensor_batch().changes_of(list(model.state_dict()).index("2.weight")) == "any"
    provider = ModuleProvider(model, frozen="never")  # declared: lazy while frozen
    index = list(model.state_dict()).index("2.weight")
    assert provider.tensor_batch().changes_of(index) == "never"
    model[2].weight.requires_grad_(True)
    batch = provider.tensor_batch()
    assert batch.changes_of(index) == "step"
    _assert_lists_describe(batch, provider.describe())


# --- a module's listing reused while nothing state_dict() reads has changed (providers/module_layout.py) ---


def _set_param(model: nn.Module) -> None:
    model[0].weight = nn.Parameter(torch.randn(5, 6))


def _set_param_behind_setattr(model: nn.Module) -> None:
    vars(model[0])["_parameters"]["bias"] = nn.Parameter(torch.zeros(5))  # as FSDP2 swaps in unsharded ones


def _delete_param(model: nn.Module) -> None:
    del model[3].bias


def _new_buffer(model: nn.Module) -> None:
    model[3].register_buffer("scale", torch.ones(3))


def _buffer_made_non_persistent(model: nn.Module) -> None:
    model[1].register_buffer("running_var", model[1].running_var, persistent=False)


def _swap_child(model: nn.Module) -> None:
    model[2] = nn.Linear(5, 6)


def _parametrized(model: nn.Module) -> None:
    nn.utils.parametrize.register_parametrization(model[0], "weight", nn.Identity())


EXTRA = torch.zeros(2)


def _state_dict_hook(model: nn.Module) -> None:
    def add(module: nn.Module, state: dict[str, Any], prefix: str, _meta: Any) -> None:
        state[prefix + "added"] = EXTRA

    model[3]._register_state_dict_hook(add)


def _instance_override(model: nn.Module) -> None:
    original = model[1].state_dict

    def listing(*, destination: dict[str, Any], prefix: str, keep_vars: bool) -> dict[str, Any]:
        original(destination=destination, prefix=prefix, keep_vars=keep_vars)
        destination[prefix + "added"] = EXTRA
        return destination

    model[1].state_dict = listing


@pytest.mark.parametrize(
    "change",
    [_set_param, _set_param_behind_setattr, _delete_param, _new_buffer, _buffer_made_non_persistent, _swap_child,
     _parametrized, _state_dict_hook, _instance_override],
)  # fmt: skip
def test_a_module_is_listed_again_after_any_change_state_dict_would_show(change: Callable[[nn.Module], None]) -> None:
    model = _model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    provider = ModuleProvider(model)
    first = provider.tensor_batch()
    _train(model, optimizer)  # values change in place: the very same listing
    again = provider.tensor_batch()
    assert again.keys is first.keys and again.tensors is first.tensors
    change(model)
    batch = provider.tensor_batch()
    live = model.state_dict(keep_vars=True)
    assert list(batch.keys) == list(live)
    assert change not in (_state_dict_hook, _instance_override) or any(k.endswith("added") for k in live)
    assert all(tensor is value for tensor, value in zip(batch.tensors, live.values(), strict=True))
    _assert_lists_describe(batch, provider.describe())


def test_an_optimizer_skeleton_restated_before_any_listing_is_refused_naming_the_order() -> None:
    weight = nn.Parameter(torch.ones(3))
    provider = OptimizerProvider(torch.optim.SGD([weight], lr=0.1))
    with pytest.raises(ListingOrderError, match=r"restated: no listing yet .* tensor_batch\(\), then"):
        provider.restated("skeleton", {"param_groups": []})
    listed = provider.tensor_batch()
    assert listed is not None
    assert provider.restated("skeleton", {"param_groups": [], "state": None})["state"] == {}
