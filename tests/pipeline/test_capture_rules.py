"""Lazy only where it is safe: every checkpoint holds the state of the moment it was requested.

Each test changes state right after ``checkpoint()`` returns, the way real trainers do (a forward
updating BatchNorm statistics, an EMA update, an optimizer step without ``attach()``), while the
capture is made slow by a host cache far smaller than the state and a paced persist tier: a lazy
copy of those tensors would then read the new values.
"""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch

from tierstate import CheckpointFailed, ModuleProvider, OptimizerProvider, Runner, TensorDictProvider, TensorItem

SLOW = {"host_cache__size": "2MiB", "chunk_size": "1MiB", "pipeline__stages__persist__bandwidth": "40MB"}


def _bn_model() -> torch.nn.Module:
    torch.manual_seed(0)
    layers: list[torch.nn.Module] = []
    for _ in range(3):  # ~12 MiB of parameters ahead of each BatchNorm: its buffers are planned late
        layers += [torch.nn.Linear(1024, 1024), torch.nn.BatchNorm1d(1024)]
    return torch.nn.Sequential(*layers)


def _train_step(model: torch.nn.Module, opt: torch.optim.Optimizer | None) -> None:
    loss = model(torch.randn(32, 1024)).pow(2).mean()
    loss.backward()
    if opt is not None:
        opt.step()
        opt.zero_grad()


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _assert_restores(runner: Runner, model: torch.nn.Module, step: int, expected: dict[str, torch.Tensor]) -> None:
    runner.restore(step)
    for key, value in model.state_dict().items():
        assert torch.equal(value, expected[key]), f"step {step}: {key} is not its value at the request"


def test_batchnorm_buffers_are_those_of_the_request(make_runner: Callable[..., Runner]) -> None:
    model = _bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    runner = make_runner(**SLOW)
    runner.register(model=ModuleProvider(model), optim=OptimizerProvider(opt))  # no attach(): registering does it
    expected, snapshots = {}, []
    for step in range(1, 4):
        _train_step(model, opt)
        expected[step] = _snapshot(model)
        handle = runner.checkpoint(step)
        _train_step(model, opt)  # the forward updates running_mean/var at once; the step waits for capture
        handle.result()
        snapshots.append(handle.snapshot.tensors)
    for step, state in expected.items():
        _assert_restores(runner, model, step, state)
    assert snapshots == [9, 9, 9]  # 3 x (running_mean, running_var, num_batches_tracked), nothing else


def test_without_an_attached_optimizer_everything_is_copied_before_checkpoint_returns(
    make_runner: Callable[..., Runner], caplog: pytest.LogCaptureFixture
) -> None:
    model = _bn_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)  # neither registered nor attached
    runner = make_runner(**SLOW)
    runner.register(model=ModuleProvider(model))
    _train_step(model, opt)
    expected = _snapshot(model)
    handle = runner.checkpoint(1)
    _train_step(model, opt)  # mutates every parameter while the capture is still running
    handle.result()
    assert handle.snapshot.uncovered and "not covered by an attached optimizer" in caplog.text
    _assert_restores(runner, model, 1, expected)


def test_an_ema_updated_right_after_the_request_is_saved_as_requested(make_runner: Callable[..., Runner]) -> None:
    ema = {"w": torch.randn(4 * 1024 * 1024), "b": torch.randn(1000)}  # 16 MiB: far beyond the cache
    expected = {k: v.clone() for k, v in ema.items()}
    runner = make_runner(**SLOW)
    runner.register(ema=TensorDictProvider(ema))
    handle = runner.checkpoint(1)
    for value in ema.values():
        value.mul_(0.5).add_(1.0)
    handle.result()
    runner.restore(1)
    assert all(torch.equal(ema[k], expected[k]) for k in ema)


def test_a_guarded_ema_stays_lazy_and_the_guard_keeps_it_right(make_runner: Callable[..., Runner]) -> None:
    ema = {"w": torch.randn(4 * 1024 * 1024)}
    expected = ema["w"].clone()
    runner = make_runner(**SLOW)
    runner.register(ema=TensorDictProvider(ema, changes="guarded"))
    handle = runner.checkpoint(1)
    assert handle.snapshot.tensors == 0  # nothing copied on the trainer's thread
    runner.wait_captured()  # the guard the README's EMA example calls before updating
    ema["w"].add_(1.0)
    handle.result()
    runner.restore(1)
    assert torch.equal(ema["w"], expected)


