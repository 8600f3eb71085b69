"""Multi-rank pieces that need no second process: shard geometry, merging rank parts, reading boxes
out of real checkpoint files, and the assignment that spreads work over ranks."""

from __future__ import annotations

import pytest
import torch

from conftest import DEFAULT_YAML
from tierstate.pipeline.assign import balance
from tierstate.pipeline.runner import Runner
from tierstate.providers import ModuleProvider, ShardInfo, TensorDictProvider, TensorItem
from tierstate.tiers.format.format import ManifestError, now_iso
from tierstate.tiers.format.manifest import Manifest
from tierstate.tiers.format.multirank import RankPart, merge_parts, rank_view
from tierstate.tiers.format.records import FileRecord, ObjectRecord, PerRankRecord, ShardRecord, TensorRecord
from tierstate.tiers.reading.boxes import Box, tiling_problem
from tierstate.tiers.reading.reshard import Region, read_regions
from tierstate.tiers.reading.stored import CorruptCheckpointError, load

MiB = 1 << 20


def test_boxes_intersect_and_tile():
    a, b = Box((0, 0), (4, 6)), Box((2, 3), (5, 5))
    assert a.intersect(b) == Box((2, 3), (2, 3))
    assert a.intersect(Box((4, 0), (1, 6))) is None
    rows = [Box((0, 0), (3, 5)), Box((3, 0), (4, 5))]
    assert tiling_problem(rows, (7, 5)) is None
    assert "overlap" in tiling_problem([Box((0, 0), (4, 5)), Box((3, 0), (4, 5))], (7, 5))
    assert "cover 15 of the 35" in tiling_problem(rows[:1], (7, 5))
    assert "outside" in tiling_problem([Box((5, 0), (4, 5))], (7, 5))


def test_balance_spreads_bytes_and_respects_holders():
    sizes = {"a": 8, "b": 5, "c": 4, "d": 3, "only1": 1}
    holders = {key: [0, 1] for key in sizes} | {"only1": [1]}
    chosen = balance(sizes, holders, load={0: 2, 1: 0})
    per_rank = {r: sum(sizes[k] for k, v in chosen.items() if v == r) + {0: 2, 1: 0}[r] for r in (0, 1)}
    assert chosen["only1"] == 1 and abs(per_rank[0] - per_rank[1]) <= 2
    assert chosen == balance(dict(reversed(sizes.items())), holders, load={0: 2, 1: 0})  # order-free


def _record(shape, offsets=None, global_shape=None, dtype="float32") -> TensorRecord:
    shard = None if offsets is None else ShardRecord(global_shape=list(global_shape), offsets=list(offsets))
    return TensorRecord(dtype=dtype, shape=list(shape), shard=shard, pieces=[])


def _part(rank: int, items: dict, replicated=()) -> RankPart:
    files = {f"rank-{rank:05d}.data": FileRecord(size=0, frames=[])}
    manifest = Manifest(step=3, created=now_iso(), files=files, items=items)
    return RankPart(rank, manifest, frozenset(replicated))


def test_merge_places_each_key_once():
    obj = ObjectRecord(serializer="msgpack", length=0, pieces=[])
    parts = [
        _part(0, {"w": _record((3, 4), (0, 0), (5, 4)), "rng": obj, "model": _record((2,))}, replicated={"model"}),
        _part(1, {"w": _record((2, 4), (3, 0), (5, 4)), "rng": obj}),
    ]
    merged = merge_parts(3, parts)
    assert merged.world_size == 2 and merged.version == 2
    assert sorted(merged.files) == ["rank-00000.data", "rank-00001.data"]
    assert merged.items["model"].kind == "tensor"
    assert merged.items["rng"].kind == "per_rank" and sorted(merged.items["rng"].ranks) == [0, 1]
    assert merged.items["w"].kind == "sharded" and merged.items["w"].global_shape == [5, 4]
    with pytest.raises(KeyError, match=r"saved per rank by rank\(s\) \[0, 1\]; rank 2 has no value"):
        rank_view(merged, 2, ["rng"])
    replicated_only = merge_parts(3, [_part(0, {"m": _record((2,))}, {"m"}), _part(1, {}, set())])
    assert replicated_only.version == 1  # nothing multi-rank in it: older readers still read it


@pytest.mark.parametrize(
    ("parts", "message"),
    [
        (
            [_part(0, {"w": _record((3, 4), (0, 0), (5, 4))}), _part(1, {"w": _record((3, 4), (1, 0), (5, 4))})],
            r"sharded item 'w': shards at \[0, 0\] and \[1, 0\] overlap",
        ),
        (
            [_part(0, {"w": _record((3, 4), (0, 0), (5, 4))}), _part(1, {})],
            r"sharded item 'w': shards cover 12 of the 20 elements",
        ),
        (
            [_part(0, {"m": _record((2,))}, {"m"}), _part(1, {"m": _record((2,))}, {"m"})],
            r"replicated item 'm' was written by ranks \[0, 1\]",
        ),
        (
            [_part(0, {"m": _record((2,))}, {"m"}), _part(1, {"m": _record((2,))})],
            r"item 'm' is per-rank on rank 1, replicated on rank 0",
        ),
        ([_part(0, {}), _part(2, {})], r"parts from ranks \[0, 2\]"),
    ],
)
def test_merge_names_what_clashes(parts, message):
    with pytest.raises(ManifestError, match=message):
        merge_parts(3, parts)


