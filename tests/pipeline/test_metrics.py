"""What a checkpoint cost, where people look: ``handle.stats``, one structured log record per
checkpoint, ``runner.metrics()``, the manifest's ``stats`` and ``tierstate stats``."""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from tierstate.cli.stats import show_stats
from tierstate.pipeline.handle import CheckpointFailed, HandleCompleter
from tierstate.pipeline.runner import Runner
from tierstate.providers import TensorDictProvider
from tierstate.tiers.format.format import ManifestError, checksum, manifest_bytes, read_manifest
from tierstate.tiers.format.manifest import MANIFEST_NAME
from tierstate.tiers.format.multirank import RankPart, merge_parts

MiB = 1 << 20
CHAIN = ["capture", "serialize", "compress", "persist"]


def _tensors(mib: int) -> dict[str, torch.Tensor]:
    return {f"t{i}": torch.full((MiB // 4,), float(i)) for i in range(mib)}


def _records(caplog: pytest.LogCaptureFixture) -> list[dict]:
    return [r.tierstate for r in caplog.records if hasattr(r, "tierstate")]


def test_the_handle_says_what_each_stage_moved_and_took(make_runner: Callable[..., Runner]) -> None:
    runner = make_runner(chunk_size="1MiB")
    runner.register(t=TensorDictProvider(_tensors(4)))
    handle = runner.checkpoint(1)
    result = handle.result()
    stats = handle.stats
    assert stats.outcome == "durable" and stats.step == 1
    assert (stats.raw_bytes, stats.stored_bytes, stats.chunks) == (result.raw_bytes, result.stored_bytes, 4)
    assert list(stats.stages) == CHAIN
    for name, stage in stats.stages.items():
        assert stage.units == 4 and stage.bytes == 4 * MiB, name
        if name in ("serialize", "compress"):  # nothing to do on tensor chunks, uncompressed: passed on
            assert stage.passed_units == 4 and stage.seconds == stage.busy_s == stage.queue_peak == 0, name
            continue
        assert stage.passed_units == 0 and 0 < stage.seconds and 0 < stage.busy_s and stage.gbps > 0, name
        assert 1 <= stage.queue_peak <= stage.queue_bound, name
    assert 0 < stats.capture_s <= stats.written_s <= stats.durable_s == result.durable_s
    assert stats.blocked_s == handle.blocked_s > 0 and stats.gbps == pytest.approx(4 * MiB / stats.durable_s / 1e9)
    assert stats.eager.tensors == 4  # a TensorDictProvider's tensors may change at any time: copied at once
    assert runner.history[-1] == (handle, stats)


def test_seconds_count_from_the_request_not_from_the_return(make_runner: Callable[..., Runner]) -> None:
    """32 MiB copied inside ``checkpoint()`` (its tensors may change at any time): the capture ends after
    the call returns, so ``capture_s``, counted from the request, is at least the time spent in the call."""
    runner = make_runner(chunk_size="4MiB", host_cache__size="64MiB")
    runner.register(t=TensorDictProvider(_tensors(32)))
    handle = runner.checkpoint(1)
    in_call = handle.stats.blocked_s  # the time checkpoint() took (nothing attached: no pre-hook waits)
    handle.result()
    assert in_call > 0 and handle.stats.capture_s >= in_call - 1e-4, (handle.stats.capture_s, in_call)
    assert handle.stats.capture_s <= handle.stats.written_s <= handle.stats.durable_s
    runner.close()


def test_capture_waiting_for_the_host_cache_is_measured(make_runner: Callable[..., Runner]) -> None:
    """Two 1 MiB slabs, 8 MiB to write at 16 MiB/s: capture can only run as fast as persist frees slabs."""
    slow = make_runner(host_cache__size="2MiB", chunk_size="1MiB", pipeline__stages__persist__bandwidth="16MiB")
    slow.register(t=TensorDictProvider(_tensors(8)))
    starved = slow.checkpoint(1)
    starved.result()
    slow.close()  # one writer per tier: the next runner takes it
    fast = make_runner(chunk_size="1MiB")
    fast.register(t=TensorDictProvider(_tensors(8)))
    roomy = fast.checkpoint(2)  # same tiers: another step
    roomy.result()
    assert starved.stats.cache_wait_s > 0.2 and starved.stats.cache_wait_s > 10 * roomy.stats.cache_wait_s
    assert starved.stats.stages["persist"].seconds > 0.3


def test_blocked_time_includes_the_step_pre_hook_and_reaches_the_manifest(make_runner: Callable[..., Runner]) -> None:
    model = torch.nn.Linear(1024, 2048)  # 8 MiB of parameters, captured lazily behind the pre-hook
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    runner = make_runner(host_cache__size="2MiB", chunk_size="1MiB", pipeline__stages__persist__bandwidth="16MiB")
    runner.register(model=model, optim=opt)
    model(torch.randn(4, 1024)).sum().backward()
    called = time.perf_counter()
    handle = runner.checkpoint(1)
    started = time.perf_counter()
    opt.step()  # waits in the pre-hook until the capture is done
    waited = time.perf_counter() - started
    call = started - called
    result = handle.result()
    # Everything counted happened within the call and the step, and the wait is counted once (twice
    # would exceed call + waited, since the wait is most of the step).
    assert waited > 0.2 and waited * 0.5 <= handle.stats.blocked_s <= call + waited
    written = read_manifest(result.path).stats
    assert written is not None and written[0].blocked_s == pytest.approx(handle.stats.blocked_s, abs=1e-5)


def test_a_wait_counts_as_blocked_by_the_time_the_capture_resolves() -> None:
    """The job writes the blocked time into the manifest right after the capture: a trainer thread
    still waking up from its wait must already be counted then."""
    completer = HandleCompleter(1, ["nvme"])
    waiting = threading.Event()

    def trainer() -> None:
        waiting.set()
        completer.wait_captured()

    thread = threading.Thread(target=trainer)
    thread.start()
    waiting.wait()
    started = time.perf_counter()
    while time.perf_counter() - started < 0.05:  # the trainer waits meanwhile
        pass
    completer.captured()
    counted = completer.handle.stats.blocked_s  # on this thread, before the trainer may run again
    thread.join()
    assert counted >= 0.04 and completer.handle.stats.blocked_s == counted


class _Broken:
    """A provider whose describe() fails (a bug in user code): its checkpoint fails, training goes on."""

    def describe(self) -> list:
        raise RuntimeError("cannot describe")

    def restore(self, state: object) -> None:
        raise AssertionError("never restored")


def test_one_structured_log_record_per_checkpoint(
    make_runner: Callable[..., Runner], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="tierstate")
    runner = make_runner(pipeline__stages__persist__bandwidth="16MiB", policies__in_flight="skip")
    runner.register(t=TensorDictProvider(_tensors(4)))
    first = runner.checkpoint(1)
    skipped = runner.checkpoint(2)  # the first is still writing (~0.25 s at 16 MiB/s)
    first.result()
    runner.register(broken=_Broken())
    failed = runner.checkpoint(3)  # a provider that cannot describe its state: that checkpoint fails
    failed.wait()
    records = _records(caplog)
    assert [(r["step"], r["outcome"]) for r in records] == [(2, "skipped"), (1, "durable"), (3, "failed")]
    assert skipped.skipped and records[1]["raw_bytes"] == first.stats.raw_bytes == 4 * MiB
    assert [s["name"] for s in records[1]["stages"]] == CHAIN
    assert records[2]["error"].startswith("RuntimeError: cannot describe"), records[2]["error"]
    json.dumps(records)  # structured: ready for a JSON log formatter


def test_runner_metrics_sum_the_run(make_runner: Callable[..., Runner]) -> None:
    runner = make_runner()
    runner.register(t=TensorDictProvider(_tensors(2)))
    handles = [runner.checkpoint(step) for step in (1, 2, 3)]
    for handle in handles:
        handle.result()
    before = runner.metrics()
    runner.register(broken=_Broken())
    failed = runner.checkpoint(4)
    with pytest.raises(CheckpointFailed):
        failed.result()
    metrics = runner.metrics()
    assert (before.requested, before.durable, before.failed) == (3, 3, 0)
    assert (metrics.requested, metrics.durable, metrics.failed, metrics.skipped) == (4, 3, 1, 0)
    assert metrics.raw_bytes == 3 * 2 * MiB == metrics.stages["persist"].bytes
    assert metrics.durable_s == pytest.approx(sum(h.stats.durable_s for h in handles))
    assert metrics.stages["capture"].units == 3  # one 16 MiB chunk each
    assert metrics.blocked_max_s >= metrics.blocked_mean_s > 0 and metrics.gbps > 0
    assert metrics.last is failed.stats
    assert json.loads(json.dumps(metrics.as_dict()))["durable"] == 3


def test_the_manifest_keeps_what_the_checkpoint_cost(make_runner: Callable[..., Runner]) -> None:
    runner = make_runner(chunk_size="1MiB")
    runner.register(t=TensorDictProvider(_tensors(3)))
    handle = runner.checkpoint(1)
    result = handle.result()
    written = read_manifest(result.path).stats
    assert written is not None and list(written) == [0]
    record, stats = written[0], handle.stats
    assert (record.raw_bytes, record.stored_bytes, record.chunks) == (stats.raw_bytes, stats.stored_bytes, 3)
    assert record.capture_s <= record.written_s < stats.durable_s
    assert record.written_s == pytest.approx(stats.written_s, abs=1e-5)
    assert [(s.name, s.units, s.bytes) for s in record.stages] == [(name, 3, 3 * MiB) for name in CHAIN]
    assert record.eager_tensors == 3 and record.eager_bytes == 3 * MiB


def _rewrite_manifest(directory: Path, edit: Callable[[dict], None]) -> None:
    """Edit the manifest body and give it a valid checksum again (what a tool of another version writes)."""
    doc = json.loads((directory / MANIFEST_NAME).read_bytes())
    edit(doc["manifest"])
    body = json.dumps(doc["manifest"], sort_keys=True, separators=(",", ":")).encode()
    doc["checksum"] = checksum(body)
    (directory / MANIFEST_NAME).write_text(json.dumps(doc))


def test_manifests_without_stats_stay_valid_and_bad_stats_are_refused(make_runner: Callable[..., Runner]) -> None:
    runner = make_runner()
    runner.register(t=TensorDictProvider(_tensors(1)))
    path = runner.checkpoint(1).result().path
    _rewrite_manifest(path, lambda body: body.pop("stats"))
    assert read_manifest(path).stats is None
    assert b'"stats"' not in manifest_bytes(read_manifest(path))  # rewritten (migrated) as it was
    runner.restore(1)  # an older manifest restores as before
    path = runner.checkpoint(2).result().path
    _rewrite_manifest(path, lambda body: body["stats"]["0"].update(capture_s=-1.0))
    with pytest.raises(ManifestError, match=r"invalid manifest at stats.0.capture_s"):
        read_manifest(path)


def test_tierstate_stats_shows_what_a_checkpoint_cost(
    make_runner: Callable[..., Runner], capsys: pytest.CaptureFixture[str]
) -> None:
    runner = make_runner(chunk_size="1MiB")
    runner.register(t=TensorDictProvider(_tensors(2)))
    path = runner.checkpoint(5).result().path
    assert show_stats(path, as_json=False) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("step 5: 2,097,152 bytes raw")
    assert lines[1] == "rank 0: 2,097,152 bytes in 2 chunks, 2,097,152 stored"
    assert "trainer blocked" in lines[3]
    assert "2 tensors (2,097,152 bytes) copied before checkpoint() returned" in lines[3]
    table = [line.split() for line in lines[4:]]
    assert [row[0] for row in table] == ["stage", *CHAIN]
    passed = {"capture": "0", "serialize": "2", "compress": "2", "persist": "0"}  # units, passed, bytes
    assert all(row[1:4] == ["2", passed[row[0]], "2,097,152"] for row in table[1:])
    assert show_stats(path, as_json=True) == 0
    document = json.loads(capsys.readouterr().out)
    assert document["step"] == 5 and document["ranks"]["0"]["stages"][3]["name"] == "persist"
    _rewrite_manifest(path, lambda body: body.pop("stats"))
    show_stats(path, as_json=False)
    assert "no stats recorded" in capsys.readouterr().out


def test_a_merged_multi_rank_manifest_keeps_every_rank_stats(tmp_path: Path) -> None:
    parts = []
    for rank in (0, 1):
        tiers = {"nvme": {"path": str(tmp_path / f"rank{rank}")}, "pfs": {"path": str(tmp_path / "pfs")}}
        with Runner.from_yaml(Path(__file__).parents[2] / "configs" / "default.yaml", {"tiers": tiers}, rank=rank) as r:
            r.register(t=TensorDictProvider(_tensors(rank + 1)))
            manifest = read_manifest(r.checkpoint(1).result().path)
        parts.append(RankPart(rank, manifest, frozenset()))
    merged = merge_parts(1, parts)
    assert merged.stats is not None and sorted(merged.stats) == [0, 1]
    assert [merged.stats[rank].raw_bytes for rank in (0, 1)] == [MiB, 2 * MiB]


def test_metrics_flat_and_as_prometheus_text(make_runner: Callable[..., Runner]) -> None:
    runner = make_runner()
    runner.register(t=TensorDictProvider(_tensors(2)))
    for step in (1, 2):
        runner.checkpoint(step).result()
    metrics = runner.metrics()
    flat = metrics.flat()
    assert all(isinstance(v, int | float) and not isinstance(v, bool) for v in flat.values())
    assert flat["durable"] == 2 and flat["raw_bytes"] == 2 * 2 * MiB and flat["stage_persist_bytes"] == 2 * 2 * MiB
    assert flat["last_step"] == 2 and flat["last_failures"] == 0 and flat["last_blocked_s"] > 0
    text = metrics.prometheus()
    samples = {}
    for line in text.splitlines():
        if not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    assert "# TYPE tierstate_durable counter" in text and "# TYPE tierstate_gbps gauge" in text
    assert samples["tierstate_durable"] == 2 and samples["tierstate_raw_bytes"] == 4 * MiB
    assert samples['tierstate_stage_bytes{stage="persist"}'] == 4 * MiB
    assert set(samples) >= {f'tierstate_stage_units{{stage="{s}"}}' for s in CHAIN}
