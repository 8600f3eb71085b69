"""Demo: a GPT training loop with tierstate embedded, and proof that resuming from it is exact.

Run ``python examples/train_gpt.py --config configs/default.yaml`` (or ``python -m
examples.train_gpt``). It

1. trains ``--steps`` steps, requesting a checkpoint every ``--every`` steps, and records how long
   each checkpoint blocked the trainer and how long capture and durability took in the background;
2. times a synchronous ``torch.save`` + fsync of the same state to the same disk, the usual way of
   checkpointing, which blocks training for its whole duration;
3. starts a fresh process (this script with ``--resume-step K``) that builds everything from
   scratch, restores checkpoint K and trains on to the last step;
4. compares: every loss after K and the final parameters and optimizer state must be identical
   bit for bit, else the exit code is 1.

A fresh process, not a second model in this one, because only that shows the checkpoint is
complete: nothing (RNG, data position, scheduler, optimizer step counts) can leak through memory.
The functions are importable so tests drive the same loop.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import os
import random
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field, fields
from datetime import datetime
from pathlib import Path
from typing import Any

import numpy as np
import torch

REPO_ROOT = Path(__file__).resolve().parent.parent
if __package__ in (None, ""):  # run as a script: make the sibling `examples.gpt` importable
    sys.path.insert(0, str(REPO_ROOT))

from examples.gpt import GPT, GPTConfig, TokenStream  # noqa: E402
from tierstate import (  # noqa: E402
    CheckpointFailed,
    CheckpointHandle,
    CheckpointResult,
    ModuleProvider,
    ObjectProvider,
    OptimizerProvider,
    RNGProvider,
    Runner,
    StatefulProvider,
    StateProvider,
    empty_init,
    load_config,
    materialize,
)

DEFAULT_CONFIG = REPO_ROOT / "configs" / "default.yaml"


@dataclass(frozen=True)
class TrainConfig:
    """Everything that determines the run; both processes must get the same values.

    ``steps`` is part of it (not just a loop bound) because the LR schedule is laid out over it.
    ``threads`` is fixed because CPU kernels split reductions by thread count, so a different
    count would change the low bits of every result. It is 1 because two are not reproducible
    either: of 200 processes forked to train the same 8 steps with two intra-op threads, 6 got
    other low bits in the loss of one or more steps (torch 2.13 CPU, OpenMP), and with one thread
    150 of 150 agreed; a resumed run is compared with the straight one bit for bit.
    """

    steps: int = 40
    every: int = 10
    batch_size: int = 16
    lr: float = 3e-3
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    seed: int = 0
    threads: int = 1
    model: GPTConfig = field(default_factory=GPTConfig)


@dataclass
class Trainer:
    """The live training state; :func:`providers_for` says how each part is checkpointed."""

    config: TrainConfig
    model: GPT
    optimizer: torch.optim.AdamW
    scheduler: torch.optim.lr_scheduler.OneCycleLR
    data: TokenStream
    counters: dict[str, int]


def build(config: TrainConfig, for_restore: bool = False) -> Trainer:
    """Build the model, optimizer, schedule and data from seeds alone, as a fresh process would.

    ``for_restore``: every value is about to be overwritten by a checkpoint, so the model is built on
    the meta device (no storage, no random init) and given uninitialised storage (``materialize``,
    which keeps the tied embedding tied); the optimizer holds no state until the restore brings it.
    A restore that lacks any value fails before anything is applied, so no garbage is ever trained on.
    """
    torch.set_num_threads(config.threads)
    torch.manual_seed(config.seed)
    random.seed(config.seed)
    np.random.seed(config.seed)
    if for_restore:
        with empty_init():  # the meta device, and torch.nn.init's calls skipped
            model = GPT(config.model)
        materialize(model)
    else:
        model = GPT(config.model)
    optimizer = torch.optim.AdamW(model.param_groups(config.weight_decay), lr=config.lr, betas=(0.9, 0.95))
    # OneCycleLR's state_dict is plain numbers, unlike LambdaLR's, which holds code it cannot save.
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=config.lr, total_steps=config.steps)
    data = TokenStream(config.batch_size, config.model.seq_len, seed=config.seed)
    return Trainer(config, model, optimizer, scheduler, data, {"step": 0, "tokens": 0})


def providers_for(trainer: Trainer) -> dict[str, StateProvider]:
    """Every piece of state whose loss would make a resumed run diverge from the original."""
    return {
        "model": ModuleProvider(trainer.model),
        "optim": OptimizerProvider(trainer.optimizer),
        "sched": StatefulProvider(trainer.scheduler),
        "data": StatefulProvider(trainer.data),
        "rng": RNGProvider(),  # dropout draws from the global torch generator
        "trainer": ObjectProvider(trainer.counters),
    }


def make_runner(config_path: str | os.PathLike[str], root: Path) -> Runner:
    """A runner with each tier of the YAML redirected to ``root/<tier name>``, so runs never mix."""
    tiers = load_config(config_path).tiers
    return Runner.from_yaml(config_path, overrides={f"tiers.{name}.path": str(root / name) for name in tiers})


def attach(runner: Runner, trainer: Trainer) -> None:
    """Register the trainer's state and hook the optimizer, so a step never mutates tensors still being copied."""
    runner.register(**providers_for(trainer))
    runner.attach(trainer.optimizer)


