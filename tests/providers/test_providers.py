"""Providers: describe -> state as the pipeline would read it back -> change the live objects -> restore."""

from __future__ import annotations

import copy
import random
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np
import pytest
import torch
from torch import nn

from tierstate.providers import (
    TENSOR_MARKER,
    CompositeProvider,
    ModuleProvider,
    ObjectItem,
    ObjectProvider,
    OptimizerProvider,
    RestoreError,
    RNGProvider,
    StatefulProvider,
    StateProvider,
    TensorDictProvider,
    TensorItem,
    join_tensors,
    split_tensors,
)
from tierstate.providers.optimizer import ParamIds
from tierstate.tiers.format.objcodec import decode_object, encode_object


def read_back(items: Iterable[TensorItem | ObjectItem], serializer: str | None = None) -> dict[str, Any]:
    """What restore receives after a checkpoint: tensors copied, objects through their encoding."""
    state: dict[str, Any] = {}
    for item in items:
        if isinstance(item, TensorItem):
            state[item.key] = item.tensor.clone()
        else:
            codec = serializer or item.serializer
            state[item.key] = decode_object(encode_object(item.value, codec), codec)
    return state


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Tanh(), nn.Linear(8, 1))


def make_batches(n: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    gen = torch.Generator().manual_seed(1234)
    return [(torch.randn(16, 4, generator=gen), torch.randn(16, 1, generator=gen)) for _ in range(n)]


def train(model: nn.Module, opt: torch.optim.Optimizer, batches: list, scheduler: Any = None) -> list[float]:
    lrs = []
    for x, y in batches:
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        lrs.append(opt.param_groups[0]["lr"])
    return lrs


def assert_same_tensors(a: Mapping[str, torch.Tensor], b: Mapping[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert torch.equal(a[key], b[key]), key


def optimizer_tensors(opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    return {item.key: item.tensor for item in OptimizerProvider(opt).describe() if isinstance(item, TensorItem)}


OPTIMIZERS: dict[str, Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer]] = {
    "adam": lambda p: torch.optim.Adam(p, lr=1e-2),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.95)),
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=1e-2, momentum=0.9, nesterov=True),
}


# --- split_tensors / join_tensors -------------------------------------------------------------------------------


def test_split_references_tensors_and_rebuilds_structure() -> None:
    exp_avg, step, extra = torch.randn(3), torch.tensor(2.0), torch.arange(4)
    state = {"state": {0: {"exp_avg": exp_avg, "step": step}}, "groups": [{"betas": (0.9, 0.99)}], "t": (extra, 3)}
    skeleton, items = split_tensors(state)
    by_key = {item.key: item.tensor for item in items}
    assert by_key.keys() == {"state/0/exp_avg", "state/0/step", "t/0"}
    assert by_key["state/0/exp_avg"] is exp_avg and by_key["t/0"] is extra  # referenced, not cloned
    assert skeleton["state"][0]["step"] == {TENSOR_MARKER: "state/0/step"}
    assert type(skeleton["t"]) is tuple and type(skeleton["groups"][0]["betas"]) is tuple
    joined = join_tensors(skeleton, by_key)
    assert joined["state"][0]["exp_avg"] is exp_avg and joined["t"] == (extra, 3)
    assert joined["groups"] == [{"betas": (0.9, 0.99)}]


def test_split_prefix_and_invalid_keys() -> None:
    t = torch.zeros(1)
    assert [item.key for item in split_tensors({"a": t}, "opt")[1]] == ["opt/a"]
    assert split_tensors(t, "root")[0] == {TENSOR_MARKER: "root"}
    with pytest.raises(ValueError, match="key_prefix"):
        split_tensors(t)
    with pytest.raises(ValueError, match="a/b"):
        split_tensors({"a/b": t, "a": {"b": t}})
    with pytest.raises(ValueError, match="reserved"):
        split_tensors({"x": {TENSOR_MARKER: "y"}})


def test_skeleton_is_isolated_from_later_mutation() -> None:
    class Box:
        def __init__(self) -> None:
            self.items = [1]

    live = {"lrs": [0.1, 0.2], "box": Box(), "t": torch.ones(2)}
    skeleton, _ = split_tensors(live)
    live["lrs"][0] = 99.0
    live["box"].items.append(2)
    assert skeleton["lrs"] == [0.1, 0.2]
    assert skeleton["box"] is not live["box"] and skeleton["box"].items == [1]


