"""The commit protocol, in-flight policies, and failures that must not reach the training loop."""

from __future__ import annotations

import json

import pytest
import torch

from tierstate import cli
from tierstate.pipeline.handle import CheckpointFailed
from tierstate.pipeline.restore import NoCheckpointError
from tierstate.providers import ObjectProvider, TensorDictProvider
from tierstate.tiers.format.format import ManifestError, parse_index, read_manifest
from tierstate.tiers.format.manifest import Manifest
from tierstate.tiers.storage.filesystem import CheckpointExistsError, TierError


def _state(mib: int = 1) -> dict[str, torch.Tensor]:
    return {"w": torch.randn(mib * 1024 * 1024 // 4, generator=torch.Generator().manual_seed(mib))}


def test_committed_layout_and_nothing_partial_left(make_runner, tmp_path):
    runner = make_runner()
    runner.register(t=TensorDictProvider(_state()))
    result = runner.checkpoint(4).result()
    assert result.path == tmp_path / "nvme" / "step-4"
    assert sorted(p.name for p in result.path.iterdir()) == ["manifest.json", "rank-00000.data", "rank-00000.index"]
    assert [p.name for p in (tmp_path / "nvme").iterdir() if p.suffix != ".lock"] == ["step-4"]
    assert runner.steps() == {"nvme": [4], "pfs": []}


def test_manifest_is_written_in_the_exact_form_the_schema_reads(make_runner):
    """The pipeline writes manifests as plain dicts (fast with 10^4 items), not through the pydantic
    records: what it writes must be exactly what the schema would write for the same checkpoint."""
    w = torch.arange(600_000, dtype=torch.float32)
    tensors = {"w": w, "tied": w, "h": torch.ones(3, 5, dtype=torch.bfloat16).t(), "empty": torch.empty(0, 2)}
    runner = make_runner(chunk_size="1MiB")
    runner.register(t=TensorDictProvider(tensors), meta=ObjectProvider({"epoch": 3}))
    path = runner.checkpoint(6).result().path
    raw = (path / "manifest.json").read_bytes()
    doc = json.loads(raw)
    body = doc["manifest"]
    assert Manifest.model_validate(body).model_dump(mode="json") == body
    assert raw == json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    items = body["items"]
    assert items["t/tied"] == {"kind": "alias", "of": "t/w"}
    assert [p["item_offset"] for p in items["t/w"]["pieces"]] == [0, 1 << 20, 2 << 20]  # split over 3 chunks
    assert items["t/h"]["shape"] == [5, 3] and items["t/empty"]["pieces"] == []
    index = parse_index((path / "rank-00000.index").read_bytes(), "index")
    assert {key: record.model_dump(mode="json") for key, record in index.items.items()} == items


def test_directory_without_manifest_is_never_listed_or_restored(make_runner, tmp_path):
    tensors = _state()
    expected = tensors["w"].clone()
    runner = make_runner()
    runner.register(t=TensorDictProvider(tensors))
    runner.checkpoint(2).result()
    # What a crash leaves: a partial directory; and a final-looking one without a manifest, which no
    # commit leaves (the rename comes after the manifest): a damaged step, never taken for a checkpoint.
    crashed = tmp_path / "nvme" / "step-5.partial"
    crashed.mkdir()
    (crashed / "rank-00000.data").write_bytes(b"\0" * 4096)
    torn = tmp_path / "nvme" / "step-7"
    torn.mkdir()
    (torn / "rank-00000.data").write_bytes(b"\0" * 4096)
    (torn / "manifest.json.tmp").write_bytes(b"{")
    assert runner.steps()["nvme"] == [2]
    tensors["w"].zero_()
    with pytest.raises(NoCheckpointError, match="latest step: step 7 on tier nvme: not a checkpoint"):
        runner.restore("latest")  # the newest step is damaged: said, never quietly an older one
    assert runner.restore("latest", fallback=True).step == 2
    assert torch.equal(tensors["w"], expected)
    with pytest.raises(NoCheckpointError, match="step 7"):
        runner.restore(7)


def test_flipped_byte_is_detected_and_never_loaded(make_runner, tmp_path):
    tensors = _state()
    runner = make_runner()
    runner.register(t=TensorDictProvider(tensors))
    path = runner.checkpoint(1).result().path
    data = path / "rank-00000.data"
    raw = bytearray(data.read_bytes())
    raw[len(raw) // 2] ^= 0x01
    data.write_bytes(bytes(raw))
    tensors["w"].fill_(7.0)
    with pytest.raises(NoCheckpointError, match=r"rank-00000.data frame 0: checksum mismatch"):
        runner.restore(1)
    assert bool((tensors["w"] == 7.0).all())  # nothing half-loaded


def test_skip_policy_drops_requests_while_one_is_in_flight(make_runner):
    # 64 MiB/s on 8 MiB keeps the first checkpoint in flight for ~0.12 s, ages for a call that takes microseconds.
    runner = make_runner(pipeline__stages__persist__bandwidth="64MiB", policies__in_flight="skip")
    runner.register(t=TensorDictProvider(_state(8)))
    first = runner.checkpoint(1)
    second = runner.checkpoint(2)
    assert second.skipped and second.done()
    with pytest.raises(CheckpointFailed, match="skipped"):
        second.result()
    assert first.result().step == 1
    assert runner.steps()["nvme"] == [1]


def test_wait_policy_waits_for_the_previous_checkpoint(make_runner):
    runner = make_runner(pipeline__stages__persist__bandwidth="64MiB", policies__in_flight="wait")
    runner.register(t=TensorDictProvider(_state(8)))
    first = runner.checkpoint(1)
    second = runner.checkpoint(2)
    assert first.done()  # checkpoint(2) returned only once step 1 was durable
    assert second.result().step == 2 and runner.steps()["nvme"] == [1, 2]


def test_failed_checkpoint_reports_and_training_goes_on(make_runner, tmp_path, caplog):
    values = {"ok": 1}
    runner = make_runner()
    runner.register(t=TensorDictProvider(_state()), meta=ObjectProvider(lambda: values))
    runner.checkpoint(1).result()
    values["bad"] = {1, 2}  # a set is not msgpack data
    handle = runner.checkpoint(2)  # must not raise
    assert handle.wait(30) and handle.error is not None
    with pytest.raises(CheckpointFailed, match=r"meta/value.*set"):
        handle.result()
    assert "checkpoint step 2 failed" in caplog.text
    assert sorted(p.name for p in (tmp_path / "nvme").iterdir() if p.suffix != ".lock") == ["step-1"]  # partial removed
    del values["bad"]
    assert runner.checkpoint(3).result().step == 3
    assert runner.restore("latest").step == 3


def test_pickle_needs_permission(make_runner):
    runner = make_runner()
    runner.register(meta=ObjectProvider({"k": 1}, serializer="pickle"))
    with pytest.raises(CheckpointFailed, match="allow_pickle"):
        runner.checkpoint(1).result()
    runner.close()  # one writer per tier, in a process too: the next runner takes it once this one is closed
    allowed = make_runner(policies__allow_pickle=True)
    allowed.register(meta=ObjectProvider({"k": 1}, serializer="pickle"))
    assert allowed.checkpoint(1).result().step == 1


def test_same_step_twice_keeps_the_first(make_runner):
    tensors = _state()
    first_values = tensors["w"].clone()
    runner = make_runner()
    runner.register(t=TensorDictProvider(tensors))
    runner.checkpoint(1).result()
    tensors["w"].add_(1)
    with pytest.raises(CheckpointExistsError, match="holds step 1 already"):  # at the call, not on a handle
        runner.checkpoint(1)
    runner.restore(1)
    assert torch.equal(tensors["w"], first_values)


def test_unwritable_tier_fails_the_checkpoint_not_the_trainer(make_runner, tmp_path):
    blocker = tmp_path / "not-a-dir"
    runner = make_runner(tiers={"nvme": {"path": str(blocker)}})  # a bad path at build time fails there
    blocker.rmdir()
    blocker.write_text("a file where the tier directory should be")  # so it goes bad during the run
    runner.register(t=TensorDictProvider(_state()))
    handle = runner.checkpoint(1)
    handle.wait()
    assert isinstance(handle.error, TierError) and "not-a-dir" in str(handle.error)
    assert runner.cache.in_use == 0


def test_a_provider_that_raises_fails_only_its_checkpoint(make_runner):
    class Broken:
        def describe(self):
            raise RuntimeError("sampler state unavailable")

        def restore(self, state):
            pass

    runner = make_runner()
    runner.register(broken=Broken())
    handle = runner.checkpoint(1)
    assert handle.done() and "sampler state unavailable" in str(handle.error)


async def test_acheckpoint_from_an_async_trainer(make_runner):
    runner = make_runner()
    runner.register(t=TensorDictProvider(_state()))
    result = await runner.acheckpoint(9)
    assert result.step == 9 and result.path.is_dir()


def test_cli_inspect_and_ls(make_runner, tmp_path, capsys):
    runner = make_runner()
    runner.register(t=TensorDictProvider(_state()), meta=ObjectProvider({"epoch": 1}))
    path = runner.checkpoint(6).result().path
    (tmp_path / "nvme" / "step-8.partial").mkdir()
    assert cli.main(["inspect", str(path), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["step"] == 6 and {r["key"] for r in shown["item_table"]} == {"t/w", "meta/value"}
    assert cli.main(["ls", "--tier", f"nvme={tmp_path / 'nvme'}", "--json"]) == 0
    listed = json.loads(capsys.readouterr().out)
    assert [(e["step"], e["state"]) for e in listed] == [(6, "committed"), ("step-8.partial", "partial")]
    assert cli.main(["inspect", "6", "--tier", f"nvme={tmp_path / 'nvme'}"]) == 0
    assert "t/w" in capsys.readouterr().out
    assert cli.main(["inspect", "99", "--tier", f"nvme={tmp_path / 'nvme'}"]) == 2
    assert "step 99" in capsys.readouterr().err


def test_a_manifest_edited_in_place_is_refused(make_runner):
    """Edited without changing its layout (the form the fast parse takes), a manifest fails its checksum."""
    tensors = _state()
    runner = make_runner()
    runner.register(t=TensorDictProvider(tensors))
    path = runner.checkpoint(1).result().path / "manifest.json"
    raw = path.read_bytes()
    assert b'"step":1,' in raw
    path.write_bytes(raw.replace(b'"step":1,', b'"step":2,'))
    with pytest.raises(ManifestError, match="manifest checksum mismatch"):
        read_manifest(path.parent)
