"""``s3://`` tiers in the regular commands (ls, inspect, stats, verify, migrate both ways, prune, gc,
export, import), against a real S3 server on 127.0.0.1 (moto; MinIO too if TIERSTATE_TEST_MINIO names one)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("boto3")
pytest.importorskip("moto.server")

import s3server
from safetensors.torch import load_file

from tierstate.cli import main
from tierstate.providers import TensorDictProvider
from tierstate.tiers.reading.stored import load
from tierstate.tiers.storage.filesystem import FilesystemTier
from tierstate.tiers.storage.objstore import ObjectStore
from tierstate.tiers.storage.s3tier import S3Tier

endpoint = s3server.endpoint
bucket = s3server.bucket
MiB = 1 << 20


@pytest.fixture
def nvme(make_runner, tmp_path) -> FilesystemTier:
    """Steps 1-3 on a directory tier: 4 MiB of float32 in 1 MiB frames and a bfloat16 matrix, each step changed."""
    state = {"w": torch.arange(MiB, dtype=torch.float32), "h": torch.randn(33, 65).to(torch.bfloat16)}
    with make_runner(chunk_size="1MiB", host_cache__size="4MiB") as runner:
        runner.register(t=TensorDictProvider(state))
        for step in (1, 2, 3):
            state["w"].add_(step)
            state["h"].mul_(-1)
            runner.checkpoint(step).result()
    return FilesystemTier("nvme", tmp_path / "nvme")


def _run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out = capsys.readouterr()
    return code, out.out, out.err


def test_every_command_takes_an_s3_tier(nvme, endpoint, bucket, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)  # as a user sets it; --endpoint-url is tried below
    url = f"s3://{bucket}/run 7/ckpt"
    tiers = ["--tier", f"nvme={nvme.root}", "--tier", f"bucket={url}"]
    store = S3Tier("bucket", ObjectStore("bucket", url, endpoint_url=endpoint))

    # migrate up, verified, manifest last
    code, out, _ = _run(capsys, "migrate", "--all", "--from", "nvme", "--to", "bucket", *tiers)
    assert code == 0 and out.count("copied") == 3, out
    assert store.steps() == [1, 2, 3]
    store.store.put_bytes("step-4/rank-00000.data", b"left by a killed writer")

    # ls: the bucket's steps beside nvme's, and the step without a manifest as a partial one
    code, out, _ = _run(capsys, "ls", "--json", *tiers)
    rows = [(e["tier"], e["step"], e["state"]) for e in json.loads(out)]
    assert ("bucket", 2, "committed") in rows and ("bucket", "step-4", "partial") in rows
    assert [r for r in rows if r[0] == "nvme"] == [("nvme", s, "committed") for s in (1, 2, 3)]

    # inspect and stats: a step on the tiers, or the s3:// URL of a checkpoint, read through the byte source
    code, out, _ = _run(capsys, "inspect", "--json", f"{url}/step-2")
    assert code == 0 and json.loads(out)["step"] == 2
    code, by_step, _ = _run(capsys, "inspect", "--json", "2", "--tier", f"bucket={url}")
    assert json.loads(by_step) == json.loads(out)
    code, out, _ = _run(capsys, "stats", "--json", f"{url}/step-3", "--endpoint-url", endpoint)
    assert code == 0 and json.loads(out)["step"] == 3 and json.loads(out)["ranks"]

    # export from the bucket: the same tensors as from nvme
    code, _, _ = _run(capsys, "export", "2", str(tmp_path / "b.safetensors"), "--format", "safetensors",
                      "--tier", f"bucket={url}")  # fmt: skip
    assert code == 0
    exported, stored = load_file(tmp_path / "b.safetensors"), load(nvme.step_dir(2))
    assert all(torch.equal(exported[k].view(torch.uint8), stored[k].view(torch.uint8)) for k in ("t/w", "t/h"))

    # verify: clean, then a flipped bit named by file and frame
    code, out, _ = _run(capsys, "verify", "--only", "bucket", *tiers)
    assert code == 0 and out.count("bucket step") == 3, out
    data = bytearray(store.store.get_bytes("step-1/rank-00000.data"))
    data[MiB + 7] ^= 1
    store.store.put_bytes("step-1/rank-00000.data", bytes(data))
    code, out, _ = _run(capsys, "verify", "1", "--only", "bucket", *tiers)
    assert code == 1 and "bucket step 1: FAILED" in out and "rank-00000.data frame 1" in out, out

    # migrate down (--move): verified before the local commit, then gone from the bucket
    down = ["--tier", f"pfs={tmp_path / 'down'}", "--tier", f"bucket={url}"]
    code, out, _ = _run(capsys, "migrate", "3", "--move", "--from", "bucket", "--to", "pfs", *down)
    assert code == 0 and "source deleted" in out, out
    assert FilesystemTier("pfs", tmp_path / "down").steps() == [3] and store.steps() == [1, 2]
    assert torch.equal(load(tmp_path / "down" / "step-3")["t/w"], load(nvme.step_dir(3))["t/w"])
    code, out, _ = _run(capsys, "migrate", "1", "--from", "bucket", "--to", "pfs", *down)  # the damaged step
    assert code == 1 and "rank-00000.data" in out and FilesystemTier("pfs", tmp_path / "down").steps() == [3]

    # prune by --keep-last, gc of the orphan
    code, out, _ = _run(capsys, "prune", "--keep-last", "1", "--only", "bucket", "-y", *tiers)
    assert code == 0 and "bucket step 1: deleted" in out and store.steps() == [2]
    code, out, _ = _run(capsys, "gc", "--older-than", "0", "--only", "bucket", *tiers)
    assert code == 0 and "orphan object" in out and store.incomplete_steps() == set()


def test_import_into_a_bucket_and_a_config_with_a_bucket(nvme, endpoint, bucket, tmp_path, capsys):
    url = f"s3://{bucket}/imported"
    dcp_dir = tmp_path / "dcp"
    code, _, _ = _run(capsys, "export", "3", str(dcp_dir), "--format", "dcp", "--tier", f"nvme={nvme.root}")
    assert code == 0
    config = tmp_path / "tiers.yaml"
    config.write_text(
        f"tiers:\n  nvme: {{path: {nvme.root}}}\n"
        f"  bucket: {{kind: s3, url: '{url}', endpoint_url: '{endpoint}', region: us-east-1, "
        "retention: {keep_last: 1}}\n"
    )
    imported = ["import", str(dcp_dir), "--to", "bucket", "--step", "9", "--json", "--config", str(config)]
    code, out, _ = _run(capsys, *imported)
    assert code == 0 and json.loads(out)["path"] == f"{url}/step-9", out
    store = S3Tier("bucket", ObjectStore("bucket", url, endpoint_url=endpoint))
    assert store.steps() == [9]
    code, out, _ = _run(capsys, "ls", "--json", "--config", str(config))
    assert ("bucket", 9) in [(e["tier"], e["step"]) for e in json.loads(out)]
    code, _, _ = _run(capsys, "migrate", "2", "--from", "nvme", "--to", "bucket", "--config", str(config))
    assert code == 0 and store.steps() == [2, 9]
    code, out, _ = _run(capsys, "prune", "--only", "bucket", "-y", "--config", str(config))  # the YAML's keep_last
    assert code == 0 and store.steps() == [9], out


def test_a_missing_bucket_is_named(nvme, endpoint, capsys):
    code, _, err = _run(capsys, "ls", "--tier", "bucket=s3://no-such-bucket-y/p", "--endpoint-url", endpoint)
    assert code == 1 and "tier bucket: bucket 'no-such-bucket-y' does not exist" in err
    code, _, err = _run(capsys, "inspect", "s3://b-bucket/p/not-a-step", "--endpoint-url", endpoint)
    assert code == 2 and "ends in /step-N" in err
