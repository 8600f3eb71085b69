"""The "real training state" every method saves: the example GPT, its AdamW and its data, by preset size."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from examples.gpt import GPT, GPTConfig, TokenStream

from .model_state import ModelOptimizerState
from .tensors import iter_tensors

# GPT shapes by preset; "full" is the size: params + AdamW's two moments ~1.5 GB.
GPT_PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(d_model=128, n_layers=2, n_heads=4, seq_len=64),                  # ~0.5 M params, ~6 MB
    "small": GPTConfig(d_model=256, n_layers=4, n_heads=4, seq_len=64),                 # ~3 M params, ~40 MB
    "medium": GPTConfig(d_model=512, n_layers=8, n_heads=8, seq_len=64),                # ~25 M params, ~0.3 GB
    "full": GPTConfig(d_model=1024, n_layers=10, n_heads=16, seq_len=64, dropout=0.1),  # ~126 M params, ~1.5 GB
}

# Denormal floats flushed to zero in every process that trains this GPT: on the CPU, denormals slow its steps
# steadily as it trains (medium preset on the 2-core VM: 0.29 s at first, 0.36 s after 300 steps; flat with
# the flush), which the later runs of an interleaved benchmark took as a cost of theirs (and earlier sections
# of RESULTS.md, as the VM's neighbours).
torch.set_flush_denormal(True)


@dataclass
class GPTState(ModelOptimizerState):
    """The example GPT, its AdamW and its data: the "real training state" every method saves."""

    model: GPT
    optimizer: torch.optim.AdamW
    data: TokenStream
    steps_done: int = 0
    device: torch.device = torch.device("cpu")

    def train_step(self, before_step: Callable[[], object] | None = None) -> float:
        """One forward/backward/step; ``before_step`` runs where an async checkpointer may have to wait."""
        x, y = next(self.data)
        x, y = x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)
        _, loss = self.model(x, y)
        assert loss is not None
        self.optimizer.zero_grad(set_to_none=True)
        loss.backward()
        if before_step is not None:
            before_step()
        self.optimizer.step()
        self.steps_done += 1
        return float(loss.detach())

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())

    def digest(self) -> float:
        """A cheap fingerprint of every parameter and moment, to check that a restore really restored."""
        return sum(float(t.sum()) for t in iter_tensors(self.state_dict()) if t.is_floating_point())

    def scramble(self) -> None:
        """Overwrite every parameter and moment, so a restore that loads nothing is caught."""
        with torch.no_grad():
            for tensor in iter_tensors(self.state_dict()):
                if tensor.is_floating_point():
                    tensor.fill_(0.5)


def build_gpt(
    preset: str | GPTConfig,
    batch_size: int = 4,
    warm_steps: int = 1,
    lr: float = 1e-3,
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> GPTState:
    """The example model at ``preset`` size, trained ``warm_steps`` so AdamW's moments exist and are real."""
    torch.manual_seed(seed)
    config = GPT_PRESETS[preset] if isinstance(preset, str) else preset
    device = torch.device(device)
    model = GPT(config).to(device)
    optimizer = torch.optim.AdamW(model.param_groups(0.1), lr=lr, betas=(0.9, 0.95))
    state = GPTState(model, optimizer, TokenStream(batch_size, config.seq_len, seed=seed), device=device)
    for _ in range(warm_steps):
        state.train_step()
    state.optimizer.zero_grad(set_to_none=True)  # gradients are not checkpointed; do not count them as state
    return state


def build_gpt_for_restore(preset: str, batch_size: int = 4, seed: int = 0) -> GPTState:
    """The GPT and AdamW as a restarted trainer builds them for a restore: the model on the meta device
    (``tierstate.empty_init``), given uninitialised storage (``tierstate.materialize``), AdamW with no state."""
    from tierstate import empty_init, materialize

    config = GPT_PRESETS[preset]
    with empty_init():
        model = GPT(config)
    materialize(model)
    optimizer = torch.optim.AdamW(model.param_groups(0.1), lr=1e-3, betas=(0.9, 0.95))
    return GPTState(model, optimizer, TokenStream(batch_size, config.seq_len, seed=seed))