def test_join_names_every_missing_tensor() -> None:
    skeleton, _ = split_tensors({"a": torch.ones(1), "b": [torch.ones(1)]})
    with pytest.raises(RestoreError, match=r"opt: checkpoint lacks 2 tensor\(s\): a, b/0"):
        join_tensors(skeleton, {}, owner="opt")


# --- ModuleProvider ---------------------------------------------------------------------------------------------


def test_module_describe_references_live_storage() -> None:
    model = make_model(0)
    items = ModuleProvider(model).describe()
    assert [item.key for item in items] == list(model.state_dict())
    assert "1.num_batches_tracked" in {item.key for item in items}
    weight = next(item for item in items if item.key == "0.weight")
    assert weight.tensor.data_ptr() == model[0].weight.data_ptr()


def test_module_restore_copies_in_place() -> None:
    model = make_model(0)
    provider = ModuleProvider(model)
    model.train()
    model(torch.randn(16, 4))  # moves BatchNorm running stats and its counter
    state = read_back(provider.describe())
    params_before = [(p, p.data_ptr()) for p in model.parameters()]
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    model(torch.randn(16, 4))
    provider.restore(state)
    assert_same_tensors(model.state_dict(), state)
    assert [(p, p.data_ptr()) for p in model.parameters()] == params_before


def test_module_restore_into_fresh_model() -> None:
    state = read_back(ModuleProvider(make_model(0)).describe())
    fresh = make_model(1)
    assert not torch.equal(fresh[0].weight, state["0.weight"])
    ModuleProvider(fresh).restore(state)
    assert_same_tensors(fresh.state_dict(), state)


def test_module_tied_parameters_appear_under_each_name() -> None:
    model = nn.Sequential(nn.Embedding(5, 3), nn.Linear(3, 5, bias=False))
    model[1].weight = model[0].weight
    items = {item.key: item.tensor for item in ModuleProvider(model).describe()}
    assert items["0.weight"].data_ptr() == items["1.weight"].data_ptr()


def test_module_extra_state_is_an_object_item() -> None:
    class Counted(nn.Linear):
        def __init__(self) -> None:
            super().__init__(2, 2)
            self.calls = {"n": 0}

        def get_extra_state(self) -> dict:
            return self.calls

        def set_extra_state(self, state: dict) -> None:
            self.calls = state

    module = Counted()
    module.calls["n"] = 5
    items = ModuleProvider(module).describe()
    extra = next(item for item in items if isinstance(item, ObjectItem))
    assert extra.key == "_extra_state" and extra.value == {"n": 5}
    module.calls["n"] = 6  # after describe: must not leak into the snapshot
    state = read_back(items)
    ModuleProvider(module).restore(state)
    assert module.calls == {"n": 5}


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda s: s.pop("0.bias"), r"lacks 1 item\(s\): 0\.bias"),
        (lambda s: s.update({"9.weight": torch.zeros(1)}), r"the module lacks: 9\.weight"),
        (lambda s: s.update({"3.weight": torch.zeros(2, 8)}), r"3\.weight: checkpoint float32\[2, 8\], live"),
    ],
)
def test_module_restore_errors_name_the_keys(edit: Callable[[dict], Any], message: str) -> None:
    model = make_model(0)
    state = read_back(ModuleProvider(model).describe())
    edit(state)
    with pytest.raises(RestoreError, match=message):
        ModuleProvider(model).restore(state)


# --- OptimizerProvider ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_optimizer_restore_into_fresh_optimizer_continues_bit_exactly(name: str) -> None:
    batches = make_batches(6)
    model = make_model(0)
    opt = OPTIMIZERS[name](model.parameters())
    train(model, opt, batches[:3])
    provider = CompositeProvider(model=ModuleProvider(model), optim=OptimizerProvider(opt))
    state = read_back(provider.describe())
    train(model, opt, batches[3:])  # the uninterrupted run

    fresh_model = make_model(1)
    fresh_opt = OPTIMIZERS[name](fresh_model.parameters())
    assert not fresh_opt.state
    CompositeProvider(model=ModuleProvider(fresh_model), optim=OptimizerProvider(fresh_opt)).restore(state)
    train(fresh_model, fresh_opt, batches[3:])

    assert_same_tensors(fresh_model.state_dict(), model.state_dict())
    assert_same_tensors(optimizer_tensors(fresh_opt), optimizer_tensors(opt))


