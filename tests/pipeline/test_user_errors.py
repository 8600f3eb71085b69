"""Errors a user meets in the first hour say what is wrong where it is wrong (issue: what a user sees)."""

from __future__ import annotations

import asyncio
import gc
import logging
import subprocess
import sys
import weakref
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import conftest
from tierstate import (
    CheckpointExistsError,
    ConfigError,
    ProviderNameError,
    RestoreError,
    Runner,
    RunnerClosedError,
    TensorDictProvider,
    TierError,
    TierInUseError,
    TierstateError,
    load_config,
)
from tierstate.cli import main as cli_main
from tierstate.pipeline.packaged import packaged_configs
from tierstate.pipeline.tierpaths import warn_unbounded

CONFTEST = Path(conftest.__file__)
MAKE_RUNNER_LINE = next(n for n, line in enumerate(CONFTEST.read_text().splitlines(), 1) if "Runner.from_yaml(" in line)


def _model_and_optim() -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.lr_scheduler.StepLR]:
    model = torch.nn.Linear(4, 4)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    return model, optim, torch.optim.lr_scheduler.StepLR(optim, 1)


def test_a_provider_the_checkpoint_lacks_is_named_with_those_it_has(make_runner: Callable[..., Runner]) -> None:
    model, optim, sched = _model_and_optim()
    runner = make_runner()
    runner.register(model=model, optim=optim)
    runner.checkpoint(1).result()
    runner.register(sched=sched)  # added since, or saved under another name
    weights = model.weight.detach().clone()
    with torch.no_grad():
        model.weight.add_(1.0)
    with pytest.raises(RestoreError, match=r"the checkpoint has no provider 'sched' \(it has: model, optim\)"):
        runner.restore(1)
    assert not torch.equal(model.weight, weights)  # nothing applied


def test_a_name_registered_twice_is_a_tierstate_error_and_registers_nothing(make_runner: Callable[..., Runner]) -> None:
    runner = make_runner()
    runner.register(t=TensorDictProvider({"w": torch.ones(2)}))
    with pytest.raises(ProviderNameError, match=r"a provider named 't' is already registered") as raised:
        runner.register(u=TensorDictProvider({"w": torch.ones(2)}), t=TensorDictProvider({"w": torch.zeros(2)}))
    assert isinstance(raised.value, TierstateError) and isinstance(raised.value, ValueError)
    assert list(runner.providers.children) == ["t"]  # u was not registered either


def test_a_repeated_step_fails_at_the_call_and_latest_step_tells_a_first_run(
    make_runner: Callable[..., Runner],
) -> None:
    runner = make_runner()
    runner.register(t=TensorDictProvider({"w": torch.ones(2)}))
    assert runner.latest_step() is None  # a first run
    runner.checkpoint(3).result()
    with pytest.raises(CheckpointExistsError, match=r"checkpoint step 3: tier nvme holds step 3 already"):
        runner.checkpoint(3)
    assert runner.latest_step() == 3
    runner.checkpoint(4).result()  # training goes on
    assert runner.latest_step() == 4


def test_a_second_runner_on_a_tier_is_refused_when_built_naming_the_first(
    make_runner: Callable[..., Runner], tmp_path: Path
) -> None:
    """A notebook cell that builds the runner, run twice: the second runner is refused at once (not at its
    first checkpoint, in the background), naming the first, where it was built and close(); it is built once
    the first is closed."""
    first = make_runner()
    first.register(t=TensorDictProvider({"w": torch.ones(2)}))
    first.checkpoint(1).result()
    with pytest.raises(TierInUseError) as refused:
        make_runner()
    nvme = tmp_path / "nvme"
    assert str(refused.value) == (
        f"[Errno 16] tier nvme ({nvme}) is written by another open runner of this process, <Runner writing nvme "
        f"({nvme}), built at {CONFTEST}:{MAKE_RUNNER_LINE}, open>; close that one first (runner.close(), or build "
        "runners in a `with` block; it is this error's .holder), or give this one a tier of its own"
    )
    assert refused.value.holder is first  # type: ignore[attr-defined]
    # Another path to the same directory is the same tier; another directory is another tier.
    (tmp_path / "link").symlink_to(nvme)
    with pytest.raises(TierInUseError, match="tier mine .* is written by another open runner"):
        Runner.from_dict({"tiers": {"mine": {"path": str(tmp_path / "link")}}})
    Runner.from_dict({"tiers": {"mine": {"path": str(tmp_path / "other")}}}).close()
    first.checkpoint(2).result()  # the first goes on
    first.close()
    second = make_runner()
    second.register(t=TensorDictProvider({"w": torch.zeros(2)}))
    second.checkpoint(3).result()
    assert second.steps()["nvme"] == [1, 2, 3]


