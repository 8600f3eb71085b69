"""The README cannot drift: every fenced block of README.md is run here as written, twice in a row in one
working directory, as a person runs a snippet again (a restarted job, a command retyped): the second
run must do what the README says a second run does.

* ``yaml``: loaded through the real config loader (``load_config``): a block with ``tiers`` is a whole
  config; one without must say on its first line that it is a fragment (``# a fragment: ...``), and is
  loaded as a section of the packaged default.
* ``python``: run in a subprocess of this Python, in the scenario's working directory, after the
  scenario's prelude, which defines the stand-ins its README comment names (``model``, ``runner``...).
  Python blocks of one scenario that follow each other run as one program (the later continue the
  earlier: they see its names); files carry over between all blocks of a scenario.
  A block whose first line is ``# FILE — run with: COMMAND`` is written to FILE and run by COMMAND.
* ``console``: each ``$ `` line run by bash in that directory; it must exit 0 (or the status the
  README shows: ``Killed``, or an ``echo $?`` after it), and where the README shows output, the
  printed output must have its shape: the same lines, with numbers, sizes, times and checksums free
  (:func:`readme_blocks.mismatch`). ``bash``: each line a command that must exit 0. Run a second
  time, a command does the same, unless its scenario's ``again`` says what it does then instead (an
  export refusing to overwrite the file the first run wrote, a migration finding the step there).
* a block without a language: a scenario checks it (the config errors the loader prints).

Blocks belong to a scenario by the comment before their fence (``<!-- readme-test: NAME; stand-ins
... -->``): blocks of one scenario share a working directory that ``prepare`` fills first (real
checkpoints from real runners). A block without a comment runs alone in an empty directory. A block
not run is named in SKIPPED with why, in this one place; a scenario named in the README but defined
nowhere, and an entry here that no block uses, fail the test.
"""

from __future__ import annotations

import re
import subprocess
import sys
import warnings
from collections.abc import Callable, Iterator, Mapping
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import readme_standins as standins
import yaml
from readme_blocks import README, Block, Command, bash_commands, blocks, console_commands, mismatch

from launch import TEARDOWN_ABORT
from tierstate.pipeline.config import ConfigError, load_config
from tierstate.pipeline.packaged import packaged_config

HERE = Path(__file__).resolve().parent
PRELUDE = f"import sys\nsys.path.insert(0, {str(HERE)!r})\nimport torch\nfrom readme_standins import *\n"


@dataclass(frozen=True)
class Scenario:
    prepare: Callable[[Path], None] | None = None  # fills the working directory before the first block
    prelude: str = ""  # run before each Python block: the stand-ins the README names
    epilogue: str = ""  # run after each Python block: what it promises, checked in its own process
    check: Callable[[Path], None] | None = None  # after the last block
    serve: Callable[[], AbstractContextManager[dict[str, str]]] | None = None  # a server the blocks use: its env
    slow: bool = False
    # What a command (as written after "$ ", or a bash line; its comment left out) does when its block runs
    # the second time, where that is not what it did the first time: every other command does the same again.
    again: Mapping[str, Again] = field(default_factory=dict)


@dataclass(frozen=True)
class Again:
    """A command's second run: the status it exits with and a line its output (stdout or stderr) holds."""

    status: int
    says: str


def _stats_checkpoint(workdir: Path) -> None:
    """What the stats sample says it shows: 4 Linear(2048, 2048) + AdamW, a 128 MiB host cache."""
    model = standins.nn.Sequential(*(standins.nn.Linear(2048, 2048) for _ in range(4)))
    opt = standins.stepped(model)
    config = {"host_cache": {"size": "128MiB"}, "tiers": {"nvme": {"path": str(workdir / "checkpoints/nvme")}}}
    with standins.Runner.from_dict(config) as runner:
        runner.register(model=model, optim=opt)
        runner.checkpoint(3).result()


