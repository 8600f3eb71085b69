"""What is wrong with a pipeline config, said in the YAML's own vocabulary: ``<key.path>: <message>``.

Two kinds of mistake are told here. Those of the text: :func:`read_yaml` parses strictly, refusing
a key written twice (plain YAML keeps the last one silently, so a second ``retention:`` would
quietly decide what is deleted) and naming line and column. Those of the values: pydantic reports
a location in its own terms (``tiers.NVMe.[key]``, union tags inserted into the path, ``Input
should be ...``); :func:`render` turns each error into ``key.path: message`` with the YAML's type
names and the closest valid key for a typo. It walks the schema's annotations from the root model
it is given, so it needs no import of the schema (pipeline/config_schema.py), which imports it.
"""

from __future__ import annotations

import types
import typing
from collections.abc import Mapping
from typing import Annotated, Any, Union

import yaml
from pydantic import BaseModel, ValidationError

from tierstate.errors import TierstateError
from tierstate.suggest import did_you_mean

__all__ = ["ConfigError", "SemanticErrors", "read_yaml", "render", "yaml_type"]

Problem = tuple[str, str]  # (dotted key path, message)


class ConfigError(TierstateError, ValueError):
    """An invalid pipeline config; ``problems`` holds one ``key.path: message`` per problem.

    A ValueError so callers that treat bad input generically still catch it; ``source`` names the
    file (or ``<config>``) so the text is actionable when several configs are in play.
    """

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__("\n".join(f"{source}: {problem}" for problem in problems))

    def __reduce__(self) -> tuple[type[ConfigError], tuple[str, list[str]]]:
        # The default reduce replays args=(message,), which does not match __init__; errors must
        # survive pickling to cross process boundaries (multiprocessing, torchrun workers).
        return (type(self), (self.source, self.problems))