CLOSED = (
    "this runner is closed (close() was called, or its with-block ended): it checkpoints, registers and restores "
    "no more; build a new one (Runner.from_yaml(...)) to go on: it restores from the same tiers"
)


def test_a_closed_runner_takes_its_hooks_off_the_optimizer_and_is_freed(tmp_path: Path) -> None:
    """The optimizer outlives the runner (a new runner after a restart in the same process, a second fit): a closed
    runner's hooks would keep it (its host cache, its slots' mappings) alive and run at every later step."""
    model, optim, _ = _model_and_optim()
    layout = {"tiers": {"nvme": {"path": str(tmp_path), "retention": {"keep_last": 1}}}}
    for step in (1, 2):  # one runner after the other on the same optimizer
        with Runner.from_dict(layout) as runner:
            runner.register(model=model, optim=optim)
            assert len(optim._optimizer_step_pre_hooks) == len(optim._optimizer_load_state_dict_pre_hooks) == 1
            runner.checkpoint(step).result()
        assert optim._optimizer_step_pre_hooks == {} and optim._optimizer_load_state_dict_pre_hooks == {}
        assert runner.attached == ()
    freed = weakref.ref(runner)
    del runner
    gc.collect()
    assert freed() is None, gc.get_referrers(freed())
    model(torch.randn(2, 4)).sum().backward()
    optim.step()  # nothing left to wait for


def test_a_closed_runner_refuses_everything_saying_what_to_do(make_runner: Callable[..., Runner]) -> None:
    model, optim, _ = _model_and_optim()
    with make_runner() as runner:
        runner.register(model=model, optim=optim)
        runner.checkpoint(1).result()
    assert runner.closed
    calls: dict[str, Callable[[], object]] = {
        "register()": lambda: runner.register(other=TensorDictProvider({"w": torch.ones(2)})),
        "attach()": lambda: runner.attach(torch.optim.SGD(model.parameters(), lr=0.1)),
        "checkpoint(2)": lambda: runner.checkpoint(2),
        "restore('latest')": lambda: runner.restore("latest"),
        "start_fresh()": lambda: runner.start_fresh(),
        "latest_step()": lambda: runner.latest_step(),
    }
    for call, make_call in calls.items():
        with pytest.raises(RunnerClosedError) as refused:
            make_call()
        assert str(refused.value) == f"runner.{call}: {CLOSED}", call
        assert isinstance(refused.value, TierstateError) and isinstance(refused.value, RuntimeError)
    with pytest.raises(RunnerClosedError, match=r"^runner\.acheckpoint\(2\): this runner is closed"):
        asyncio.run(runner.acheckpoint(2))
    optim.step()  # its attached optimizer still steps: the pre-hook has nothing to wait for
    runner.close()  # closing twice is no error
    assert runner.metrics().durable == 1 and runner.steps()["nvme"] == [1]  # what the run left stays readable


def test_a_tier_that_keeps_every_checkpoint_is_warned_of_once_naming_its_key(
    make_runner: Callable[..., Runner], caplog: pytest.LogCaptureFixture
) -> None:
    """``Runner.from_yaml()`` with a checkpoint every 2 steps wrote 8.7 GB in 12 s, and nothing said so."""
    with caplog.at_level(logging.WARNING, logger="tierstate"):
        runner = make_runner(tiers__pfs__flush={"every": 1}, tiers__pfs__retention={"keep_last": 2})
        runner.register(t=TensorDictProvider({"w": torch.ones(2)}))
        for step in (1, 2, 3):
            runner.checkpoint(step).result()
        runner.close()
    warned = [r.getMessage() for r in caplog.records if "retention" in r.getMessage()]
    assert warned == [
        "tiers.nvme has no retention: it keeps every checkpoint, so its storage fills as training goes on; set "
        "tiers.nvme.retention (e.g. {keep_last: 3}) to keep the newest only"
    ]  # once, when built; the PFS keeps 2


@pytest.mark.parametrize("name", packaged_configs())
def test_every_packaged_config_keeps_a_bounded_number_on_every_tier_it_writes(
    name: str, caplog: pytest.LogCaptureFixture
) -> None:
    config = load_config(name)
    with caplog.at_level(logging.WARNING, logger="tierstate"):
        warn_unbounded(config)
    assert caplog.records == []
    assert all(tier.retention.active for tier in config.tiers.values()), name


