"""The methods tierstate is compared with: ``torch.save`` (+ ``torch.load``), PyTorch DCP ``save``,
``async_save`` (+ ``load``), each as a :class:`~harness.checkpointer.Checkpointer`."""

from __future__ import annotations

import os
import time
import warnings
from pathlib import Path
from typing import Any

import torch

from .checkpointer import BackgroundCheckpointer, Checkpointer, Record
from .disk import fsync_dir
from .tensors import iter_tensors

# Without CUDA, DCP's pinned memory and non-blocking copies are unavailable (its DefaultStager raises
# when asked for them), so its best CPU configuration is: plain memory, staging in a background thread.
CUDA = torch.cuda.is_available()
# DCP says so on every call without a process group; single-process saving is exactly what we ask for.
warnings.filterwarnings("ignore", message="torch.distributed is disabled")


class TorchSaveCheckpointer(Checkpointer):
    """``torch.save`` of the state dict to a temp file, fsync, rename, fsync the directory: synchronous."""

    name = "torch.save"

    def __init__(self, state: Any, root: Path, mmap_load: bool = False) -> None:
        super().__init__(state, root)
        self.mmap_load = mmap_load
        self.setup = "sync, fsync + atomic rename"

    def path(self, step: int) -> Path:
        return self.root / f"step-{step}.pt"

    def _save(self, record: Record) -> None:
        final = self.path(record.step)
        partial = final.with_suffix(".partial")
        with open(partial, "wb") as f:
            torch.save(self.state.state_dict(), f)
            f.flush()
            os.fsync(f.fileno())
        os.rename(partial, final)
        fsync_dir(self.root)
        record.durable_at = time.perf_counter()

    def restore(self, step: int) -> None:
        loaded = torch.load(self.path(step), map_location="cpu", weights_only=True, mmap=self.mmap_load)
        self.state.load_state_dict(loaded)
        if self.mmap_load:
            # The optimizer keeps the loaded tensors, which mmap leaves file-backed: nothing is read until
            # the next optimizer.step() touches them. Touch one element per page so the timing includes the
            # reads (the restore is complete), as it does for every other method.
            for tensor in iter_tensors(loaded):
                if tensor.numel():
                    float(tensor.reshape(-1)[:: max(1, 4096 // tensor.element_size())].float().sum())


def _dcp() -> Any:
    import torch.distributed.checkpoint as dcp

    return dcp


class DCPSaveCheckpointer(Checkpointer):
    """PyTorch DCP ``save`` (FileSystemWriter, sync_files=True), single process: synchronous."""

    name = "dcp.save"
    setup = "sync, FileSystemWriter(sync_files=True)"

    def _save(self, record: Record) -> None:
        _dcp().save(self.state.state_dict(), checkpoint_id=str(self.path(record.step)), no_dist=True)
        record.durable_at = time.perf_counter()

    def restore(self, step: int) -> None:
        # DCP loads in place into the tensors of the given state dict, then the usual load_state_dict.
        state = self.state.state_dict()
        _dcp().load(state, checkpoint_id=str(self.path(step)), no_dist=True)
        self.state.load_state_dict(state)


class DCPAsyncCheckpointer(BackgroundCheckpointer, DCPSaveCheckpointer):
    """PyTorch DCP ``async_save``: stage a CPU copy, then write it on a background thread.

    ``staging="sync"`` is DCP's default (the call copies the whole state before returning);
    ``staging="async"`` passes a reused ``DefaultStager`` that stages in a background thread, so the
    trainer waits for the copy only before its next ``optimizer.step()`` -- the same overlap tierstate
    uses. Without CUDA, pinned memory and non-blocking copies do not exist (DefaultStager refuses
    them), so both run on plain memory. As DCP's docs ask, a new save first waits for the previous one.
    It restores as :class:`DCPSaveCheckpointer` does.
    """

    def __init__(self, state: Any, root: Path, staging: str = "async") -> None:
        super().__init__(state, root)
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.staging = staging
        self.name = "dcp.async_save" + ("+async-staging" if staging == "async" else "")
        self._stager = None
        if staging == "async":
            self._stager = DefaultStager(
                StagingOptions(
                    use_pinned_memory=CUDA, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=CUDA
                )
            )
            self.setup = f"DefaultStager reused: async staging, pinned={CUDA}, non-blocking={CUDA}"
        else:
            self.setup = "default stager: synchronous staging copy"

    def _save(self, record: Record) -> None:
        if self.durable is not None:
            self.durable.result()  # one in flight, as with tierstate's `in_flight: wait`
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            response = _dcp().async_save(
                self.state.state_dict(),
                checkpoint_id=str(self.path(record.step)),
                no_dist=True,
                async_stager=self._stager,
            )
        if hasattr(response, "upload_completion"):
            self.staged, self.durable = response.staging_completion, response.upload_completion
        else:
            self.staged, self.durable = None, response

        def done(_future: Any, record: Record = record) -> None:
            record.durable_at = time.perf_counter()

        self.durable.add_done_callback(done)

    def close(self) -> None:
        self.drain()
        if self._stager is not None:
            self._stager.close()
