"""Object encoding on disk: what round-trips, what is refused, and that refusing pickle never unpickles."""

from __future__ import annotations

import math
import pickle
from collections import OrderedDict

import numpy as np
import pytest

from tierstate.tiers.format.objcodec import ObjectCodecError, decode_object, encode_object

SIDE_EFFECTS: list[str] = []


def _mark(tag: str) -> str:
    SIDE_EFFECTS.append(tag)
    return tag


class Exploit:
    """Unpickling this calls ``_mark``: stands in for a payload that runs code."""

    def __reduce__(self):
        return (_mark, ("unpickled",))


class Opaque:
    def __init__(self, x: int) -> None:
        self.x = x

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Opaque) and other.x == self.x


def test_msgpack_keeps_tuples_int_keys_and_bytes() -> None:
    value = {
        0: {"betas": (0.9, (0.999, "x")), "step": 3},
        "blob": b"\x00\xff",
        (1, 2): [None, True, -1.5, float("inf")],
        "nested": [(1,), ()],
    }
    back = decode_object(encode_object(value, "msgpack"), "msgpack")
    assert back == value
    assert type(back[0]["betas"]) is tuple and type(back[0]["betas"][1]) is tuple
    assert type(back["nested"][0]) is tuple and type(back["nested"]) is list
    assert isinstance(back["blob"], bytes)
    assert 0 in back and "0" not in back


def test_msgpack_plain_types_from_subclasses_and_numpy_scalars() -> None:
    value = OrderedDict(b=np.float64(0.25), a=np.int64(7))
    back = decode_object(encode_object(value))
    assert back == {"b": 0.25, "a": 7}
    assert list(back) == ["b", "a"]
    assert type(back["b"]) is float and type(back["a"]) is int


def test_encoding_is_deterministic() -> None:
    def build() -> dict:
        return {"lr": [0.1, 0.01], "step": (1, 2), 5: "x", "nan": float("nan")}

    for serializer in ("msgpack", "json"):
        assert encode_object(build(), serializer) == encode_object(build(), serializer)
    assert encode_object(build(), "pickle", allow_pickle=True) == encode_object(build(), "pickle", allow_pickle=True)


def test_json_round_trip_allows_nan() -> None:
    back = decode_object(encode_object({"loss": float("nan"), "ok": [1, "é"]}, "json"), "json")
    assert math.isnan(back["loss"]) and back["ok"] == [1, "é"]


@pytest.mark.parametrize(
    ("serializer", "value", "type_name", "suggestion"),
    [
        ("msgpack", {1, 2}, "set", "pickle"),
        ("msgpack", {"o": Opaque(1)}, "Opaque", "policies.allow_pickle: true"),
        ("json", {"o": Opaque(1)}, "Opaque", "msgpack"),
        ("json", b"raw", "bytes", "msgpack"),
    ],
)
def test_unencodable_values_name_type_and_suggest_serializer(serializer, value, type_name, suggestion) -> None:
    with pytest.raises(ObjectCodecError) as info:
        encode_object(value, serializer)
    assert type_name in str(info.value) and suggestion in str(info.value)


def test_msgpack_int_overflow_is_a_codec_error() -> None:
    with pytest.raises(ObjectCodecError, match="msgpack cannot encode"):
        encode_object(2**70)


def test_pickle_refused_unless_allowed() -> None:
    with pytest.raises(ObjectCodecError, match=r"policies\.allow_pickle: true"):
        encode_object(Opaque(3), "pickle")
    data = encode_object(Opaque(3), "pickle", allow_pickle=True)
    assert decode_object(data, "pickle", allow_pickle=True) == Opaque(3)


def test_refused_pickle_is_never_unpickled() -> None:
    SIDE_EFFECTS.clear()
    payload = pickle.dumps(Exploit())
    with pytest.raises(ObjectCodecError, match="pickle is disabled"):
        decode_object(payload, "pickle", allow_pickle=False)
    assert SIDE_EFFECTS == []
    decode_object(payload, "pickle", allow_pickle=True)  # control: the payload does run when allowed
    assert SIDE_EFFECTS == ["unpickled"]


@pytest.mark.parametrize(
    ("data", "serializer"),
    [(b"\xc1", "msgpack"), (b"\x92\x01", "msgpack"), (b"{nope", "json"), (b"\xd4\x07\x00", "msgpack")],
)
def test_corrupt_data_is_a_codec_error(data: bytes, serializer: str) -> None:
    with pytest.raises(ObjectCodecError):
        decode_object(data, serializer)


def test_unknown_serializer() -> None:
    with pytest.raises(ObjectCodecError, match="unknown serializer"):
        encode_object(1, "yaml")
    with pytest.raises(ObjectCodecError, match="unknown serializer"):
        decode_object(b"1", "yaml")
    assert issubclass(ObjectCodecError, ValueError)
