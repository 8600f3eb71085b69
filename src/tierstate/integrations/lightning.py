"""Lightning: ``Trainer(plugins=[TierstateCheckpointIO()])`` makes every checkpoint save asynchronous and tiered.

Lightning hands its ``CheckpointIO`` plugin one dict per save (``state_dict``, ``optimizer_states``,
``lr_schedulers``, ``loops``, ``callbacks``, ``epoch``, ``global_step``, ...) and a path. Here:

- **Items.** Each top-level key is a provider of that name, laid out as
  :mod:`tierstate.layout` says: ``state_dict/<param>`` (what a ``ModuleProvider`` of
  the LightningModule describes), ``optimizer_states/0/state/0/exp_avg`` with a ``skeleton`` object,
  and so on. Tensors an optimizer holds (parameters, optimizer state) are captured lazily: every
  optimizer that steps while the plugin is set up is attached (a global step pre-hook notes it),
  so its next ``step()`` waits only for a capture still pending. Everything else (buffers, the
  small state of loops and callbacks) is copied before ``save_checkpoint`` returns, as Lightning's
  own ``AsyncCheckpointIO`` copies everything.
- **Paths.** Each save is a tierstate checkpoint of its own, numbered in order (1, 2, ... and on
  from the newest on the tiers after a restart; Lightning may save twice at one global step, e.g. a
  top-k file and ``last.ckpt``, with different loop state). The file at ``path`` is a small pointer
  naming that number (JSON after a short pickle on which ``torch.load`` fails saying what to do),
  written (atomically) only once the checkpoint is durable: Lightning finds ``last.ckpt`` as usual,
  and it always names a checkpoint that is there, also after a SIGKILL. ``remove_checkpoint``
  removes a pointer after the saves requested before it are published; the checkpoints themselves
  are kept or deleted by the tiers' retention policies.
- **Loading.** ``load_checkpoint`` reads the pointer and restores from the fastest tier holding a
  verified copy, as a runner restores; a path that is not a pointer (a ``.ckpt`` that
  ``torch.save`` wrote) is loaded as Lightning's ``TorchCheckpointIO`` would.

A failed checkpoint does not stop training: it is logged, its pointer is not written (``last``
keeps naming the previous one) and it is listed in ``failures``.

Lightning is imported only when :class:`TierstateCheckpointIO` is first looked up; without it, that says to
``pip install 'tierstate[lightning]'``.
"""

from __future__ import annotations

import concurrent.futures
import inspect
import io as io_module
import logging
import os
import threading
import weakref
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from tierstate import (
    CheckpointHandle,
    FilesystemTier,
    Item,
    ObjectCodecError,
    PipelineConfig,
    Runner,
    Serializer,
    TensorItem,
    TierstateError,
    layout,
    load_config,
    open_buckets,
    parse_config,
    storage_of,
)

from ..tiers.reading.stored import read_first_clean
from . import needs_extra
from .lightning_pointer import LOAD_HINT, POINTER_KIND, read_pointer, write_pointer

if TYPE_CHECKING:
    from lightning.fabric.plugins import CheckpointIO

    from ..tiers.reading.stored import StoredCheckpoint

log = logging.getLogger("tierstate")

class LightningCheckpointError(TierstateError, ValueError):
    """A Lightning checkpoint that cannot be saved or loaded as asked (the key or path is named)."""


def _serializer(name: str, value: Any, allow_pickle: bool) -> Serializer:
    """How the objects under ``name`` are stored (see ``serializer_for``); refused ones fail the save, named."""
    try:
        return layout.serializer_for(layout.describe(value, layout.layout_of(value)), allow_pickle)
    except ObjectCodecError as exc:
        raise LightningCheckpointError(
            f"Lightning checkpoint key {name!r}, {exc}; set policies.allow_pickle: true in the tierstate config "
            "to store it with pickle"
        ) from None