class _Undeclared:
    """A user's provider written before items could declare anything: its tensors may change any time."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def describe(self) -> list[TensorItem]:
        return [TensorItem("t", self.tensor)]

    def restore(self, state: Any) -> None:
        self.tensor.copy_(state["t"])


def test_a_custom_provider_without_a_declaration_is_copied_at_once(make_runner: Callable[..., Runner]) -> None:
    provider = _Undeclared(torch.randn(4 * 1024 * 1024))
    expected = provider.tensor.clone()
    runner = make_runner(**SLOW)
    runner.register(custom=provider)
    handle = runner.checkpoint(1)
    provider.tensor.zero_()
    handle.result()
    runner.restore(1)
    assert torch.equal(provider.tensor, expected)


def test_parameters_and_optimizer_state_stay_lazy(make_runner: Callable[..., Runner]) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.Linear(256, 256))
    model[0].requires_grad_(False)  # frozen: in no optimizer, never changed, and declared so
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad])
    runner = make_runner()
    runner.register(model=ModuleProvider(model, frozen="never"), optim=OptimizerProvider(opt))
    _train_step_small(model, opt)
    handle = runner.checkpoint(1)
    handle.result()
    assert handle.snapshot.tensors == 0 and handle.snapshot.uncovered == ()


def test_optimizer_state_loaded_from_elsewhere_stays_lazy(make_runner: Callable[..., Runner]) -> None:
    """``optimizer.load_state_dict`` (a resume through torch.load) replaces every state tensor, same counts:
    the new ones are the optimizer's, so still captured lazily, in a reused plan too."""
    model = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.Linear(64, 64))
    opt = torch.optim.Adam(model.parameters())
    runner = make_runner()
    runner.register(model=model, optim=opt)
    _train_step_small(model, opt)
    saved = {"state": {k: {n: v.clone() for n, v in s.items()} for k, s in opt.state_dict()["state"].items()},
             "param_groups": opt.state_dict()["param_groups"]}  # fmt: skip
    for step in (1, 2):  # the second one reuses the plan
        handle = runner.checkpoint(step)
        handle.result()
        assert handle.snapshot.tensors == 0
    opt.load_state_dict(saved)
    handle = runner.checkpoint(3)
    handle.result()
    assert handle.snapshot.tensors == 0 and handle.snapshot.uncovered == ()


def _train_step_small(model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
    model(torch.randn(4, 256)).sum().backward()
    opt.step()
    opt.zero_grad()


def test_the_capture_check_names_a_lazily_captured_tensor_changed_behind_its_back(
    make_runner: Callable[..., Runner],
) -> None:
    ema = {"w": torch.randn(4 * 1024 * 1024), "quiet": torch.randn(8)}
    runner = make_runner(**SLOW, policies__check_capture=True)
    runner.register(ema=TensorDictProvider(ema, changes="guarded"))
    handle = runner.checkpoint(1)
    ema["w"].add_(1.0)  # declared guarded, but changed without runner.wait_captured()
    with pytest.raises(CheckpointFailed, match=r"ema/w") as failure:
        handle.result()
    assert "ema/quiet" not in str(failure.value)
    assert runner.steps()["nvme"] == []


def test_attach_refuses_what_is_not_an_optimizer(make_runner: Callable[..., Runner]) -> None:
    runner = make_runner()
    with pytest.raises(TypeError, match="expects a torch.optim.Optimizer .*got Linear"):
        runner.attach(torch.nn.Linear(2, 2))  # type: ignore[arg-type]


def test_attach_unwraps_accelerate_optimizer(make_runner: Callable[..., Runner]) -> None:
    accelerate = pytest.importorskip("accelerate")
    from accelerate.optimizer import AcceleratedOptimizer

    accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    wrapped = AcceleratedOptimizer(opt)
    runner = make_runner()
    runner.attach(wrapped)
    assert runner.attached == (opt,)


def _ema_update(teacher: torch.nn.Module, student: torch.nn.Module, through_data: bool) -> None:
    """BYOL/DINO/MoCo: the frozen teacher follows the student, in place, right after the checkpoint."""
    with torch.no_grad():
        for pt, ps in zip(teacher.parameters(), student.parameters(), strict=True):
            (pt.data if through_data else pt).mul_(0.9).add_(ps, alpha=0.1)


@pytest.mark.parametrize("through_data", [False, True], ids=["mul_", "data.mul_"])
def test_a_frozen_ema_teacher_updated_right_after_the_request_is_saved_as_requested(
    make_runner: Callable[..., Runner], through_data: bool
) -> None:
    """requires_grad=False says nothing about who writes a tensor: the teacher's frozen parameters are
    copied before checkpoint() returns (they were taken as never changing, and saved torn)."""
    student = _bn_model()
    teacher = copy.deepcopy(student).requires_grad_(False)
    opt = torch.optim.AdamW(student.parameters())
    runner = make_runner(**SLOW, policies__check_capture=False)  # no debugging aid: the default alone
    runner.register(student=student, teacher=teacher, optim=opt)
    expected = {}
    for step in (1, 2):
        _train_step(student, opt)
        expected[step] = _snapshot(teacher)
        handle = runner.checkpoint(step)
        _ema_update(teacher, student, through_data)
        handle.result()
    for step in (1, 2):
        _assert_restores(runner, teacher, step, expected[step])


def test_the_version_tripwire_fails_a_checkpoint_whose_declared_frozen_tensor_changed(
    make_runner: Callable[..., Runner],
) -> None:
    """Declared ``frozen="never"`` (lazy) and then updated in place anyway: always on, without
    ``check_capture``, the version counter fails that checkpoint naming the keys; nothing torn is kept."""
    student = _bn_model()
    teacher = copy.deepcopy(student).requires_grad_(False)
    opt = torch.optim.AdamW(student.parameters())
    runner = make_runner(**SLOW, policies__check_capture=False)
    runner.register(student=student, teacher=ModuleProvider(teacher, frozen="never"), optim=opt)
    _train_step(student, opt)
    handle = runner.checkpoint(1)
    _ema_update(teacher, student, through_data=False)
    moved = r"12 tensor\(s\) declared .* changed in place between the request and their copy: teacher/0\.bias, "
    with pytest.raises(CheckpointFailed, match=moved):
        handle.result()
    assert runner.steps()["nvme"] == []
    handle = runner.checkpoint(2)  # unchanged after the request: lazy, and fine
    handle.result()
    buffers = sum(1 for m in (student, teacher) for _ in m.buffers())
    assert handle.snapshot.tensors == buffers  # the teacher's parameters stay lazy, as declared
    _assert_restores(runner, teacher, 2, _snapshot(teacher))
