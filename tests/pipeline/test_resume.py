"""Resume equivalence: training N steps straight equals training k, checkpointing, and resuming in a new process.

The resumed half runs in a subprocess on purpose: within one process, state the checkpoint forgot
(an RNG, the data position, a scheduler counter) could survive in memory and hide the omission.
Equality is bit for bit, since a resumed run that is merely close drifts further with every step.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from examples.gpt import GPTConfig, TokenStream
from examples.train_gpt import (
    DEFAULT_CONFIG,
    REPO_ROOT,
    TrainConfig,
    attach,
    build,
    make_runner,
    run_resumed,
    state_digests,
    train_steps,
)

# Small enough that both processes together take a few seconds, but with every kind of state:
# dropout (global RNG), tied weights, two AdamW param groups, a scheduler and the data stream.
TINY = TrainConfig(steps=8, every=3, batch_size=4, model=GPTConfig(seq_len=16, d_model=32, n_layers=2, n_heads=2))


@pytest.mark.parametrize("yaml_name", ["default.yaml", "compressed.yaml"])
def test_resume_in_new_process_is_bit_identical(tmp_path: Path, yaml_name: str) -> None:
    config_path = REPO_ROOT / "configs" / yaml_name
    straight = build(TINY)
    straight_losses, _ = train_steps(straight, TINY.steps)

    first = build(TINY)
    with make_runner(config_path, tmp_path) as runner:
        attach(runner, first)
        first_losses, handles = train_steps(first, TINY.every, runner, TINY.every)
        assert [h.result().step for h in handles] == [TINY.every]
    # Checkpointing while training must not perturb training itself.
    assert first_losses == {s: straight_losses[s] for s in range(1, TINY.every + 1)}

    resumed = run_resumed(TINY, config_path, tmp_path, TINY.every)

    assert resumed["restored_step"] == TINY.every
    assert resumed["losses"] == {str(s): straight_losses[s] for s in range(TINY.every + 1, TINY.steps + 1)}
    assert resumed["digests"] == state_digests(straight)


def test_token_stream_refuses_state_of_a_differently_built_stream() -> None:
    source = TokenStream(batch_size=4, seq_len=16, seed=0)
    next(source)
    with pytest.raises(ValueError, match="batch_size"):
        TokenStream(batch_size=8, seq_len=16, seed=0).load_state_dict(source.state_dict())


def test_token_stream_resumes_its_sequence() -> None:
    source = TokenStream(batch_size=4, seq_len=16, seed=0)
    next(source)
    saved = source.state_dict()
    expected = next(source)
    resumed = TokenStream(batch_size=4, seq_len=16, seed=0)
    resumed.load_state_dict(saved)
    assert resumed.position == 1
    assert all(a.equal(b) for a, b in zip(next(resumed), expected, strict=True))


@pytest.mark.slow
def test_demo_script_end_to_end(tmp_path: Path) -> None:
    # Run as a script from another directory, the way a user would, to cover its sys.path setup.
    proc = subprocess.run(
        [sys.executable, str(REPO_ROOT / "examples" / "train_gpt.py"), "--config", str(DEFAULT_CONFIG),
         "--dir", str(tmp_path / "demo"), "--steps", "12", "--every", "4"],
        cwd=tmp_path, capture_output=True, text=True, check=False, timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "resumed training matches: yes" in proc.stdout
    assert "losses of steps 5..12 identical: 8/8" in proc.stdout