class _Entry:
    """The provider of one top-level key of the checkpoint dict being saved (nothing when it lacks the key)."""

    def __init__(self, io: _TierstateIO, name: str) -> None:
        self.io, self.name = io, name

    def describe(self) -> list[Item]:
        value = self.io.saving.get(self.name, layout.ABSENT)
        if value is layout.ABSENT:
            return []
        items = layout.describe(value, layout.layout_of(value), self.io.serializers.get(self.name, "msgpack"))
        covered = self.io.covered
        for item in items:  # what only optimizer.step() changes: lazy (the runner checks it is attached)
            if isinstance(item, TensorItem) and storage_of(item.tensor) in covered:
                item.changes = "step"
        return items

    def restore(self, _state: Mapping[str, Any]) -> None:
        raise LightningCheckpointError(f"{self.name}: restore through load_checkpoint()")


class _TierstateIO:
    """What :class:`TierstateCheckpointIO` does, without Lightning's base class (see the module docstring)."""

    def __init__(self, config: str | os.PathLike[str] | Mapping[str, Any] | PipelineConfig | None = None) -> None:
        """``config``: the tierstate pipeline (a YAML path, a packaged config's name, a mapping; None = the
        packaged default), as ``Runner.from_yaml`` / ``Runner.from_dict`` take it."""
        if isinstance(config, PipelineConfig):
            self.config = config
        elif isinstance(config, Mapping):
            self.config = parse_config(config)
        else:
            self.config = load_config(config)
        self.saving: dict[str, Any] = {}  # the dict being saved, while save_checkpoint describes it
        self.serializers: dict[str, Serializer] = {}  # how the objects of each of its keys are stored
        self.covered: frozenset[int] = frozenset()
        self.failures: list[tuple[str, BaseException]] = []  # (path, error) of each save that failed
        self._runner: Runner | None = None
        self._entries: set[str] = set()
        self._next_step = 0
        self._publisher: concurrent.futures.ThreadPoolExecutor | None = None
        self._pending: list[concurrent.futures.Future[None]] = []
        self._seen: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._hook: Any = None
        self._lock = threading.Lock()
        # Saves whose figures are not yet with the saving Trainer's loggers: (handle, that Trainer, global step).
        self._unlogged: list[tuple[CheckpointHandle, weakref.ref[Any], int | None]] = []
        self._watch_optimizers()

    # --- saving ---------------------------------------------------------------------------------
    def save_checkpoint(self, checkpoint: dict[str, Any], path: Any, storage_options: Any | None = None) -> None:
        """Request a tierstate checkpoint of ``checkpoint``; the pointer at ``path`` appears once it is durable."""
        if storage_options is not None:
            raise TypeError(f"TierstateCheckpointIO takes no storage_options, got {storage_options!r}")
        runner = self._ensure_runner()
        for optimizer in list(self._seen):
            runner.attach(optimizer)
        self.covered = _storages(runner.attached)
        for name in checkpoint:
            if name not in self._entries:
                if not isinstance(name, str) or not name or "/" in name:
                    raise LightningCheckpointError(f"checkpoint key {name!r}: a tierstate name is a string without '/'")
                runner.register(**{name: _Entry(self, name)})
                self._entries.add(name)
        allow_pickle = self.config.policies.allow_pickle
        self.serializers = {  # objects msgpack refuses fail the save here, not in the background
            name: _serializer(name, value, allow_pickle) for name, value in checkpoint.items()
        }
        step = self._next_step
        self._next_step += 1
        self.saving = checkpoint
        self._log_finished()
        try:
            handle = runner.checkpoint(step)
        finally:
            self.saving, self.covered = {}, frozenset()
        pointer = {"kind": POINTER_KIND, "step": step, "global_step": checkpoint.get("global_step"), "load": LOAD_HINT}
        self._queue(self._publish, handle, Path(path), pointer)
        trainer = _saving_trainer()
        if trainer is not None:
            self._unlogged.append((handle, weakref.ref(trainer), checkpoint.get("global_step")))

    def _log_finished(self, wait: bool = False) -> None:
        """Each finished save's figures (``tierstate/blocked_s``, ``durable_s``, ``gbps``, ``bytes``,
        ``failures``) to the Lightning loggers of the Trainer that saved it (TensorBoard, CSV, W&B, MLflow),
        from the training thread, at the next save; ``wait``: the last ones too, at teardown."""
        while self._unlogged and (wait or self._unlogged[0][0].done()):
            handle, trainer_ref, global_step = self._unlogged.pop(0)
            handle.wait()
            trainer = trainer_ref()
            for logger in [] if trainer is None else trainer.loggers:
                logger.log_metrics(handle.stats.figures(), step=global_step)
                if wait:
                    logger.save()

    def _publish(self, handle: CheckpointHandle, path: Path, pointer: dict[str, Any]) -> None:
        error = handle.exception()
        if error is not None:
            log.error("Lightning checkpoint %s (tierstate step %d) not written: %s", path, pointer["step"], error)
            self.failures.append((str(path), error))
            return
        result = handle.result()
        write_pointer(path, {**pointer, "tier": result.tier, "directory": str(result.path)})

    def remove_checkpoint(self, path: Any) -> None:
        """Remove the pointer at ``path`` once the saves requested before are published."""
        self._queue(_remove, Path(path))

    def _queue(self, fn: Any, *args: Any) -> None:
        with self._lock:
            if self._publisher is None:
                self._publisher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="tierstate-lightning")
            self._pending = [f for f in self._pending if not f.done()]
            self._pending.append(self._publisher.submit(fn, *args))

    def wait(self) -> None:
        """Block until every save requested so far is durable (or failed) and its pointer written."""
        with self._lock:
            pending = list(self._pending)
        for future in pending:
            future.result()

    def _ensure_runner(self) -> Runner:
        if self._runner is None:
            # Only the global-zero rank saves (Lightning's strategies call this there alone): no collectives.
            self._runner = Runner(self.config, distributed=False)
            held = [step for steps in self._runner.steps().values() for step in steps]
            self._next_step = max(held, default=0) + 1
            self._watch_optimizers()
        return self._runner

    def _watch_optimizers(self) -> None:
        """Note every optimizer that steps from now on (a global step pre-hook): each is attached at the next save."""
        if self._hook is None:
            self._hook = register_optimizer_step_pre_hook(self._saw_optimizer)

    def _saw_optimizer(self, optimizer: torch.optim.Optimizer, _args: Any, _kwargs: Any) -> None:
        self._seen.add(optimizer)

    # --- loading --------------------------------------------------------------------------------
    def load_checkpoint(self, path: Any, map_location: Any | None = None, weights_only: bool | None = None) -> dict:
        """The checkpoint dict the pointer at ``path`` names, read from the fastest tier with a verified copy,
        the config's buckets last (a new machine's tiers are empty: only then are they opened); a file that
        is no pointer is loaded as ``TorchCheckpointIO`` loads it."""
        self.wait()
        if not os.path.isfile(path):
            raise FileNotFoundError(f"Checkpoint file not found: {path}")
        pointer = read_pointer(path)
        if pointer is None:
            from lightning.fabric.plugins import TorchCheckpointIO

            load = TorchCheckpointIO().load_checkpoint
            return load(path, weights_only=weights_only, **({"map_location": map_location} if map_location else {}))
        step = pointer["step"]
        tiers = [FilesystemTier(name, tier.path) for name, tier in self.config.tiers.items()]
        allow_pickle = self.config.policies.allow_pickle
        problems: list[str] = []

        def read(stored: StoredCheckpoint) -> dict[str, Any]:
            return stored.read(allow_pickle=allow_pickle)

        found = read_first_clean(tiers, step, read, problems)
        if found is None and self.config.buckets:  # a new machine: the run's steps are in a bucket only
            buckets = open_buckets(self.config)
            found = read_first_clean(buckets, step, read, problems)
            tiers += buckets
        if found is None:
            where = ", ".join(f"{t.name}={t.location(step)}" for t in tiers)
            held = f"no copy reads clean: {'; '.join(problems)}" if problems else f"which no tier holds ({where})"
            raise LightningCheckpointError(f"{path} names tierstate step {step}, {held}")
        for problem in problems:
            log.warning("lightning load: passed over %s", problem)
        checkpoint = {name: layout.rebuild(values)[0] for name, values in layout.group_by_name(found[1]).items()}
        if map_location is not None:
            checkpoint = _moved(checkpoint, map_location)
        return checkpoint

    # --- lifecycle ------------------------------------------------------------------------------
    def teardown(self) -> None:
        """Drain: every save requested is durable (or failed) and published; the runner is closed.

        The plugin stays usable: a later save (another ``fit``) builds a new runner."""
        try:
            self._log_finished(wait=True)
            self.wait()  # raises what a pointer write met (an OSError), after closing everything
        finally:
            with self._lock:
                if self._publisher is not None:
                    self._publisher.shutdown()
                    self._publisher = None
            if self._hook is not None:
                self._hook.remove()
                self._hook = None
            if self._runner is not None:
                self._runner.close()
                self._runner = None
                self._entries.clear()