def test_optimizer_items_and_snapshot_isolation() -> None:
    model = make_model(0)
    opt = torch.optim.Adam(model.parameters(), lr=0.5)
    train(model, opt, make_batches(1))
    items = OptimizerProvider(opt).describe()
    tensors = {item.key: item.tensor for item in items if isinstance(item, TensorItem)}
    first = next(iter(model.parameters()))
    assert tensors["state/0/exp_avg"] is opt.state[first]["exp_avg"]
    assert tensors["state/0/step"].dim() == 0
    skeleton = next(item for item in items if item.key == "skeleton").value
    opt.param_groups[0]["lr"] = 123.0
    opt.param_groups[0]["betas"] = (0.1, 0.2)
    assert skeleton["param_groups"][0]["lr"] == 0.5 and skeleton["param_groups"][0]["betas"] == (0.9, 0.999)


def test_optimizer_does_not_keep_the_restored_buffers() -> None:
    model = make_model(0)
    opt = torch.optim.Adam(model.parameters())
    train(model, opt, make_batches(1))
    state = read_back(OptimizerProvider(opt).describe())
    fresh = torch.optim.Adam(make_model(1).parameters())
    OptimizerProvider(fresh).restore(state)
    inputs = {v.data_ptr() for v in state.values() if isinstance(v, torch.Tensor)}
    assert all(v.data_ptr() not in inputs for s in fresh.state.values() for v in s.values())
    assert_same_tensors(optimizer_tensors(fresh), optimizer_tensors(opt))


def test_param_ids_answer_membership_like_the_list_they_are() -> None:
    ids = ParamIds([3, 1, 2])
    assert ids == [3, 1, 2] and 1 in ids and 4 not in ids and "1" not in ids
    ids.append(4)  # contents changed after a lookup: answered from the new contents
    assert 4 in ids
    copied = copy.deepcopy(ids)  # what Optimizer.load_state_dict does to the saved groups
    assert type(copied) is ParamIds and copied == [3, 1, 2, 4] and 4 in copied and 5 not in copied
    assert [1] in ParamIds([[1], 2])  # unhashable: compared by a scan


def test_a_restored_optimizer_keeps_its_own_lists_of_live_parameters() -> None:
    model = make_model(0)
    opt = torch.optim.AdamW(
        [{"params": list(model.parameters())[:2]}, {"params": list(model.parameters())[2:], "lr": 0.1}]
    )
    train(model, opt, make_batches(2))
    state = read_back(OptimizerProvider(opt).describe())
    fresh_model = make_model(1)
    groups = [list(fresh_model.parameters())[:2], list(fresh_model.parameters())[2:]]
    fresh = torch.optim.AdamW([{"params": groups[0]}, {"params": groups[1], "lr": 0.5}])
    OptimizerProvider(fresh).restore(state)
    assert [type(group["params"]) for group in fresh.param_groups] == [list, list]
    assert all(a is b for group, live in zip(fresh.param_groups, groups, strict=True)
               for a, b in zip(group["params"], live, strict=True))  # fmt: skip
    assert [group["lr"] for group in fresh.param_groups] == [group["lr"] for group in opt.param_groups]
    assert_same_tensors(optimizer_tensors(fresh), optimizer_tensors(opt))


def test_optimizer_restore_errors() -> None:
    model = make_model(0)
    opt = torch.optim.Adam(model.parameters())
    train(model, opt, make_batches(1))
    state = read_back(OptimizerProvider(opt).describe())
    with pytest.raises(RestoreError, match="state/0/exp_avg"):
        OptimizerProvider(opt).restore({k: v for k, v in state.items() if k != "state/0/exp_avg"})
    with pytest.raises(RestoreError, match="skeleton"):
        OptimizerProvider(opt).restore({k: v for k, v in state.items() if k != "skeleton"})
    other = torch.optim.Adam([nn.Parameter(torch.zeros(1))])
    with pytest.raises(RestoreError, match="load_state_dict failed"):
        OptimizerProvider(other).restore(state)
    with pytest.raises(TypeError):
        OptimizerProvider(model)


# --- StatefulProvider: schedulers, GradScaler -------------------------------------------------------------------


SCHEDULERS: dict[str, Callable[[torch.optim.Optimizer], Any]] = {
    "onecycle": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=10),
    "cosine": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, T_max=7, eta_min=1e-4),
}


@pytest.mark.parametrize("name", SCHEDULERS)
def test_scheduler_resumes_the_same_schedule(name: str) -> None:
    batches = make_batches(8)

    def setup(seed: int) -> tuple[nn.Module, torch.optim.Optimizer, Any, CompositeProvider]:
        model = make_model(seed)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        sched = SCHEDULERS[name](opt)
        providers = CompositeProvider(model=ModuleProvider(model), optim=OptimizerProvider(opt))
        return model, opt, sched, providers.add("sched", StatefulProvider(sched))

    model, opt, sched, providers = setup(0)
    train(model, opt, batches[:4], sched)
    state = read_back(providers.describe())
    expected_lrs = train(model, opt, batches[4:], sched)

    model2, opt2, sched2, providers2 = setup(1)
    providers2.restore(state)
    assert sched2.get_last_lr() == state["sched/skeleton"]["_last_lr"]
    assert train(model2, opt2, batches[4:], sched2) == expected_lrs
    assert_same_tensors(model2.state_dict(), model.state_dict())