def _checkpoint(make_runner, tensors: dict[str, torch.Tensor], shard: dict[str, ShardInfo] | None = None):
    class Provider(TensorDictProvider):
        def describe(self):
            return [TensorItem(k, t, shard=(shard or {}).get(k)) for k, t in self.tensors.items()]

    runner = make_runner(chunk_size="1MiB", host_cache__size="4MiB")
    runner.register(t=Provider(tensors))
    path = runner.checkpoint(1).result().path
    return path, runner.durable_tier.manifest(1)


def test_regions_cut_any_box_of_any_dtype(make_runner):
    gen = torch.Generator().manual_seed(0)
    tensors = {
        "f64": torch.randn(9, 7, 5, generator=gen, dtype=torch.float64),
        "f8": torch.randint(0, 256, (6, 11), dtype=torch.uint8, generator=gen).view(torch.float8_e4m3fn),
        "flags": torch.rand(5, 3, generator=gen) > 0.5,
    }
    path, manifest = _checkpoint(make_runner, tensors)
    boxes = {
        "f64": [Box((2, 1, 0), (4, 3, 5)), Box((0, 0, 2), (9, 7, 1)), Box.whole((9, 7, 5))],
        "f8": [Box((3, 4), (3, 7))],
        "flags": [Box((1, 1), (2, 2))],
    }
    regions = [Region(f"t/{k}", manifest.items[f"t/{k}"], box) for k, bs in boxes.items() for box in bs]
    got = read_regions(path, manifest, regions).tensors
    for region, value in zip(regions, got, strict=True):
        full = tensors[region.key.removeprefix("t/")]
        want = full[tuple(slice(o, o + s) for o, s in zip(region.box.offsets, region.box.shape, strict=True))]
        assert value.dtype == full.dtype
        assert torch.equal(value.view(torch.uint8), want.contiguous().view(torch.uint8)), region


def test_a_box_reads_only_the_frames_holding_it(make_runner):
    # 3 MiB of rows in 1 MiB chunks: three frames, row blocks of a third each.
    big = torch.arange(3 * MiB // 4, dtype=torch.int32).reshape(768, 1024)
    path, manifest = _checkpoint(make_runner, {"big": big})
    record = manifest.items["t/big"]
    frames = manifest.files["rank-00000.data"].frames
    last = next(p for p in record.pieces if p.item_offset == 2 * MiB)  # rows 512.. (frames are in write order)
    data = path / "rank-00000.data"
    raw = bytearray(data.read_bytes())
    raw[frames[last.frame].offset + 100] ^= 0xFF  # corrupt only the frame holding the last rows
    data.write_bytes(bytes(raw))
    first_rows = read_regions(path, manifest, [Region("t/big", record, Box((0, 0), (200, 1024)))])
    assert torch.equal(first_rows.tensors[0], big[:200]) and first_rows.bytes_read == MiB
    with pytest.raises(CorruptCheckpointError, match=f"frame {last.frame}: checksum mismatch"):
        read_regions(path, manifest, [Region("t/big", record, Box((700, 0), (10, 1024)))])


def test_a_stored_shard_is_placed_in_its_global_tensor(make_runner):
    full = torch.randn(10, 4, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    path, manifest = _checkpoint(make_runner, {"w": full[6:].clone()}, {"w": ShardInfo((10, 4), (6, 0))})
    record = manifest.items["t/w"]
    inside = read_regions(path, manifest, [Region("t/w", record, Box((7, 1), (2, 3)))]).tensors[0]
    assert torch.equal(inside, full[7:9, 1:4])
    with pytest.raises(ValueError, match=r"outside its global shape \[10, 4\]"):
        read_regions(path, manifest, [Region("t/w", record, Box((8, 0), (3, 4)))])


def test_one_process_ignores_replicated_and_writes_format_1(make_runner):
    model = torch.nn.Linear(4, 3)
    runner = make_runner()
    runner.register(model=ModuleProvider(model, replicated=True))
    path = runner.checkpoint(2).result().path
    manifest = runner.durable_tier.manifest(2)
    assert manifest.version == 1 and manifest.world_size == 1
    assert torch.equal(load(path)["model/weight"], model.weight.detach())
    assert not any(isinstance(r, PerRankRecord) for r in manifest.items.values())


def test_a_distributed_runner_needs_torch_distributed(tmp_path):
    with pytest.raises(RuntimeError, match=r"distributed=True\) needs torch.distributed.init_process_group"):
        Runner.from_yaml(DEFAULT_YAML, {"tiers": {"nvme": {"path": str(tmp_path)}}}, distributed=True)