def train_steps(
    trainer: Trainer, until: int, runner: Runner | None = None, every: int = 0
) -> tuple[dict[int, float], list[CheckpointHandle]]:
    """Train from the current step to ``until``; checkpoint after every ``every``-th step when a runner is given.

    Returns the loss of each step (numbered from 1) and the handles of the checkpoints requested.
    The loop does not wait for them: capture overlaps the next forward/backward and the optimizer
    step pre-hook installed by ``runner.attach`` waits only if the copies are not done by then.
    """
    losses: dict[int, float] = {}
    handles: list[CheckpointHandle] = []
    model, optimizer = trainer.model, trainer.optimizer
    model.train()
    while trainer.counters["step"] < until:
        x, y = next(trainer.data)
        _, loss = model(x, y)
        assert loss is not None
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), trainer.config.grad_clip)
        optimizer.step()
        trainer.scheduler.step()
        trainer.counters["step"] += 1
        trainer.counters["tokens"] += x.numel()
        step = trainer.counters["step"]
        losses[step] = loss.item()
        if runner is not None and every and step % every == 0:
            handles.append(runner.checkpoint(step))
    return losses, handles


def _tensor_bytes(tensor: torch.Tensor) -> bytes:
    # Viewing as bytes covers every dtype (numpy has no bfloat16) and 0-dim tensors such as Adam's step.
    return tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def state_digests(trainer: Trainer) -> dict[str, str]:
    """SHA-256 of the parameters and of the optimizer state: equal digests mean bit-identical state."""
    params = hashlib.sha256()
    for name, tensor in trainer.model.state_dict().items():
        params.update(name.encode())
        params.update(_tensor_bytes(tensor))
    optim = hashlib.sha256()
    state = trainer.optimizer.state_dict()["state"]
    for index in sorted(state):
        for name in sorted(state[index]):
            optim.update(f"{index}/{name}".encode())
            optim.update(_tensor_bytes(state[index][name]))
    return {"params": params.hexdigest(), "optimizer": optim.hexdigest()}


def time_torch_save(trainer: Trainer, path: Path, repeats: int = 3) -> list[float]:
    """Seconds per synchronous ``torch.save`` + fsync of the state the runner checkpoints.

    The baseline a trainer pays without asynchronous checkpointing: it blocks for all of this.
    """
    state = {
        "model": trainer.model.state_dict(),
        "optim": trainer.optimizer.state_dict(),
        "sched": trainer.scheduler.state_dict(),
        "data": trainer.data.state_dict(),
        "rng": torch.get_rng_state(),
        "trainer": dict(trainer.counters),
    }
    seconds = []
    try:
        for _ in range(repeats):
            started = time.perf_counter()
            with open(path, "wb") as file:
                torch.save(state, file)
                file.flush()
                os.fsync(file.fileno())
            seconds.append(time.perf_counter() - started)
    finally:
        path.unlink(missing_ok=True)
    return seconds


