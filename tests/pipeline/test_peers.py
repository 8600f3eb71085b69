"""Peer copies: who is whose partner, what a received part must pass, and the settings refused.

The copies between real nodes (two torchrun launches) are in tests/pipeline/test_nodes.py.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from tierstate.pipeline.config import ConfigError, parse_config
from tierstate.pipeline.config_schema import TierConfig
from tierstate.pipeline.room import Room, TierFullError, no_room_for
from tierstate.pipeline.runner import Runner
from tierstate.providers import TensorDictProvider
from tierstate.tiers.format.format import ManifestError
from tierstate.tiers.format.manifest import MANIFEST_NAME
from tierstate.tiers.reading.pieces import CorruptCheckpointError
from tierstate.tiers.storage.filesystem import FilesystemTier
from tierstate.tiers.storage.nodeparts import node_part
from tierstate.tiers.storage.peers import ReceivedPart, part_files, partner_of
from tierstate.tiers.storage.safeopen import read_bytes

MiB = 1 << 20


def test_partners_form_a_ring_over_the_sorted_nodes():
    nodes = ["n2", "n0", "n1"]
    assert [partner_of(nodes, n) for n in ("n0", "n1", "n2")] == ["n1", "n2", "n0"]
    assert partner_of(["a", "b"], "b") == "a"


@pytest.mark.parametrize(
    ("tiers", "expected"),
    [
        ({"nvme": {"scope": "node"}, "pfs": {"replicas": 1, "flush": {"every": 1}}},
         "tiers.pfs.replicas: peer copies put a node's part on a partner node; only a scope: node tier"),
        ({"nvme": {"scope": "shared", "replicas": 1}}, "tiers.nvme.replicas: peer copies put"),
        ({"nvme": {"scope": "node", "replicas": 2}}, "tiers.nvme.replicas: must be less than or equal to 1, got 2"),
        ({"pfs": {}, "nvme": {"scope": "node", "replicas": 1, "flush": {"every": 1}}},
         "tiers.nvme.replicas: peer copies are of a node's part, but the persist tier 'pfs' is shared"),
    ],
)  # fmt: skip
def test_replicas_only_on_a_node_tier_of_a_node_scoped_checkpoint(tmp_path: Path, tiers: dict, expected: str):
    spec = {name: {"path": str(tmp_path / name), **tier} for name, tier in tiers.items()}
    with pytest.raises(ConfigError) as caught:
        parse_config({"tiers": spec}, source="my.yaml")
    assert f"my.yaml: {expected}" in str(caught.value)


@pytest.fixture
def one_rank() -> Iterator[None]:
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.mark.skipif(not (dist.is_available() and dist.is_gloo_available()), reason="needs gloo")
def test_more_replicas_than_other_nodes_is_refused_when_the_job_starts(tmp_path: Path, one_rank: None):
    tiers = {"nvme": {"path": str(tmp_path / "{node}"), "scope": "node", "replicas": 1}}
    with pytest.raises(ValueError, match=r"tiers\.nvme\.replicas: 1 peer copies need 2 nodes; this job runs on 1"):
        Runner.from_dict({"tiers": tiers}, distributed=True)


# --- receiving a part -----------------------------------------------------------------------------


def committed_part(tmp_path: Path) -> FilesystemTier:
    """A one-rank checkpoint on ``tmp_path/src``, rewritten as node n0's part of a two-node job."""
    tiers = {"nvme": {"path": str(tmp_path / "whole")}}
    runner = Runner.from_dict({"chunk_size": "1MiB", "host_cache": {"size": "8MiB"}, "tiers": tiers})
    runner.register(state=TensorDictProvider({"w": torch.arange(1000.0)}))
    runner.checkpoint(3).result()
    runner.close()
    whole = FilesystemTier("whole", tmp_path / "whole")
    source = FilesystemTier("src", tmp_path / "src", "node")
    source.begin(3)
    for name in os.listdir(whole.step_dir(3)):
        if name != MANIFEST_NAME and not name.startswith("verified"):
            (source.partial_dir(3) / name).write_bytes((whole.step_dir(3) / name).read_bytes())
    source.commit(3, node_part(whole.manifest(3), "n0", [0], ["n0", "n1"]))
    return source


def receive(source: FilesystemTier, target: FilesystemTier, change: dict[str, bytes] | None = None) -> Path:
    """Send ``source``'s step 3 to ``target`` as the peer transfer does, file by file, with ``change`` applied."""
    part = ReceivedPart(target, 3, "n0")
    try:
        for name, _size in part_files(source, 3):
            data = (change or {}).get(name, read_bytes(source.step_dir(3) / name))
            fd = part.open(name)
            if fd is None:
                part.manifest += data
                continue
            os.write(fd, data)
            os.close(fd)
        return part.publish()
    except BaseException:
        part.abort()
        raise


