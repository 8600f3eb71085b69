"""The s3 tier against a real S3-protocol server on 127.0.0.1 (moto; MinIO too if TIERSTATE_TEST_MINIO names it)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request

import pytest
import torch

pytest.importorskip("boto3")
pytest.importorskip("moto.server")

import s3server
from s3server import FaultyProxy

from conftest import REPO
from tierstate.providers import TensorDictProvider
from tierstate.tiers.reading.source import ByteSource
from tierstate.tiers.reading.stored import CorruptCheckpointError, StoredCheckpoint, load
from tierstate.tiers.storage.filesystem import CheckpointExistsError, FilesystemTier, TierError
from tierstate.tiers.storage.objstore import ObjectStore, parse_s3_url
from tierstate.tiers.storage.s3tier import S3Tier

# The server and a fresh bucket per test (tests/tiers/s3server.py).
endpoint = s3server.endpoint
bucket = s3server.bucket
MiB = 1 << 20
def _tier(endpoint: str, url: str, **options) -> S3Tier:
    store = ObjectStore("bucket", url, endpoint_url=endpoint, region="us-east-1", **options)
    store.check()
    return S3Tier("bucket", store)


def _state(seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {"big": torch.randn(3 * MiB, generator=gen), "bf16": torch.randn(64, 33, generator=gen).to(torch.bfloat16)}


@pytest.fixture
def nvme_step(make_runner, tmp_path) -> tuple[FilesystemTier, dict[str, torch.Tensor]]:
    """Step 5 committed on nvme (12 MiB data file in 1 MiB frames); the tier, and the state saved."""
    runner = make_runner(chunk_size="1MiB", host_cache__size="16MiB")
    state = _state()
    runner.register(t=TensorDictProvider(state))
    runner.checkpoint(5).result()
    runner.close()
    return FilesystemTier("nvme", tmp_path / "nvme"), {f"t/{k}": v.clone() for k, v in state.items()}


def _same(loaded: dict, expected: dict) -> bool:
    return all(torch.equal(loaded[k].view(torch.uint8), v.view(torch.uint8)) for k, v in expected.items())


def test_parse_urls():
    assert parse_s3_url("s3://my-bucket/run7/ckpt/").prefix == "run7/ckpt"
    assert parse_s3_url("s3://my-bucket").prefix == ""
    for bad in ("s3:/x/y", "gs://b/x", "s3://B/x", "s3://bkt/a//b", "s3://bkt/a/../b"):
        with pytest.raises(TierError):
            parse_s3_url(bad)


def test_commit_then_restore_bit_exact_after_local_tiers_wiped(endpoint, bucket, nvme_step, tmp_path):
    nvme, expected = nvme_step
    tier = _tier(endpoint, f"s3://{bucket}/run 7/ckpt+α", part_size=5 * MiB)  # odd characters in the prefix
    report = tier.upload(nvme.step_dir(5), nvme.manifest(5))
    assert report.outcome == "copied" and report.bytes > 12 * MiB
    assert tier.steps() == [5]
    assert tier.upload(nvme.step_dir(5), nvme.manifest(5)).outcome == "already there"  # idempotent
    for path in (tmp_path / "nvme", tmp_path / "pfs"):
        subprocess.run(["rm", "-rf", str(path)], check=True)
    restored = FilesystemTier("nvme", tmp_path / "nvme")
    tier.download(5, restored)
    assert restored.steps() == [5]
    assert _same(load(restored.step_dir(5)), expected)


def test_a_prefix_without_manifest_is_no_checkpoint_and_two_writers_publish_once(endpoint, bucket, nvme_step):
    nvme, _ = nvme_step
    url = f"s3://{bucket}/shared"
    tier = _tier(endpoint, url)
    tier.store.put_bytes("step-9/rank-00000.data", b"half a checkpoint")
    assert tier.steps() == []
    manifest = nvme.manifest(5)
    body = (nvme.step_dir(5) / "manifest.json").read_bytes()
    results: list[BaseException | None] = []
    barrier = threading.Barrier(2)

    def publish() -> None:
        writer = _tier(endpoint, url)
        barrier.wait()
        try:
            writer.store.put_bytes("step-5/manifest.json", body, if_absent=True)
            results.append(None)
        except BaseException as exc:  # judged below
            results.append(exc)

    threads = [threading.Thread(target=publish) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert sum(r is None for r in results) == 1
    (lost,) = [r for r in results if r is not None]
    assert isinstance(lost, CheckpointExistsError) and "tier bucket" in str(lost) and "already exists" in str(lost)
    assert manifest.step == 5


def test_corrupted_object_detected_and_nothing_committed(endpoint, bucket, nvme_step, tmp_path):
    nvme, _ = nvme_step
    tier = _tier(endpoint, f"s3://{bucket}/c")
    tier.upload(nvme.step_dir(5), nvme.manifest(5))
    name = "step-5/rank-00000.data"
    data = bytearray(tier.store.get_bytes(name))
    data[MiB + 17] ^= 0xFF
    tier.store.put_bytes(name, bytes(data))
    target = FilesystemTier("fresh", tmp_path / "fresh")
    with pytest.raises(CorruptCheckpointError, match=r"rank-00000\.data frame 1.*step 5 on tier bucket"):
        tier.download(5, target)
    assert target.steps() == [] and not target.partial_dir(5).exists()


def test_corrupt_source_is_never_uploaded(endpoint, bucket, nvme_step):
    nvme, _ = nvme_step
    path = nvme.step_dir(5) / "rank-00000.data"
    with open(path, "r+b") as f:
        f.seek(2 * MiB + 3)
        byte = f.read(1)
        f.seek(2 * MiB + 3)
        f.write(bytes([byte[0] ^ 1]))
    tier = _tier(endpoint, f"s3://{bucket}/x")
    with pytest.raises(CorruptCheckpointError, match="not uploading"):
        tier.upload(nvme.step_dir(5), nvme.manifest(5))
    assert tier.store.list("") == []


def test_missing_credentials_named_at_check(endpoint, bucket, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(TierError, match=r"tier bucket: no S3 credentials found for s3://.*AWS_ACCESS_KEY_ID"):
        _tier(endpoint, f"s3://{bucket}/p")


def test_missing_bucket_named_at_check(endpoint):
    with pytest.raises(TierError, match=r"tier bucket: bucket 'no-such-bucket-here' does not exist"):
        _tier(endpoint, "s3://no-such-bucket-here/p")


def test_drops_and_throttling_are_retried(endpoint, bucket, nvme_step, tmp_path):
    nvme, expected = nvme_step
    proxy = FaultyProxy(endpoint)
    try:
        tier = _tier(proxy.endpoint, f"s3://{bucket}/flaky", part_size=5 * MiB, workers=1)
        proxy.plan = ["drop", "503", "503", "pass", "drop", "503"]
        tier.upload(nvme.step_dir(5), nvme.manifest(5))
        proxy.plan = ["503", "drop", "pass", "503", "drop"]
        target = FilesystemTier("fresh", tmp_path / "fresh")
        tier.download(5, target)
        assert _same(load(target.step_dir(5)), expected)
        assert proxy.seen > 11
        # Throttled for good: fails, naming the tier, after its retries (one, here: each waits up to twice as
        # long as the one before, 20 s in all for the default 5).
        impatient = _tier(proxy.endpoint, f"s3://{bucket}/flaky", retries=1)
        proxy.plan = ["503"] * 50
        with pytest.raises(TierError, match="tier bucket: cannot list"):
            impatient.steps()
    finally:
        proxy.close()


_KILLED_UPLOAD = """
import sys
from pathlib import Path
from tierstate.tiers.storage.filesystem import FilesystemTier
from tierstate.tiers.storage.objstore import ObjectStore
from tierstate.tiers.storage.s3tier import S3Tier
nvme = FilesystemTier("nvme", Path(sys.argv[1]))
tier = S3Tier("bucket", ObjectStore("bucket", sys.argv[2], endpoint_url=sys.argv[3], part_size=5 << 20, workers=1))
tier.upload(nvme.step_dir(5), nvme.manifest(5))
"""


@pytest.mark.slow
def test_kill_during_multipart_upload_leaves_no_checkpoint_and_gc_cleans(endpoint, bucket, nvme_step):
    nvme, _ = nvme_step
    url = f"s3://{bucket}/killed"
    env = {**os.environ, "TIERSTATE_FAULT": "s3.part@2"}
    killed = subprocess.run(
        [sys.executable, "-c", _KILLED_UPLOAD, str(nvme.root), url, endpoint], cwd=REPO, env=env,
        capture_output=True, text=True,
    )
    assert killed.returncode == -9, killed.stderr
    tier = _tier(endpoint, url)
    assert tier.steps() == []
    assert len(tier.store.uploads()) == 1  # the data file's upload, cut after its 2nd part
    assert tier.collect_garbage(older_than=3600) == []  # within the grace period: a writer may be at work
    found = tier.collect_garbage(older_than=0)  # its writer is gone from this host: its claim is stale
    assert {f.kind for f in found} == {"incomplete upload", "orphan object", "stale claim"}  # the index went first
    assert tier.store.uploads() == [] and tier.store.list("") == []


def test_restore_reads_the_bucket_through_the_byte_source(endpoint, bucket, nvme_step):
    nvme, expected = nvme_step
    tier = _tier(endpoint, f"s3://{bucket}/direct")
    tier.upload(nvme.step_dir(5), nvme.manifest(5))
    source = tier.source(5)
    assert isinstance(source, ByteSource) and source.where == f"s3://{bucket}/direct/step-5"
    stored = StoredCheckpoint(source, step=5)
    assert _same(stored.read(workers=4), expected)
    name = "step-5/rank-00000.data"
    data = bytearray(tier.store.get_bytes(name))
    data[2 * MiB + 5] ^= 0x10
    tier.store.put_bytes(name, bytes(data))
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        StoredCheckpoint(tier.source(5), step=5).read()
    tier.store.put_bytes(name, bytes(data[: 2 * MiB]))  # truncated: refused before anything is allocated
    with pytest.raises(StoredCheckpoint.COPY_ERRORS):
        StoredCheckpoint(tier.source(5), step=5).read()
    tier.store.delete([name])
    with pytest.raises(StoredCheckpoint.COPY_ERRORS):
        StoredCheckpoint(tier.source(5), step=5).read()


def _moto_auth(endpoint: str, free_requests: str) -> None:
    """moto checks credentials after ``free_requests`` more requests ("inf": never, its default);
    a MinIO server always checks them and has no such switch."""
    request = urllib.request.Request(
        f"{endpoint}/moto-api/reset-auth", data=free_requests.encode(), method="POST",
        headers={"Content-Type": "text/plain"},  # a form body would be parsed away from request.data
    )
    try:
        urllib.request.urlopen(request, timeout=10).close()
    except urllib.error.HTTPError:
        pass


def test_wrong_credentials_refused_naming_the_tier(endpoint, bucket, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "AKIAIOSFODNN7WRONGKEY")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    _moto_auth(endpoint, "0")
    try:
        with pytest.raises(TierError, match=rf"tier bucket: the S3 credentials were refused .* s3://{bucket}"):
            _tier(endpoint, f"s3://{bucket}/p")
    finally:
        _moto_auth(endpoint, "inf")
