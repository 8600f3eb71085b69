"""A runner with a ``kind: s3`` tier: flushed to after each commit, restored from when local tiers are wiped."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch

pytest.importorskip("boto3")
pytest.importorskip("moto.server")

import s3server

from tierstate.cli import main as cli_main
from tierstate.pipeline.config import ConfigError
from tierstate.pipeline.fresh import ExistingCheckpointsError
from tierstate.pipeline.restore import NoCheckpointError
from tierstate.providers import TensorDictProvider
from tierstate.tiers.storage.filesystem import FilesystemTier, TierError
from tierstate.tiers.storage.objstore import ObjectStore
from tierstate.tiers.storage.s3tier import S3Tier

# The server and a fresh bucket per test (tests/tiers/s3server.py).
endpoint = s3server.endpoint
bucket = s3server.bucket
MiB = 1 << 20


def _bucket_tier(endpoint: str, url: str, retention: dict | None = None, **flush) -> dict:
    return {
        "tiers.bucket": {
            "kind": "s3", "url": url, "endpoint_url": endpoint, "region": "us-east-1",
            "flush": {"every": 1, "workers": 2, **flush}, "retention": retention or {"keep_last": 2},
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


def test_a_new_machine_sees_the_buckets_steps_and_a_fresh_start_over_them_is_refused(
    make_runner, endpoint, bucket, tmp_path
):
    """With the local tiers empty (a new machine), ``latest_step`` and ``steps`` see the bucket's
    checkpoints, as ``restore("latest")`` does, so a loop that resumes when ``latest_step()`` is not None
    resumes. A fresh start over them is refused, also with ``set_aside=True`` (a bucket has no rename):
    otherwise a later ``latest`` would find the old run's newer steps there."""
    url = f"s3://{bucket}/newmachine"
    state = {"w": torch.randn(MiB)}
    runner = make_runner(chunk_size="1MiB", **_bucket_tier(endpoint, url))
    runner.register(model=TensorDictProvider(state))
    for step in (1, 2):
        runner.checkpoint(step).result()
    runner.close()
    assert runner.flush_failures == []
    shutil.rmtree(tmp_path / "nvme")
    shutil.rmtree(tmp_path / "pfs", ignore_errors=True)
    again = make_runner(chunk_size="1MiB", **_bucket_tier(endpoint, url))
    assert again.latest_step() == 2 and again.steps()["bucket"] == [1, 2]
    for aside in (False, True):
        with pytest.raises(ExistingCheckpointsError, match=r"bucket \(s3://.*/newmachine\): steps \[1, 2\]"):
            again.start_fresh(set_aside=aside)
    again.register(model=TensorDictProvider(state))
    again.checkpoint(3).result()  # a local step, then a fresh start with leave to set aside: refused whole
    with pytest.raises(ExistingCheckpointsError, match="cannot be set aside .*nothing was set aside"):
        again.start_fresh(set_aside=True)
    assert 3 in again.steps()["nvme"]
    again.close()


def test_a_fresh_start_over_a_bucket_it_cannot_list_fails_naming_the_bucket(make_runner, endpoint, bucket):
    """Whether the bucket holds an older run is unknown: not an ExistingCheckpointsError, a TierError on it."""
    import boto3

    url = f"s3://{bucket}/unlisted"
    runner = make_runner(**_bucket_tier(endpoint, url, retries=0))
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").delete_bucket(Bucket=bucket)
    with pytest.raises(TierError, match=rf"cannot tell whether .* tier bucket \(s3://{bucket}/unlisted\): ") as said:
        runner.start_fresh()
    assert not isinstance(said.value, ExistingCheckpointsError)
    runner.close()


def test_runner_construction_names_a_missing_bucket(make_runner, endpoint):
    with pytest.raises(TierError, match="tier bucket: bucket 'not-there-at-all' does not exist"):
        make_runner(**_bucket_tier(endpoint, "s3://not-there-at-all/x"))