def _saving_trainer() -> Any:
    """The Lightning Trainer whose ``save_checkpoint`` is calling (up the stack: ``trainer.save_checkpoint``
    -> its strategy -> this plugin), for its loggers; None when a save comes from elsewhere."""
    from lightning.pytorch import Trainer

    frame = inspect.currentframe()
    try:
        while frame is not None:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer):
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame  # a frame kept alive keeps every local of the stack alive


def _storages(optimizers: tuple[torch.optim.Optimizer, ...]) -> frozenset[int]:
    """The storages of every parameter and state tensor of ``optimizers``: what only their step() changes."""
    found: set[int] = set()
    for optimizer in optimizers:
        for group in optimizer.param_groups:
            found.update(storage_of(p) for p in group["params"])
        for state in optimizer.state.values():
            found.update(storage_of(v) for v in state.values() if isinstance(v, torch.Tensor))
    return frozenset(found)


def _moved(value: Any, device: Any) -> Any:
    """``value`` with every tensor on ``device`` (a device or its name; what map_location means here)."""
    if not isinstance(device, (str, torch.device)):
        raise LightningCheckpointError(f"map_location must be a device or its name here, got {device!r}")
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, dict):
        return {k: _moved(v, device) for k, v in value.items()}
    if isinstance(value, list):
        return [_moved(v, device) for v in value]
    return value


