"""Attacks on a bucket tier, against a real S3-protocol server (moto, given S3's atomic conditional writes:
tests/s3server.py): what two writers, a gc and a forger with write access to the bucket can do to
checkpoints that were reported durable.

- two runs writing one step whose checkpoints were created in the same millisecond (the claim tells
  them apart by checkpoint id, not by creation time);
- two writers taking over one stale claim, the claim read of one answered only after the other's
  takeover succeeded (the takeover is a conditional write, so exactly one holds the claim);
- ``tierstate s3 gc --older-than 0`` run while a paced upload is between its objects (the claim is
  live, so nothing of it goes), and objects removed or replaced behind a writer's back (its publisher
  check refuses to publish);
- forged bucket manifests, re-signed (sizes, names, serializers, a zstd frame's raw length, an index
  with an extra nested field, a manifest that is not JSON), through ``tierstate s3 verify``, a restore
  and ``tierstate migrate``: each refuses with one-line errors and exit 1, nothing is allocated for a
  claim, and every forgery verify rejects a restore rejects too.

Each test tallies its trials, the published checkpoints found damaged, and the losses (a writer told
its checkpoint was durable when the bucket does not hold it intact).
"""

from __future__ import annotations

import errno
import json
import socket
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgpack
import pytest
import torch

pytest.importorskip("boto3")
pytest.importorskip("moto.server")

import s3server

from faultkit import REPO, expected, scaled, tally, trainer
from tierstate import Runner
from tierstate.cli import main
from tierstate.errors import TierstateError
from tierstate.providers import TensorDictProvider
from tierstate.tiers.format.format import checksum, manifest_bytes
from tierstate.tiers.format.manifest import MANIFEST_NAME, Manifest
from tierstate.tiers.ops.pacing import Pacer
from tierstate.tiers.ops.verify import verify_step
from tierstate.tiers.reading.stored import StoredCheckpoint
from tierstate.tiers.storage.filesystem import FilesystemTier, TierError
from tierstate.tiers.storage.objstore import ObjectStore
from tierstate.tiers.storage.s3claim import CLAIM_NAME
from tierstate.tiers.storage.s3tier import S3Tier

pytestmark = pytest.mark.faults
endpoint = s3server.endpoint
bucket = s3server.bucket
MiB = 1 << 20
DATA, INDEX = "rank-00000.data", "rank-00000.index"


def _tier(endpoint: str, url: str) -> S3Tier:
    return S3Tier("bucket", ObjectStore("bucket", url, endpoint_url=endpoint, region="us-east-1", part_size=5 * MiB))


def _local(root: Path, values_of: int = 5, **extra: Any) -> FilesystemTier:
    """Step 5 committed on ``root/nvme``, holding the fault suite's known state of step ``values_of`` (~3.8
    MiB in four frames, and an object): two writers of step 5 with other values write other bytes."""
    with trainer(root, **extra) as (runner, state):
        state.advance(values_of)
        runner.checkpoint(5).result()
    return FilesystemTier("nvme", root / "nvme")


def _gone_pid() -> int:
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(done.stdout)