def _listed_tiers(workdir: Path) -> None:
    """nvme 300, 400; the PFS 100-400, verified by the migrations; a 2-hour-old partial step 500 there."""
    standins.write_mlp_steps(workdir, [100, 200, 300, 400])
    for step in (100, 200, 300, 400):
        standins.migrate(workdir, step)
    for step in (100, 200):
        standins.remove(workdir / f"checkpoints/nvme/step-{step}")
    standins.abandoned_partial(workdir, "pfs", 500, 2 * 3600 + 14)


def _before_migration(workdir: Path) -> None:
    standins.write_mlp_steps(workdir, [100, 200, 300, 400])
    standins.migrate(workdir, 200)


def _damaged_nvme_copy(workdir: Path) -> None:
    """Step 400 on both tiers, the NVMe copy's frame 2 damaged."""
    standins.write_mlp_steps(workdir, [400])
    standins.migrate(workdir, 400)
    standins.damage_frame(workdir / "checkpoints/nvme/step-400", 2)


def _before_prune(workdir: Path) -> None:
    """nvme 100-400, only 100 flushed to the PFS; an abandoned partial step 500 there."""
    standins.write_mlp_steps(workdir, [100, 200, 300, 400])
    standins.migrate(workdir, 100)
    standins.abandoned_partial(workdir, "pfs", 500, 7214)


def _dcp_sources(workdir: Path) -> None:
    """Step 400 of the CLI model; a DCP checkpoint as TorchTitan writes one (model tensors at the top level)."""
    import torch.distributed.checkpoint as dcp

    standins.write_mlp_steps(workdir, [400])
    model = standins.mlp()
    with warnings.catch_warnings():  # DCP says it assumes one process without a process group: it is one
        warnings.filterwarnings("ignore", "torch.distributed is disabled", UserWarning)
        dcp.save({**model.state_dict(), "train_state": {"step": 1000}}, checkpoint_id=str(workdir / "titan/step-1000"))


def _after_a_crash(workdir: Path) -> None:
    """nvme 600-800 from a run killed while flushing: 800 on the PFS, 600 half-copied, 700 not at all."""
    standins.write_mlp_steps(workdir, [600, 700, 800])
    standins.migrate(workdir, 800)
    standins.killed_migration(workdir, 600)


def _hf_checkpoint(workdir: Path) -> None:
    """Step 4000 of a tiny GPT-2 registered as ``model``; its config.json in my-base-model/."""
    model = standins.tiny_gpt2()
    model.config.save_pretrained(workdir / "my-base-model")
    with standins.small_runner(workdir, nvme="checkpoints/nvme") as runner:
        runner.register(model=model)
        runner.checkpoint(4000).result()


def _gpt_checkpoint(workdir: Path) -> None:
    """What the Recovery example restores: GPT + AdamW (after a step) + OneCycleLR on ./checkpoints/nvme."""
    model = standins.GPT(standins.GPTConfig())
    optimizer = standins.stepped(model, lr=3e-4)
    scheduler = standins.torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=3e-4, total_steps=10_000)
    with standins.small_runner(workdir, nvme="checkpoints/nvme") as runner:
        runner.register(model=model, optim=optimizer, sched=scheduler)
        runner.checkpoint(100).result()


@contextmanager
def _s3_server() -> Iterator[dict[str, str]]:
    """A real S3-protocol server on 127.0.0.1 (the s3 tests' moto server) holding the bucket ``my-bucket``."""
    import boto3
    from s3server import CREDENTIALS, moto_server

    with moto_server() as endpoint:
        boto3.client(
            "s3", endpoint_url=endpoint, region_name="us-east-1",
            aws_access_key_id=CREDENTIALS["AWS_ACCESS_KEY_ID"],
            aws_secret_access_key=CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        ).create_bucket(Bucket="my-bucket")  # fmt: skip
        yield {**CREDENTIALS, "AWS_ENDPOINT_URL": endpoint}


def _steps_written(*steps: int) -> Callable[[Path], None]:
    def check(workdir: Path) -> None:
        written = sorted(p.name for p in (workdir / "checkpoints/nvme").iterdir() if p.name.startswith("step-"))
        assert written == [f"step-{s}" for s in steps], written

    return check


