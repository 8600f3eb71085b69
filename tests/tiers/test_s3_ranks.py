"""A bucket behind a job of two ranks: they restore from it when their shared tier's copy is damaged (one
restore path, issue 26/29), and they persist to it, staged in one shared directory or on each node's
own, the global manifest published last by rank 0 (issue 29)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

pytest.importorskip("boto3")
pytest.importorskip("moto.server")

import s3server

from conftest import REPO
from launch import run_side_by_side
from tierstate.tiers.ops.verify import verify_step
from tierstate.tiers.storage import faults
from tierstate.tiers.storage.filesystem import FilesystemTier
from tierstate.tiers.storage.objstore import ObjectStore
from tierstate.tiers.storage.s3tier import S3Tier

endpoint = s3server.endpoint
bucket = s3server.bucket
WORKER = REPO / "tests" / "tiers" / "s3_ranks_worker.py"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo"),
]


def _two_ranks(
    workdir: Path, endpoint: str, url: str, scenario: str, nodes: bool = False, killed: int | None = None
) -> list[dict]:
    """Both ranks run ``scenario``: two plain processes (rank and world from the environment), or with
    ``nodes`` two torchrun launches with ``--nnodes=2``, each a node of its own (``TIERSTATE_NODE``).
    Rank ``killed`` is SIGKILLed after its first uploaded part; what the others recorded is returned."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    launches = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "PYTHONPATH": str(REPO / "tests")}  # fmt: skip
        if rank == killed:
            env[faults.ENV] = "s3.part@1"
        command = [sys.executable, str(WORKER), str(workdir), endpoint, url, scenario]
        if nodes:
            env["TIERSTATE_NODE"] = f"n{rank}"
            command[1:1] = ["-m", "torch.distributed.run", "--nnodes=2", "--nproc_per_node=1", f"--node_rank={rank}",
                            "--master_addr=127.0.0.1", f"--master_port={port}"]  # fmt: skip
        launches.append((command, env))
    for rank, end in enumerate(run_side_by_side(launches, "S3-RANKS-DONE", 180, agents=nodes)):
        if rank == killed:
            assert end.returncode == -signal.SIGKILL, f"rank {rank}, {scenario}, not killed:\n{end.output[-6000:]}"
            continue
        assert end.succeeded, f"rank {rank}, {scenario}:\n{end.output[-6000:]}"
    return [json.loads((workdir / scenario / f"rank-{r}.json").read_text()) for r in (0, 1) if r != killed]


