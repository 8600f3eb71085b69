"""Lightning on a new machine: its local tiers are empty, the bucket holds the run's checkpoints."""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("boto3")
pytest.importorskip("moto.server")
pytest.importorskip("lightning")

import s3server
from lightning_sized import Sized, sized_data, sized_trainer

from tierstate.integrations.lightning import LightningCheckpointError, load_from_checkpoint, read_pointer
from tierstate.tiers.storage.objstore import ObjectStore
from tierstate.tiers.storage.s3tier import S3Tier

endpoint = s3server.endpoint
bucket = s3server.bucket


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
    sized_trainer(config, tmp_path / "ckpt", 1).fit(trained, sized_data())
    last = tmp_path / "ckpt" / "last.ckpt"
    pointer = read_pointer(last)
    assert pointer is not None
    held = S3Tier("bucket", ObjectStore("bucket", url, endpoint_url=endpoint)).steps()
    assert pointer["step"] in held
    shutil.rmtree(tmp_path / "nvme")  # a new machine: the checkpoint directory and the bucket came along

    loaded = load_from_checkpoint(Sized, last, config)
    assert loaded.hparams.width == 5 and torch.equal(loaded.net.weight, trained.net.weight)

    resumed = sized_trainer(config, tmp_path / "ckpt", 2)
    resumed.fit(Sized(width=5), sized_data(), ckpt_path=last)
    assert resumed.global_step == 4  # two batches an epoch: resumed after epoch 1, not started over

    newest = read_pointer(last)  # the resumed run's last save
    assert newest is not None and newest["step"] > pointer["step"]
    store = ObjectStore("bucket", url, endpoint_url=endpoint)
    store.delete([stored.name for stored in store.list(f"step-{newest['step']}/")])
    shutil.rmtree(tmp_path / "nvme")
    gone = rf"step {newest['step']}, which no tier holds \(nvme=.*, bucket={url}/step-{newest['step']}\)"
    with pytest.raises(LightningCheckpointError, match=gone):
        load_from_checkpoint(Sized, last, config)