def _prometheus_file(workdir: Path) -> None:
    text = (workdir / "textfiles/tierstate.prom").read_text()
    assert "# TYPE tierstate_durable counter" in text and "\ntierstate_durable 1\n" in text, text[:500]


_RUNNER = "runner = Runner.from_yaml()\n"
_NEXT_STEP = "step = (runner.latest_step() or 0) + 1  # a second run's checkpoint is a new step\n"
_LIGHTNING = """
import lightning as L
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import DataLoader, TensorDataset

class Regression(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)
    def training_step(self, batch, _index):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)
    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-2)

model = Regression()
data = DataLoader(TensorDataset(torch.randn(16, 4), torch.randn(16, 1)), batch_size=8)
"""
_HF_TRAINER = """
import os
os.environ["HF_HUB_OFFLINE"] = "1"
from transformers import Trainer, TrainingArguments
model = tiny_gpt2()
ids = torch.randint(0, 128, (8, 16), generator=torch.Generator().manual_seed(1))
data = [{"input_ids": row, "labels": row} for row in ids]
args = TrainingArguments(output_dir="out", max_steps=3, per_device_train_batch_size=4, save_strategy="no",
                         report_to=[], use_cpu=True, disable_tqdm=True)
"""

SCENARIOS: dict[str, Scenario] = {
    "embedding": Scenario(
        prelude="model = LossModel()\nopt = torch.optim.AdamW(model.parameters())\n"
        "scheduler = torch.optim.lr_scheduler.StepLR(opt, 50)\nsteps = 200\nbatch = lambda: torch.randn(4, 8)\n",
        epilogue="assert counters == {'step': 200}, counters\n",
        check=_steps_written(100, 200),
    ),
    "stats": Scenario(prepare=_stats_checkpoint, slow=True),
    "prometheus": Scenario(
        prelude=_RUNNER + _NEXT_STEP
        + "runner.register(model=torch.nn.Linear(4, 4))\nrunner.checkpoint(step).result()\n",
        check=_prometheus_file,
    ),
    "ema-provider": Scenario(
        prelude=_RUNNER + "shadow = {'w': torch.zeros(4)}\n",
        epilogue=_NEXT_STEP + "runner.checkpoint(step).result()\nshadow['w'].fill_(3)\nrunner.restore(step)\n"
        "assert shadow['w'].eq(0).all()\nrunner.close()\n",
    ),
    "ema-guarded": Scenario(
        prelude=_RUNNER + _NEXT_STEP + "model = torch.nn.Linear(4, 4)\nopt = stepped(model)\n"
        "shadow = {k: v.detach().clone() for k, v in model.state_dict().items()}\n"
        "def update_ema(shadow, model):\n"
        "    for k, v in model.state_dict().items():\n        shadow[k].mul_(0.9).add_(v, alpha=0.1)\n",
        epilogue="runner.close()\n",
    ),
    "config-errors": Scenario(),
    "torchrun": Scenario(
        prelude="def build_model():\n    return torch.nn.Linear(8, 8)\nsteps = 200\n",
        epilogue="import os\nopen(f'.finished-rank-{os.environ[\"RANK\"]}', 'w').close()\n",
        check=_steps_written(100, 200),
        slow=True,
    ),
    # Run again, train() resumes from step 3 and, as the Trainer's own resume from its checkpoint-3 does (max_steps
    # reached in mid-epoch), takes one step more: step 4. Steps 1-3 are not trained again.
    "hf-trainer": Scenario(prelude=_HF_TRAINER, check=_steps_written(3, 4), slow=True),
    "lightning": Scenario(prelude=_LIGHTNING, slow=True),
    "dcp": Scenario(
        prepare=_dcp_sources, prelude="model = mlp()\nopt = stepped(model)\n", slow=True,
        again={
            "tierstate export 400 ckpt-dcp --format dcp --config tiered": Again(2, "ckpt-dcp exists; give --force"),
            "tierstate import titan/step-1000 --to nvme --step 1000 --config tiered":
                Again(2, "--step 1000: tier nvme holds a checkpoint step 1000 already"),
        },
    ),
    "recovery": Scenario(prepare=_gpt_checkpoint, prelude="config = GPTConfig()\n"),
    "ls": Scenario(
        prepare=_listed_tiers, slow=True,
        again={"tierstate init configs": Again(2, "configs/default.yaml exists; give --force to replace it")},
    ),
    "migrate": Scenario(
        prepare=_before_migration, slow=True,
        again={  # the steps the first run copied are there: nothing to kill, nothing copied twice
            "TIERSTATE_FAULT=migrate.frame@3 tierstate migrate 300 --from nvme --to pfs --config tiered":
                Again(0, "step 300: nvme -> pfs: already there"),
            "tierstate migrate --all --from nvme --to pfs --config tiered":
                Again(0, "step 100: nvme -> pfs: already there"),
        },
    ),
    "verify": Scenario(prepare=_damaged_nvme_copy),
    "prune": Scenario(prepare=_before_prune, again={"tierstate gc --config tiered": Again(0, "no leftovers")}),
    "export": Scenario(
        prepare=_damaged_nvme_copy, slow=True,
        again={  # an export never replaces a file unless given --force
            "tierstate export 400 step-400.h5 --format hdf5 --config tiered":
                Again(2, "step-400.h5 exists; give --force to replace it"),
            "tierstate export 400 step-400.safetensors --format safetensors --config tiered":
                Again(2, "step-400.safetensors exists; give --force to replace it"),
        },
    ),
    "hf-export": Scenario(
        prepare=_hf_checkpoint, slow=True,
        again={"tierstate export 4000 gpt2-4000 --format hf --provider model --config tiered":
               Again(2, "gpt2-4000/model.safetensors exists; give --force to replace it")},
    ),
    "flush": Scenario(
        prepare=_after_a_crash, slow=True,
        again={"tierstate flush --config tiered": Again(0, "nothing pending: every tier holds the checkpoints due")},
    ),
    "s3-cli": Scenario(
        prepare=lambda workdir: standins.write_mlp_steps(workdir, [1000]), serve=_s3_server, slow=True,
        again={"tierstate export 1000 model.safetensors --format safetensors --tier bucket=s3://my-bucket/run7/ckpt":
               Again(2, "model.safetensors exists; give --force to replace it")},
    ),
}