def test_a_received_part_is_verified_then_published_with_its_manifest_last(tmp_path: Path):
    source = committed_part(tmp_path)
    names = [name for name, _ in part_files(source, 3)]
    assert names == ["rank-00000.data", "rank-00000.index", MANIFEST_NAME]
    target = FilesystemTier("nvme (copy of n0)", tmp_path / "peer-n0", "node")
    receive(source, target)
    assert target.steps() == [3]
    assert target.manifest(3) == source.manifest(3)


def test_a_received_part_with_a_damaged_frame_is_not_published(tmp_path: Path):
    source = committed_part(tmp_path)
    data = bytearray(read_bytes(source.step_dir(3) / "rank-00000.data"))
    data[len(data) // 2] ^= 0xFF
    target = FilesystemTier("copy", tmp_path / "peer-n0", "node")
    with pytest.raises(CorruptCheckpointError, match="rank-00000.data"):
        receive(source, target, {"rank-00000.data": bytes(data)})
    assert target.steps() == [] and target.partials() == []


def test_a_received_file_name_outside_a_checkpoints_grammar_is_refused(tmp_path: Path):
    target = FilesystemTier("copy", tmp_path / "peer-n0", "node")
    part = ReceivedPart(target, 3, "n0")
    with pytest.raises(ManifestError, match="not a file of a checkpoint's part"):
        part.open("../../escape")
    part.abort()
    assert not (tmp_path / "escape").exists() and target.partials() == []


# --- a bounded tier keeps its partner's parts within its size -------------------------------------


def test_a_tiers_used_bytes_count_the_peer_copies_it_keeps_but_not_what_a_symlink_points_at(tmp_path: Path):
    source = committed_part(tmp_path)
    memory = FilesystemTier("memory", tmp_path / "memory", "node")
    memory.root.mkdir()
    alone = memory.bytes_used()
    receive(source, FilesystemTier("memory (copy of n0)", memory.root / "peer-n0", "node"))
    part = sum((source.step_dir(3) / name).stat().st_blocks * 512 for name, _ in part_files(source, 3))
    assert memory.bytes_used() - alone >= part  # the copy's files, and its directories
    before = memory.bytes_used()
    (memory.root / "peer-n9").symlink_to(source.root)  # planted: points at a whole other tier
    (memory.root / "step-8").symlink_to(source.step_dir(3))
    links = sum((memory.root / name).lstat().st_blocks * 512 for name in ("peer-n9", "step-8"))
    assert memory.bytes_used() - before == links  # the links themselves, never their targets


def test_a_replicated_bounded_tier_must_hold_its_partners_parts_too(tmp_path: Path):
    tiers = {"memory": {"kind": "memory", "path": str(tmp_path / "m"), "size": "40MiB", "replicas": 1,
                        "retention": {"keep_last": 1}},
             "pfs": {"path": str(tmp_path / "pfs"), "flush": {"every": 1}}}  # fmt: skip
    config = parse_config({"tiers": tiers})
    memory = FilesystemTier("memory", tmp_path / "m", "node")
    room = Room.of(memory, config.tiers["memory"], node_ranks=1, settle=_nothing_to_settle, pool=None)  # type: ignore[arg-type]
    assert room is not None  # the memory tier's size is bounded
    assert room.needed(5, 8 * MiB) == 9 * MiB  # 2 own + 2 partner's of 9 MiB fit in 40 MiB
    with pytest.raises(TierFullError) as caught:
        room.needed(5, 10 * MiB)  # 4 x 11 MiB do not, though 2 x 11 would without the partner's parts
    text = str(caught.value)
    assert "tiers.memory.size: 40.0MiB cannot hold" in text and "the partner node's parts (replicas: 1)" in text


def test_a_partners_part_that_would_overfill_a_bounded_tier_is_refused_naming_the_key(tmp_path: Path):
    source = committed_part(tmp_path)
    memory = FilesystemTier("memory", tmp_path / "memory", "node")
    memory.root.mkdir()
    part = sum(size for _, size in part_files(source, 3))
    bounded = TierConfig(path=memory.root, kind="memory", scope="node", size=memory.bytes_used() + part + 8192,
                         retention={"keep_last": 1})  # fmt: skip
    assert no_room_for(memory, bounded, part, "node n0's part of step 3") is None
    receive(source, FilesystemTier("memory (copy of n0)", memory.root / "peer-n0", "node"))
    refused = no_room_for(memory, bounded, part, "node n0's part of step 5")
    assert refused is not None
    assert refused.startswith("tier memory: no room for node n0's part of step 5") and "(tiers.memory.size)" in refused
    unbounded = TierConfig(path=memory.root, scope="node")
    assert no_room_for(memory, unbounded, 1 << 40, "anything") is None


async def _nothing_to_settle() -> bool:
    return False
