"""A Lightning run for tests/integrations/test_lightning.py, in a process of its own (it may be SIGKILLed).

Usage: ``python lightning_worker.py ROOT MAX_EPOCHS [--resume] [--hang-at STEP]``. Prints ``loss STEP HEX``
for every training step (the float's exact bits). ``--hang-at STEP``: before that step, waits until every
checkpoint requested so far is durable, prints ``READY`` and blocks, for the test to kill it.
"""

from __future__ import annotations

import sys

import lightning as L
import torch
from torch.utils.data import DataLoader, TensorDataset

from tierstate.integrations.lightning import TierstateCheckpointIO

BATCHES_PER_EPOCH = 4


class Regression(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.save_hyperparameters({"width": 8})
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8), torch.nn.Linear(8, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _index: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.net(x), y)
        print(f"loss {self.global_step} {loss.item().hex()}", flush=True)
        return loss

    def configure_optimizers(self):
        optimizer = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return [optimizer], [torch.optim.lr_scheduler.StepLR(optimizer, 3, 0.5)]


class HangAt(L.Callback):
    """Before global step ``step``: every checkpoint so far durable, then READY, then block until killed."""

    def __init__(self, io: TierstateCheckpointIO, step: int) -> None:
        self.io, self.step = io, step

    def on_train_batch_start(self, trainer: L.Trainer, *_args: object) -> None:
        if trainer.global_step == self.step:
            self.io.wait()
            print("READY", flush=True)
            sys.stdin.read()


def main(argv: list[str]) -> None:
    root, max_epochs = argv[0], int(argv[1])
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(1)
    data = TensorDataset(torch.randn(8 * BATCHES_PER_EPOCH, 4, generator=gen), torch.randn(32, 1, generator=gen))
    io = TierstateCheckpointIO({"tiers": {"nvme": {"path": f"{root}/tiers"}}})
    callbacks: list[L.Callback] = [
        L.pytorch.callbacks.ModelCheckpoint(dirpath=f"{root}/ckpt", save_last=True, every_n_epochs=1)
    ]
    if "--hang-at" in argv:
        callbacks.append(HangAt(io, int(argv[argv.index("--hang-at") + 1])))
    trainer = L.Trainer(
        max_epochs=max_epochs, plugins=[io], callbacks=callbacks, logger=False, enable_progress_bar=False,
        enable_model_summary=False, accelerator="cpu", deterministic=True,
    )  # fmt: skip
    trainer.fit(Regression(), DataLoader(data, batch_size=8), ckpt_path="last" if "--resume" in argv else None)
    print(f"failures {len(io.failures)}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