# Blocks not run, each with why. Nothing else may be left out.
SKIPPED: dict[str, str] = {
    "quick-start": "creates a venv and pip-installs torch from the network (minutes); .ci/run runs command 2 "
    "as written, and the demo of command 1 is examples/train_gpt.py, run by tests/pipeline/test_resume.py",
}


def _groups() -> dict[str, list[Block]]:
    """Each scenario's blocks, and each block without a scenario alone (under its place); YAML aside."""
    groups: dict[str, list[Block]] = {}
    for block in blocks():
        if block.language != "yaml":
            groups.setdefault(block.scenario or block.where, []).append(block)
    return groups


def _params() -> list[object]:
    params = []
    for name in _groups():
        scenario = SCENARIOS.get(name, Scenario())
        marks = [pytest.mark.skip(reason=SKIPPED[name])] if name in SKIPPED else []
        params.append(pytest.param(name, marks=[*marks, *([pytest.mark.slow] if scenario.slow else [])], id=name))
    return params


def test_every_block_is_run_or_listed_with_a_reason() -> None:
    named = {block.scenario for block in blocks() if block.scenario}
    assert not named - SCENARIOS.keys() - SKIPPED.keys(), "README names scenarios the test does not define"
    assert not (SCENARIOS.keys() | SKIPPED.keys()) - named, "scenarios or skips no README block uses any more"
    assert not SCENARIOS.keys() & SKIPPED.keys()
    for block in blocks():
        assert block.language in {"yaml", "python", "console", "bash", ""}, f"{block.where}: {block.language}?"
        assert block.language or block.scenario, f"{block.where}: a block without a language needs a scenario"
        assert block.language != "yaml" or not block.scenario, f"{block.where}: YAML is checked on its own"


