"""The stand-ins the README's blocks are run with (each named in the README's ``readme-test`` comment
above its block), and the checkpoints a console block reads, made by real runners.

Imported by the test in-process (to prepare a working directory) and by the blocks' subprocesses
(their preludes put this folder on ``sys.path``), so a block and the checkpoint it reads use the
same model.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from tierstate import Runner
from tierstate.cli import main as cli

HERE = Path(__file__).resolve().parent


class Output:
    """What an HF model returns, as far as the README's loop uses it."""

    def __init__(self, loss: torch.Tensor) -> None:
        self.loss = loss


class LossModel(nn.Module):
    """The embedding example's ``model``: returns an object with ``.loss``, as HF models do."""

    def __init__(self) -> None:
        super().__init__()
        self.layer = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> Output:
        return Output(self.layer(x).pow(2).mean())


def mlp() -> nn.Sequential:
    """The CLI section's model: two bf16 Linear layers (5 MiB with AdamW's moments: several 1 MiB frames)."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512)).to(torch.bfloat16)


def stepped(model: nn.Module, lr: float = 1e-3) -> torch.optim.Optimizer:
    """An AdamW that has taken one step, so it holds state."""
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    opt.zero_grad()
    return opt


@dataclass
class GPTConfig:
    vocab: int = 64
    dim: int = 32


class GPT(nn.Module):
    """The Recovery example's ``GPT(config)``: an embedding tied to the output layer."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.embed = nn.Embedding(config.vocab, config.dim)
        self.block = nn.Linear(config.dim, config.dim)
        self.head = nn.Linear(config.dim, config.vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.relu(self.block(self.embed(tokens))))


def small_runner(workdir: Path, **tiers: str) -> Runner:
    """A runner with 1 MiB chunks writing to the first of ``tiers`` (name=relative path)."""
    return Runner.from_dict({
        "chunk_size": "1MiB", "host_cache": {"size": "16MiB"},
        "tiers": {name: {"path": str(workdir / path)} for name, path in tiers.items()},
    })  # fmt: skip


def write_mlp_steps(workdir: Path, steps: list[int]) -> None:
    """``steps`` of the CLI section's model + AdamW on ``checkpoints/nvme`` (as configs/tiered.yaml names it)."""
    model = mlp()
    opt = stepped(model)
    with small_runner(workdir, nvme="checkpoints/nvme") as runner:
        runner.register(model=model, optim=opt)
        for step in steps:
            opt.step()
            runner.checkpoint(step).result()


def migrate(workdir: Path, step: int, source: str = "nvme", target: str = "pfs") -> None:
    """Copy a step between the tiers of configs/tiered.yaml, as ``tierstate migrate`` does (verified)."""
    tiers = [f"--tier={name}={workdir / 'checkpoints' / name}" for name in ("nvme", "pfs")]
    assert cli(["migrate", str(step), "--from", source, "--to", target, *tiers]) == 0


def killed_migration(workdir: Path, step: int) -> None:
    """Leave ``checkpoints/pfs/step-N.partial`` as a migration SIGKILLed after its 3rd frame leaves it."""
    done = subprocess.run(
        ["tierstate", "migrate", str(step), "--from", "nvme", "--to", "pfs", "--config", "tiered"],
        cwd=workdir, env={**environment(workdir.parent / "bin"), "TIERSTATE_FAULT": "migrate.frame@3"},
        capture_output=True, check=False,
    )  # fmt: skip
    assert done.returncode == -9, done
    assert (workdir / "checkpoints" / "pfs" / f"step-{step}.partial").is_dir()


def abandoned_partial(workdir: Path, tier: str, step: int, age_s: float) -> None:
    """A ``step-N.partial`` a crashed writer left ``age_s`` ago."""
    partial = workdir / "checkpoints" / tier / f"step-{step}.partial"
    partial.mkdir(parents=True)
    (partial / "rank-00000.data").write_bytes(b"\0" * 4096)
    then = time.time() - age_s
    for path in (partial / "rank-00000.data", partial):
        os.utime(path, (then, then))


def damage_frame(step_dir: Path, frame: int) -> None:
    """Flip a byte inside data frame ``frame`` of rank 0 (found through the index, never in padding)."""
    from tierstate.tiers.reading.source import DirectorySource
    from tierstate.tiers.reading.stored import StoredCheckpoint

    record = StoredCheckpoint(DirectorySource(step_dir)).manifest.files["rank-00000.data"].frames[frame]
    data = step_dir / "rank-00000.data"
    with data.open("r+b") as f:
        f.seek(record.offset + record.length // 2)
        byte = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([byte[0] ^ 0xFF]))


def tiny_gpt2() -> Any:
    """The HF export's model: a one-layer GPT-2 of transformers itself."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=128, n_positions=64))


def remove(path: Path) -> None:
    shutil.rmtree(path)


def on_path(scratch: Path) -> str:
    """PATH with this Python's scripts first, so that ``tierstate``, ``python`` and ``torchrun`` are this
    environment's. A venv that shares another's torch lacks its ``torchrun`` script: then one is made
    in ``scratch``, doing what torch's does (``python -m torch.distributed.run``)."""
    scripts = Path(sys.executable).parent
    path = f"{scripts}{os.pathsep}{os.environ.get('PATH', '')}"
    if not (scripts / "torchrun").exists():
        scratch.mkdir(exist_ok=True)
        shim = scratch / "torchrun"
        shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m torch.distributed.run "$@"\n')
        shim.chmod(0o755)
        path = f"{scratch}{os.pathsep}{path}"
    return path


def environment(scratch: Path) -> dict[str, str]:
    """The environment a README command runs in: this one, without test hooks, this Python first on PATH."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("TIERSTATE_")}
    return {**env, "PATH": on_path(scratch), "PYTHONUNBUFFERED": "1"}