def resume_and_train(config: TrainConfig, config_path: str | os.PathLike[str], root: Path, step: int) -> dict[str, Any]:
    """What the fresh process does: build (without init: the restore sets every value), restore checkpoint
    ``step``, train to the end."""
    trainer = build(config, for_restore=True)
    with make_runner(config_path, root) as runner:
        attach(runner, trainer)
        restored = runner.restore(step)
    if trainer.counters["step"] != step:
        raise RuntimeError(f"restored step {step} but the trainer counters say {trainer.counters['step']}")
    losses, _ = train_steps(trainer, config.steps)
    return {
        "restored_step": restored.step,
        "tier": restored.tier,
        "restore_s": restored.seconds,
        "losses": {str(s): loss for s, loss in losses.items()},  # json keeps floats exact (repr round-trips)
        "digests": state_digests(trainer),
    }


def run_resumed(config: TrainConfig, config_path: str | os.PathLike[str], root: Path, step: int) -> dict[str, Any]:
    """Run :func:`resume_and_train` in a new Python process and return its report."""
    out = root / f"resumed-from-{step}.json"
    command = [
        sys.executable, str(Path(__file__).resolve()),
        "--config", str(Path(config_path).resolve()), "--dir", str(root.resolve()),
        "--resume-step", str(step), "--out", str(out.resolve()), *config_argv(config),
    ]
    proc = subprocess.run(command, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"resumed process exited with {proc.returncode}:\n{proc.stderr}")
    return json.loads(out.read_text())


# --- command line: the child process must be given exactly the parent's TrainConfig ---------------
_TRAIN_FLAGS = [f.name for f in fields(TrainConfig) if f.name != "model"]
_MODEL_FLAGS = [f.name for f in fields(GPTConfig) if f.name != "vocab_size"]


def config_argv(config: TrainConfig) -> list[str]:
    """Flags that make :func:`parse_args` rebuild ``config``; ``repr`` keeps floats exact."""
    values = {**{name: getattr(config, name) for name in _TRAIN_FLAGS}, **asdict(config.model)}
    return [arg for name in _TRAIN_FLAGS + _MODEL_FLAGS for arg in (f"--{name.replace('_', '-')}", repr(values[name]))]


def parse_args(argv: list[str] | None = None) -> tuple[argparse.Namespace, TrainConfig]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], prog="train_gpt")
    parser.add_argument("--config", default=str(DEFAULT_CONFIG), help="tierstate pipeline YAML")
    parser.add_argument("--dir", type=Path, help="checkpoint root (default: ./checkpoints/demo-<timestamp>)")
    parser.add_argument("--resume-step", type=int, help="internal: restore this step, train on, write --out")
    parser.add_argument("--verify-from", type=int, help="checkpoint step the fresh process resumes from")
    parser.add_argument("--out", type=Path, help="internal: JSON report of the resumed process")
    defaults = TrainConfig()
    for name in _TRAIN_FLAGS:
        value = getattr(defaults, name)
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    for name in _MODEL_FLAGS:
        value = getattr(defaults.model, name)
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    args = parser.parse_args(argv)
    model = GPTConfig(**{name: getattr(args, name) for name in _MODEL_FLAGS})
    config = TrainConfig(**{name: getattr(args, name) for name in _TRAIN_FLAGS}, model=model)
    if config.every < 1 or config.every > config.steps:
        parser.error(f"--every must be between 1 and --steps ({config.steps}), got {config.every}")
    return args, config


