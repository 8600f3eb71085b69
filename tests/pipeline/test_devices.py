"""Every checkpoint holds the state of its request on each device this machine has.

The same tests run on the CPU everywhere and, where there is a CUDA GPU, on it: there capture copies
on a side stream into pinned slabs after an event recorded at the request, and eager copies
(BatchNorm buffers) are made on the GPU before ``checkpoint()`` returns. Kernels still queued when
``checkpoint()`` is called, a forward right after it and an optimizer step that must wait for the
capture are what would tear the saved state if any of that were out of order.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from tierstate import ModuleProvider, OptimizerProvider, RNGProvider, Runner

DEVICES = [
    pytest.param("cpu"),
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]
SLOW = {"host_cache__size": "4MiB", "chunk_size": "1MiB", "pipeline__stages__persist__bandwidth": "40MB"}


def _model(device: str) -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(3):
        layers += [torch.nn.Linear(512, 512), torch.nn.BatchNorm1d(512)]
    return torch.nn.Sequential(*layers).to(device)


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer, device: str) -> None:
    model(torch.randn(64, 512, device=device)).pow(2).mean().backward()
    opt.step()
    opt.zero_grad()


def _state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, torch.Tensor]:
    """Every tensor of the model and the optimizer, copied to the CPU (waits for queued kernels)."""
    tensors = {f"model/{k}": v.detach().cpu().clone() for k, v in model.state_dict().items()}
    for index, per_param in enumerate(opt.state.values()):
        tensors |= {f"optim/{index}/{k}": v.detach().cpu().clone() for k, v in per_param.items()}
    return tensors


def _assert_equal(actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], what: str) -> None:
    assert actual.keys() == expected.keys()
    for key, value in expected.items():
        assert torch.equal(actual[key], value), f"{what}: {key} is not its value at the request"


@pytest.mark.parametrize("device", DEVICES)
def test_each_checkpoint_restores_the_state_of_its_request(make_runner: Callable[..., Runner], device: str) -> None:
    model = _model(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    runner = make_runner(**SLOW)
    runner.register(model=ModuleProvider(model), optim=OptimizerProvider(opt))
    expected = {}
    for step in range(1, 4):
        _train_step(model, opt, device)
        with torch.no_grad():  # queued, not yet run on a GPU, when checkpoint() is called
            for parameter in model.parameters():
                parameter.mul_(0.999)
        expected[step] = _state(model, opt)
        handle = runner.checkpoint(step)
        _train_step(model, opt, device)  # the forward changes BatchNorm's buffers; step() waits for the capture
        handle.result()
    for step, state in expected.items():
        runner.restore(step)
        _assert_equal(_state(model, opt), state, f"step {step}")
        assert all(p.device.type == device for p in model.parameters())

    runner.close()
    fresh_model = _model(device)  # a new process's model and optimizer, restored from the tier
    fresh_opt = torch.optim.AdamW(fresh_model.parameters(), lr=1e-3)
    fresh = make_runner(**SLOW)
    fresh.register(model=ModuleProvider(fresh_model), optim=OptimizerProvider(fresh_opt))
    fresh.restore("latest")
    _assert_equal(_state(fresh_model, fresh_opt), expected[3], "fresh restore of step 3")
    assert all(v.device.type == device for s in fresh_opt.state.values() for k, v in s.items() if k != "step")


@pytest.mark.parametrize("device", DEVICES)
def test_the_random_streams_resume_where_the_checkpoint_was_taken(
    make_runner: Callable[..., Runner], device: str
) -> None:
    runner = make_runner()
    runner.register(rng=RNGProvider(cuda=device == "cuda"))
    torch.manual_seed(1)
    torch.rand(3, device=device)
    runner.checkpoint(1).result()
    expected = torch.rand(5, device=device).cpu()
    torch.rand(7, device=device)
    runner.restore(1)
    assert torch.equal(torch.rand(5, device=device).cpu(), expected)
