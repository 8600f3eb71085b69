"""Two ranks restore from a bucket when their shared tier's copy is damaged (one restore path, issue 26/29)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch.distributed as dist

pytest.importorskip("boto3")
pytest.importorskip("moto.server")

import s3server

from conftest import REPO
from launch import TEARDOWN_ABORT
from tierstate.tiers.filesystem import FilesystemTier

endpoint = s3server.endpoint
bucket = s3server.bucket
WORKER = REPO / "tests" / "tiers" / "s3_ranks_worker.py"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo"),
]


def _two_ranks(workdir: Path, endpoint: str, url: str, scenario: str) -> list[dict]:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    procs = []
    for rank in (0, 1):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "PYTHONPATH": str(REPO / "tests")}  # fmt: skip
        command = [sys.executable, str(WORKER), str(workdir), endpoint, url, scenario]
        procs.append(subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    for rank, proc in enumerate(procs):
        out, _ = proc.communicate(timeout=180)
        torn_down = proc.returncode == -signal.SIGABRT and TEARDOWN_ABORT in out  # torch's gloo teardown abort
        ended = "S3-RANKS-DONE" in out and (proc.returncode == 0 or torn_down)
        assert ended, f"rank {rank}, {scenario}:\n{out[-6000:]}"
    return [json.loads((workdir / scenario / f"rank-{rank}.json").read_text()) for rank in (0, 1)]


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
