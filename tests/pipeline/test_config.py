"""Tests for the YAML pipeline spec: shipped configs load, values parse, and every mistake is
reported with its file, key path and a message that says what to fix."""

from __future__ import annotations

import copy
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from pydantic import ValidationError

from tierstate.pipeline.config import ConfigError, PipelineConfig, config_path, load_config, parse_config
from tierstate.pipeline.config_schema import ConfigSchema
from tierstate.pipeline.config_stages import CompressStage, PersistStage, capture_workers_for_host
from tierstate.pipeline.packaged import packaged_configs
from tierstate.pipeline.runner import Runner
from tierstate.providers import TensorDictProvider

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
MiB = 1 << 20

# Smallest complete config; optional sections are left out on purpose so defaults are exercised.
MINIMAL: dict[str, Any] = {
    "version": 1,
    "tiers": {"nvme": {"path": "nvme"}, "pfs": {"path": "pfs"}},
    "pipeline": {
        "stages": {
            "capture": {"next": "serialize"},
            "serialize": {"next": "compress"},
            "compress": {"next": "persist"},
            "persist": {"tier": "nvme"},
        }
    },
}


def write(tmp_path: Path, data: dict[str, Any] | str, name: str = "pipeline.yaml") -> Path:
    """Write ``data`` (a mapping, dumped as YAML, or raw YAML text) to a real file."""
    path = tmp_path / name
    path.write_text(data if isinstance(data, str) else yaml.safe_dump(data, sort_keys=False))
    return path


def minimal(**changes: Any) -> dict[str, Any]:
    """MINIMAL with changes at ``a__b__c`` key paths (keyword-friendly); a value of ``...`` deletes the key."""
    data = copy.deepcopy(MINIMAL)
    for dotted, value in changes.items():
        *parents, leaf = dotted.split("__")
        node = data
        for part in parents:
            node = node.setdefault(part, {})
        if value is ...:
            del node[leaf]
        else:
            node[leaf] = value
    return data


