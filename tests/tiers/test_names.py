"""The rank file-name grammar: names built, parsed back, strangers refused, and written in one place."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tierstate.tiers.format.names import (
    RankFile,
    data_file_name,
    data_file_rank,
    hdf5_file_name,
    index_file_name,
    parse_rank_file,
    parse_step_name,
    step_name,
)

REPO = Path(__file__).resolve().parents[2]

# Modules that still spell the grammar out themselves, until they import it from tiers/format/names.py.
PENDING: set[str] = set()


@pytest.mark.parametrize("rank", [0, 7, 12345, 99999])
def test_every_name_parses_back_to_its_rank_and_kind(rank: int) -> None:
    assert parse_rank_file(data_file_name(rank)) == RankFile(rank, "data")
    assert parse_rank_file(hdf5_file_name(rank)) == RankFile(rank, "h5")
    assert parse_rank_file(index_file_name(rank)) == RankFile(rank, "index")
    assert data_file_rank(data_file_name(rank)) == data_file_rank(hdf5_file_name(rank)) == rank
    assert data_file_rank(index_file_name(rank)) is None


@pytest.mark.parametrize(
    "name",
    [
        "rank-0000.data",
        "rank-000000.data",
        "rank-00000.data\n",
        "rank-00000.data/x",
        "../rank-00000.data",
        "rank-\u0660\u0660\u0660\u0660\u0660.data",
        "rank-00000.json",
        "rank-00000.index.tmp",
        "manifest.json",
    ],
)
def test_names_outside_the_grammar_are_no_rank_files(name: str) -> None:
    assert parse_rank_file(name) is None and data_file_rank(name) is None


def _spells_rank_names(path: Path) -> bool:
    """Whether ``path`` builds (``f"rank-{...}"``) or matches (``"^rank-..."``) rank file names itself."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.JoinedStr) and node.values:
            first = node.values[0]
            if isinstance(first, ast.Constant) and str(first.value).startswith("rank-"):
                return True
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("^rank-"):
            return True
    return False


def test_rank_file_names_are_spelled_out_only_in_names() -> None:
    sources = [p for folder in ("pipeline", "providers", "tiers") for p in (REPO / folder).rglob("*.py")]
    spelled = {str(p.relative_to(REPO)) for p in sources if _spells_rank_names(p)}
    assert spelled == {"tiers/format/names.py"} | PENDING, "build and parse rank file names with tiers/format/names.py"


@pytest.mark.parametrize(
    ("name", "step"),
    [("step-0", 0), ("step-4", 4), ("step-1000", 1000), ("step-04", None), ("step-00", None), ("step-4x", None),
     ("step-4\n", None), ("step-\u0664", None), ("step--4", None), ("step-", None), ("step-" + "9" * 19, None),
     ("Step-4", None), ("step-4.partial", None)],
)  # fmt: skip
def test_step_names_are_parsed_strictly(name: str, step: int | None) -> None:
    assert parse_step_name(name) == step
    if step is not None:
        assert step_name(step) == name


def test_a_tier_lists_no_step_under_a_name_that_is_not_its_own(tmp_path: Path) -> None:
    """A stray ``step-04`` (a committed checkpoint's files, copied in by hand) is no step 4: not listed,
    not named invalid as step 4, not restored; nor is a ``step-05.partial`` a partial gc would remove."""
    from tierstate.tiers.format.format import manifest_bytes
    from tierstate.tiers.format.manifest import MANIFEST_NAME, Manifest
    from tierstate.tiers.storage.filesystem import FilesystemTier

    tier = FilesystemTier("nvme", tmp_path)
    for name in ("step-04", "step-4x", "step-05.partial"):
        (tmp_path / name).mkdir()
    (tmp_path / "step-04" / MANIFEST_NAME).write_bytes(
        manifest_bytes(Manifest(step=4, created="2026-01-01T00:00:00.000+00:00", files={}, items={}))
    )
    assert tier.steps() == [] and tier.invalid() == [] and tier.partials() == []