def test_runner_construction_names_missing_credentials(make_runner, endpoint, bucket, monkeypatch):
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    with pytest.raises(TierError, match="tier bucket: no S3 credentials found"):
        make_runner(**_bucket_tier(endpoint, f"s3://{bucket}/x"))


def test_a_bucket_without_staging_is_not_the_persist_tier(make_runner, endpoint, bucket):
    with pytest.raises(ConfigError, match="is a bucket .*tiers.bucket.staging"):
        make_runner(**_bucket_tier(endpoint, f"s3://{bucket}/x"), **{"pipeline.stages.persist.tier": "bucket"})


@pytest.mark.parametrize(
    ("key", "value", "said"),
    [("staging_scope", "nodes", "tiers.bucket.staging_scope: must be 'node' or 'shared'"),
     ("stagin", "/tmp/s", "tiers.bucket.stagin: unknown key; did you mean 'staging'?")],
)  # fmt: skip
def test_a_bad_bucket_key_is_named_where_the_yaml_has_it(make_runner, endpoint, bucket, key, value, said):
    settings = _bucket_tier(endpoint, f"s3://{bucket}/x")
    settings["tiers.bucket"] = {**settings["tiers.bucket"], key: value}
    with pytest.raises(ConfigError, match=re.escape(said)):
        make_runner(**settings)


def _persist_to_bucket(endpoint: str, url: str, staging) -> dict:
    settings = _bucket_tier(endpoint, url)
    settings["tiers.bucket"] = {**settings["tiers.bucket"], "staging": str(staging)}
    del settings["tiers.bucket"]["flush"]
    return {**settings, "pipeline.stages.persist.tier": "bucket"}


def test_the_bucket_as_persist_tier_of_one_process(make_runner, endpoint, bucket, tmp_path):
    url = f"s3://{bucket}/persist"
    tier = S3Tier("bucket", ObjectStore("bucket", url, endpoint_url=endpoint))
    state = {"w": torch.randn(3 * MiB), "b": torch.arange(1000, dtype=torch.int64)}
    runner = make_runner(chunk_size="1MiB", **_persist_to_bucket(endpoint, url, tmp_path / "staging"))
    runner.register(model=TensorDictProvider(state))
    for step in (1, 2, 3):
        state["w"].add_(1)
        result = runner.checkpoint(step).result()
        assert result.tier == "bucket" and step in tier.steps()  # durable = its manifest is in the bucket
    expected = {k: v.clone() for k, v in state.items()}
    runner.close()
    assert tier.steps() == [2, 3]  # the bucket's keep_last: 2
    assert FilesystemTier("staging", tmp_path / "staging").steps() == [3]  # staging keeps the newest only
    assert tier.store.uploads() == [] and tier.incomplete_steps() == set()

    # A second run on the same prefix cannot publish step 3 again: its checkpoint fails, naming it.
    other = make_runner(chunk_size="1MiB", **_persist_to_bucket(endpoint, url, tmp_path / "staging2"))
    other.register(model=TensorDictProvider({k: v.clone() for k, v in state.items()}))
    handle = other.checkpoint(3)
    assert "already holds a different checkpoint for step 3" in str(handle.exception())
    other.close()

    # Restore after the local directories are gone: from the bucket, bit-exact.
    for directory in ("staging", "staging2", "nvme", "pfs"):
        shutil.rmtree(tmp_path / directory, ignore_errors=True)
    restored = {k: torch.zeros_like(v) for k, v in state.items()}
    again = make_runner(chunk_size="1MiB", **_persist_to_bucket(endpoint, url, tmp_path / "staging"))
    again.register(model=TensorDictProvider(restored))
    assert again.restore().step == 3
    assert all(torch.equal(restored[k], expected[k]) for k in expected)


@dataclass(frozen=True)
class _Done:
    returncode: int
    stdout: str
    stderr: str


