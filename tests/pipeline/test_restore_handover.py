"""Restore hands freshly read optimizer tensors over instead of copying them, and only those.

A torch optimizer keeps the tensors ``load_state_dict`` is given, so ``OptimizerProvider`` copies
any that alias its input, in case the caller reuses that memory. Tensors a restore has just read
into fresh buffers are nobody else's, and copying them cost ~0.2 s per GB of moments on every
restore; the restore says so in the state it hands over (``ReadState.fresh``). Anything else (a
caller's own tensors, tied storage) is still copied. Where the optimizer already holds tensors of the
stored shapes, the restore reads straight into them instead (tiers/reading/livefill.py): nothing to hand over.
"""

from __future__ import annotations

from typing import Any

import torch

from tierstate.pipeline.restore import fresh_read
from tierstate.providers import CompositeProvider, ModuleProvider, OptimizerProvider, ReadState


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    return model, optimizer


def _copied_state(provider: OptimizerProvider) -> dict[str, Any]:
    """The provider's state as a caller would hand it in: tensors cloned, objects as described."""
    items = provider.describe()
    return {i.key: i.tensor.clone() if hasattr(i, "tensor") else i.value for i in items}


def _kept(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]


def test_a_callers_tensors_are_still_copied() -> None:
    _, optimizer = _trained()
    provider = OptimizerProvider(optimizer)
    state = _copied_state(provider)
    provider.restore(state)
    inputs = {v.untyped_storage().data_ptr() for v in state.values() if isinstance(v, torch.Tensor)}
    assert _kept(optimizer) and not any(v.untyped_storage().data_ptr() in inputs for v in _kept(optimizer))


def test_fresh_tensors_are_kept_as_they_are_and_only_those() -> None:
    _, optimizer = _trained()
    provider = OptimizerProvider(optimizer)
    state = _copied_state(provider)
    tensors = sorted(k for k, v in state.items() if isinstance(v, torch.Tensor))
    fresh, copied = set(tensors[::2]), tensors[1::2]
    provider.restore(ReadState(state, fresh))
    kept_ids = {id(v) for v in _kept(optimizer)}
    assert all(id(state[key]) in kept_ids for key in fresh)
    inputs = {state[key].untyped_storage().data_ptr() for key in copied}
    assert copied and not any(v.untyped_storage().data_ptr() in inputs for v in _kept(optimizer))


def test_fresh_marks_reach_a_provider_inside_a_composite() -> None:
    _, optimizer = _trained()
    state = {f"optim/{key}": value for key, value in _copied_state(OptimizerProvider(optimizer)).items()}
    fresh = {key for key, value in state.items() if isinstance(value, torch.Tensor)}
    CompositeProvider(optim=OptimizerProvider(optimizer)).restore(ReadState(state, fresh))
    assert {id(v) for v in _kept(optimizer)} == {id(state[key]) for key in fresh}


def test_a_read_is_fresh_except_shared_or_empty_storage() -> None:
    tied, own, empty = torch.ones(3), torch.zeros(2), torch.empty(0)
    read = {"a": tied, "b": tied[1:], "c": own, "d": empty, "e": {"step": 1}}
    state = fresh_read(read)
    assert state.fresh == {"c"}
    assert list(state) == list(read) and all(state[key] is value for key, value in read.items())


def test_runner_restore_reads_straight_into_the_optimizers_own_tensors(make_runner) -> None:
    model, optimizer = _trained()
    runner = make_runner()
    runner.register(model=ModuleProvider(model), optim=OptimizerProvider(optimizer))
    runner.checkpoint(1).result()
    expected = {(i, k): v.clone() for i, s in enumerate(optimizer.state.values()) for k, v in s.items()}
    before = {id(v): v.untyped_storage().data_ptr() for v in _kept(optimizer)}
    for v in _kept(optimizer):
        v.zero_()
    runner.restore(1)
    # Neither copied nor handed over: the stored bytes were read into the very tensors it had
    # (tiers/reading/livefill.py).
    assert {id(v): v.untyped_storage().data_ptr() for v in _kept(optimizer)} == before
    for i, s in enumerate(optimizer.state.values()):
        for k, v in s.items():
            assert torch.equal(v, expected[(i, k)])


def test_runner_restore_hands_read_tensors_to_an_optimizer_without_state(make_runner) -> None:
    model, optimizer = _trained()
    runner = make_runner()
    runner.register(model=ModuleProvider(model), optim=OptimizerProvider(optimizer))
    runner.checkpoint(1).result()
    expected = {(i, k): v.clone() for i, s in enumerate(optimizer.state.values()) for k, v in s.items()}
    runner.close()
    fresh = torch.optim.AdamW(model.parameters(), lr=1e-2)  # no state until the restore brings it
    runner = make_runner()
    runner.register(model=ModuleProvider(model), optim=OptimizerProvider(fresh))
    runner.restore(1)
    assert {(i, k) for i, s in enumerate(fresh.state.values()) for k in s} == set(expected)
    for i, s in enumerate(fresh.state.values()):
        for k, v in s.items():
            assert torch.equal(v, expected[(i, k)])