def problems_of(tmp_path: Path, data: dict[str, Any] | str, **kwargs: Any) -> list[str]:
    """Problems reported for a file holding ``data``; also checks the error text names the file."""
    path = write(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        load_config(path, **kwargs)
    err = info.value
    assert err.source == str(path)
    assert str(err).splitlines() == [f"{path}: {problem}" for problem in err.problems]
    return err.problems


# --- loading valid configs ---------------------------------------------------------------------


@pytest.mark.parametrize(("name", "codec", "chunk"), [("default.yaml", "none", 64), ("compressed.yaml", "zstd", 16)])
def test_shipped_configs_load(
    name: str, codec: str, chunk: int, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    cfg = load_config(CONFIGS / name)
    assert [stage_name for stage_name, _ in cfg.chain()] == ["capture", "serialize", "compress", "persist"]
    assert cfg.chunk_size == chunk * MiB
    assert cfg.align == 4096
    assert cfg.host_cache.size == 256 * MiB
    assert cfg.host_cache.pinned == "auto"
    assert list(cfg.tiers) == ["nvme", "pfs"]  # fastest first, as written
    assert cfg.persist_tier == "nvme"
    assert cfg.tiers["nvme"].path == tmp_path / "checkpoints" / "nvme"
    assert cfg.tiers["pfs"].path == tmp_path / "checkpoints" / "pfs"
    compress = cfg.stage_of_kind("compress")
    assert isinstance(compress, CompressStage)
    assert (compress.codec, compress.level, compress.threads, compress.workers, compress.queue) == (codec, 1, 0, 2, 4)
    persist = cfg.stage_of_kind("persist")
    assert isinstance(persist, PersistStage) and persist.bandwidth is None
    assert cfg.policies.in_flight == "wait" and cfg.policies.allow_pickle is False


# --- packaged configs, by name, and configs as mappings ------------------------------------------


def test_no_argument_is_the_packaged_default_with_tiers_under_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)  # no configs/ here: the packaged files are read, wherever tierstate lives
    assert packaged_configs() == ["cluster", "compressed", "default", "tiered"]
    cfg = load_config()
    assert cfg == load_config(CONFIGS / "default.yaml")
    assert {name: tier.path for name, tier in cfg.tiers.items()} == {
        "nvme": tmp_path / "checkpoints" / "nvme", "pfs": tmp_path / "checkpoints" / "pfs"}  # fmt: skip


def test_a_packaged_config_by_name_unless_a_file_of_that_name_is_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    tiered = load_config("tiered")
    assert tiered == load_config("tiered.yaml") == load_config(CONFIGS / "tiered.yaml")
    assert tiered.tiers["pfs"].flush is not None and tiered.tiers["nvme"].retention.keep_last == 2
    write(tmp_path, minimal(), name="tiered.yaml")  # the user's own file of that name wins
    assert load_config("tiered.yaml").tiers["pfs"].flush is None
    assert config_path("tiered.yaml") == Path("tiered.yaml")
    with pytest.raises(ConfigError, match="^nosuch: file not found \\(packaged configs, by name: cluster, compr"):
        load_config("nosuch")


def test_a_mapping_with_only_tiers_gets_the_packaged_pipeline_persisting_to_its_first_tier(tmp_path: Path) -> None:
    tiers = {"fast": {"path": str(tmp_path / "fast")}, "slow": {"path": str(tmp_path / "slow")}}
    cfg = parse_config({"tiers": tiers})
    assert cfg.persist_tier == "fast"
    assert cfg == load_config(overrides={"tiers": tiers, "pipeline.stages.persist.tier": "fast"})
    # Only what is left out is filled in: a pipeline given is taken as it is, a persist stage's tier too.
    assert parse_config({**MINIMAL, "tiers": tiers | {"nvme": {"path": "n"}}}).persist_tier == "nvme"
    no_tier = minimal(pipeline__stages__persist__tier=..., tiers={"pfs": {"path": "p"}, "nvme": {"path": "n"}})
    assert parse_config(no_tier).persist_tier == "pfs"
    assert "tier" not in no_tier["pipeline"]["stages"]["persist"]  # the caller's mapping is left as it was


def test_a_mapping_is_validated_like_a_file_with_the_same_messages(tmp_path: Path) -> None:
    data = minimal(chunk_size="tiny", pipeline__stages__persist__tier="tape")
    with pytest.raises(ConfigError) as info:
        parse_config(data)
    assert info.value.source == "<config>"
    assert info.value.problems == problems_of(tmp_path, data)
    with pytest.raises(ConfigError) as info:
        parse_config({})  # nothing to fill the pipeline's tier from: only the tiers are reported
    assert info.value.problems == ["tiers: required key is missing"]


def test_runner_from_dict_and_from_yaml_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    small = {"chunk_size": "1MiB", "host_cache": {"size": "2MiB"}}
    with Runner.from_dict({"tiers": {"local": {"path": "ckpt"}}, **small}) as runner:
        runner.register(t=TensorDictProvider({"w": torch.arange(10.0)}))
        assert runner.checkpoint(1).result().path == tmp_path / "ckpt" / "step-1"
    with pytest.raises(ConfigError, match="^<config>: tiers: required key is missing$"):
        Runner.from_dict(small)
    with Runner.from_yaml("tiered", overrides=small) as runner:
        assert runner.config.tiers["pfs"].flush is not None
        assert [t.root for t in runner.tiers] == [tmp_path / "checkpoints" / "nvme", tmp_path / "checkpoints" / "pfs"]


def test_defaults_and_kind_from_stage_name(tmp_path: Path) -> None:
    cfg = load_config(write(tmp_path, MINIMAL))
    assert cfg.chunk_size == 64 * MiB and cfg.align == 4096 and cfg.host_cache.size == 256 * MiB
    assert [stage.kind for _, stage in cfg.chain()] == ["capture", "serialize", "compress", "persist"]
    capture = cfg.stage_of_kind("capture")
    assert capture is not None and (capture.workers, capture.queue) == (capture_workers_for_host(), 4)
    compress = cfg.stage_of_kind("compress")
    assert isinstance(compress, CompressStage) and compress.codec == "zstd"


def test_chunk_size_left_out_fits_the_host_cache_and_the_bounded_tiers(tmp_path: Path) -> None:
    """64MiB by default, but a config that was valid with the old 16MiB default (a 64MiB host cache)
    stays valid: a quarter of the smallest bound, in whole MiB, at least 1MiB. A chunk_size given is
    kept, and checked against the same bounds."""
    nvme = {"nvme": {"path": str(tmp_path / "nvme")}}
    memory = {"memory": {"kind": "memory", "path": str(tmp_path / "m"), "size": "40MiB", "retention": {"keep_last": 1}}}
    cases = [
        ({"tiers": nvme}, 64 * MiB),
        ({"tiers": nvme, "host_cache": {"size": "64MiB"}}, 16 * MiB),
        ({"tiers": nvme, "host_cache": {"size": 6 * MiB}}, MiB),
        ({"tiers": {**nvme, **memory}, "host_cache": {"size": "1GiB"}}, 10 * MiB),
        ({"tiers": nvme, "host_cache": {"size": "64MiB"}, "chunk_size": "32MiB"}, 32 * MiB),
    ]
    assert [parse_config(data).chunk_size for data, _ in cases] == [chunk for _, chunk in cases]
    small = {"memory": {**memory["memory"], "size": "4MiB"}}
    with pytest.raises(ConfigError) as caught:
        parse_config({"tiers": small, "chunk_size": "16MiB"}, source="my.yaml")
    assert "my.yaml: tiers.memory.size: 4.0MiB is smaller than chunk_size (16.0MiB)" in str(caught.value)
    with pytest.raises(ConfigError, match="host_cache.size: must be a size"):  # reported at its key, not here
        parse_config({"tiers": nvme, "host_cache": {"size": "lots"}})


def test_capture_workers_auto_leaves_the_trainer_a_core(tmp_path: Path) -> None:
    """``auto`` is resolved at load: the cores this process may use less one, 1..2; a number is kept."""
    cores = len(os.sched_getaffinity(0))
    assert capture_workers_for_host() == max(1, min(2, cores - 1))
    data = minimal(pipeline__stages__capture__workers="auto")
    assert load_config(write(tmp_path, data)).pipeline.stages["capture"].workers == capture_workers_for_host()
    data = minimal(pipeline__stages__capture__workers=3)
    assert load_config(write(tmp_path, data)).pipeline.stages["capture"].workers == 3


def test_explicit_kind_and_optional_compress(tmp_path: Path) -> None:
    data = minimal(pipeline__stages={
        "grab": {"kind": "capture", "next": "frames"},
        "frames": {"kind": "serialize", "next": "write"},
        "write": {"kind": "persist", "tier": "pfs"},
    })
    cfg = load_config(write(tmp_path, data))
    assert [name for name, _ in cfg.chain()] == ["grab", "frames", "write"]
    assert cfg.stage_of_kind("compress") is None
    assert cfg.persist_tier == "pfs"


def test_sizes_parse(tmp_path: Path) -> None:
    data = minimal(chunk_size="8MiB", align="4KiB", host_cache={"size": "1GB", "pinned": False})
    data["pipeline"]["stages"]["persist"]["bandwidth"] = "200MB"
    cfg = load_config(write(tmp_path, data))
    assert cfg.chunk_size == 8 * MiB
    assert cfg.align == 4096
    assert cfg.host_cache.size == 10**9
    assert cfg.host_cache.pinned is False
    persist = cfg.stage_of_kind("persist")
    assert isinstance(persist, PersistStage) and persist.bandwidth == 200 * 10**6
    assert load_config(write(tmp_path, minimal(chunk_size=2 * MiB))).chunk_size == 2 * MiB


def test_tier_paths_resolved_against_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    config_dir = tmp_path / "etc"
    config_dir.mkdir()
    work = tmp_path / "run"
    work.mkdir()
    monkeypatch.chdir(work)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    data = minimal(tiers={"nvme": {"path": "./a/../b"}, "pfs": {"path": "~/pfs"}, "abs": {"path": "/srv/ckpt"}})
    cfg = load_config(write(config_dir, data))
    assert cfg.tiers["nvme"].path == work / "b"
    assert cfg.tiers["pfs"].path == tmp_path / "home" / "pfs"
    assert cfg.tiers["abs"].path == Path("/srv/ckpt")
    assert list(cfg.tiers) == ["nvme", "pfs", "abs"]


def test_overrides(tmp_path: Path) -> None:
    path = write(tmp_path, MINIMAL)
    cfg = load_config(path, overrides={
        "tiers.nvme.path": str(tmp_path / "fast"),
        "host_cache.size": "64MiB",
        "chunk_size": "4MiB",
        "pipeline.stages.compress.codec": "none",
        "policies.in_flight": "skip",  # `policies` is absent from the file: created on the way
    })
    assert cfg.tiers["nvme"].path == tmp_path / "fast"
    assert cfg.host_cache.size == 64 * MiB and cfg.chunk_size == 4 * MiB
    compress = cfg.stage_of_kind("compress")
    assert isinstance(compress, CompressStage) and compress.codec == "none"
    assert cfg.policies.in_flight == "skip"
    assert yaml.safe_load(path.read_text()) == MINIMAL


def test_override_replaces_whole_mapping_and_leaves_input_alone() -> None:
    data = copy.deepcopy(MINIMAL)
    cfg = parse_config(data, overrides={"tiers": {"nvme": {"path": "/tmp/only"}}})
    assert list(cfg.tiers) == ["nvme"]
    assert cfg.tiers["nvme"].path == Path("/tmp/only")
    assert data == MINIMAL


def test_parse_config_accepts_yaml_text() -> None:
    cfg = parse_config(yaml.safe_dump(MINIMAL))
    assert cfg.persist_tier == "nvme"


def test_bad_override_value_is_attributed_to_the_override(tmp_path: Path) -> None:
    problems = problems_of(tmp_path, MINIMAL, overrides={"host_cache.size": "lots"})
    assert problems == [("host_cache.size: must be a size such as 16MiB, 1GB or a number of bytes, "
                         "got 'lots' (string) (set by override 'host_cache.size')")]


def test_override_through_a_non_mapping(tmp_path: Path) -> None:
    problems = problems_of(tmp_path, MINIMAL, overrides={"tiers.nvme.path.deep": 1})
    assert problems == [("tiers.nvme.path: cannot apply override 'tiers.nvme.path.deep': "
                         "tiers.nvme.path is a string, not a mapping")]


# --- schema errors -----------------------------------------------------------------------------


def test_unknown_key_suggests_the_closest(tmp_path: Path) -> None:
    data = minimal(**{"host-cache": {"size": "256MiB"}})
    data["pipeline"]["stages"]["compress"]["levl"] = 5
    assert problems_of(tmp_path, data) == [
        "pipeline.stages.compress.levl: unknown key; did you mean 'level'?",
        "host-cache: unknown key; did you mean 'host_cache'?",
    ]


def test_unknown_key_without_close_match_lists_valid_keys(tmp_path: Path) -> None:
    data = minimal(tiers__nvme__colour="blue")
    valid = "path, kind, scope, size, retention, flush, replicas, slots"
    assert problems_of(tmp_path, data) == [f"tiers.nvme.colour: unknown key (valid keys: {valid})"]


def test_wrong_type_names_expected_and_given(tmp_path: Path) -> None:
    data = minimal(policies={"allow_pickle": "yes please"}, tiers__pfs__path=3)
    data["pipeline"]["stages"]["capture"]["workers"] = "two"
    assert problems_of(tmp_path, data) == [
        "tiers.pfs.path: must be a path string, got 3 (integer)",
        "pipeline.stages.capture.workers: must be a whole number of workers or 'auto', got 'two'",
        "policies.allow_pickle: must be a valid boolean, got 'yes please' (string)",
    ]


def test_stage_that_is_not_a_mapping(tmp_path: Path) -> None:
    data = minimal(pipeline__stages__serialize=8)
    assert problems_of(tmp_path, data) == ["pipeline.stages.serialize: must be a mapping, got 8 (integer)"]


@pytest.mark.parametrize(("changes", "expected"), [
    ({"pipeline__stages__compress__level": 99},
     "pipeline.stages.compress.level: must be less than or equal to 22, got 99 (integer)"),
    ({"pipeline__stages__serialize__workers": -1},
     "pipeline.stages.serialize.workers: must be greater than or equal to 0, got -1 (integer)"),
    ({"pipeline__stages__capture__workers": 0},  # the first stage: no stage before it to run it
     "pipeline.stages.capture.workers: must be greater than or equal to 1, got 0 (integer)"),
    ({"chunk_size": "512KiB"}, "chunk_size: must be at least 1.0MiB, got 512.0KiB"),
    ({"align": 1000}, "align: must be a power of two between 512 and 1048576 (1MiB), got 1000"),
    ({"align": 256}, "align: must be a power of two between 512 and 1048576 (1MiB), got 256"),
    ({"version": 2}, "version: unsupported version 2; only version 1 is supported"),
    ({"pipeline__stages__compress__codec": "lz4"},
     "pipeline.stages.compress.codec: must be 'none' or 'zstd', got 'lz4' (string)"),
    ({"policies": {"in_flight": "never"}}, "policies.in_flight: must be 'wait' or 'skip', got 'never' (string)"),
    ({"tiers__nvme__path": ""}, "tiers.nvme.path: must not be empty"),
])
def test_out_of_range(tmp_path: Path, changes: dict[str, Any], expected: str) -> None:
    assert problems_of(tmp_path, minimal(**changes)) == [expected]


def test_tier_name_and_tier_list(tmp_path: Path) -> None:
    bad_name = minimal(tiers={"NVMe": {"path": "x"}, "nvme": {"path": "y"}})
    assert problems_of(tmp_path, bad_name) == [
        "tiers.NVMe: invalid name: string should match pattern '^[a-z][a-z0-9_-]*$', got 'NVMe' (string)"]
    assert problems_of(tmp_path, minimal(tiers={})) == ["tiers: must not be empty"]


def test_stage_kind_missing_or_misspelt(tmp_path: Path) -> None:
    data = minimal()
    data["pipeline"]["stages"]["extra"] = {"next": "persist"}
    data["pipeline"]["stages"]["other"] = {"kind": "compres"}
    assert problems_of(tmp_path, data) == [
        ("pipeline.stages.extra.kind: missing; the stage name is not a kind, so set kind to one of "
         "capture, serialize, compress, persist"),
        ("pipeline.stages.other.kind: must be one of capture, serialize, compress, persist, got 'compres'; "
         "did you mean 'compress'?"),
    ]


def test_missing_required_keys(tmp_path: Path) -> None:
    data = minimal(tiers=..., pipeline__stages__persist__tier=...)
    assert problems_of(tmp_path, data) == [
        "tiers: required key is missing",
        "pipeline.stages.persist.tier: required key is missing",
    ]


def test_multiple_errors_reported_together(tmp_path: Path) -> None:
    data = minimal(chunk_size="tiny", align=3, colour="blue", policies={"in_flight": 1})
    data["pipeline"]["stages"]["persist"]["workers"] = -1
    problems = problems_of(tmp_path, data)
    assert [problem.split(":")[0] for problem in problems] == [
        "chunk_size", "align", "pipeline.stages.persist.workers", "policies.in_flight", "colour"]


# --- graph and cross-field errors --------------------------------------------------------------


def test_cycle(tmp_path: Path) -> None:
    data = minimal(pipeline__stages={
        "capture": {"next": "serialize"},
        "serialize": {"next": "capture"},
        "persist": {"tier": "nvme"},
    })
    problems = problems_of(tmp_path, data)
    assert "pipeline.stages.serialize.next: cycle capture -> serialize -> capture" in problems
    assert "pipeline.stages.persist: stage 'persist' is never fed: it is not on the chain from capture" in problems


def test_stage_that_feeds_nothing(tmp_path: Path) -> None:
    data = minimal(pipeline__stages__compress__next=...)
    problems = problems_of(tmp_path, data)
    assert problems == [
        "pipeline.stages.compress.next: stage 'compress' feeds nothing: a compress stage needs `next`",
        "pipeline.stages.persist: stage 'persist' is never fed: it is not on the chain from capture",
    ]


def test_stage_never_fed(tmp_path: Path) -> None:
    data = minimal(pipeline__stages__serialize__next="persist")
    assert problems_of(tmp_path, data) == [
        "pipeline.stages.compress.next: 'persist' is already fed by 'serialize'; stages must form a single chain",
        "pipeline.stages.compress: stage 'compress' is never fed: it is not on the chain from capture",
    ]


def test_next_names_a_missing_stage(tmp_path: Path) -> None:
    data = minimal(pipeline__stages__compress__next="persit")
    problems = problems_of(tmp_path, data)
    assert problems[0] == ("pipeline.stages.compress.next: 'persit' is not a stage "
                           "(stages: capture, serialize, compress, persist)")


def test_persist_with_next(tmp_path: Path) -> None:
    data = minimal(pipeline__stages={
        "capture": {"next": "serialize"},
        "serialize": {"next": "persist"},
        "persist": {"tier": "nvme", "next": "archive"},
        "archive": {"kind": "persist", "tier": "pfs"},
    })
    assert problems_of(tmp_path, data) == [
        "pipeline.stages.persist.next: a persist stage ends the chain and cannot feed 'archive'; remove `next`",
    ]


def test_missing_tier(tmp_path: Path) -> None:
    data = minimal(tiers={"pfs": {"path": "pfs"}})
    assert problems_of(tmp_path, data) == [
        "pipeline.stages.persist.tier: tier 'nvme' is not defined under tiers (defined: pfs)"]


def test_cache_smaller_than_two_chunks(tmp_path: Path) -> None:
    data = minimal(chunk_size="16MiB", host_cache={"size": "24MiB"})
    (problem,) = problems_of(tmp_path, data)
    assert problem.startswith("host_cache.size: 24.0MiB is smaller than 2 * chunk_size (2 * 16.0MiB)")
    assert load_config(write(tmp_path, minimal(chunk_size="16MiB", host_cache={"size": "32MiB"})))


def test_two_captures(tmp_path: Path) -> None:
    data = minimal()
    data["pipeline"]["stages"]["again"] = {"kind": "capture", "next": "serialize"}
    problems = problems_of(tmp_path, data)
    assert problems[0] == "pipeline.stages: expected exactly one capture stage, found 2 (capture, again)"


def test_no_capture(tmp_path: Path) -> None:
    data = minimal(pipeline__stages__capture=...)
    assert problems_of(tmp_path, data) == ["pipeline.stages: expected exactly one capture stage, found none"]


@pytest.mark.parametrize(("stages", "expected"), [
    ({"capture": {"next": "compress"}, "compress": {"next": "serialize"},
      "serialize": {"next": "persist"}, "persist": {"tier": "nvme"}},
     ["pipeline.stages.capture.next: 'compress' (compress) cannot follow a capture stage; expected serialize",
      "pipeline.stages.compress.next: 'serialize' (serialize) cannot follow a compress stage; expected persist"]),
    ({"capture": {"next": "persist"}, "persist": {"tier": "nvme"}},
     ["pipeline.stages.capture.next: 'persist' (persist) cannot follow a capture stage; expected serialize"]),
    ({"capture": {"next": "serialize"}, "serialize": {"next": "s2"},
      "s2": {"kind": "serialize", "next": "persist"}, "persist": {"tier": "nvme"}},
     ["pipeline.stages.serialize.next: 's2' (serialize) cannot follow a serialize stage; "
      "expected compress or persist"]),
])
def test_wrong_order(tmp_path: Path, stages: dict[str, Any], expected: list[str]) -> None:
    order = " (order: capture -> serialize -> [compress ->] persist)"
    assert problems_of(tmp_path, minimal(pipeline__stages=stages)) == [line + order for line in expected]


def test_graph_checked_without_parse_config() -> None:
    data = minimal(pipeline__stages__compress__next="persit")
    with pytest.raises(ValidationError, match="'persit' is not a stage"):
        PipelineConfig.model_validate(data)


# --- file-level errors -------------------------------------------------------------------------


def test_malformed_yaml_names_line_and_column(tmp_path: Path) -> None:
    text = "version: 1\nchunk_size: 16MiB\n  align: 4096\n"
    assert problems_of(tmp_path, text) == [
        "line 3, column 8: invalid YAML: mapping values are not allowed here"]


def test_duplicate_yaml_key(tmp_path: Path) -> None:
    text = yaml.safe_dump(MINIMAL, sort_keys=False) + "version: 1\n"
    line = text.count("\n")
    assert problems_of(tmp_path, text) == [f"line {line}, column 1: invalid YAML: duplicate key 'version'"]


@pytest.mark.parametrize(("text", "given"), [
    ("- a\n- b\n", "a list"), ("42\n", "an integer"), ("", "an empty document"),
])
def test_top_level_not_a_mapping(tmp_path: Path, text: str, given: str) -> None:
    assert problems_of(tmp_path, text) == [
        f"<top level>: expected a mapping of settings (version, tiers, ...), got {given}"]


def test_missing_file(tmp_path: Path) -> None:
    missing = tmp_path / "nope.yaml"
    with pytest.raises(ConfigError) as info:
        load_config(missing)
    assert str(info.value) == (
        f"{missing}: file not found (packaged configs, by name: cluster, compressed, default, tiered; "
        "`tierstate init` writes an editable copy)"
    )


def test_config_error_is_a_value_error_and_pickles(tmp_path: Path) -> None:
    with pytest.raises(ValueError) as info:
        parse_config(minimal(version=3), source="inline")
    err = info.value
    assert isinstance(err, ConfigError)
    clone = pickle.loads(pickle.dumps(err))
    assert (clone.source, clone.problems, str(clone)) == (err.source, err.problems, str(err))
    assert str(err) == "inline: version: unsupported version 3; only version 1 is supported"


def test_the_persist_tier_of_a_schema_without_a_persist_stage_is_a_config_error_naming_the_stages() -> None:
    body = load_config().model_dump(mode="json")
    stages = body["pipeline"]["stages"]
    del stages["persist"]
    stages["compress"]["next"] = None
    schema = ConfigSchema.model_validate(body)  # the schema alone: PipelineConfig's checks would refuse it
    with pytest.raises(ConfigError, match="pipeline.stages: no persist stage"):
        _ = schema.persist_tier
