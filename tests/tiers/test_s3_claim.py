"""Upload claims on a real S3-protocol server: two writers never upload objects of one step at once, so
the checkpoint that wins the manifest's conditional put is intact, and a killed writer's claim neither
blocks its own host for ever nor outlives gc (tiers/storage/s3claim.py). The races themselves (equal creation
times, two takeovers of one stale claim, gc beside an upload) are in tests/faults/test_bucket_attacks.py."""

from __future__ import annotations

import errno
import json
import os
import socket
import subprocess
import sys
import threading
from pathlib import Path

import pytest
import torch

pytest.importorskip("boto3")
pytest.importorskip("moto.server")

import s3server

from tierstate import Runner
from tierstate.providers import TensorDictProvider
from tierstate.tiers.format.manifest import Manifest
from tierstate.tiers.ops.verify import verify_step
from tierstate.tiers.reading.stored import StoredCheckpoint
from tierstate.tiers.storage.filesystem import FilesystemTier, TierError
from tierstate.tiers.storage.nodeparts import node_part
from tierstate.tiers.storage.objstore import ObjectChangedError, ObjectStore
from tierstate.tiers.storage.s3claim import CLAIM_NAME, alive_here, claim_is_live, claim_step, release_step
from tierstate.tiers.storage.s3tier import S3Tier

endpoint = s3server.endpoint
bucket = s3server.bucket
MiB = 1 << 20


def _tier(endpoint: str, url: str) -> S3Tier:
    return S3Tier("bucket", ObjectStore("bucket", url, endpoint_url=endpoint, region="us-east-1", part_size=5 * MiB))


def _checkpoint(directory: Path, seed: int) -> tuple[FilesystemTier, dict[str, torch.Tensor]]:
    """Step 5 of a state of its own committed in ``directory`` (an 8 MiB data file: a multipart upload)."""
    settings = {"chunk_size": "1MiB", "host_cache": {"size": "16MiB"}, "tiers": {"nvme": {"path": str(directory)}}}
    runner = Runner.from_dict(settings)
    state = {"w": torch.randn(2 * MiB, generator=torch.Generator().manual_seed(seed))}
    runner.register(t=TensorDictProvider(state))
    runner.checkpoint(5).result()
    runner.close()
    return FilesystemTier("nvme", directory), {"t/w": state["w"].clone()}


def _claim(tier: S3Tier, pid: int, checkpoint: str = "0" * 32, created: str = "2026-01-01T00:00:00.000+00:00") -> None:
    claim = {"checkpoint": checkpoint, "created": created, "host": socket.gethostname(), "pid": pid,
             "since": "2026-01-01T00:00:00+00:00"}  # fmt: skip
    tier.store.put_bytes(f"step-5/{CLAIM_NAME}", json.dumps(claim).encode())


