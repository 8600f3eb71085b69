"""The small LightningModule the Lightning tests train (tests/integrations/test_lightning.py and
tests/tiers/test_s3_lightning.py), a Trainer saving through tierstate, and its data.

Imports Lightning: import it after ``pytest.importorskip("lightning")``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from tierstate.integrations.lightning import TierstateCheckpointIO


class Sized(L.LightningModule):
    """A linear layer whose ``width`` is a hyperparameter (saved, so that loading must restore it)."""

    def __init__(self, width: int = 3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(4, width)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _index: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def sized_trainer(config: dict[str, Any], checkpoints: Path, epochs: int) -> L.Trainer:
    """A CPU Trainer saving through tierstate: a checkpoint each epoch and ``last.ckpt`` in ``checkpoints``."""
    return L.Trainer(
        max_epochs=epochs, plugins=[TierstateCheckpointIO(config)], logger=False, enable_progress_bar=False,
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=checkpoints, save_last=True)],
        enable_model_summary=False, accelerator="cpu",
    )  # fmt: skip


def sized_data() -> DataLoader:
    """Two batches an epoch, the same every run."""
    return DataLoader(TensorDataset(torch.randn(8, 4, generator=torch.Generator().manual_seed(0))), batch_size=4)
