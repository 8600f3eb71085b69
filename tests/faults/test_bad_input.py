"""Bad input: hostile or broken manifests, indexes, frames, objects and configs are refused, never obeyed.

A manifest is only trusted after it parses, its self-checksum matches and every name, size, offset
and dtype is checked. The targeted tests forge manifests that pass the checksum (re-signed, as an
attacker or a buggy tool could) to reach the checks behind it. The fuzz tests feed the parsers
random bytes and random edits of real files: whatever comes in, only our own error types come out
(ManifestError, CorruptCheckpointError, CodecError, ObjectCodecError, ConfigError). A pickle
planted in a checkpoint must not run unless the caller allows pickle.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import subprocess
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import msgpack
import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from faultkit import DEFAULT_YAML, REPO, make_runner, scaled, tally, write_steps
from tierstate import cli
from tierstate.pipeline.config import ConfigError, parse_config
from tierstate.pipeline.handle import CheckpointFailed
from tierstate.providers import ObjectProvider
from tierstate.tiers.format.codecs import CodecError, decompress
from tierstate.tiers.format.format import ManifestError, _canonical, checksum, parse_index, parse_manifest
from tierstate.tiers.format.manifest import FORMAT_VERSION, MANIFEST_NAME
from tierstate.tiers.format.objcodec import MAX_DEPTH, ObjectCodecError, decode_object, encode_object
from tierstate.tiers.reading.stored import CorruptCheckpointError, StoredCheckpoint, load

pytestmark = pytest.mark.faults

DATA = "rank-00000.data"
INDEX = "rank-00000.index"
FUZZ = settings(
    max_examples=scaled(1000),
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)
READ_ERRORS = (ManifestError, CorruptCheckpointError, ObjectCodecError)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One real committed checkpoint (tensors in four dtypes, an empty one, an object)."""
    root = tmp_path_factory.mktemp("bad-input")
    write_steps(root, [1])
    return root / "nvme" / "step-1"


def _doc(directory: Path) -> dict[str, Any]:
    return json.loads((directory / MANIFEST_NAME).read_bytes())


def _signed(doc: dict[str, Any]) -> bytes:
    """The manifest with its self-checksum recomputed: a forgery that gets past the checksum."""
    return json.dumps({"manifest": doc["manifest"], "checksum": checksum(_canonical(doc["manifest"]))}).encode()


def _forged(directory: Path, edit: Callable[[dict[str, Any]], None]) -> bytes:
    doc = _doc(directory)
    edit(doc["manifest"])
    return _signed(doc)


def _rename_data_file(name: str) -> Callable[[dict[str, Any]], None]:
    def edit(body: dict[str, Any]) -> None:
        body["files"][name] = body["files"].pop(DATA)
        for item in body["items"].values():
            for piece in item.get("pieces", []):
                piece["file"] = name

    return edit


# --- forged manifests -----------------------------------------------------------------------------

ESCAPES = [
    "../rank-00000.data",
    "/etc/passwd",
    "rank-00000.data/../../x",
    "sub/rank-00000.data",
    "rank-00000.data\n",
    "rank-\u0660\u0660\u0660\u0660\u0660.data",
    "",
    "..",
    "rank-00000.data\x00",
]


@pytest.mark.parametrize("name", ESCAPES)
def test_file_names_that_leave_the_checkpoint_directory_are_refused(checkpoint: Path, name: str) -> None:
    with pytest.raises(ManifestError, match="is not allowed"):
        parse_manifest(_forged(checkpoint, _rename_data_file(name)), "forged")


@pytest.mark.parametrize("name", ["../rank-00000.index", "/tmp/rank-00000.index", "rank-00000.index\n"])
def test_index_names_that_leave_the_checkpoint_directory_are_refused(checkpoint: Path, name: str) -> None:
    def edit(body: dict[str, Any]) -> None:
        body["indexes"] = {name: body["indexes"][INDEX]}

    with pytest.raises(ManifestError, match="index file name"):
        parse_manifest(_forged(checkpoint, edit), "forged")


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """An edit setting the value at a dotted path (``files.rank-00000.data.size``; list indices as numbers)."""

    def edit(body: dict[str, Any]) -> None:
        *parents, leaf = _split(path)
        node = body
        for part in parents:
            node = node[part]
        node[leaf] = value

    return edit