@pytest.mark.parametrize("block", [b for b in blocks() if b.language == "yaml"], ids=lambda b: b.where)
def test_yaml_block_loads_through_the_config_loader(block: Block, tmp_path: Path) -> None:
    path = tmp_path / "my.yaml"
    path.write_text(block.text)
    section = yaml.safe_load(block.text)
    if "tiers" not in section:  # a section: the packaged default with it in place of its own
        assert block.text.startswith("# a fragment"), f"{block.where}: a config without tiers says it is a fragment"
        path.write_text(yaml.safe_dump({**yaml.safe_load(packaged_config("default").read_text()), **section}))
    load_config(path)  # raises ConfigError naming the key path


def test_every_config_a_command_line_names_works_for_a_wheel_user() -> None:
    """Prose included: ``--config tiered`` (packaged) or ``--config my.yaml`` (the user's own file), never a path
    into a checkout such as ``--config configs/tiered.yaml`` (the quick start, run in a checkout, aside)."""
    quick_start = next(block.text for block in blocks() if block.scenario == "quick-start")
    names = re.findall(r"--config\s+([^\s`]+)", README.read_text(encoding="utf-8").replace(quick_start, ""))
    assert "tiered" in names and not [name for name in names if "/" in name], names


@pytest.mark.parametrize("name", _params())
def test_blocks_run_twice_as_written(name: str, tmp_path: Path) -> None:
    scenario = SCENARIOS.get(name, Scenario())
    workdir = tmp_path / "work"
    workdir.mkdir()
    if scenario.prepare is not None:
        scenario.prepare(workdir)
    unused = set(scenario.again)
    with (scenario.serve or nullcontext)() as served:
        env = {**standins.environment(tmp_path / "bin"), **(served or {})}
        for second in (False, True):
            for program in _programs(_groups()[name]):
                try:
                    unused -= _run(program, scenario, workdir, env, second)
                except AssertionError as failed:
                    if name in SCENARIOS:
                        raise AssertionError(f"{'second' if second else 'first'} run: {failed}") from None
                    hint = "a block needing stand-ins or files: a <!-- readme-test: NAME; stand-ins: ... --> comment"
                    raise AssertionError(f"{failed}\n({hint} before it, and NAME in SCENARIOS here)") from None
    assert not unused, f"{name}: again names commands no block of it runs: {sorted(unused)}"
    if scenario.check is not None:
        scenario.check(workdir)


def _run(program: list[Block], scenario: Scenario, workdir: Path, env: dict[str, str], second: bool) -> set[str]:
    """Run one program of a scenario, the first or the ``second`` time; the commands of ``again`` it ran."""
    if program[0].language == "python":
        _run_python(program, scenario, workdir, env)
        return set()
    if program[0].language in ("console", "bash"):
        commands = (console_commands if program[0].language == "console" else bash_commands)(program[0])
        _run_commands(commands, workdir, env, scenario.again if second else {})
        return {_bare(command.text) for command in commands} & set(scenario.again)
    _check_config_errors(program[0], workdir)
    return set()


def _programs(group: list[Block]) -> list[list[Block]]:
    """A scenario's blocks as they run: Python blocks that follow each other make one program (a block
    continuing the one before sees its names); every other block runs alone."""
    programs: list[list[Block]] = []
    for block in group:
        if block.language == "python" and programs and programs[-1][-1].language == "python":
            programs[-1].append(block)
        else:
            programs.append([block])
    return programs


RUN_WITH = re.compile(r"#\s*(\S+\.py)\s*\W+\s*run with:\s*(.+)$")