def default_resume_step(config: TrainConfig) -> int:
    """The checkpoint nearest the middle, so the fresh process has a good half of the run to diverge in."""
    return max(config.every, config.steps // 2 // config.every * config.every)


# --- the demo ---------------------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args, config = parse_args(argv)
    if args.resume_step is not None:
        if args.dir is None or args.out is None:
            raise SystemExit("--resume-step needs --dir and --out")
        report = resume_and_train(config, args.config, args.dir, args.resume_step)
        args.out.write_text(json.dumps(report))
        return 0

    root: Path = args.dir or Path("checkpoints") / f"demo-{datetime.now():%Y%m%d-%H%M%S-%f}"
    if root.exists() and any(root.iterdir()):
        raise SystemExit(f"{root} is not empty; give a fresh --dir")
    resume_step = default_resume_step(config) if args.verify_from is None else args.verify_from
    if resume_step % config.every or not 0 < resume_step <= config.steps:
        raise SystemExit(f"--verify-from {resume_step} is not a checkpoint step (a multiple of {config.every}, "
                         f"at most {config.steps})")

    trainer = build(config)
    with make_runner(args.config, root) as runner:
        attach(runner, trainer)
        started = time.perf_counter()
        losses, handles = train_steps(trainer, config.steps, runner, config.every)
        train_s = time.perf_counter() - started
        runner.wait()
        try:
            results = [handle.result() for handle in handles]
        except CheckpointFailed as exc:
            print(f"checkpoint failed: {exc}", file=sys.stderr)
            return 1
        blocked = [handle.blocked_s for handle in handles]  # final: includes the optimizer pre-hook waits
        save_s = time_torch_save(trainer, root / "torch_save.pt")
    digests = state_digests(trainer)
    resumed = run_resumed(config, args.config, root, resume_step)

    after = [s for s in losses if s > resume_step]
    same_losses = [s for s in after if resumed["losses"].get(str(s)) == losses[s]]
    losses_match = len(same_losses) == len(after) == len(resumed["losses"])
    params_match = resumed["digests"]["params"] == digests["params"]
    optim_match = resumed["digests"]["optimizer"] == digests["optimizer"]
    matches = losses_match and params_match and optim_match

    _report(trainer, root, losses, train_s, results, blocked, save_s, resumed)
    print(f"losses of steps {resume_step + 1}..{config.steps} identical: {len(same_losses)}/{len(after)}; "
          f"parameters identical: {_yes(params_match)}; optimizer state identical: {_yes(optim_match)}")
    print(f"resumed training matches: {_yes(matches)}")
    return 0 if matches else 1


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _report(
    trainer: Trainer,
    root: Path,
    losses: dict[int, float],
    train_s: float,
    results: list[CheckpointResult],
    blocked: list[float],
    save_s: list[float],
    resumed: dict[str, Any],
) -> None:
    """Print the run summary and one row per checkpoint next to the synchronous torch.save baseline."""
    from rich.console import Console
    from rich.table import Table

    config = trainer.config
    save_ms = statistics.median(save_s) * 1e3
    params = sum(p.numel() for p in trainer.model.parameters())
    console = Console(highlight=False)
    console.print(f"GPT {params / 1e6:.2f}M params, {config.steps} steps in {train_s:.1f} s, "
                  f"loss {losses[1]:.3f} -> {losses[config.steps]:.3f}")
    console.print(f"checkpoints: {root}", soft_wrap=True)
    table = Table(title=f"checkpoint every {config.every} steps vs torch.save + fsync (median of {len(save_s)})")
    for column in ("step", "MiB", "blocked ms", "capture ms", "durable ms", "torch.save ms", "ratio"):
        table.add_column(column, justify="right")
    for result, blocked_s in zip(results, blocked, strict=True):
        table.add_row(
            str(result.step), f"{result.raw_bytes / 2**20:.1f}", f"{blocked_s * 1e3:.2f}",
            f"{result.capture_s * 1e3:.1f}", f"{result.durable_s * 1e3:.1f}", f"{save_ms:.1f}",
            f"{save_ms / max(blocked_s * 1e3, 1e-3):.0f}x",
        )
    console.print(table)
    console.print(f"fresh process restored step {resumed['restored_step']} from tier {resumed['tier']} "
                  f"in {resumed['restore_s'] * 1e3:.1f} ms and trained to step {config.steps}")


if __name__ == "__main__":
    sys.exit(main())