def _split(path: str) -> list[Any]:
    parts: list[Any] = []
    for part in path.replace(DATA, "\0").split("."):
        part = part.replace("\0", DATA)
        parts.append(int(part) if part.isdigit() else part)
    return parts


ABSURD = {
    "offset beyond the file": (f"files.{DATA}.frames.1.offset", 1 << 40, "lies outside the file"),
    "size beyond any disk": (f"files.{DATA}.size", 1 << 60, "less than or equal to 1125899906842624"),
    "negative length": (f"files.{DATA}.frames.0.length", -1, "greater than or equal to 0"),
    "shape of a petabyte": ("items.t/w.shape", [1 << 30, 1 << 30], "absurd shape"),
    "piece beyond its frame": ("items.t/i.pieces.0.offset", 1 << 30, "overruns frame"),
    "piece in a frame that is not there": ("items.t/i.pieces.0.frame", 99, "which has"),
    "overlapping frames": (f"files.{DATA}.frames.1.offset", 0, "overlaps"),
    "alias to nothing": ("items.t/e", {"kind": "alias", "of": "nope"}, "not a stored item"),
}


@pytest.mark.parametrize("case", ABSURD)
def test_absurd_sizes_and_offsets_are_refused(checkpoint: Path, case: str) -> None:
    path, value, message = ABSURD[case]
    with pytest.raises(ManifestError, match=message):
        parse_manifest(_forged(checkpoint, _set(path, value)), "forged")


def test_a_zstd_frame_claiming_more_than_zstd_can_expand_is_refused(checkpoint: Path) -> None:
    def edit(body: dict[str, Any]) -> None:
        frame = body["files"][DATA]["frames"][0]
        frame.update(codec="zstd", raw_length=frame["length"] * (1 << 15) + 1)

    with pytest.raises(ManifestError, match="more than zstd can expand"):
        parse_manifest(_forged(checkpoint, edit), "forged")


def test_sizes_larger_than_the_files_are_refused_before_allocating(checkpoint: Path, tmp_path: Path) -> None:
    """A consistent manifest claiming 1 TiB over a 4 MiB file: refused by size, nothing allocated."""
    forged = tmp_path / "step-1"
    forged.mkdir()
    for name in (DATA, INDEX):
        os.link(checkpoint / name, forged / name)

    def edit(body: dict[str, Any]) -> None:
        # The last frame grows to end at 1 TiB; a frame may be longer than the pieces it holds.
        body["files"][DATA]["size"] = 1 << 40
        frame = body["files"][DATA]["frames"][-1]
        frame["length"] = frame["raw_length"] = (1 << 40) - frame["offset"]

    (forged / MANIFEST_NAME).write_bytes(_forged(checkpoint, edit))
    last = len(_doc(checkpoint)["manifest"]["files"][DATA]["frames"]) - 1
    with pytest.raises(CorruptCheckpointError, match=f"frame {last}: truncated"):
        load(forged)


@pytest.mark.parametrize("dtype", ["float128", "__class__", "torch.float32", "qint8", 3, None, "Float32"])
def test_unknown_dtypes_are_refused(checkpoint: Path, dtype: Any) -> None:
    with pytest.raises(ManifestError, match="dtype"):
        parse_manifest(_forged(checkpoint, _set("items.t/w.dtype", dtype)), "forged")


@pytest.mark.parametrize("signed", [True, False])
def test_a_newer_format_version_is_refused(checkpoint: Path, signed: bool) -> None:
    doc = _doc(checkpoint)
    doc["manifest"]["version"] = FORMAT_VERSION + 1
    raw = _signed(doc) if signed else json.dumps(doc).encode()
    with pytest.raises(ManifestError, match=f"newer tierstate \\(format version {FORMAT_VERSION + 1}"):
        parse_manifest(raw, "future")


@pytest.mark.parametrize(
    "raw",
    [b"[" * 100_000, b'{"manifest": {"format": "tierstate", "version": ' + b"1" * 5000 + b"}}", b"\xff\xfe", b""],
    ids=["deep nesting", "5000-digit number", "not utf-8", "empty"],
)
def test_parser_limits_are_manifest_errors(raw: bytes) -> None:
    with pytest.raises(ManifestError, match="not valid JSON"):
        parse_manifest(raw, "hostile")


