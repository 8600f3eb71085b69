"""Whether pipeline stages form the one chain capture -> serialize -> (compress ->) persist.

The stages are a graph the user writes (each names its ``next``), so it can be broken in every way
a graph can: several or no captures, a stage feeding nothing or fed by two, a missing target, a
wrong order, a cycle, a stage off the chain. Each problem is reported once, at the key path of the
``next`` (or stage) to change. Only ``kind`` and ``next`` matter here, so this module needs no
import of the config models (pipeline/config_schema.py); pipeline/config_checks.py calls it.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Protocol

__all__ = ["chain_problems"]


class Stage(Protocol):
    """What the graph checks read of a stage."""

    @property
    def kind(self) -> str: ...

    @property
    def next(self) -> str | None: ...


# Which kind may follow which. Encoding the order as successor sets makes one edge check cover
# "wrong order", "each kind at most once" and "serialize is required"; "persist is required"
# follows from the rule that only persist may end the chain.
_SUCCESSORS: dict[str, frozenset[str]] = {
    "capture": frozenset({"serialize"}),
    "serialize": frozenset({"compress", "persist"}),
    "compress": frozenset({"persist"}),
    "persist": frozenset(),
}


def chain_problems(stages: Mapping[str, Stage]) -> Iterator[tuple[str, str]]:
    """Why ``stages`` is not one chain capture -> serialize -> (compress ->) persist."""
    captures = [name for name, stage in stages.items() if stage.kind == "capture"]
    if len(captures) != 1:
        found = f"{len(captures)} ({', '.join(captures)})" if captures else "none"
        yield "pipeline.stages", f"expected exactly one capture stage, found {found}"

    fed_by: dict[str, str] = {}
    for name, stage in stages.items():
        where = f"pipeline.stages.{name}.next"
        target = stage.next
        if target is None:
            if stage.kind != "persist":
                yield where, f"stage {name!r} feeds nothing: a {stage.kind} stage needs `next`"
        elif stage.kind == "persist":
            yield where, f"a persist stage ends the chain and cannot feed {target!r}; remove `next`"
        elif target not in stages:
            yield where, f"{target!r} is not a stage (stages: {', '.join(stages)})"
        else:
            if target in fed_by:
                yield where, (f"{target!r} is already fed by {fed_by[target]!r}; "
                              "stages must form a single chain")
            fed_by.setdefault(target, name)
            allowed = _SUCCESSORS[stage.kind]
            if stages[target].kind not in allowed:
                yield where, (f"{target!r} ({stages[target].kind}) cannot follow a {stage.kind} stage; "
                              f"expected {' or '.join(sorted(allowed))} "
                              "(order: capture -> serialize -> [compress ->] persist)")

    yield from _cycle_problems(stages, captures)
    if len(captures) == 1:
        reached = set(_walk(stages, captures[0]))
        for name in stages:
            if name not in reached:
                yield f"pipeline.stages.{name}", f"stage {name!r} is never fed: it is not on the chain from capture"


def _walk(stages: Mapping[str, Stage], start: str) -> Iterator[str]:
    """Follow ``next`` from ``start``, stopping at a missing stage, the end, or a repeat."""
    visited: set[str] = set()
    name: str | None = start
    while name is not None and name in stages and name not in visited:
        visited.add(name)
        yield name
        name = stages[name].next


def _cycle_problems(stages: Mapping[str, Stage], captures: list[str]) -> Iterator[tuple[str, str]]:
    """Each cycle once, blamed on the ``next`` that closes it; walking from capture first roots
    the reported cycle where the user reads the chain from."""
    seen: set[str] = set()
    for start in [*captures, *stages]:
        if start in seen:
            continue
        path: list[str] = []
        for name in _walk(stages, start):
            if name in seen:
                break
            seen.add(name)
            path.append(name)
        else:
            closing = stages[path[-1]].next
            if closing in path:
                loop = path[path.index(closing):] + [closing]
                yield f"pipeline.stages.{path[-1]}.next", f"cycle {' -> '.join(loop)}"
