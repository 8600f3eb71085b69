"""A checkpoint's random id: drawn once when it is made, the same in every rank's and node's manifest of it,
kept by migration and conversion, left out of manifests written without one (which stay byte-identical),
and what tells two checkpoints of one step apart when their creation times are equal."""

from __future__ import annotations

import re

import pytest
import torch

from tierstate.providers import TensorDictProvider
from tierstate.tiers.format.format import ManifestError, manifest_bytes, parse_manifest
from tierstate.tiers.format.manifest import Manifest
from tierstate.tiers.format.multirank import RankPart, merge_parts
from tierstate.tiers.ops.migrate import migrate
from tierstate.tiers.storage.filesystem import FilesystemTier
from tierstate.tiers.storage.nodeparts import join_parts, node_part

CREATED = "2026-01-01T00:00:00.000+00:00"


def _saved(make_runner, steps=(1, 2)) -> FilesystemTier:
    with make_runner() as runner:
        runner.register(t=TensorDictProvider({"w": torch.arange(8.0)}))
        for step in steps:
            runner.checkpoint(step).result()
        return runner.durable_tier


def test_every_checkpoint_gets_an_id_of_its_own(make_runner) -> None:
    tier = _saved(make_runner)
    ids = [tier.manifest(step).checkpoint_id for step in (1, 2)]
    assert all(re.fullmatch(r"[0-9a-f]{32}", i or "") for i in ids) and ids[0] != ids[1]


def test_a_manifest_without_an_id_is_written_as_it_was() -> None:
    """An older manifest (no id) round-trips byte for byte: the field is left out, not written as null."""
    old = Manifest(step=3, created=CREATED, files={}, items={})
    raw = manifest_bytes(old)
    assert b"checkpoint_id" not in raw and manifest_bytes(parse_manifest(raw, "old")) == raw
    with pytest.raises(ManifestError, match="checkpoint_id"):
        parse_manifest(manifest_bytes({**old.model_dump(mode="json"), "checkpoint_id": "not-hex"}), "forged")


def test_the_same_checkpoint_is_the_same_id_not_the_same_creation_time() -> None:
    a = Manifest(step=3, created=CREATED, files={}, items={}, checkpoint_id="a" * 32)
    b = a.model_copy(update={"checkpoint_id": "b" * 32})
    assert not a.same_checkpoint(b) and a.same_checkpoint(a.model_copy())
    older = a.model_copy(update={"checkpoint_id": None})  # written before ids: step, time and items decide
    assert older.same_checkpoint(a) and not older.same_checkpoint(a.model_copy(update={"created": "2026"}))


def test_every_rank_and_node_part_carries_rank_0s_id() -> None:
    parts = [
        RankPart(rank, Manifest(step=3, created=CREATED, files={}, items={}, checkpoint_id=str(rank) * 32), frozenset())
        for rank in (0, 1)
    ]
    whole = merge_parts(3, parts)
    assert whole.checkpoint_id == "0" * 32
    nodes = [node_part(whole, node, [rank], ["n0", "n1"]) for rank, node in enumerate(("n0", "n1"))]
    assert {part.checkpoint_id for part in nodes} == {"0" * 32} and join_parts(3, nodes) == whole
    stranger = nodes[1].model_copy(update={"checkpoint_id": "f" * 32})  # same time, another checkpoint
    with pytest.raises(ManifestError, match="node n1's part is of another checkpoint"):
        join_parts(3, [nodes[0], stranger])


@pytest.mark.parametrize("fmt", [None, "hdf5"])
def test_migration_and_conversion_keep_the_id(make_runner, tmp_path, fmt) -> None:
    tier = _saved(make_runner, steps=(1,))
    target = FilesystemTier("other", tmp_path / "other")
    assert migrate(1, tier, target, fmt=fmt).outcome == ("converted" if fmt else "copied")
    assert target.manifest(1).checkpoint_id == tier.manifest(1).checkpoint_id is not None