def test_grad_scaler_round_trip() -> None:
    try:
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
    except (TypeError, RuntimeError, AttributeError) as exc:
        pytest.skip(f"GradScaler on CPU not supported here: {exc}")
    model = make_model(0)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for x, y in make_batches(2):
        opt.zero_grad()
        scaler.scale(nn.functional.mse_loss(model(x), y)).backward()
        scaler.step(opt)
        scaler.update()
    provider = StatefulProvider(scaler)
    snapshot = scaler.state_dict()
    state = read_back(provider.describe())
    scaler.update(new_scale=3.0)
    assert scaler.get_scale() == 3.0
    provider.restore(state)
    assert scaler.get_scale() == snapshot["scale"] == 4096.0
    assert scaler.state_dict() == snapshot


def test_stateful_provider_rejects_objects_without_state_dict() -> None:
    with pytest.raises(TypeError, match="state_dict"):
        StatefulProvider(object())


# --- RNGProvider ------------------------------------------------------------------------------------------------


def draws() -> tuple[float, float, list[float]]:
    return random.random(), float(np.random.rand()), torch.rand(3).tolist()


@pytest.mark.parametrize("serializer", [None, "json"])
def test_rng_restore_repeats_draws(serializer: str | None) -> None:
    provider = RNGProvider(cuda=False)
    random.gauss(0, 1)  # leaves a cached gaussian in random's state
    np.random.standard_normal()
    items = provider.describe()
    state = read_back(items, serializer)
    expected = draws()
    assert draws() != expected  # the generators moved on
    provider.restore(state)
    assert draws() == expected
    assert {item.key for item in items} == {"python", "numpy", "torch"}


def test_rng_describe_copies_state() -> None:
    item = next(item for item in RNGProvider(cuda=False).describe() if item.key == "torch")
    before = item.tensor.clone()
    torch.rand(10)
    assert torch.equal(item.tensor, before)


def test_rng_restore_takes_a_view_with_a_storage_offset() -> None:
    # A resharded restore hands the state over as a view into a larger buffer; torch's own
    # set_rng_state would read from the storage's start (a wrong state, or a crash).
    provider = RNGProvider(cuda=False)
    state = read_back(provider.describe(), None)
    saved = state["torch"]
    buffer = torch.zeros(saved.numel() + 1, dtype=torch.uint8)
    buffer[1:] = saved
    expected = draws()
    provider.restore({**state, "torch": buffer[1:]})
    assert draws() == expected


def test_ranks_without_saved_state_derive_streams_of_their_own() -> None:
    """Saved on 1 rank, restored on 3: ranks 1 and 2 derive their generators from rank 0's state and their
    rank, so no two ranks draw alike (every generator: python, numpy, torch), and a second restore of the
    same checkpoint draws the same again."""
    provider = RNGProvider(cuda=False)
    saved = provider.digest()
    rank0 = draws()
    by_rank = {}
    for rank in (1, 2, 1):
        provider.derive(saved, rank)
        by_rank.setdefault(rank, []).append(draws())
    assert by_rank[1][0] == by_rank[1][1]  # the same on every restore of that checkpoint
    streams = [rank0, by_rank[1][0], by_rank[2][0]]
    for generator in range(3):
        assert len({repr(stream[generator]) for stream in streams}) == 3, generator
    with pytest.raises(ValueError, match="'derive', 'keep' or 'error'"):
        RNGProvider(cuda=False, missing_rank="copy")  # type: ignore[arg-type]


def test_rng_refuses_a_state_of_the_wrong_kind() -> None:
    state = read_back(RNGProvider(cuda=False).describe(), None)
    with pytest.raises(RestoreError, match="'torch' must be a 1-d uint8 tensor, got a 1-d torch.float32 tensor"):
        RNGProvider(cuda=False).restore({**state, "torch": torch.zeros(4)})


def test_rng_missing_items() -> None:
    with pytest.raises(RestoreError, match="numpy, python"):
        RNGProvider(cuda=False).restore({"torch": torch.get_rng_state()})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusal")
