"""Restore hands freshly read optimizer tensors over instead of copying them, and only those.

A torch optimizer keeps the tensors ``load_state_dict`` is given, so ``OptimizerProvider`` copies
any that alias its input, in case the caller reuses that memory. Tensors a restore has just read
into fresh buffers are nobody else's, and copying them cost ~0.2 s per GB of moments on every
restore; those are handed over. Anything else (a caller's own tensors, tied storage) is still copied.
"""

from __future__ import annotations

import torch

from tierstate.providers import ModuleProvider, OptimizerProvider
from tierstate.providers.items import hand_over, handed_over


def _trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(8, 64)).sum().backward()
    optimizer.step()
    return model, optimizer


def test_handed_over_is_by_identity_not_by_value() -> None:
    kept, other = torch.ones(4), torch.ones(4)
    hand_over(kept)
    assert handed_over(kept) and not handed_over(other) and not handed_over(3)


def test_a_callers_tensors_are_still_copied() -> None:
    _, optimizer = _trained()
    provider = OptimizerProvider(optimizer)
    state = {item.key: item.tensor.clone() for item in provider.describe() if hasattr(item, "tensor")}
    state.update({item.key: item.value for item in provider.describe() if hasattr(item, "value")})
    provider.restore(state)
    inputs = {v.untyped_storage().data_ptr() for v in state.values() if isinstance(v, torch.Tensor)}
    kept = [v for s in optimizer.state.values() for v in s.values() if isinstance(v, torch.Tensor)]
    assert kept and not any(v.untyped_storage().data_ptr() in inputs for v in kept)


def test_runner_restore_hands_read_tensors_to_the_optimizer(make_runner) -> None:
    model, optimizer = _trained()
    runner = make_runner()
    runner.register(model=ModuleProvider(model), optim=OptimizerProvider(optimizer))
    runner.checkpoint(1).result()
    expected = {(i, k): v.clone() for i, s in enumerate(optimizer.state.values()) for k, v in s.items()}
    for s in optimizer.state.values():
        for v in s.values():
            v.zero_()
    runner.restore(1)
    restored = [v for s in optimizer.state.values() for v in s.values()]
    assert all(handed_over(v) for v in restored if v.numel())  # kept as read: no copy was made
    for i, s in enumerate(optimizer.state.values()):
        for k, v in s.items():
            assert torch.equal(v, expected[(i, k)])
