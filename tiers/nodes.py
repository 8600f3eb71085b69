"""Which node this process runs on, and tier paths that differ per node.

A node-scoped tier (local NVMe, a memory tier) is one directory per node; its YAML path may say so
with ``{node}`` (``/local/ckpt/{node}``, or a shared mount split per node in tests). The node is
the hostname, unless ``TIERSTATE_NODE`` names it: that is how tests run several "nodes" on one
machine, and how a site whose hostnames are not stable names its nodes.
"""

from __future__ import annotations

import os
import socket

NODE_ENV = "TIERSTATE_NODE"
NODE_PLACEHOLDER = "{node}"


def node_name() -> str:
    """This process's node: ``$TIERSTATE_NODE`` if set and not blank, else the hostname."""
    named = os.environ.get(NODE_ENV, "").strip()
    return named or socket.gethostname()


def expand_node(path: str) -> str:
    """``path`` with every ``{node}`` replaced by :func:`node_name` (other text is left as it is)."""
    return path.replace(NODE_PLACEHOLDER, node_name()) if NODE_PLACEHOLDER in path else path