def test_rng_cuda_required_without_cuda() -> None:
    with pytest.raises(RuntimeError, match="cuda"):
        RNGProvider(cuda=True)
    assert not RNGProvider().cuda


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_rng_cuda_states() -> None:
    provider = RNGProvider(cuda=True)
    state = read_back(provider.describe())
    assert {f"cuda/{i}" for i in range(torch.cuda.device_count())} <= state.keys()
    expected = torch.rand(4, device="cuda").cpu()
    torch.rand(4, device="cuda")
    provider.restore(state)
    assert torch.equal(torch.rand(4, device="cuda").cpu(), expected)


# --- ObjectProvider ---------------------------------------------------------------------------------------------


def test_object_provider_callable_with_load() -> None:
    trainer = {"step": 10, "history": [1.0, 0.5]}
    loaded: list[Any] = []
    provider = ObjectProvider(lambda: trainer, load=loaded.append)
    items = provider.describe()
    trainer["history"].append(0.25)  # after describe: not in the snapshot
    trainer["step"] = 11
    provider.restore(read_back(items))
    assert loaded == [{"step": 10, "history": [1.0, 0.5]}]
    assert provider.value == loaded[0]
    assert trainer["step"] == 11  # with a callable get, only load decides what happens


def test_object_provider_plain_dict_updated_in_place() -> None:
    config = {"seed": 3, "name": "run"}
    provider = ObjectProvider(config, serializer="json")
    state = read_back(provider.describe())
    config["seed"] = 4
    config["added"] = True
    provider.restore(state)
    assert config == {"seed": 3, "name": "run"} and provider.value == config


def test_object_provider_missing_value() -> None:
    with pytest.raises(RestoreError, match="value"):
        ObjectProvider(1).restore({})


# --- CompositeProvider ------------------------------------------------------------------------------------------


def test_composite_nesting_namespaces_keys_and_routes_restore() -> None:
    counters = {"step": 1}
    model = make_model(0)
    inner = CompositeProvider(c=ObjectProvider(counters), m=ModuleProvider(model))
    root = CompositeProvider(a=CompositeProvider(b=inner))
    items = root.describe()
    assert {item.key for item in items} == {"a/b/c/value"} | {f"a/b/m/{k}" for k in model.state_dict()}
    state = read_back(items)
    counters["step"] = 2
    with torch.no_grad():
        model[0].weight.zero_()
    root.restore(state)
    assert counters == {"step": 1}
    assert torch.equal(model[0].weight, state["a/b/m/0.weight"])
    assert all(isinstance(p, StateProvider) for p in (root, inner, RNGProvider(cuda=False)))


def test_composite_missing_child_data_names_the_child() -> None:
    root = CompositeProvider(a=CompositeProvider(b=ObjectProvider(1)), rng=RNGProvider(cuda=False))
    state = read_back(root.describe())
    del state["a/b/value"]
    with pytest.raises(RestoreError, match=r"provider 'a/b': object: checkpoint lacks 1 item\(s\): value"):
        root.restore(state)


def test_composite_names() -> None:
    root = CompositeProvider(x=ObjectProvider(1))
    for bad in ("", "a/b"):
        with pytest.raises(ValueError, match="name"):
            root.add(bad, ObjectProvider(1))
    with pytest.raises(ValueError, match="already"):
        root.add("x", ObjectProvider(2))
    with pytest.raises(TypeError):
        root.add("y", object())
    assert list(root.add("y", ObjectProvider(2)).children) == ["x", "y"]


def test_tensor_dict_provider_restores_every_dtype_in_place_and_names_missing_keys() -> None:
    bits = torch.tensor([0xA5, 0x0F], dtype=torch.uint8).view(torch.bits8)
    tensors = {"w": torch.zeros(3), "f8": torch.zeros(4, dtype=torch.float8_e4m3fn), "bits": torch.zeros_like(bits)}
    provider = TensorDictProvider(tensors)
    w = tensors["w"]
    provider.restore({"w": torch.arange(3.0), "f8": torch.ones(4).to(torch.float8_e4m3fn), "bits": bits})
    assert tensors["w"] is w and torch.equal(w, torch.arange(3.0))
    assert torch.equal(tensors["f8"].view(torch.uint8), torch.ones(4).to(torch.float8_e4m3fn).view(torch.uint8))
    assert torch.equal(tensors["bits"].view(torch.uint8), bits.view(torch.uint8))
    with pytest.raises(RestoreError, match=r"TensorDictProvider: checkpoint lacks 2 item\(s\): bits, f8"):
        provider.restore({"w": torch.arange(3.0)})