# --- pickle -----------------------------------------------------------------------------------------


class Payload:
    """Unpickling this creates a directory: proof of code execution that the test can look for."""

    def __init__(self, target: Path) -> None:
        self.target = target

    def __reduce__(self) -> tuple[Any, ...]:
        return (os.mkdir, (str(self.target),))


def _plant(path: Path, payload: bytes) -> None:
    """Replace the bytes of object item ``meta/value`` (alone in its frame) with ``payload``, re-signed:
    what someone with write access to the tier could do, checksums and all."""
    doc = _doc(path)
    item = doc["manifest"]["items"]["meta/value"]
    record = doc["manifest"]["files"][DATA]
    frame = record["frames"][item["pieces"][0]["frame"]]
    later = [other["offset"] for other in record["frames"] if other["offset"] > frame["offset"]]
    assert not later or frame["offset"] + len(payload) <= min(later)  # fits before the next frame
    with open(path / DATA, "r+b") as data:
        data.seek(frame["offset"])
        data.write(payload)
    frame.update(length=len(payload), raw_length=len(payload), checksum=checksum(payload))
    record["size"] = max(record["size"], frame["offset"] + len(payload))
    item["length"] = item["pieces"][0]["length"] = len(payload)
    (path / MANIFEST_NAME).write_bytes(_signed(doc))


def test_a_planted_pickle_never_runs_unless_allowed(tmp_path: Path) -> None:
    evidence = tmp_path / "pwned"
    writer = make_runner(tmp_path, policies__allow_pickle=True)
    writer.register(meta=ObjectProvider({"harmless": True}, serializer="pickle"))
    path = writer.checkpoint(1).result().path
    writer.close()
    _plant(path, pickle.dumps(Payload(evidence)))
    # Refused on every path that reads the checkpoint without permission; nothing ran.
    reader = make_runner(tmp_path)
    reader.register(meta=ObjectProvider({}))
    with pytest.raises(ObjectCodecError, match="pickle is disabled"):
        reader.restore("latest")
    reader.close()
    with pytest.raises(ObjectCodecError, match="pickle is disabled"):
        load(path)
    assert cli.main(["inspect", str(path), "--json"]) == 0
    # The same bytes relabelled as msgpack or json are just undecodable data.
    for serializer in ("msgpack", "json"):
        doc = _doc(path)
        doc["manifest"]["items"]["meta/value"]["serializer"] = serializer
        (path / MANIFEST_NAME).write_bytes(_signed(doc))
        with pytest.raises(ObjectCodecError):
            load(path)
    assert not evidence.exists(), "checkpoint content was unpickled without permission"
    # The control: with permission the payload does run, so the test above could have seen it.
    doc["manifest"]["items"]["meta/value"]["serializer"] = "pickle"
    (path / MANIFEST_NAME).write_bytes(_signed(doc))
    load(path, allow_pickle=True)
    assert evidence.is_dir()


def test_pickle_needs_permission_to_be_written_too(tmp_path: Path) -> None:
    runner = make_runner(tmp_path)
    runner.register(meta=ObjectProvider({"k": 1}, serializer="pickle"))
    with pytest.raises(CheckpointFailed, match="allow_pickle"):
        runner.checkpoint(1).result()
    runner.close()


# --- deep objects ------------------------------------------------------------------------------

KINDS = ("list", "map", "tuple")


def _nested(levels: Sequence[str], leaf: Any = 0) -> Any:
    """An object nesting one container per entry of ``levels``, outermost first."""
    value = leaf
    for kind in reversed(levels):
        value = [value] if kind == "list" else {"k": value} if kind == "map" else (value,)
    return value


def _forged_msgpack(levels: Sequence[str]) -> bytes:
    """msgpack bytes nesting as ``levels`` say, made without our encoder (tuples as extension 1)."""
    data = msgpack.packb(0)
    for kind in reversed(levels):
        if kind == "list":
            data = b"\x91" + data  # an array of one element
        elif kind == "map":
            data = b"\x81\xa1k" + data  # a map of one entry, key "k"
        else:
            data = msgpack.packb(msgpack.ExtType(1, b"\x91" + data))
    return data