# --- what a user's config or environment can get wrong: tierstate errors naming the key, or the extra ----
def test_an_s3_endpoint_without_its_scheme_is_refused_naming_the_key(tmp_path: Path) -> None:
    """botocore said ``ValueError: Invalid endpoint: 127.0.0.1:9000``: no tier, no key."""
    bucket = {"kind": "s3", "url": "s3://my-bucket/run7", "endpoint_url": "127.0.0.1:9000"}
    with pytest.raises(ConfigError) as refused:
        Runner.from_dict({"tiers": {"nvme": {"path": str(tmp_path / "nvme")}, "bucket": bucket}})
    assert str(refused.value) == (
        "<config>: tiers.bucket.endpoint_url: must be a URL with its scheme, e.g. http://127.0.0.1:9000 or "
        "https://s3.example.com; got '127.0.0.1:9000'"
    )


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("s3://My_Bucket/run7", "must be s3://BUCKET/PREFIX, e.g. s3://my-bucket/run7/ckpt: the bucket 3 to 63 "
         "lower-case letters, digits, dots and hyphens; got 's3://My_Bucket/run7'"),
        ("my-bucket/run7", "must be s3://BUCKET/PREFIX, e.g. s3://my-bucket/run7/ckpt: the bucket 3 to 63 "
         "lower-case letters, digits, dots and hyphens; got 'my-bucket/run7'"),
        ("s3://my-bucket/run7/../x", "a prefix has no empty, '.' or '..' segments; got 's3://my-bucket/run7/../x'"),
    ],
)  # fmt: skip
def test_an_s3_url_error_says_what_an_url_looks_like_never_a_pattern(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], url: str, problem: str
) -> None:
    with pytest.raises(ConfigError) as refused:
        Runner.from_dict({"tiers": {"nvme": {"path": str(tmp_path / "nvme")}, "bucket": {"kind": "s3", "url": url}}})
    assert str(refused.value) == f"<config>: tiers.bucket.url: {problem}"
    if url.startswith("s3://"):  # the same rule for a bucket on the command line
        assert cli_main(["ls", "--tier", f"bucket={url}"]) == 1
        assert capsys.readouterr().err == f"tierstate: [Errno 22] not an s3:// URL: {problem}\n"


def test_an_endpoint_from_the_environment_or_the_command_line_is_checked_naming_where_it_came_from(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from tierstate.tiers.storage.objstore import ObjectStore

    monkeypatch.setenv("AWS_ENDPOINT_URL", "localhost:9000")
    with pytest.raises(TierError) as refused:
        ObjectStore("bucket", "s3://my-bucket/run7")
    assert str(refused.value) == (
        "[Errno 22] tier bucket: $AWS_ENDPOINT_URL must be a URL with its scheme, e.g. http://127.0.0.1:9000 or "
        "https://s3.example.com; got 'localhost:9000'"
    )
    monkeypatch.delenv("AWS_ENDPOINT_URL")
    assert cli_main(["s3", "ls", "s3://my-bucket/run7", "--endpoint-url", "minio:9000"]) == 2
    assert capsys.readouterr().err == (
        "tierstate: --endpoint-url must be a URL with its scheme, e.g. http://127.0.0.1:9000 or "
        "https://s3.example.com; got 'minio:9000'\n"
    )


@pytest.mark.parametrize(
    ("framework", "statement", "said"),
    [
        ("transformers", "from tierstate.integrations.hf import TierstateCallback",
         "TierstateCallback needs transformers, which is not installed: pip install 'tierstate[hf]'"),
        ("lightning", "from tierstate.integrations.lightning import TierstateCheckpointIO",
         "TierstateCheckpointIO needs lightning, which is not installed: pip install 'tierstate[lightning]'"),
    ],
)  # fmt: skip
def test_an_integration_without_its_framework_names_the_extra_to_install(framework, statement, said) -> None:
    """A bare ``ModuleNotFoundError: No module named 'transformers'`` said nothing of tierstate's extras. The
    framework is made missing as Python sees a module that is not installed (None in sys.modules)."""
    probe = (
        f"import sys\nsys.modules[{framework!r}] = None\n"
        "from tierstate import TierstateError\n"
        f"try:\n    {statement}\n"
        "except ImportError as error:\n"
        "    assert isinstance(error, TierstateError) and isinstance(error, ModuleNotFoundError), type(error)\n"
        "    print(error)\n"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout == said + "\n"
