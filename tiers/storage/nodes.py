"""Which node this process runs on, and tier paths that differ per node.

A node-scoped tier (local NVMe, a memory tier) is one directory per node; its YAML path may say so
with ``{node}`` (``/local/ckpt/{node}``, or a shared mount split per node in tests). The node is
the hostname, unless ``TIERSTATE_NODE`` names it: that is how tests run several "nodes" on one
machine, and how a site whose hostnames are not stable names its nodes. The ``tierstate`` CLI
looks at another node's view (``--node``) with :func:`as_node`, without touching the environment.
"""

from __future__ import annotations

import contextlib
import os
import socket
from collections.abc import Iterator
from contextvars import ContextVar

NODE_ENV = "TIERSTATE_NODE"
NODE_PLACEHOLDER = "{node}"

_viewed_as: ContextVar[str | None] = ContextVar("tierstate_node", default=None)


def node_name() -> str:
    """This process's node: the one :func:`as_node` names, else ``$TIERSTATE_NODE`` if set and not
    blank, else the hostname."""
    named = _viewed_as.get() or os.environ.get(NODE_ENV, "").strip()
    return named or socket.gethostname()


@contextlib.contextmanager
def as_node(name: str) -> Iterator[None]:
    """Within the block, :func:`node_name` is ``name``: tier paths with ``{node}`` are that node's."""
    token = _viewed_as.set(name)
    try:
        yield
    finally:
        _viewed_as.reset(token)


def expand_node(path: str) -> str:
    """``path`` with every ``{node}`` replaced by :func:`node_name` (other text is left as it is)."""
    return path.replace(NODE_PLACEHOLDER, node_name()) if NODE_PLACEHOLDER in path else path