def _forged_tuples(depth: int) -> bytes:
    """Tuples, each directly the data of the one around it: 200 deep is 714 bytes."""
    data = msgpack.packb(0)
    for _ in range(depth):
        data = msgpack.packb(msgpack.ExtType(1, data))
    return data


def test_a_too_deep_object_fails_its_checkpoint_and_training_goes_on(tmp_path: Path) -> None:
    """Before the bound, this checkpointed as durable and every restore died with SIGSEGV."""
    values: dict[str, Any] = {"deep": _nested(["tuple"] * 250)}
    runner = make_runner(tmp_path)
    runner.register(meta=ObjectProvider(lambda: values))
    with pytest.raises(CheckpointFailed, match=rf"item 'meta/value'.*deeper than {MAX_DEPTH} levels"):
        runner.checkpoint(1).result()
    values["deep"] = _nested((["tuple", "list", "map"] * MAX_DEPTH)[: MAX_DEPTH - 1])  # MAX_DEPTH in all
    path = runner.checkpoint(2).result().path
    runner.close()
    assert load(path)["meta/value"] == values
    with pytest.raises(ObjectCodecError, match="deeper than"):  # a deep tuple as a map key is as deep
        encode_object({_nested(["tuple"] * MAX_DEPTH): 1})


DECODE_IN_A_CHILD = """
import sys, threading
from tierstate.tiers.format.objcodec import ObjectCodecError, decode_object
from tierstate.tiers.reading.stored import load

def attempt(name, decode):
    try:
        decode()
        print(name, "decoded")
    except ObjectCodecError as exc:
        print(name, "refused:", exc)

attempt("checkpoint", lambda: load(sys.argv[1]))
threading.stack_size(1 << 20)  # a worker thread's stack may be small: MAX_DEPTH levels must still fit
for forged in map(bytes.fromhex, sys.argv[2:]):
    attempt(f"{len(forged)}-bytes", lambda: decode_object(forged))
    worker = threading.Thread(target=attempt, args=(f"{len(forged)}-bytes-in-a-thread", lambda: decode_object(forged)))
    worker.start()
    worker.join()
"""