def test_two_ranks_restore_the_buckets_copy_of_a_step_whose_shared_copy_is_damaged(endpoint, bucket, tmp_path):
    url = f"s3://{bucket}/ranks"
    assert [seen["flush_errors"] for seen in _two_ranks(tmp_path, endpoint, url, "save")] == [[], []]
    pfs = FilesystemTier("pfs", tmp_path / "pfs")
    data = pfs.step_dir(2) / "rank-00000.data"
    frame = pfs.manifest(2).files["rank-00000.data"].frames[0]
    raw = bytearray(data.read_bytes())
    raw[frame.offset + frame.length // 2] ^= 0xFF
    data.write_bytes(bytes(raw))
    # Rank 0 reads the replicated tensors from its own file, which fails its checksum: rank 0 moves on to
    # the bucket's copy of the same step while rank 1, whose reads were clean, reads the PFS again.
    for rank, seen in enumerate(_two_ranks(tmp_path, endpoint, url, "restore")):
        assert (seen["step"], seen["tier_by_rank"], seen["same"]) == (2, ["bucket", "pfs"], True), rank
        assert any(p.startswith("step 2 on rank 0, tier pfs:") and "checksum mismatch" in p for p in seen["problems"])
    first, second = (json.loads((tmp_path / "restore" / f"rank-{r}.json").read_text()) for r in (0, 1))
    assert (first["tier"], first["source"]) == ("bucket", f"{url}/step-2")
    assert (second["tier"], second["source"]) == ("pfs", str(tmp_path / "pfs" / "step-2"))


@pytest.mark.parametrize("scope", ["shared", "node"])
def test_two_ranks_persist_to_a_bucket_each_uploading_its_files_and_rank_0_publishing_last(
    endpoint, bucket, tmp_path, scope
):
    """The bucket as the persist tier of two ranks: staged in one shared directory, or on each node's own
    (two torchrun launches with --nnodes=2, the nodes' parts meeting under one prefix). Each step is durable
    on the bucket on both ranks, published as one checkpoint holding both ranks' files; with the staging
    copies gone, both ranks restore it from the bucket bit for bit; a new run checkpointing a step the bucket
    holds fails on every rank, naming the step, and leaves the published objects as they were."""
    url = f"s3://{bucket}/persist-{scope}"
    nodes = scope == "node"
    for rank, seen in enumerate(_two_ranks(tmp_path, endpoint, url, f"persist-{scope}", nodes)):
        assert {step: o["tier"] for step, o in seen["outcomes"].items()} == {"1": "bucket", "2": "bucket"}, rank
    tier = S3Tier("bucket", ObjectStore("bucket", url, endpoint_url=endpoint, region="us-east-1"))
    assert tier.steps() == [1, 2]
    manifest = tier.manifest(2)
    assert (manifest.world_size, manifest.node_part) == (2, None)
    assert sorted(manifest.files) == ["rank-00000.data", "rank-00001.data"]
    assert verify_step(tier, 2).problems == []
    staged = [tmp_path / "staging"] if not nodes else [tmp_path / "nodes" / n / "staging" for n in ("n0", "n1")]
    assert all(d.is_dir() for d in staged)
    objects = {o.name: (o.size, o.modified) for o in tier.store.list("step-2/")}

    for directory in staged:  # every local copy gone: the ranks read the bucket's
        shutil.rmtree(directory)
    for rank, seen in enumerate(_two_ranks(tmp_path, endpoint, url, f"restore-{scope}", nodes)):
        assert (seen["step"], seen["tier_by_rank"], seen["same"]) == (2, ["bucket", "bucket"], True), rank

    if nodes:
        return  # the conflict is the same code on either staging scope
    for rank, seen in enumerate(_two_ranks(tmp_path, endpoint, url, "again-shared")):
        assert seen["error"] is not None and "step 2" in seen["error"], rank
        assert "already holds step 2" in seen["error"] and "bucket" in seen["error"], rank
    assert {o.name: (o.size, o.modified) for o in tier.store.list("step-2/")} == objects
    assert verify_step(tier, 2).problems == []


def test_a_rank_killed_mid_upload_fails_the_step_on_the_others_and_nothing_is_published(endpoint, bucket, tmp_path):
    """Rank 1 dies after the first part of its multipart upload: rank 0, whose uploads succeeded, does not
    wait for it forever and does not publish a checkpoint missing its files; gc then removes both ranks'
    leftovers (rank 0's objects and claim, rank 1's incomplete upload), their writers gone from this host."""
    url = f"s3://{bucket}/killed"
    (seen,) = _two_ranks(tmp_path, endpoint, url, "killed-shared", killed=1)
    assert seen["error"] is not None and "step 1" in seen["error"], seen
    tier = S3Tier("bucket", ObjectStore("bucket", url, endpoint_url=endpoint, region="us-east-1"))
    assert tier.steps() == [] and tier.incomplete_steps() == {1}
    left = tier.collect_garbage(older_than=0)
    assert {leftover.kind for leftover in left} == {"orphan object", "incomplete upload", "stale claim"}
    assert tier.store.list("") == [] and tier.store.uploads() == []


def test_each_nodes_leader_flushes_its_part_to_the_bucket_and_the_last_publishes_the_step(endpoint, bucket, tmp_path):
    """Two nodes (torchrun --nnodes=2) persist to their own NVMe and flush to the bucket with no shared
    directory: each node's leader uploads its part and a marker, the node that finds both markers publishes
    the global manifest, and retention keeps the two newest steps. With both NVMe copies gone the ranks
    restore the newest step from the bucket, bit for bit."""
    url = f"s3://{bucket}/nodes"
    for rank, seen in enumerate(_two_ranks(tmp_path, endpoint, url, "flush-node", nodes=True)):
        assert (set(seen["outcomes"]), seen["flush_errors"]) == ({"1", "2", "3"}, []), rank
    tier = S3Tier("bucket", ObjectStore("bucket", url, endpoint_url=endpoint, region="us-east-1"))
    assert tier.steps() == [2, 3]
    manifest = tier.manifest(3)
    assert (manifest.world_size, manifest.node_part) == (2, None)
    assert sorted(manifest.files) == ["rank-00000.data", "rank-00001.data"]
    assert verify_step(tier, 3).problems == []
    for node in ("n0", "n1"):
        assert 3 in FilesystemTier("nvme", tmp_path / "nodes" / node / "nvme", "node").steps()
        shutil.rmtree(tmp_path / "nodes" / node / "nvme")
    for rank, seen in enumerate(_two_ranks(tmp_path, endpoint, url, "restoreflushed-node", nodes=True)):
        assert (seen["step"], seen["tier_by_rank"], seen["same"]) == (3, ["bucket", "bucket"], True), rank
