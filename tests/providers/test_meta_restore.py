"""Restoring into a model built on the meta device: no init work, every value from the checkpoint.

A restarted trainer builds the model under ``torch.device("meta")`` (no storage, no random init),
gives it uninitialised storage with ``tierstate.materialize`` (ties kept), builds the optimizer and
scheduler on it and restores. The result must be the saved state bit for bit, and training on from
it must take the same steps as the original; a checkpoint that lacks any value must fail before
anything is applied, since the storage it would leave unrestored is garbage.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from examples.gpt import GPTConfig
from examples.train_gpt import TrainConfig, attach, build, state_digests, train_steps
from tierstate import MetaBufferError, RestoreError, Runner, empty_init, materialize
from tierstate.providers import ModuleProvider, OptimizerProvider

TINY = TrainConfig(steps=8, every=3, batch_size=4, model=GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=2))


def _runner(root: Path) -> Runner:
    return Runner.from_dict({"tiers": {"nvme": {"path": str(root / "nvme")}}, "chunk_size": "1MiB",
                             "host_cache": {"size": "4MiB"}})  # fmt: skip


def _bytes(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def test_a_meta_built_gpt_adamw_and_scheduler_restore_bit_exact_and_train_on_alike(tmp_path: Path) -> None:
    saved = build(TINY)
    with _runner(tmp_path) as runner:
        attach(runner, saved)
        train_steps(saved, 3, runner, 3)
        runner.wait()

    restored = build(TINY, for_restore=True)
    model = restored.model
    assert not any(t.is_meta for t in model.state_dict().values())
    assert model.lm_head.weight is model.tok_emb.weight  # to_empty untied them; materialize ties them again
    assert restored.optimizer.state_dict()["state"] == {}
    with _runner(tmp_path) as runner:
        attach(runner, restored)
        assert runner.restore("latest").step == 3

    assert state_digests(restored) == state_digests(saved)
    assert restored.scheduler.state_dict() == saved.scheduler.state_dict()
    assert restored.counters == saved.counters  # the data position: shown by training on, below
    assert model.lm_head.weight is model.tok_emb.weight
    params = {id(p) for p in model.parameters()}
    assert all(id(p) in params for group in restored.optimizer.param_groups for p in group["params"])
    # Training on: the same losses and the same state, bit for bit (RNG, data position and schedule restored).
    # One process runs both, and dropout draws from the one global generator: each starts from the restored one.
    rng = torch.get_rng_state()
    losses = train_steps(restored, 6)[0]
    torch.set_rng_state(rng)
    assert train_steps(saved, 6)[0] == losses
    assert state_digests(restored) == state_digests(saved)


def _adamw_stepped(model: nn.Module) -> torch.optim.AdamW:
    optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    return optimizer


@pytest.mark.parametrize("initialised", [False, True], ids=["fresh", "initialised-after"])
def test_a_checkpoint_lacking_a_value_of_a_meta_built_model_fails_with_nothing_applied(
    tmp_path: Path, initialised: bool
) -> None:
    small = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    with _runner(tmp_path) as runner:
        runner.register(model=ModuleProvider(small), optim=OptimizerProvider(_adamw_stepped(small)))
        runner.checkpoint(1).result()

    with torch.device("meta"):
        larger = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4))
    materialize(larger)
    if initialised:  # values of its own now (an in-place op): live state, which a failed restore leaves as it was
        with torch.no_grad():
            for param in larger.parameters():
                param.normal_()
    optimizer = torch.optim.AdamW(larger.parameters(), lr=0.1)
    before = {k: _bytes(v) for k, v in larger.state_dict().items()}
    with _runner(tmp_path) as runner:
        runner.register(model=ModuleProvider(larger), optim=OptimizerProvider(optimizer))
        with pytest.raises(RestoreError, match=r"lacks 2 item\(s\): 2\.bias, 2\.weight"):
            runner.restore("latest")
    if initialised:
        assert {k: _bytes(v) for k, v in larger.state_dict().items()} == before  # not even the keys it has
    # Fresh (uninitialised) tensors hold nothing to keep: the read filled the keys it has in one pass
    # (providers/fresh.py), the rest stays garbage, and the failed restore is no restore.
    assert optimizer.state_dict()["state"] == {}


def test_a_module_still_on_the_meta_device_is_refused_naming_the_fix(tmp_path: Path) -> None:
    saved = nn.Linear(4, 4)
    with _runner(tmp_path) as runner:
        runner.register(model=saved)
        runner.checkpoint(1).result()
    with torch.device("meta"):
        unmaterialized = nn.Linear(4, 4)
    with _runner(tmp_path) as runner:
        runner.register(model=unmaterialized)
        with pytest.raises(RestoreError, match=r"2 tensor\(s\) are on the meta device.*tierstate\.materialize"):
            runner.restore("latest")


class _WithCache(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)
        self.register_buffer("inv_freq", torch.arange(4.0), persistent=False)


def test_materialize_refuses_buffers_no_checkpoint_holds() -> None:
    with torch.device("meta"):
        module = _WithCache()
    with pytest.raises(MetaBufferError, match=r"persistent=False.*restores them: inv_freq"):
        materialize(module)
    assert module.proj.weight.is_meta  # refused before anything was allocated


def test_empty_init_builds_on_meta_without_calling_init_and_puts_torch_init_back() -> None:
    normal = torch.nn.init.normal_
    with empty_init():
        module = nn.Sequential(nn.Linear(4, 4), nn.Embedding(8, 4), nn.LayerNorm(4))
        assert torch.nn.init.normal_ is not normal
    assert torch.nn.init.normal_ is normal
    assert all(t.is_meta for t in module.state_dict().values())
    materialize(module)
    assert not any(t.is_meta for t in module.state_dict().values())