def test_forged_deep_objects_are_our_error_not_a_crash(tmp_path: Path) -> None:
    """In a child process, so that a segfault is a failed test instead of the end of the run. The
    714-byte forgery (200 tuples deep) killed every restore of the checkpoint it was planted in."""
    forgeries = [_forged_tuples(200), _forged_tuples(MAX_DEPTH + 1), _forged_msgpack(["list", "tuple"] * 200)]
    assert len(forgeries[0]) == 714
    write_steps(tmp_path, [1])
    path = tmp_path / "nvme" / "step-1"
    _plant(path, forgeries[0])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    child = subprocess.run(
        [sys.executable, "-c", DECODE_IN_A_CHILD, str(path), *(forged.hex() for forged in forgeries)],
        env=env, cwd=REPO, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode == 0, f"decoding forged bytes killed the process ({child.returncode}): {child.stdout}"
    lines = child.stdout.splitlines()
    assert len(lines) == 1 + 2 * len(forgeries), child.stderr
    assert all(f"refused: msgpack data nests tuples deeper than {MAX_DEPTH}" in line for line in lines), lines


# --- fuzzing ------------------------------------------------------------------------------------

SCALARS = (
    st.none()
    | st.booleans()
    | st.sampled_from([0, 1, -1, 3, 4096, 1 << 31, 1 << 50, (1 << 50) + 1, 1 << 63, 1 << 64])
    | st.integers()
    | st.floats()
    | st.text(max_size=12)
    | st.sampled_from(["tensor", "object", "alias", "sharded", "per_rank", "zstd", "none", DATA, "float32"])
)
VALUES = st.recursive(
    SCALARS,
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=8,
)


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    """Every place in a JSON tree: the paths of all its dict values and list elements."""
    found = [prefix]
    children = node.items() if isinstance(node, dict) else enumerate(node) if isinstance(node, list) else []
    for key, child in children:
        found += _paths(child, (*prefix, key))
    return found


def _mutate(data: st.DataObject, body: Any) -> Any:
    """Replace, delete or add one value somewhere in ``body`` (which it edits in place)."""
    path = data.draw(st.sampled_from(_paths(body)))
    if not path:
        return data.draw(VALUES)
    *parents, leaf = path
    node = body
    for part in parents:
        node = node[part]
    action = data.draw(st.sampled_from(["replace", "delete", "add"]))
    if action == "replace":
        node[leaf] = data.draw(VALUES)
    elif action == "delete":
        del node[leaf]
    elif isinstance(node, dict):
        node[data.draw(st.text(max_size=8))] = data.draw(VALUES)
    else:
        node.insert(leaf, data.draw(VALUES))
    return body


@FUZZ
@given(raw=st.binary(max_size=512) | st.text(max_size=256).map(str.encode))
def test_fuzz_manifest_bytes(raw: bytes) -> None:
    with pytest.raises(ManifestError):
        parse_manifest(raw, "fuzz")


@settings(FUZZ, max_examples=scaled(1500))
@given(data=st.data())
def test_fuzz_manifest_edits(checkpoint: Path, data: st.DataObject) -> None:
    """Random edits of a real manifest, mostly re-signed so they reach the checks behind the checksum;
    whatever parses is then read against the real files: only our errors, or a load."""
    doc = _doc(checkpoint)
    body = doc["manifest"]
    for _ in range(data.draw(st.integers(1, 3))):
        body = _mutate(data, body)
    doc["manifest"] = body
    raw = _signed(doc) if data.draw(st.integers(0, 9)) else json.dumps(doc).encode()
    try:
        manifest = parse_manifest(raw, "fuzz")
    except ManifestError:
        return
    try:
        StoredCheckpoint(checkpoint, manifest=manifest).read()
    except READ_ERRORS:
        pass


@settings(FUZZ, max_examples=scaled(1000))
@given(data=st.data())
def test_fuzz_index(checkpoint: Path, data: st.DataObject) -> None:
    """Random bytes, and random edits of a real index: only ManifestError, or a valid index."""
    if data.draw(st.booleans()):
        raw = data.draw(st.binary(max_size=512))
    else:
        doc = msgpack.unpackb((checkpoint / INDEX).read_bytes(), raw=False)
        for _ in range(data.draw(st.integers(1, 3))):
            doc = _mutate(data, doc)
        try:
            raw = msgpack.packb(doc)
        except (OverflowError, TypeError, ValueError):
            return  # not representable in msgpack (an integer beyond 64 bits): cannot be on disk
    try:
        index = parse_index(raw, "fuzz")
    except ManifestError:
        return
    assert index.rank >= 0 and index.file.size >= 0


@settings(FUZZ, max_examples=scaled(500))
@given(raw=st.binary(max_size=1024), length=st.integers(0, 1 << 20), width=st.sampled_from([1, 2, 4, 8, 16]))
def test_fuzz_frame_decoding(raw: bytes, length: int, width: int) -> None:
    try:
        out = decompress(raw, "zstd", length, width)
    except CodecError:
        return
    assert len(out) == length


OBJECT_KIB = 64  # the largest object the object fuzzers build or edit
LEAVES = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**64 - 1)
    | st.floats()
    | st.text(max_size=1024)
    | st.binary(max_size=4096)
)
OBJECTS = st.recursive(
    LEAVES,
    lambda inner: (
        st.lists(inner, max_size=4)
        | st.lists(inner, max_size=4).map(tuple)
        | st.dictionaries(st.text(max_size=8) | st.integers(-(2**63), 2**63 - 1), inner, max_size=4)
    ),
    max_leaves=16,
)


@settings(FUZZ, max_examples=scaled(500))
@given(raw=st.binary(max_size=OBJECT_KIB * 1024), serializer=st.sampled_from(["msgpack", "json", "pickle"]))
def test_fuzz_object_decoding(raw: bytes, serializer: str) -> None:
    try:
        decode_object(raw, serializer, allow_pickle=False)
    except ObjectCodecError:
        return


