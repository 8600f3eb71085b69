"""A convolutional net with BatchNorm, whose running statistics change in every forward.

The example GPT has no buffers that change in forward (LayerNorm only), so its checkpoints are all
lazy; this model is the other case: every checkpoint must copy the BatchNorm buffers before
``checkpoint()`` returns, and the blocked-time benchmark shows what that costs.
"""

from __future__ import annotations

import torch
from torch import nn

from .gpt_state import GPTState

# Channels by preset: 8 conv blocks of C x C x 3 x 3 (+ AdamW's two moments).
BN_PRESETS: dict[str, int] = {"tiny": 32, "small": 64, "medium": 256, "full": 512}  # full: ~19 M params, ~0.23 GB


class BNNet(nn.Module):
    """conv -> BatchNorm -> ReLU blocks and a linear head; ``forward(x, y)`` returns (logits, loss) like the GPT."""

    def __init__(self, channels: int, blocks: int = 8, classes: int = 10) -> None:
        super().__init__()
        layers: list[nn.Module] = [nn.Conv2d(3, channels, 3, padding=1), nn.BatchNorm2d(channels), nn.ReLU()]
        for _ in range(blocks - 1):
            layers += [nn.Conv2d(channels, channels, 3, padding=1, bias=False), nn.BatchNorm2d(channels), nn.ReLU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Linear(channels, classes)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = self.head(self.body(x).mean(dim=(2, 3)))
        return logits, nn.functional.cross_entropy(logits, y)


class ImageStream:
    """Random 16x16 images and labels from a seeded generator: the data the BatchNorm net trains on."""

    def __init__(self, batch_size: int, seed: int = 0) -> None:
        self.batch_size = batch_size
        self.generator = torch.Generator().manual_seed(seed)

    def __iter__(self) -> ImageStream:
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.randn(self.batch_size, 3, 16, 16, generator=self.generator)
        return x, torch.randint(0, 10, (self.batch_size,), generator=self.generator)


def build_bn_net(preset: str, batch_size: int = 8, warm_steps: int = 1, seed: int = 0) -> GPTState:
    """The BatchNorm net at ``preset`` size in the same training-state wrapper as the GPT."""
    torch.manual_seed(seed)
    model = BNNet(BN_PRESETS[preset])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    state = GPTState(model, optimizer, ImageStream(batch_size, seed))  # type: ignore[arg-type]
    for _ in range(warm_steps):
        state.train_step()
    state.optimizer.zero_grad(set_to_none=True)
    return state