def _run_python(program: list[Block], scenario: Scenario, workdir: Path, env: dict[str, str]) -> None:
    readme = "\n".join(block.text for block in program)
    source = f"{PRELUDE}{scenario.prelude}\n# --- README ---\n{readme}\n# --- checks ---\n{scenario.epilogue}"
    where = ", ".join(block.where for block in program)
    first = RUN_WITH.match(readme.splitlines()[0])
    script = workdir / (first.group(1) if first else f"readme_{program[0].line}.py")
    script.write_text(source)
    for finished in workdir.glob(".finished-rank-*"):  # the marks of a run before this one
        finished.unlink()
    command = first.group(2) if first else f"{sys.executable} {script.name}"
    done = subprocess.run(["bash", "-c", command], cwd=workdir, env=env, capture_output=True, text=True, timeout=300)
    output = f"{done.stdout[-3000:]}\n{done.stderr[-6000:]}"
    if done.returncode != 0 and first and TEARDOWN_ABORT in output:  # torch's gloo teardown abort, after the work
        ranks = int(re.search(r"--nproc_per_node[= ](\d+)", command).group(1))
        if all((workdir / f".finished-rank-{rank}").exists() for rank in range(ranks)):
            return
    assert done.returncode == 0, f"{where} ({command}) failed:\n{output}"


def _run_commands(commands: list[Command], workdir: Path, env: dict[str, str], again: Mapping[str, Again]) -> None:
    """Each command as bash runs it; its status and output as the README shows them, or as ``again`` says."""
    status = 0
    for command in commands:
        done = subprocess.run(
            ["bash", "-c", f"(exit {status}); {command.text}"],
            cwd=workdir, env=env, capture_output=True, text=True, timeout=300,
        )  # fmt: skip
        status = 128 - done.returncode if done.returncode < 0 else done.returncode  # killed by a signal: as bash says
        printed = f"stdout:\n{done.stdout[-3000:]}\nstderr:\n{done.stderr[-3000:]}"
        if _bare(command.text) in again:
            expected = again[_bare(command.text)]
            where = f"README.md:{command.line}: {command.text}, run again"
            assert status == expected.status, f"{where}: exit {status}\n{printed}"
            assert expected.says in done.stdout + done.stderr, f"{where}: does not say {expected.says!r}\n{printed}"
            continue
        assert status == command.status, f"README.md:{command.line}: {command.text}: exit {status}\n{printed}"
        if command.shown:
            problem = mismatch(command.shown, done.stdout.splitlines())
            assert problem is None, f"README.md:{command.line}: {command.text}: output differs:\n{problem}\n{printed}"


def _bare(command: str) -> str:
    """A command line without its comment (bash drops it), as ``Scenario.again`` names it."""
    return re.sub(r"\s+#.*$", "", command).strip()


# The configs that make the errors the README shows, by key path: each written as configs/my.yaml.
CONFIG_ERRORS: dict[str, dict[str, object]] = {
    "pipeline.stages.compress.levle": {"pipeline.stages.compress.levle": 1},
    "pipeline.stages.compress.next": {"pipeline.stages.compress.next": "capture"},
    "pipeline.stages.persist.tier": {"tiers": {"pfs": {"path": "./checkpoints/pfs"}}},
}


def _check_config_errors(block: Block, workdir: Path) -> None:
    """Each line is the error the loader prints for configs/my.yaml holding that mistake."""
    (workdir / "configs").mkdir(exist_ok=True)
    for line in block.text.splitlines():
        key = line.split(": ")[1]
        assert key in CONFIG_ERRORS, f"{block.where}: no config in CONFIG_ERRORS makes the error for {key}"
        document = yaml.safe_load(packaged_config("default").read_text())
        for path, value in CONFIG_ERRORS[key].items():
            *parents, last = path.split(".")
            node = document
            for part in parents:
                node = node[part]
            node[last] = value
        (workdir / "configs/my.yaml").write_text(yaml.safe_dump(document))
        with pytest.raises(ConfigError) as error:
            load_config(workdir / "configs/my.yaml")
        printed = str(error.value).replace(f"{workdir}/", "").splitlines()
        assert line in printed, f"{block.where}: shown {line!r}, printed:\n{error.value}"
