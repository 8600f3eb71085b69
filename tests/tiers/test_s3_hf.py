"""A Hugging Face Trainer on a new machine: its local tiers are empty, the bucket holds the run (issue 29)."""

from __future__ import annotations

import logging
import shutil
from pathlib import Path

import pytest
import torch

pytest.importorskip("boto3")
pytest.importorskip("moto.server")
pytest.importorskip("transformers")

import s3server
import transformers

from tierstate.integrations.hf import TierstateCallback

endpoint = s3server.endpoint
bucket = s3server.bucket


def _trainer(tmp_path: Path, config: dict, max_steps: int) -> transformers.Trainer:
    ids = torch.randint(0, 100, (8, 16), generator=torch.Generator().manual_seed(1))
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path / "hf-output"), max_steps=max_steps, per_device_train_batch_size=2,
        learning_rate=1e-3, lr_scheduler_type="linear", save_strategy="no", report_to=[], use_cpu=True,
        disable_tqdm=True, logging_steps=1, seed=0,
    )  # fmt: skip
    config_ = transformers.GPT2Config(vocab_size=100, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(config_)
    dataset = [{"input_ids": row, "labels": row} for row in ids]
    return transformers.Trainer(
        model=model, args=args, train_dataset=dataset, callbacks=[TierstateCallback(config, every=1)]
    )


def test_a_plain_train_on_a_new_machine_resumes_from_the_buckets_copy(endpoint, bucket, tmp_path, caplog):
    """The run flushed steps 1-2 to the bucket; on a machine whose tiers are empty, a plain ``train()`` resumes
    at step 2 from the bucket (said at the default log level, naming the bucket's copy) instead of starting
    afresh over the old run's checkpoints."""
    url = f"s3://{bucket}/hf"
    config = {
        "host_cache": {"size": "64MiB"},
        "tiers": {
            "nvme": {"path": str(tmp_path / "nvme")},
            "bucket": {"kind": "s3", "url": url, "endpoint_url": endpoint, "region": "us-east-1",
                       "flush": {"every": 1}},
        },
    }  # fmt: skip
    first = _trainer(tmp_path, config, 2)
    first.train()
    shutil.rmtree(tmp_path / "nvme")  # a new machine
    caplog.set_level(logging.WARNING)
    resumed = _trainer(tmp_path, config, 3)
    resumed.train()
    said = [r.getMessage() for r in caplog.records if r.name == "tierstate" and "resuming" in r.getMessage()]
    assert len(said) == 1 and f"resuming from step 2 (tier bucket, {url}/step-2)" in said[0], said
    assert resumed.state.global_step == 3
    losses = [entry["loss"] for entry in resumed.state.log_history if "loss" in entry]
    assert len(losses) == 3 and losses[:2] == [e["loss"] for e in first.state.log_history if "loss" in e]
