"""One rule for what is due where (tiers/ops/due.py), seen from the outside: many checkpoints through every
packaged layout and the shapes a cluster or cloud user builds (chained, fanned out, buckets), then each
tier holds exactly what its retention keeps, the newest step is on every tier the graph reaches, ``ls``
shows nothing pending and ``tierstate flush`` copies nothing, run after run.

Each checkpoint's flushes are awaited through its handle's tier futures, so every run ends in the same
state (the rule is what is tested, not a race with the flusher); a second runner on the same tiers then
takes as many checkpoints again, so what the first left (receipts, pruned steps) is read back by a
restarted runner, and the space the tiers use is the same after both runs.
"""

from __future__ import annotations

import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from due_layouts import check_steady, document, run
from tierstate.pipeline.config import ConfigError, load_config, parse_config
from tierstate.tiers.storage.filesystem import FilesystemTier

STEPS = 100  # per runner; two runners per shape


@pytest.fixture
def shm(tmp_path: Path) -> Iterator[Path]:
    """A directory on a tmpfs (/dev/shm), what a memory tier is; tmp_path where there is none."""
    shm = Path("/dev/shm")
    path = shm / f"tierstate-due-{uuid.uuid4().hex}" if shm.is_dir() else tmp_path / "memory"
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _packaged(name: str, root: Path, shm: Path) -> dict[str, Any]:
    """A packaged config's tiers and policies, its paths moved under ``root`` (a memory tier on tmpfs,
    sized for this small state)."""
    config = load_config(name)
    moved: dict[str, Any] = {}
    for tier, spec in config.tiers.items():
        moved[f"tiers.{tier}.path"] = str(shm if spec.kind == "memory" else root / tier)
        if spec.kind == "memory":
            moved[f"tiers.{tier}.size"] = "16MiB"
    return document(name, **moved)


def _shape(kind: str, root: Path, shm: Path) -> dict[str, Any]:
    memory = {"kind": "memory", "path": str(shm), "size": "16MiB", "retention": {"keep_last": 1}}
    nvme = {"path": str(root / "nvme"), "flush": {"every": 1}, "retention": {"keep_last": 2}}
    if kind == "chained":  # memory -> nvme -> pfs
        pfs = {"path": str(root / "pfs"), "flush": {"from": "nvme", "every": 2}, "retention": {"keep_last": 3}}
    elif kind == "fanned out":  # memory -> nvme, memory -> pfs
        pfs = {"path": str(root / "pfs"), "flush": {"every": 3}, "retention": {"keep_last": 2}}
    else:
        raise AssertionError(kind)
    return document(None, tiers={"memory": memory, "nvme": nvme, "pfs": pfs})


@pytest.mark.slow
@pytest.mark.parametrize("name", ["default", "tiered", "compressed", "cluster"])
def test_every_packaged_config_settles_into_what_its_retention_keeps(name, tmp_path, shm, capsys):
    check_steady(_packaged(name, tmp_path, shm), tmp_path, capsys, STEPS)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["chained", "fanned out"])
def test_memory_nvme_pfs_settles_into_what_retention_keeps(kind, tmp_path, shm, capsys):
    check_steady(_shape(kind, tmp_path, shm), tmp_path, capsys, STEPS)


def test_a_flush_never_goes_towards_a_faster_tier_nor_pins_a_copy_for_one(tmp_path):
    """The repro of issue 35: memory (keep_last 1) -> nvme (keep_last 2) -> pfs (keep_last 3). The PFS and
    the NVMe copies are each other's neither source nor target, and receipts are in every copy, so a step
    the PFS received and pruned is not due there again from NVMe."""
    layout = _shape("chained", tmp_path, tmp_path / "memory")
    run(layout, 1, 12)
    config = parse_config(layout)
    nvme, pfs = (FilesystemTier(n, config.tiers[n].path) for n in ("nvme", "pfs"))
    assert nvme.steps() == [11, 12] and pfs.steps() == [8, 10, 12]
    for step in nvme.steps():
        receipts = sorted(p.name for p in nvme.step_dir(step).glob("received-*.json"))
        assert receipts == (["received-pfs.json"] if step % 2 == 0 else []), (step, receipts)


@pytest.mark.parametrize(
    ("tiers", "key", "message"),
    [
        ({"nvme": {"path": "a"}, "pfs": {"path": "b", "flush": {"from": "tape"}}}, "tiers.pfs.flush.from",
         "tier 'tape' is not defined under tiers (defined: nvme, pfs)"),
        ({"nvme": {"path": "a"}, "pfs": {"path": "b", "flush": {"from": "pfs"}}}, "tiers.pfs.flush.from",
         "a tier cannot flush to itself"),
        ({"nvme": {"path": "a"}, "pfs": {"path": "b", "flush": {}}, "tape": {"path": "c"},
          "disk": {"path": "d", "flush": {"from": "tape"}}}, "tiers.disk.flush.from",
         "tier 'tape' receives no checkpoints (it is not the persist tier and has no flush), so 'disk' would never"),
        ({"nvme": {"path": "a"}, "pfs": {"path": "b", "flush": {"from": "disk"}},
          "disk": {"path": "d", "flush": {}}}, "tiers.pfs.flush.from",
         "tiers are listed fastest first and a flush goes towards a slower tier, but 'disk' is listed after 'pfs'"),
    ],
)  # fmt: skip
def test_a_flush_graph_that_goes_nowhere_or_backwards_is_refused_naming_the_key(tmp_path, tiers, key, message):
    tiers = {name: {**spec, "path": str(tmp_path / spec["path"])} for name, spec in tiers.items()}
    with pytest.raises(ConfigError) as caught:
        parse_config({"tiers": tiers})
    assert f"{key}: {message}" in str(caught.value)