class SemanticErrors(TierstateError, ValueError):
    """Carries several ``(key.path, message)`` problems out of one pydantic model validator.

    A validator can raise only one error at the model root (a ValueError, so pydantic collects
    it); pydantic keeps the original exception in the error's ``ctx``, so :func:`render` can unpack
    all problems with their own key paths.
    """

    def __init__(self, problems: list[Problem]) -> None:
        self.problems = problems
        super().__init__("; ".join(f"{path}: {message}" for path, message in problems))


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys, which plain YAML resolves silently to the last one
    (two `compress:` stages would otherwise quietly become one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark, f"duplicate key {key!r}", key_node.start_mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def read_yaml(text: str, source: str) -> Any:
    """The YAML document in ``text``; a ConfigError at line and column if it is malformed or
    writes a key twice in one mapping."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass: no arbitrary objects
    except yaml.MarkedYAMLError as exc:
        mark = exc.problem_mark or exc.context_mark
        where = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "<yaml>"
        raise ConfigError(source, [f"{where}: invalid YAML: {exc.problem or exc.context}"]) from None
    except yaml.YAMLError as exc:
        raise ConfigError(source, [f"<yaml>: invalid YAML: {exc}"]) from None


def render(
    exc: ValidationError, root: Any, at: tuple[str, ...] = (), overrides: Mapping[str, Any] | None = None
) -> list[str]:
    """Every problem of ``exc`` as ``key.path: message``. ``root`` is the model whose keys the paths
    name, ``at`` the key path of the value validated (``("tiers",)`` when a tiers section was
    validated on its own), ``overrides`` the dotted keys set besides the file (see parse_config)."""
    return [
        f"{path}: {message}{_override_note(path, overrides)}"
        for error in exc.errors(include_url=False)
        for path, message in _describe(error, root, at)
    ]


def _override_note(path: str, overrides: Mapping[str, Any] | None) -> str:
    """Points at the override when a bad value did not come from the file the user is reading."""
    for key in overrides or {}:
        if path == key or path.startswith(key + "."):
            return f" (set by override {key!r})"
    return ""


_EXPECTED = {
    "model_type": "a mapping",
    "model_attributes_type": "a mapping",
    "dict_type": "a mapping",
    "byte_size": "a size such as 16MiB, 1GB or a number of bytes",
    "byte_size_unit": "a size such as 16MiB, 1GB or a number of bytes",
    "path_type": "a path string",
}


def _describe(error: Mapping[str, Any], root: Any, at: tuple[str, ...]) -> list[Problem]:
    """Turn one pydantic error into ``(key.path, message)`` problems."""
    kind, loc, given = error["type"], (*at, *error["loc"]), error.get("input")
    ctx = error.get("ctx") or {}
    if isinstance(ctx.get("error"), SemanticErrors):
        return ctx["error"].problems
    is_name = bool(loc) and loc[-1] == "[key]"
    keys, owner, annotation = _locate(root, loc[:-1] if is_name else loc)
    if keys[:1] == ["buckets"]:  # where the loader moved the kind: s3 tiers; the YAML has them under tiers
        keys[0] = "tiers"
    path = ".".join(keys) or "<top level>"
    if kind == "extra_forbidden":
        return [(path, _unknown_key(keys[-1], owner))]
    if kind == "missing":
        return [(path, "required key is missing")]
    if kind == "too_short":
        return [(path, "must not be empty")]
    tags = _union_tags(annotation)
    if kind == "union_tag_not_found":
        return [(f"{path}.kind", f"missing; the stage name is not a kind, so set kind to one of {', '.join(tags)}")]
    if kind == "union_tag_invalid":
        tag = str(ctx["tag"])
        return [(f"{path}.kind", f"must be one of {', '.join(tags)}, got {tag!r}{did_you_mean(tag, tags)}")]
    if kind == "value_error":
        return [(path, error["msg"].removeprefix("Value error, "))]
    expected = f"must be {_EXPECTED[kind]}" if kind in _EXPECTED else error["msg"].replace("Input should be", "must be")
    if is_name:
        expected = f"invalid name: {expected[0].lower()}{expected[1:]}"
    return [(path, f"{expected}, got {_show(given)}")]


def _locate(root: Any, loc: tuple[int | str, ...]) -> tuple[list[str], type[BaseModel] | None, Any]:
    """Map a pydantic location to the YAML key path, the model owning its last key, and the type
    found there.

    Walking the type annotations tells apart a dict key (kept) from a discriminated-union tag that
    pydantic inserts (``stages.compress.compress.level``; dropped), and finds the model whose field
    names are the candidates for an unknown-key suggestion.
    """
    keys: list[str] = []
    owner: type[BaseModel] | None = None
    annotation: Any = root
    for part in loc:
        annotation = _unwrap(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            owner = annotation
            field = annotation.model_fields.get(str(part))
            annotation = field.annotation if field else None
            keys.append(str(part))
        elif typing.get_origin(annotation) in (Union, types.UnionType):
            # Members are already known models; the union itself adds no key to the YAML path.
            annotation = next((m for m in typing.get_args(annotation) if _tag_of(m) == part), None)
        else:
            annotation = typing.get_args(annotation)[-1] if typing.get_origin(annotation) is dict else None
            keys.append(str(part))
    return keys, owner, annotation


def _unwrap(annotation: Any) -> Any:
    """Strip ``Annotated[...]`` and ``X | None`` down to the type that decides the next key."""
    while True:
        origin = typing.get_origin(annotation)
        if origin is Annotated:
            annotation = typing.get_args(annotation)[0]
        elif origin in (Union, types.UnionType):
            members = [m for m in typing.get_args(annotation) if m is not type(None)]
            if len(members) != 1:
                return annotation
            annotation = members[0]
        else:
            return annotation


def _union_tags(annotation: Any) -> list[str]:
    """The tags a discriminated union selects its members by (the stage kinds), in schema order."""
    union = _unwrap(annotation)
    if typing.get_origin(union) not in (Union, types.UnionType):
        return []
    return [str(_tag_of(member)) for member in typing.get_args(union)]


def _tag_of(model: Any) -> Any:
    """The ``kind`` literal a stage model is selected by in the discriminated union."""
    field = model.model_fields.get("kind") if isinstance(model, type) and issubclass(model, BaseModel) else None
    return field.default if field else None


def _unknown_key(key: str, owner: type[BaseModel] | None) -> str:
    valid = list(owner.model_fields) if owner else []
    hint = did_you_mean(key, valid)
    return f"unknown key{hint}" if hint or not valid else f"unknown key (valid keys: {', '.join(valid)})"


def yaml_type(value: Any) -> str:
    """Type names as a YAML author knows them, not Python's."""
    if value is None:
        return "null"
    for python_type, name in ((bool, "boolean"), (int, "integer"), (float, "number"), (str, "string"),
                              (Mapping, "mapping"), (list, "list")):
        if isinstance(value, python_type):
            return name
    return type(value).__name__


def _show(value: Any) -> str:
    if value is None:
        return "null"
    text = repr(value)
    return f"{text if len(text) <= 60 else text[:57] + '...'} ({yaml_type(value)})"
