"""One process as a group of one, so that a restore (and the runner's other collectives: which steps the
ranks hold, closing) runs the same code on one rank as on many.

The restore (pipeline/agreement.py) agrees every step with the other ranks: which steps they hold,
whether each read its copy, whether each restored. In one process there is no one to agree with,
and each collective is the identity: the value gathered is this rank's own, a broadcast from rank 0
leaves the buffer as it is (PyTorch DCP's ``_DistWrapper(use_dist=False)`` does the same). So one
rank goes through the same rounds, refusals and messages as many, instead of a second restore path.
The write path's commit among ranks (pipeline/distributed.py) is not run for one rank: its votes and
merged manifests would change what a single rank writes.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch


class RestoreGroup(Protocol):
    """What a restore needs of the ranks (:class:`pipeline.distributed.CheckpointGroup` for many)."""

    rank: int
    world_size: int
    node_ranks: list[int]

    def all_gather(self, value: Any, what: str) -> list[Any]: ...

    def node_all_gather(self, value: Any, what: str) -> list[Any]: ...

    def broadcast(self, tensor: torch.Tensor, src: int, what: str) -> None: ...

    def node_broadcast(self, tensor: torch.Tensor, src: int, what: str) -> None: ...

    def close(self) -> None: ...


class SoloGroup:
    """The ranks of a job run in one process: rank 0 of 1, on a node of its own."""

    def __init__(self) -> None:
        self.rank = 0
        self.world_size = 1
        self.node_ranks = [0]

    def all_gather(self, value: Any, what: str) -> list[Any]:  # noqa: ARG002  # the protocol's signature
        return [value]

    def node_all_gather(self, value: Any, what: str) -> list[Any]:  # noqa: ARG002
        return [value]

    def broadcast(self, tensor: torch.Tensor, src: int, what: str) -> None:
        """Nothing to send: the only rank holds ``tensor`` already."""

    def node_broadcast(self, tensor: torch.Tensor, src: int, what: str) -> None:
        """Nothing to send: the only rank holds ``tensor`` already."""

    def close(self) -> None:
        """Nothing to release: no process group was made."""