@settings(FUZZ, max_examples=scaled(500))
@given(value=OBJECTS, data=st.data())
def test_fuzz_objects_round_trip_and_edits_are_refused(value: Any, data: st.DataObject) -> None:
    """Objects up to 64 KiB encode deterministically and decode to what re-encodes the same bytes
    (NaN included); random edits of their bytes give back a value or our error."""
    encoded = encode_object(value)
    assert len(encoded) <= OBJECT_KIB * 1024 + 1024
    assert encode_object(decode_object(encoded)) == encoded
    edited = bytearray(encoded)
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(edited)))
        action = data.draw(st.sampled_from(["flip", "cut", "insert"]))
        if action == "flip" and at < len(edited):
            edited[at] ^= data.draw(st.integers(1, 255))
        elif action == "cut":
            del edited[at:]
        else:
            edited[at:at] = data.draw(st.binary(min_size=1, max_size=8))
    try:
        decode_object(bytes(edited))
    except ObjectCodecError:
        pass


@settings(FUZZ, max_examples=scaled(300))
@given(pattern=st.lists(st.sampled_from(KINDS), min_size=1, max_size=6), depth=st.integers(0, 3 * MAX_DEPTH))
def test_fuzz_nesting(pattern: list[str], depth: int) -> None:
    """Nesting of lists, maps and tuples up to three times the bound, built and forged: encoding and
    decoding both take exactly MAX_DEPTH levels, and refuse one more with our error."""
    levels = (pattern * depth)[:depth]
    value = _nested(levels)
    fits = depth <= MAX_DEPTH
    forgeries = {"msgpack": _forged_msgpack(levels), "json": json.dumps(value, separators=(",", ":")).encode()}
    for serializer, forged in forgeries.items():
        try:
            encoded = encode_object(value, serializer)
            assert fits, f"{serializer} encoded {depth} levels"
            assert encoded == forged
        except ObjectCodecError as exc:
            assert not fits and "deeper than" in str(exc)
        try:
            decoded = decode_object(forged, serializer)
            assert fits, f"{serializer} decoded {depth} levels"
            assert decoded == (value if serializer == "msgpack" else json.loads(forged))
        except ObjectCodecError as exc:
            assert not fits and "deeper than" in str(exc), exc


BASE_CONFIG = yaml.safe_load(DEFAULT_YAML.read_text())


@settings(FUZZ, max_examples=scaled(500))
@given(data=st.data())
def test_fuzz_config(data: st.DataObject) -> None:
    """Random YAML text and random edits of the shipped config: a ConfigError naming where, or a config."""
    if data.draw(st.booleans()):
        source: Any = data.draw(st.text(max_size=200))
    else:
        source = copy.deepcopy(BASE_CONFIG)
        for _ in range(data.draw(st.integers(1, 3))):
            source = _mutate(data, source)
    try:
        parse_config(source)
    except ConfigError as exc:
        assert exc.problems and all(": " in p for p in exc.problems)


def test_fuzz_counts_are_recorded() -> None:
    fuzzed = scaled(1000) + scaled(1500) + scaled(1000) + scaled(500) * 4 + scaled(300)
    tally("fuzz", inputs=fuzzed, losses=0)


def test_a_cyclic_stage_graph_is_an_error_not_a_hang() -> None:
    """Found by test_fuzz_config: checks that walk the stage chain ran on broken graphs too."""
    config = copy.deepcopy(BASE_CONFIG)
    config["pipeline"]["stages"]["persist"]["next"] = "capture"
    errors: list[BaseException] = []
    worker = threading.Thread(target=lambda: errors.append(pytest.raises(ConfigError, parse_config, config).value))
    worker.start()
    worker.join(30)
    assert not worker.is_alive(), "parse_config does not return on a cyclic stage graph"
    assert "cycle capture -> serialize -> compress -> persist -> capture" in str(errors[0])


@pytest.mark.parametrize(
    "key,value,message",
    [
        ("retries", -1, "retries: must be greater than or equal to 0, got -1"),
        ("retries", True, "retries: must be a valid integer, got True"),
        ("backoff", 0, "backoff: must be greater than 0, got 0"),
        ("backoff", "soon", "backoff: must be a valid number"),
        ("retrys", 3, "retrys: unknown key; did you mean 'retries'?"),
    ],
)
def test_retry_settings_are_checked_at_their_key_path(key: str, value: Any, message: str) -> None:
    config = copy.deepcopy(BASE_CONFIG)
    config["pipeline"]["stages"]["persist"][key] = value
    with pytest.raises(ConfigError) as failure:
        parse_config(config, source="my.yaml")
    assert f"my.yaml: pipeline.stages.persist.{message}" in str(failure.value)