def _remove(path: Path) -> None:
    if path.is_symlink() or path.is_file():
        path.unlink()


_CLASS: type | None = None


def load_from_checkpoint(
    module_class: Any,
    path: str | os.PathLike[str],
    config: str | os.PathLike[str] | Mapping[str, Any] | PipelineConfig | None = None,
    **kwargs: Any,
) -> Any:
    """``module_class.load_from_checkpoint(path, **kwargs)`` for a ``path`` that may be tierstate's pointer.

    Lightning's classmethod reads the file with ``torch.load``, which a pointer refuses (saying to come
    here). A pointer is read here through ``config``'s tiers (the same config
    the saving plugin had) and handed to Lightning as the checkpoint dict it expects; any other file goes
    to Lightning as it is."""
    if read_pointer(path) is None:
        return module_class.load_from_checkpoint(path, **kwargs)
    io = _checkpoint_io_class()(config)
    try:
        checkpoint = io.load_checkpoint(path, map_location=kwargs.get("map_location"))
    finally:
        io.teardown()
    buffer = io_module.BytesIO()
    torch.save(checkpoint, buffer)
    buffer.seek(0)
    return module_class.load_from_checkpoint(buffer, **{"weights_only": False, **kwargs})


def _checkpoint_io_class() -> type:
    """``TierstateCheckpointIO``, made on first use: a Lightning ``CheckpointIO`` (imported only now)."""
    global _CLASS
    if _CLASS is None:
        with needs_extra("lightning", "TierstateCheckpointIO", ("lightning",)):
            from lightning.fabric.plugins import CheckpointIO

        class TierstateCheckpointIO(_TierstateIO, CheckpointIO):
            """Lightning's ``CheckpointIO`` through tierstate: ``Trainer(plugins=[TierstateCheckpointIO(config)])``."""

        _CLASS = TierstateCheckpointIO
    return _CLASS


def __getattr__(name: str) -> Any:
    if name == "TierstateCheckpointIO":
        return _checkpoint_io_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


if TYPE_CHECKING:

    class TierstateCheckpointIO(_TierstateIO, CheckpointIO):
        """Lightning's CheckpointIO through tierstate (see the module docstring)."""