def _gone_pid() -> int:
    """The pid of a process that has exited."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(gone.stdout)


def test_a_live_writers_claim_refuses_another_checkpoint_of_the_step_before_any_upload(endpoint, bucket, tmp_path):
    local, _ = _checkpoint(tmp_path / "a", seed=0)
    tier = _tier(endpoint, f"s3://{bucket}/claimed")
    _claim(tier, os.getpid())  # a writer at work: this very process
    with pytest.raises(TierError, match=rf"being uploaded by another writer \(host {socket.gethostname()}, "
                       rf"pid {os.getpid()}.*gc removes its claim") as refused:  # fmt: skip
        tier.upload(local.step_dir(5), local.manifest(5))
    assert refused.value.errno == errno.EBUSY and "tier bucket" in str(refused.value)
    assert [o.name for o in tier.store.list("")] == [f"step-5/{CLAIM_NAME}"] and tier.store.uploads() == []
    tier.store.delete([f"step-5/{CLAIM_NAME}"])  # that writer finished
    assert tier.upload(local.step_dir(5), local.manifest(5)).outcome == "copied"
    assert tier.steps() == [5] and not any(o.name.endswith(CLAIM_NAME) for o in tier.store.list(""))


def test_a_claim_left_by_a_writer_killed_on_this_host_is_taken_over(endpoint, bucket, tmp_path):
    local, expected = _checkpoint(tmp_path / "a", seed=0)
    tier = _tier(endpoint, f"s3://{bucket}/taken")
    _claim(tier, _gone_pid())  # its process has exited: the claim is stale
    assert tier.upload(local.step_dir(5), local.manifest(5)).outcome == "copied"
    assert tier.steps() == [5] and verify_step(tier, 5).problems == []
    assert not any(o.name.endswith(CLAIM_NAME) for o in tier.store.list(""))


def test_two_checkpoints_of_one_step_uploaded_at_once_leave_the_published_one_intact(endpoint, bucket, tmp_path):
    """Two runs sharing a prefix upload different checkpoints of step 5 at the same moment, three times:
    one publishes, the other fails naming the tier, and what is published is the winner's, bit for bit."""
    writers = [_checkpoint(tmp_path / name, seed) for name, seed in (("a", 1), ("b", 2))]
    for round_ in range(3):
        url = f"s3://{bucket}/race-{round_}"
        barrier = threading.Barrier(2)
        results: list[BaseException | None] = [None, None]

        def upload(which: int, url: str = url, barrier: threading.Barrier = barrier, results: list = results) -> None:
            local, _ = writers[which]
            tier = _tier(endpoint, url)
            barrier.wait()
            try:
                tier.upload(local.step_dir(5), local.manifest(5))
            except BaseException as exc:  # judged below
                results[which] = exc

        threads = [threading.Thread(target=upload, args=(which,)) for which in (0, 1)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert sum(r is None for r in results) == 1, results
        (winner,) = [which for which in (0, 1) if results[which] is None]
        lost = results[1 - winner]
        assert isinstance(lost, TierError) and lost.errno in (errno.EBUSY, errno.EEXIST), lost
        assert "tier bucket" in str(lost) and "step 5" in str(lost) or "step-5" in str(lost), lost
        tier = _tier(endpoint, url)
        assert tier.manifest(5) == Manifest.model_validate(writers[winner][0].manifest(5).model_dump())
        assert verify_step(tier, 5).problems == []
        loaded = StoredCheckpoint(tier.source(5), 5).read()
        assert torch.equal(loaded["t/w"], writers[winner][1]["t/w"])


def test_gc_removes_a_claim_left_on_a_published_step(endpoint, bucket, tmp_path):
    """A writer killed between its manifest and its release leaves a claim on a committed step: gc removes
    the claim after the grace period and nothing of the checkpoint; a live writer's claim it leaves alone."""
    local, _ = _checkpoint(tmp_path / "a", seed=0)
    tier = _tier(endpoint, f"s3://{bucket}/left")
    tier.upload(local.step_dir(5), local.manifest(5))
    _claim(tier, os.getpid(), local.manifest(5).checkpoint_id or "")  # a writer at work here: live, at any age
    assert tier.collect_garbage(older_than=0) == []
    _claim(tier, _gone_pid(), local.manifest(5).checkpoint_id or "")
    assert tier.collect_garbage(older_than=3600) == []
    (found,) = tier.collect_garbage(older_than=0)
    assert (found.kind, found.what.endswith(f"step-5/{CLAIM_NAME}")) == ("stale claim", True)
    assert tier.steps() == [5] and verify_step(tier, 5).problems == []


def test_a_claim_a_node_of_this_job_left_for_an_older_checkpoint_is_taken_over(endpoint, bucket, tmp_path):
    """A multi-node job restarted after a crash checkpoints a step again: the claim its previous incarnation
    left on another host (whose process cannot be probed from here) is taken over when it names one of the
    job's nodes and an older checkpoint; a claim of a node outside the job, or of a newer checkpoint, is not."""
    local, _ = _checkpoint(tmp_path / "a", seed=0)
    part = node_part(local.manifest(5), "n0", [0], ["n0", "n1"])  # this node's share of a two-node step
    older, newer = "2000-01-01T00:00:00.000+00:00", "2999-01-01T00:00:00.000+00:00"
    for node, created, taken in (("n9", older, False), ("n1", newer, False), ("n1", older, True)):
        tier = _tier(endpoint, f"s3://{bucket}/restarted-{node}-{created[:4]}")
        claim = {"created": created, "host": "another-host", "node": node, "pid": 1, "since": created}
        tier.store.put_bytes(f"step-5/{CLAIM_NAME}", json.dumps(claim).encode())
        if not taken:
            with pytest.raises(TierError, match="being uploaded by another writer"):
                tier.upload(local.step_dir(5), part)
            continue
        assert tier.upload(local.step_dir(5), part).outcome == "copied"
        names = {o.name for o in tier.store.list("step-5/")}
        assert {"step-5/rank-00000.data", "step-5/node-n0.part", f"step-5/{CLAIM_NAME}"} <= names
        held = json.loads(tier.store.get_bytes(f"step-5/{CLAIM_NAME}"))
        assert (held["checkpoint"], held["created"]) == (part.checkpoint_id, part.created)  # now ours
        assert tier.steps() == []  # n1's part is not in yet


def test_only_writers_of_one_checkpoint_id_share_a_claim(endpoint, bucket):
    """Two checkpoints created in the same millisecond are two checkpoints: the second is refused while
    the first writer lives; the first's id, again (another node's part, a retry), shares the claim."""
    store = _tier(endpoint, f"s3://{bucket}/ids").store
    created = "2026-01-01T00:00:00.000+00:00"
    first = claim_step(store, "bucket", "step-5/", "a" * 32, created)
    with pytest.raises(TierError, match=f"being uploaded by another writer .* of checkpoint {'a' * 32}") as refused:
        claim_step(store, "bucket", "step-5/", "b" * 32, created)
    assert refused.value.errno == errno.EBUSY
    assert claim_step(store, "bucket", "step-5/", "a" * 32, created) == first


def test_a_claim_whose_pid_now_names_another_process_is_stale(endpoint, bucket):
    """The claim names this very pid, but a process that started at another time: pid reuse, its writer
    is gone, so the claim is taken over (and gc would judge it dead)."""
    tier = _tier(endpoint, f"s3://{bucket}/reused")
    claim = {"checkpoint": "0" * 32, "created": "2026-01-01T00:00:00.000+00:00", "host": socket.gethostname(),
             "pid": os.getpid(), "started": 1, "since": "2026-01-01T00:00:00+00:00"}  # fmt: skip
    assert alive_here(claim) is False and alive_here({**claim, "started": None}) is True
    assert alive_here({**claim, "host": "elsewhere"}) is None  # cannot be told from here
    assert claim_is_live({**claim, "host": "elsewhere"}, age_s=10, grace_s=60)
    assert not claim_is_live({**claim, "host": "elsewhere"}, age_s=61, grace_s=60)
    tier.store.put_bytes(f"step-5/{CLAIM_NAME}", json.dumps(claim).encode())
    mine = claim_step(tier.store, "bucket", "step-5/", "c" * 32, "2026-01-02T00:00:00.000+00:00")
    assert json.loads(tier.store.get_bytes(f"step-5/{CLAIM_NAME}"))["checkpoint"] == "c" * 32
    assert mine.checkpoint == "c" * 32


def test_a_release_never_drops_a_claim_another_writer_took_over(endpoint, bucket):
    store = _tier(endpoint, f"s3://{bucket}/released").store
    mine = claim_step(store, "bucket", "step-5/", "a" * 32, "2026-01-01T00:00:00.000+00:00")
    theirs = json.dumps({"checkpoint": "b" * 32, "host": "elsewhere", "pid": 1}).encode()
    store.put_bytes(mine.name, theirs, if_match=mine.etag)  # taken over (as by a writer that found it stale)
    release_step(store, mine)
    assert store.get_bytes(mine.name) == theirs
    with pytest.raises(ObjectChangedError):
        store.put_bytes(mine.name, b"{}", if_match=mine.etag)  # the ETag read before is stale: refused
