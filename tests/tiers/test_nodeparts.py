"""Node parts of a multi-rank checkpoint (tiers/storage/nodeparts.py), node names in tier paths
(tiers/storage/nodes.py).

The two-node runs are in tests/pipeline/test_nodes.py; these check the format rules on their own.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from conftest import DEFAULT_YAML
from tierstate.pipeline.config import ConfigError, parse_config
from tierstate.tiers.format.format import ManifestError, manifest_bytes, parse_manifest
from tierstate.tiers.format.manifest import Manifest
from tierstate.tiers.format.multirank import RankPart, merge_parts
from tierstate.tiers.storage.filesystem import FilesystemTier
from tierstate.tiers.storage.nodeparts import join_parts, node_part, part_marker, publish_parts
from tierstate.tiers.storage.nodes import NODE_ENV


def rank_manifest(rank: int) -> Manifest:
    """What rank ``rank`` wrote: one frame of 16 bytes holding its 4-float value of ``rng/state``."""
    name = f"rank-{rank:05d}.data"
    frame = {"offset": 0, "length": 16, "raw_length": 16, "codec": "none", "checksum": f"{rank:016x}"}
    piece = {"file": name, "frame": 0, "offset": 0, "length": 16, "item_offset": 0}
    return Manifest.model_validate({
        "step": 3, "created": "2026-01-01T00:00:00.000+00:00", "world_size": 1,
        "files": {name: {"size": 16, "frames": [frame]}},
        "indexes": {f"rank-{rank:05d}.index": f"{rank:016x}"},
        "items": {"rng/state": {"kind": "tensor", "dtype": "float32", "shape": [4], "pieces": [piece]}},
    })  # fmt: skip


@pytest.fixture
def whole() -> Manifest:
    return merge_parts(3, [RankPart(rank, rank_manifest(rank), frozenset()) for rank in (0, 1)])


def test_a_node_part_holds_its_files_and_reads_back(whole):
    part = node_part(whole, "n1", [1], ["n0", "n1"])
    assert list(part.files) == ["rank-00001.data"] and list(part.indexes) == ["rank-00001.index"]
    back = parse_manifest(manifest_bytes(part), "n1 part")  # rank 0's piece lies in a file not here
    assert back == part and back.node_part is not None and back.node_part.node == "n1"


def test_a_whole_checkpoint_is_written_as_before(whole):
    assert "node_part" not in json.loads(manifest_bytes(whole))["manifest"]
    assert whole.version == 2


def test_a_node_part_still_checks_the_pieces_in_its_own_files(whole):
    part = node_part(whole, "n1", [1], ["n0", "n1"])
    broken = part.model_copy(update={"files": {}})  # its own rank's file is missing from it
    with pytest.raises(ManifestError, match="piece in unknown file 'rank-00001.data'"):
        parse_manifest(manifest_bytes(broken), "n1 part")


def test_the_parts_join_back_into_the_whole(whole):
    parts = [node_part(whole, "n0", [0], ["n0", "n1"]), node_part(whole, "n1", [1], ["n0", "n1"])]
    assert join_parts(3, parts) == whole
    with pytest.raises(ManifestError, match=r"expected one of each \['n0', 'n1'\]"):
        join_parts(3, parts[:1])
    other = parts[1].model_copy(update={"created": "2026-02-02T00:00:00.000+00:00"})
    with pytest.raises(ManifestError, match="node n1's part is of another checkpoint"):
        join_parts(3, [parts[0], other])
    with pytest.raises(ManifestError, match="step 3: a whole checkpoint's manifest among the node parts"):
        join_parts(3, [whole, parts[1]])


def test_only_the_node_that_publishes_the_parts_is_told_so(whole, tmp_path: Path):
    """The publisher alone then stamps the published copy verified: two nodes finishing together both
    stamped it, and the second's temporary stamp collided with the first's (a flush reported failed)."""
    tier = FilesystemTier("pfs", tmp_path / "pfs")
    partial = tier.partial_dir(3)
    partial.mkdir(parents=True)
    for rank in (0, 1):
        (partial / f"rank-{rank:05d}.data").write_bytes(bytes(16))
        (partial / f"rank-{rank:05d}.index").write_bytes(b"")
    (partial / part_marker("n0")).write_bytes(manifest_bytes(node_part(whole, "n0", [0], ["n0", "n1"])))
    first = publish_parts(tier, 3)
    assert (first.missing, first.published) == (["n1"], None)
    (partial / part_marker("n1")).write_bytes(manifest_bytes(node_part(whole, "n1", [1], ["n0", "n1"])))
    last = publish_parts(tier, 3)
    assert (last.missing, last.published) == ([], tier.step_dir(3)) and tier.steps() == [3]
    later = publish_parts(tier, 3)  # the other node's look, once published
    assert (later.missing, later.published) == ([], None)


def test_node_in_a_tier_path_is_the_node_name(monkeypatch, tmp_path: Path):
    monkeypatch.setenv(NODE_ENV, "n7")
    tiers = {"nvme": {"path": str(tmp_path / "{node}" / "nvme"), "scope": "node"}, "pfs": {"path": str(tmp_path)}}
    config = parse_config(DEFAULT_YAML.read_text(), overrides={"tiers": tiers})
    assert config.tiers["nvme"].path == tmp_path / "n7" / "nvme" and config.tiers["nvme"].scope == "node"
    assert config.tiers["pfs"].scope == "shared"
    with pytest.raises(ConfigError, match="tiers.pfs.scope"):
        parse_config(DEFAULT_YAML.read_text(), overrides={"tiers.pfs.scope": "rack"})
