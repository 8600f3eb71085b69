"""Lightning on a new machine: its local tiers are empty, the bucket holds the run's checkpoints."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("boto3")
pytest.importorskip("moto.server")
pytest.importorskip("lightning")

import lightning as L
import s3server
from torch.utils.data import DataLoader, TensorDataset

from tierstate.integrations.lightning import (
    LightningCheckpointError,
    TierstateCheckpointIO,
    load_from_checkpoint,
    read_pointer,
)
from tierstate.tiers.objstore import ObjectStore
from tierstate.tiers.s3tier import S3Tier

endpoint = s3server.endpoint
bucket = s3server.bucket


class Sized(L.LightningModule):
    def __init__(self, width: int = 3) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Linear(4, width)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], _index: int) -> torch.Tensor:
        return self.net(batch[0]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def _trainer(config: dict, checkpoints: Path, epochs: int) -> L.Trainer:
    return L.Trainer(
        max_epochs=epochs, plugins=[TierstateCheckpointIO(config)], logger=False, enable_progress_bar=False,
        callbacks=[L.pytorch.callbacks.ModelCheckpoint(dirpath=checkpoints, save_last=True)],
        enable_model_summary=False, accelerator="cpu",
    )  # fmt: skip


def _data() -> DataLoader:
    return DataLoader(TensorDataset(torch.randn(8, 4, generator=torch.Generator().manual_seed(0))), batch_size=4)


def test_a_pointer_whose_step_only_the_bucket_holds_loads_and_resumes_from_it(endpoint, bucket, tmp_path):
    url = f"s3://{bucket}/lightning"
    config = {
        "tiers": {
            "nvme": {"path": str(tmp_path / "nvme")},
            "bucket": {"kind": "s3", "url": url, "endpoint_url": endpoint, "region": "us-east-1",
                       "flush": {"every": 1}},
        },
    }  # fmt: skip
    trained = Sized(width=5)
    _trainer(config, tmp_path / "ckpt", 1).fit(trained, _data())
    last = tmp_path / "ckpt" / "last.ckpt"
    pointer = read_pointer(last)
    assert pointer is not None
    held = S3Tier("bucket", ObjectStore("bucket", url, endpoint_url=endpoint)).steps()
    assert pointer["step"] in held
    shutil.rmtree(tmp_path / "nvme")  # a new machine: the checkpoint directory and the bucket came along

    loaded = load_from_checkpoint(Sized, last, config)
    assert loaded.hparams.width == 5 and torch.equal(loaded.net.weight, trained.net.weight)

    resumed = _trainer(config, tmp_path / "ckpt", 2)
    resumed.fit(Sized(width=5), _data(), ckpt_path=last)
    assert resumed.global_step == 4  # two batches an epoch: resumed after epoch 1, not started over

    newest = read_pointer(last)  # the resumed run's last save
    assert newest is not None and newest["step"] > pointer["step"]
    store = ObjectStore("bucket", url, endpoint_url=endpoint)
    store.delete([stored.name for stored in store.list(f"step-{newest['step']}/")])
    shutil.rmtree(tmp_path / "nvme")
    gone = rf"step {newest['step']}, which no tier holds \(nvme=.*, bucket={url}/step-{newest['step']}\)"
    with pytest.raises(LightningCheckpointError, match=gone):
        load_from_checkpoint(Sized, last, config)
