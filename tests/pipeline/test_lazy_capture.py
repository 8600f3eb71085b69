"""Laziness must never cost consistency, and a small host cache must never cost memory bounds."""

from __future__ import annotations

import torch

from tierstate.providers import ModuleProvider, OptimizerProvider, TensorDictProvider


def _model(width: int = 512, depth: int = 4) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(*[torch.nn.Linear(width, width) for _ in range(depth)])


def _step(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    loss = model(torch.randn(16, 512)).pow(2).mean()
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_state_restored_is_that_of_the_checkpoint_step_while_training_went_on(make_runner):
    """checkpoint(k) returns at once; the next optimizer steps mutate the very tensors being copied."""
    model = _model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    _step(model, opt)
    # A cache of two 1 MiB slabs and zstd make capture slow: the optimizer steps below come while it runs.
    runner = make_runner(host_cache__size="2MiB", chunk_size="1MiB", pipeline__stages__compress__codec="zstd")
    runner.register(model=ModuleProvider(model), optim=OptimizerProvider(opt))
    runner.attach(opt)
    expected_params = {k: v.clone() for k, v in model.state_dict().items()}
    expected_moments = [s["exp_avg_sq"].clone() for s in opt.state.values()]
    handle = runner.checkpoint(1)
    for _ in range(3):
        _step(model, opt)  # the pre-hook holds the first of these until capture is done
    handle.result()
    assert not torch.equal(model[0].weight, expected_params["0.weight"])
    runner.restore(1)
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected_params[key]), key
    for state, moment in zip(opt.state.values(), expected_moments, strict=True):
        assert torch.equal(state["exp_avg_sq"], moment)


def test_state_larger_than_host_cache_streams_through_it(make_runner):
    gen = torch.Generator().manual_seed(1)
    tensors = {f"t{i}": torch.randn(3 * 1024 * 1024 // 4 + i, generator=gen) for i in range(8)}  # ~24 MiB
    expected = {k: v.clone() for k, v in tensors.items()}
    runner = make_runner(host_cache__size="2MiB", chunk_size="1MiB")
    runner.register(t=TensorDictProvider(tensors))
    result = runner.checkpoint(1).result()
    _, stats = runner.history[-1]
    assert result.raw_bytes > 10 * runner.cache.nbytes
    assert runner.cache.slab_count == 2 and runner.cache.peak_in_use <= 2 and runner.cache.waits > 0
    assert runner.cache.in_use == 0  # every slab returned
    for stage, peak in stats.queue_peaks.items():
        assert peak <= stats.queue_bounds[stage], stage
    for t in tensors.values():
        t.zero_()
    runner.restore(1)
    assert all(torch.equal(tensors[k], v) for k, v in expected.items())


def test_many_small_tensors_are_coalesced_into_few_frames(make_runner):
    tensors = {f"p{i}": torch.full((256,), float(i)) for i in range(2000)}  # 2000 x 1 KiB
    runner = make_runner(chunk_size="1MiB")
    runner.register(t=TensorDictProvider(tensors))
    result = runner.checkpoint(1).result()
    _, stats = runner.history[-1]
    assert stats.chunks == 2  # two 1 MiB frames, not 2000 small writes
    for t in tensors.values():
        t.zero_()
    runner.restore(result.step)
    assert all(torch.equal(t, torch.full((256,), float(i))) for i, t in enumerate(tensors.values()))