def _race(endpoint: str, url: str, writers: list[tuple[FilesystemTier, Manifest]]) -> list[BaseException | None]:
    """Both writers upload step 5 to ``url`` at once (threads released together); what each raised."""
    barrier = threading.Barrier(len(writers))
    results: list[BaseException | None] = [None] * len(writers)

    def upload(which: int) -> None:
        local, manifest = writers[which]
        tier = _tier(endpoint, url)
        barrier.wait()
        try:
            tier.upload(local.step_dir(5), manifest)
        except BaseException as exc:  # judged by the caller
            results[which] = exc

    threads = [threading.Thread(target=upload, args=(which,)) for which in range(len(writers))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return results


def _judge(endpoint: str, url: str, writers: list[tuple[FilesystemTier, Manifest]], results: list) -> tuple[int, int]:
    """(damaged, lost) of one race: the published step fails verification (damaged), or a writer that was
    told its upload succeeded does not find its own checkpoint published whole (lost)."""
    tier = _tier(endpoint, url)
    damaged = int(5 in tier.steps() and bool(verify_step(tier, 5).problems))
    lost = 0
    for (local, manifest), outcome in zip(writers, results, strict=True):
        if outcome is not None:
            assert isinstance(outcome, TierError) and outcome.errno in (errno.EBUSY, errno.EEXIST), outcome
            continue
        published = tier.manifest(5) if 5 in tier.steps() else None
        mine = StoredCheckpoint(local.step_dir(5), 5).read()
        if published is None or not published.same_checkpoint(manifest) or damaged:
            lost += 1
        elif any(not torch.equal(v, mine[k]) for k, v in StoredCheckpoint(tier.source(5), 5).read().items()
                 if isinstance(v, torch.Tensor)):  # fmt: skip
            lost += 1
    return damaged, lost


# --- two writers -------------------------------------------------------------------------------------


@pytest.mark.slow
def test_two_runs_writing_one_step_with_equal_creation_times_never_share_its_claim(endpoint, bucket, tmp_path):
    """Two different checkpoints of step 5 whose manifests say the same ``created`` (the millisecond
    clock's resolution): one uploads and publishes, whole; the other fails naming the step."""
    a, b = _local(tmp_path / "a", 5), _local(tmp_path / "b", 6)
    first = a.manifest(5)
    second = b.manifest(5).model_copy(update={"created": first.created})
    assert first.checkpoint_id != second.checkpoint_id
    trials, damaged, lost = scaled(3), 0, 0
    for trial in range(trials):
        url = f"s3://{bucket}/same-created-{trial}"
        writers = [(a, first), (b, second)]
        results = _race(endpoint, url, writers)
        assert sum(r is None for r in results) == 1, results
        got = _judge(endpoint, url, writers, results)
        damaged, lost = damaged + got[0], lost + got[1]
    assert (damaged, lost) == (0, 0)
    tally("bucket_equal_created", trials=trials, damaged=damaged, losses=lost)


@pytest.mark.slow
def test_two_takeovers_of_one_stale_claim_with_one_read_delayed_leave_one_writer(endpoint, bucket, tmp_path):
    """A claim left by a writer killed on this host; two writers find it stale. The server answers the
    first one's read of the claim only once the other's takeover has succeeded, so the first acts on what
    it read before: its takeover, conditional on the claim's ETag, fails, it looks again, and finds the
    winner's live claim (or, once the winner published, the step taken)."""
    a, b = _local(tmp_path / "a", 5), _local(tmp_path / "b", 6)
    writers = [(a, a.manifest(5)), (b, b.manifest(5))]
    stale = {"checkpoint": "0" * 32, "created": "2026-01-01T00:00:00.000+00:00", "host": socket.gethostname(),
             "pid": _gone_pid(), "since": "2026-01-01T00:00:00+00:00"}  # fmt: skip
    trials, damaged, lost, delayed = scaled(3), 0, 0, 0
    for trial in range(trials):
        url = f"s3://{bucket}/stale-{trial}"
        _tier(endpoint, url).store.put_bytes(f"step-5/{CLAIM_NAME}", json.dumps(stale).encode())
        with s3server.held_answer("GET", f"step-5/{CLAIM_NAME}", release=("PUT", f"step-5/{CLAIM_NAME}")) as hold:
            results = _race(endpoint, url, writers)
        delayed += hold.holding.is_set()
        assert sum(r is None for r in results) == 1, results
        got = _judge(endpoint, url, writers, results)
        damaged, lost = damaged + got[0], lost + got[1]
    assert delayed == trials  # every trial had one read answered after the other's takeover
    assert (damaged, lost) == (0, 0)
    tally("bucket_stale_claim_takeover", trials=trials, damaged=damaged, losses=lost)


# --- gc beside an upload, and objects changed behind a writer's back ----------------------------------


def test_gc_beside_a_paced_upload_removes_nothing_of_it(endpoint, bucket, tmp_path, capsys):
    """``tierstate s3 gc --older-than 0`` runs inside a paced upload of 12 MiB, after its index and after
    each 5 MiB part of its data file: every object of the upload is older than the grace period, but its
    claim is live, so gc removes none of them; the step is published whole."""
    runner = Runner.from_dict({"chunk_size": "1MiB", "host_cache": {"size": "4MiB"},
                               "tiers": {"nvme": {"path": str(tmp_path / "nvme")}}})  # fmt: skip
    runner.register(t=TensorDictProvider({"w": torch.randn(3 * MiB, generator=torch.Generator().manual_seed(5))}))
    runner.checkpoint(5).result()
    runner.close()
    local = FilesystemTier("nvme", tmp_path / "nvme")
    manifest = local.manifest(5)
    url = f"s3://{bucket}/paced"
    tier = S3Tier("bucket", ObjectStore("bucket", url, endpoint_url=endpoint, part_size=5 * MiB, workers=1))
    pacer = Pacer(24 * MiB)
    said: list[str] = []

    def progress(nbytes: int) -> None:
        pacer.wait(nbytes)
        said.append(str(main(["s3", "gc", url, "--older-than", "0", "--endpoint-url", endpoint])))
        said.append(capsys.readouterr().out.strip())

    report = tier.upload(local.step_dir(5), manifest, progress)
    assert report.outcome == "copied" and said.count("0") == 4 and set(said) == {"0", "nothing to remove"}, said
    assert tier.steps() == [5] and verify_step(tier, 5).problems == []
    tally("bucket_gc_beside_upload", trials=said.count("0"), damaged=0, losses=0)


@pytest.mark.parametrize("change", ["removed", "replaced"])
def test_an_object_changed_after_its_upload_is_never_published(endpoint, bucket, tmp_path, change):
    """Between a writer's uploads and its manifest, its index is deleted (as a gc judging objects by their
    own age did) or replaced by bytes of the same size: the publisher's check refuses the step."""
    local = _local(tmp_path, 5)
    url = f"s3://{bucket}/changed-{change}"
    tier = _tier(endpoint, url)
    index = f"step-5/{INDEX}"

    def progress(_nbytes: int) -> None:
        if not any(o.name == index for o in tier.store.list(index)):
            return  # the index goes up first; act once it is there
        if change == "removed":
            tier.store.delete([index])
        else:
            size = next(o.size for o in tier.store.list(index))
            tier.store.put_bytes(index, bytes(size))

    with pytest.raises(TierError, match=rf"not publishing step 5: .*{INDEX} (is missing|is not the object uploaded)"):
        tier.upload(local.step_dir(5), local.manifest(5), progress)
    assert tier.steps() == [] and not any(o.name.endswith(CLAIM_NAME) for o in tier.store.list(""))
    tally("bucket_changed_object", trials=1, damaged=0, losses=0)


# --- forged bucket manifests -------------------------------------------------------------------------


def _body(tier: S3Tier) -> dict[str, Any]:
    return json.loads(tier.store.get_bytes(f"step-5/{MANIFEST_NAME}"))["manifest"]


def _resign(tier: S3Tier, body: dict[str, Any]) -> None:
    tier.store.put_bytes(f"step-5/{MANIFEST_NAME}", manifest_bytes(body))


def _sixteen_tib(tier: S3Tier, body: dict[str, Any]) -> None:
    body["files"][DATA]["size"] = 16 << 40
    frame = body["files"][DATA]["frames"][-1]
    frame["length"] = frame["raw_length"] = (16 << 40) - frame["offset"]


def _frame_past_the_object(tier: S3Tier, body: dict[str, Any]) -> None:
    """The file a little longer, its last frame claiming the bytes that are not there."""
    body["files"][DATA]["size"] += 4096
    frame = body["files"][DATA]["frames"][-1]
    frame["length"] += 4096
    frame["raw_length"] += 4096 if frame["codec"] == "none" else 0


def _renamed(tier: S3Tier, body: dict[str, Any]) -> None:
    body["files"]["../rank-00000.data"] = body["files"].pop(DATA)


def _other_rank(tier: S3Tier, body: dict[str, Any]) -> None:
    """Every piece moved to rank 1's file, which is not in the bucket."""
    body["files"]["rank-00001.data"] = body["files"].pop(DATA)
    body["world_size"] = 2
    for item in body["items"].values():
        for piece in item.get("pieces", []):
            piece["file"] = "rank-00001.data"


def _serializer(to: str) -> Callable[[S3Tier, dict[str, Any]], None]:
    def edit(tier: S3Tier, body: dict[str, Any]) -> None:
        body["items"]["meta/value"]["serializer"] = to

    return edit


def _zstd_raw_length(tier: S3Tier, body: dict[str, Any]) -> None:
    """A compressed frame says it decodes to 4 KiB more than it does (its pieces all still inside)."""
    frame = next(f for f in body["files"][DATA]["frames"] if f["codec"] == "zstd")
    frame["raw_length"] += 4096 * frame["shuffle"]


def _index_extra_field(tier: S3Tier, body: dict[str, Any]) -> None:
    """The index with an extra nested field in one item's piece, its checksum re-signed in the manifest."""
    doc = msgpack.unpackb(tier.store.get_bytes(f"step-5/{INDEX}"), raw=False)
    next(item for item in doc["items"].values() if item.get("pieces"))["pieces"][0]["extra"] = {"nested": 1}
    forged = msgpack.packb(doc)
    tier.store.put_bytes(f"step-5/{INDEX}", forged)
    body["indexes"][INDEX] = checksum(forged)


FORGERIES: dict[str, Callable[[S3Tier, dict[str, Any]], None]] = {
    "16 TiB data file": _sixteen_tib,
    "frame past the object": _frame_past_the_object,
    "file name outside the step": _renamed,
    "file of a rank not there": _other_rank,
    "msgpack read as json": _serializer("json"),
    "msgpack read as pickle": _serializer("pickle"),
    "zstd raw length": _zstd_raw_length,
    "index with an extra nested field": _index_extra_field,
}


@pytest.fixture
def forged(endpoint, bucket, tmp_path) -> Callable[[str], tuple[S3Tier, str]]:
    """A bucket prefix holding step 5 (zstd where it shrinks), then forged by the named edit."""
    local = _local(tmp_path / "local", pipeline__stages__compress__codec="zstd")

    def make(name: str) -> tuple[S3Tier, str]:
        url = f"s3://{bucket}/forged"
        tier = _tier(endpoint, url)
        tier.upload(local.step_dir(5), local.manifest(5))
        if name == "manifest not JSON":
            tier.store.put_bytes(f"step-5/{MANIFEST_NAME}", b'{"checksum": "0", "manifest": {"step": 5,')
        else:
            body = _body(tier)
            FORGERIES[name](tier, body)
            _resign(tier, body)
        return tier, url

    return make


def _one_line_refusal(code: int, out: str, err: str) -> list[str]:
    """The lines a command printed, having checked it refused cleanly: exit 1, no traceback."""
    assert code == 1, (code, out, err)
    assert "Traceback" not in out + err and "MemoryError" not in out + err, err
    return [line for line in (out + err).splitlines() if line.strip()]


@pytest.mark.parametrize("name", [*FORGERIES, "manifest not JSON"])
def test_a_forged_bucket_manifest_is_refused_by_verify_restore_and_migrate(forged, endpoint, tmp_path, capsys, name):
    tier, url = forged(name)
    refused = 0

    # tierstate s3 verify: exit 1 (the checkpoint failed, not bad input), each problem one line of its own
    code = main(["s3", "verify", url, "--endpoint-url", endpoint])
    out = capsys.readouterr()
    lines = _one_line_refusal(code, out.out, out.err)
    assert lines and all(line.startswith("step 5: ") for line in lines), lines
    refused += 1

    # a restore's reads (the bucket read in place, and fetched down to a local tier): a copy error, one line
    with pytest.raises(TierstateError) as read:
        StoredCheckpoint(tier.source(5), 5).read()
    assert len(str(read.value).splitlines()) == 1, read.value
    target = FilesystemTier("pulled", tmp_path / "pulled")
    with pytest.raises(TierstateError):
        tier.download(5, target)
    assert target.steps() == [] and target.partials() == []
    refused += 1

    # tierstate migrate from the bucket: exit 1 naming the step, nothing committed on the target
    code = main(["migrate", "5", "--from", "bucket", "--to", "pfs", "--tier", f"bucket={url}",
                 "--tier", f"pfs={tmp_path / 'pfs'}", "--endpoint-url", endpoint])  # fmt: skip
    out = capsys.readouterr()
    _one_line_refusal(code, out.out, out.err)
    assert FilesystemTier("pfs", tmp_path / "pfs").steps() == []
    refused += 1
    tally("bucket_forgery", inputs=1, refused=refused, losses=0)


_CAPPED_VERIFY = """
import resource, sys
from tierstate.cli import main
with open("/proc/self/statm") as statm:
    size = int(statm.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (size + (1 << 30), resource.RLIM_INFINITY))
sys.exit(main(["s3", "verify", sys.argv[1], "--endpoint-url", sys.argv[2]]))
"""


@pytest.mark.slow
def test_verify_of_a_16_tib_claim_allocates_nothing_of_it(forged, endpoint):
    """In a process that cannot map 1 GiB more than it holds: a one-line problem and exit 1, not a MemoryError."""
    _, url = forged("16 TiB data file")
    done = subprocess.run([sys.executable, "-c", _CAPPED_VERIFY, url, endpoint], cwd=REPO, capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    lines = _one_line_refusal(done.returncode, done.stdout, done.stderr)
    assert any(f"{DATA} frame" in line and "truncated" in line for line in lines), lines
    tally("bucket_16_tib_claim", inputs=1, refused=1, losses=0)


def test_the_unforged_copy_restores_bit_for_bit(endpoint, bucket, tmp_path):
    """The fixture's checkpoint, unforged, verifies and restores exactly: the refusals above are the
    forgeries', not the fixture's."""
    local = _local(tmp_path, pipeline__stages__compress__codec="zstd")
    tier = _tier(endpoint, f"s3://{bucket}/intact")
    tier.upload(local.step_dir(5), local.manifest(5))
    assert verify_step(tier, 5).problems == []
    values = StoredCheckpoint(tier.source(5), 5).read()
    assert all(torch.equal(values[f"t/{k}"].view(torch.uint8), v.view(torch.uint8)) for k, v in expected(5).items())
    assert values["meta/value"] == {"step": 5}