@pytest.fixture
def s3_cli(endpoint, monkeypatch, capsys) -> Callable[..., _Done]:
    """``tierstate s3 ARGS`` with the endpoint from $AWS_ENDPOINT_URL, as a user sets it; in this process (a
    process of its own per command line would add torch's import, 2-3 s each, and test nothing more: the
    README's s3 commands run as processes, tests/readme)."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)

    def run(*args: str) -> _Done:
        code = cli_main(["s3", *args])
        out, err = capsys.readouterr()
        return _Done(code, out, err)

    return run


def test_cli_push_ls_verify_pull_prune_gc(make_runner, endpoint, bucket, tmp_path, s3_cli):
    runner = make_runner(chunk_size="1MiB")
    runner.register(model=TensorDictProvider({"w": torch.randn(MiB)}))
    for step in (1, 2):
        runner.checkpoint(step).result()
    runner.close()
    url = f"s3://{bucket}/cli"
    for step in ("1", "2"):
        pushed = s3_cli("push", url, step, "--from", str(tmp_path / "nvme"))
        assert pushed.returncode == 0 and "copied" in pushed.stdout, pushed.stderr
    tier = S3Tier("bucket", ObjectStore("bucket", url, endpoint_url=endpoint))
    tier.store.put_bytes("step-3/rank-00000.data", b"left by a killed writer")
    listed = json.loads(s3_cli("ls", url, "--json").stdout)
    states = [(r["step"], r["state"].split()[0]) for r in listed]
    assert states == [(1, "committed"), (2, "committed"), (3, "incomplete")]
    assert s3_cli("verify", url).returncode == 0
    pulled = s3_cli("pull", url, "2", "--to", str(tmp_path / "elsewhere"))
    assert pulled.returncode == 0, pulled.stderr
    assert pulled.stdout.endswith(" (4.2 MB)\n"), pulled.stdout  # sizes as the progress bars write them
    assert FilesystemTier("elsewhere", tmp_path / "elsewhere").steps() == [2]
    data = bytearray(tier.store.get_bytes("step-1/rank-00000.data"))
    data[100] ^= 1
    tier.store.put_bytes("step-1/rank-00000.data", bytes(data))
    bad = s3_cli("verify", url)
    assert bad.returncode == 1 and "step 1" in bad.stdout and "rank-00000.data frame 0" in bad.stdout
    assert s3_cli("prune", url, "--keep-last", "1").returncode == 0
    assert tier.steps() == [2]
    gc = s3_cli("gc", url, "--older-than", "0")
    assert gc.returncode == 0 and "orphan object" in gc.stdout
    assert tier.incomplete_steps() == set()
    missing = s3_cli("ls", "s3://no-such-bucket-x/p")
    assert missing.returncode == 1 and "bucket 'no-such-bucket-x' does not exist" in missing.stderr


def test_a_failed_flush_never_reaches_training_and_is_reported(make_runner, endpoint, bucket):
    import boto3

    runner = make_runner(chunk_size="1MiB", **_bucket_tier(endpoint, f"s3://{bucket}/gone", retries=0))
    runner.register(model=TensorDictProvider({"w": torch.randn(1000)}))
    boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1").delete_bucket(Bucket=bucket)
    assert runner.checkpoint(1).result().step == 1  # durable on nvme: the bucket's failure is not the checkpoint's
    runner.close()
    (failure,) = runner.flush_failures
    assert failure.tier == "bucket" and failure.step == 1
    assert f"bucket '{bucket}' does not exist" in str(failure)


def test_local_retention_keeps_a_step_until_its_paced_upload_is_done(make_runner, endpoint, bucket, tmp_path):
    url = f"s3://{bucket}/paced"
    settings = _bucket_tier(endpoint, url, retention={"keep_every": 1}, workers=1, bandwidth="8MB")
    runner = make_runner(chunk_size="1MiB", **settings, **{"tiers.nvme.retention": {"keep_last": 1}})
    runner.register(model=TensorDictProvider({"w": torch.randn(MiB)}))  # 4 MiB: half a second each at 8 MB/s
    for step in (1, 2, 3):
        runner.checkpoint(step).result()  # steps 1 and 2 wait for their upload while newer ones commit
    runner.close()
    assert runner.flush_failures == []
    assert S3Tier("bucket", ObjectStore("bucket", url, endpoint_url=endpoint)).steps() == [1, 2, 3]
    # Held past keep_last while queued for the bucket (without the hold, step 2, queued behind step 1's
    # half-second upload, would be pruned when step 3 commits and its flush fail); once each is in the
    # bucket its receipt lets retention free it, so the tier ends with what keep_last keeps.
    nvme = FilesystemTier("nvme", tmp_path / "nvme")
    assert nvme.steps() == [3]
    assert (nvme.step_dir(3) / "received-bucket.json").is_file()


def _damage(step_dir, how: str) -> None:
    data = step_dir / "rank-00000.data"
    if how == "missing file":
        data.unlink()
        return
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x40  # one bit in the middle of a frame
    data.write_bytes(bytes(raw))


@pytest.mark.parametrize("how", ["corrupt frame", "missing file"])
@pytest.mark.parametrize("fallback", [False, True])
def test_damaged_local_copy_falls_back_to_the_buckets_copy_of_that_step(
    make_runner, endpoint, bucket, tmp_path, caplog, how, fallback
):
    url = f"s3://{bucket}/fallback"
    state = {"w": torch.randn(MiB), "b": torch.arange(1000, dtype=torch.int64)}
    runner = make_runner(chunk_size="1MiB", **_bucket_tier(endpoint, url, retention={"keep_last": 3}))
    runner.register(model=TensorDictProvider(state))
    for step in (1, 2):
        state["w"].add_(1)
        runner.checkpoint(step).result()
    expected = {k: v.clone() for k, v in state.items()}
    runner.close()
    assert runner.flush_failures == []
    _damage(tmp_path / "nvme" / "step-2", how)  # the only local copy of step 2 (default.yaml flushes none to pfs)
    restored = {k: torch.zeros_like(v) for k, v in state.items()}
    again = make_runner(chunk_size="1MiB", **_bucket_tier(endpoint, url))
    again.register(model=TensorDictProvider(restored))
    with caplog.at_level("WARNING", logger="tierstate"):
        result = again.restore(fallback=fallback)  # with fallback too: the same step from the bucket, not step 1
    assert (result.step, result.tier, result.path, result.source) == (2, "bucket", None, f"{url}/step-2")
    assert all(torch.equal(restored[k].view(torch.uint8), expected[k].view(torch.uint8)) for k in expected)
    (problem,) = result.problems
    assert problem.startswith("step 2 on tier nvme:") and "rank-00000.data" in problem
    assert f"read from tier bucket ({url}/step-2)" in caplog.text


def test_a_damaged_bucket_copy_is_not_taken_either(make_runner, endpoint, bucket, tmp_path):
    url = f"s3://{bucket}/both"
    runner = make_runner(chunk_size="1MiB", **_bucket_tier(endpoint, url))
    runner.register(model=TensorDictProvider({"w": torch.randn(MiB)}))
    runner.checkpoint(1).result()
    runner.close()
    _damage(tmp_path / "nvme" / "step-1", "corrupt frame")
    tier = S3Tier("bucket", ObjectStore("bucket", url, endpoint_url=endpoint))
    tier.store.delete(["step-1/rank-00000.data"])
    again = make_runner(chunk_size="1MiB", **_bucket_tier(endpoint, url))
    again.register(model=TensorDictProvider({"w": torch.zeros(MiB)}))
    with pytest.raises(NoCheckpointError, match="step 1 on tier nvme: .*step 1 on tier bucket: .*rank-00000.data"):
        again.restore()
