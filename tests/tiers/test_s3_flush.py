"""A runner with a ``kind: s3`` tier: flushed to after each commit, restored from when local tiers are wiped."""

from __future__ import annotations

import shutil

import pytest
import torch

pytest.importorskip("boto3")
pytest.importorskip("moto.server")

import s3server

from tierstate.pipeline.config import ConfigError
from tierstate.providers import TensorDictProvider
from tierstate.tiers.filesystem import TierError
from tierstate.tiers.objstore import ObjectStore
from tierstate.tiers.s3tier import S3Tier

# The server and a fresh bucket per test (tests/tiers/s3server.py).
endpoint = s3server.endpoint
bucket = s3server.bucket
MiB = 1 << 20


def _bucket_tier(endpoint: str, url: str, **flush) -> dict:
    return {
        "tiers.bucket": {
            "kind": "s3", "url": url, "endpoint_url": endpoint, "region": "us-east-1",
            "flush": {"every": 1, "workers": 2, **flush}, "retention": {"keep_last": 2},
        }
    }


def test_flush_nvme_to_bucket_then_restore_after_local_tiers_wiped(make_runner, endpoint, bucket, tmp_path):
    url = f"s3://{bucket}/run7/ckpt"
    state = {"w": torch.randn(MiB), "b": torch.arange(1000, dtype=torch.int64)}
    runner = make_runner(chunk_size="1MiB", **_bucket_tier(endpoint, url))
    runner.register(model=TensorDictProvider(state))
    for step in (1, 2, 3):
        state["w"].add_(1)
        runner.checkpoint(step).result()
    expected = {k: v.clone() for k, v in state.items()}
    runner.close()
    assert runner.flush_failures == []
    tier = S3Tier("bucket", ObjectStore("bucket", url, endpoint_url=endpoint))
    assert tier.steps() == [2, 3]  # keep_last: 2 on the bucket
    shutil.rmtree(tmp_path / "nvme")
    shutil.rmtree(tmp_path / "pfs", ignore_errors=True)
    restored = {k: torch.zeros_like(v) for k, v in state.items()}
    again = make_runner(chunk_size="1MiB", **_bucket_tier(endpoint, url))
    again.register(model=TensorDictProvider(restored))
    result = again.restore()
    assert result.step == 3
    assert all(torch.equal(restored[k], expected[k]) for k in expected)


def test_runner_construction_names_a_missing_bucket(make_runner, endpoint):
    with pytest.raises(TierError, match="tier bucket: bucket 'not-there-at-all' does not exist"):
        make_runner(**_bucket_tier(endpoint, "s3://not-there-at-all/x"))


def test_runner_construction_names_missing_credentials(make_runner, endpoint, bucket, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(TierError, match="tier bucket: no S3 credentials found"):
        make_runner(**_bucket_tier(endpoint, f"s3://{bucket}/x"))


def test_a_bucket_is_not_the_persist_tier(make_runner, endpoint, bucket):
    with pytest.raises(ConfigError, match="is a bucket"):
        make_runner(**_bucket_tier(endpoint, f"s3://{bucket}/x"), **{"pipeline.stages.persist.tier": "bucket"})
