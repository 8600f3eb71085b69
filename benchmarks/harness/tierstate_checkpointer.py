"""tierstate itself as a benchmarked method, and the host cache size the benchmarks give it."""

from __future__ import annotations

import shutil
import time
from pathlib import Path
from typing import Any

import torch

from tierstate import CheckpointHandle, CheckpointResult, Runner
from tierstate.tiers.storage.filesystem import FilesystemTier

from .checkpointer import Checkpointer, Record
from .paths import DEFAULT_YAML
from .units import GiB, MiB

# One thread per chunk from copy to write: one capture worker, and no threads of their own for the
# stages after it (workers: 0, pipeline/lanes.py).
ONE_THREAD = {"pipeline.stages.capture.workers": 1, "pipeline.stages.serialize.workers": 0,
              "pipeline.stages.compress.workers": 0, "pipeline.stages.persist.workers": 0}


def cache_for(state_bytes: int, chunk: int = 64 * MiB) -> int:
    """A host cache that holds the whole state (+6% and 8 chunks for the tails of tensors split across
    chunks), so capture never waits for persist: the setting the blocked-time benchmarks use."""
    return (int(state_bytes * 1.06) // chunk + 8) * chunk


class TierstateCheckpointer(Checkpointer):
    """tierstate's runner: lazy capture into the host cache, O_DIRECT persist, manifest commit.

    The runner's optimizer step pre-hook (``runner.attach``) does the only wait a trainer sees; its
    seconds land in ``handle.blocked_s``, which is read back into the record once the step is done.
    """

    name = "tierstate"

    def __init__(
        self,
        state: Any,
        root: Path,
        cache_bytes: int,
        chunk_bytes: int = 64 * MiB,
        codec: str = "none",
        level: int = 1,
        bandwidth: int | None = None,
        io: str = "auto",
        yaml_path: Path = DEFAULT_YAML,
        optimizer: torch.optim.Optimizer | None = None,
        overrides: dict[str, Any] | None = None,
    ) -> None:
        super().__init__(state, root)
        overrides: dict[str, Any] = {
            "tiers": {"nvme": {"path": str(root)}},
            "chunk_size": chunk_bytes,
            "host_cache.size": cache_bytes,
            "pipeline.stages.compress.codec": codec,
            "pipeline.stages.compress.level": level,
            "pipeline.stages.persist.bandwidth": bandwidth,
            "pipeline.stages.persist.io": io,
            **(overrides or {}),  # any other setting, by its dotted path
        }
        self.runner = Runner.from_yaml(yaml_path, overrides)
        self.runner.register(**state.providers())
        if optimizer is not None:
            self.runner.attach(optimizer)
        self._handles: dict[int, CheckpointHandle] = {}
        self.setup = f"host cache {cache_bytes / GiB:.2f} GiB, chunk {chunk_bytes // MiB} MiB, codec {codec}"
        if bandwidth:
            self.setup += f", persist throttled to {bandwidth / 1e6:.0f} MB/s"

    def _save(self, record: Record) -> None:
        self._handles[record.step] = self.runner.checkpoint(record.step)

    def before_step(self) -> float:
        return 0.0  # the runner's own step pre-hook waits; its time is in handle.blocked_s

    def wait_staged(self) -> float:
        return self.runner.wait_captured()

    def drain(self) -> float:
        started = time.perf_counter()
        self.runner.wait()
        for record in self.records:
            handle = self._handles.get(record.step)
            if handle is None or record.durable_at is not None:
                continue
            result = handle.result()
            record.blocked_s = handle.blocked_s  # the call + the pre-hook's waits, measured by the runner
            record.durable_at = record.requested + result.durable_s
        return time.perf_counter() - started

    def result(self, step: int) -> CheckpointResult:
        return self._handles[step].result()

    def restore(self, step: int) -> None:
        self.runner.restore(step)

    def close(self) -> None:
        self.drain()
        self.runner.close()


SHM = Path("/dev/shm")


class MemoryTierCheckpointer(TierstateCheckpointer):
    """tierstate persisting to a memory tier: its directory (in /dev/shm) goes once the runner is closed."""

    def clear(self) -> None:
        """Between runs: the checkpoints go as retention deletes them, each data file back to its rank's slot
        pool, so a round measures the steady state of a long run. Removing the pool with them would make every
        round allocate and fault in its slots again (0.4-0.9 s of trainer time per 1.52 GB slot), which a run
        pays only at its first two checkpoints."""
        self.drain()
        if self.runner.closed:
            shutil.rmtree(self.root, ignore_errors=True)
            return
        tier = FilesystemTier("memory", self.root, "node")
        for step in tier.steps():
            tier.delete_step(step)


def memory_tier_config(directory: Path, state_bytes: int, slots: bool) -> dict[str, Any]:
    """A memory tier (``kind: memory``, keep_last 1) at ``directory`` (a tmpfs), room for 4x ``state_bytes`` (at
    least 1 GiB): with ``slots`` capture writes into its preallocated files; without, through the host cache."""
    size = max(4 * state_bytes, GiB)
    return {"path": str(directory), "kind": "memory", "size": size, "retention": {"keep_last": 1}, "slots": slots}


def memory_checkpointer(state: Any, directory: Path, slots: bool = True, **tierstate: Any) -> TierstateCheckpointer:
    """tierstate persisting to a memory tier at ``directory`` (a tmpfs; see :func:`memory_tier_config`)."""
    tier = memory_tier_config(directory, state.tensor_bytes, slots)
    extra = tierstate.pop("overrides", None) or {}
    ckpt = MemoryTierCheckpointer(state, directory, overrides={"tiers": {"nvme": tier}, **extra}, **tierstate)
    where = "captured into its slots" if slots else "through the host cache (slots: false)"
    ckpt.setup = f"persist tier kind: memory at {directory}, keep_last 1, {where}" + (
        "" if slots else f"; {ckpt.setup}"
    )
    return ckpt
