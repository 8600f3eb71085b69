"""``TierstateCallback``: the Hugging Face ``Trainer`` checkpointed and resumed through tierstate.

Imported through :mod:`tierstate.integrations.hf`, which loads this module (and transformers) on first use.

**Saving.** After every ``every``-th optimizer step (and the last one) the callback requests a
checkpoint of the model, the optimizer inside accelerate's wrapper (attached, so parameters and
moments are copied while the next step runs), the LR scheduler, the GradScaler when there is one,
the RNGs (python, numpy, torch, CUDA) and the Trainer's own state, the JSON ``trainer_state.json``
holds: global step, epoch, log history, stateful callbacks. The step's work must be over first: its
log entry, its evaluation (which draws from the RNGs). So a step's checkpoint is taken at the next
event that comes after all of that and before anything of the next step: ``on_step_begin`` of the
next step (its batches are fetched by then; nothing checkpointed changed), ``on_epoch_begin`` of the
next epoch (before its data loader draws a seed), or ``on_epoch_end`` when training stops. The data
position needs nothing else: the Trainer derives it from the global step, as on its own resume.

**Resuming.** A callback cannot make the Trainer skip the batches already consumed: where an epoch
starts, how many batches ``skip_first_batches`` drops, when the RNGs are put back and from which
step loss logging counts are decided inside ``train()`` from its ``resume_from_checkpoint``
argument, before any callback event, in local variables no callback reaches. So the callback
finds its ``Trainer`` when it is built (``on_init_end`` runs inside ``Trainer.__init__``) and
wraps that one instance's ``train``: a plain ``trainer.train()``, when the tiers hold a checkpoint,
becomes ``train(resume_from_checkpoint=DIR)``, HF's own resume path, with ``DIR`` a temporary
directory holding the checkpoint's ``trainer_state.json``. Each place where that path loads a file
is redirected, for that directory only, to tierstate: the model, optimizer, scheduler and scaler are
restored in place where it loads the optimizer (the first moment all of them exist), the RNGs where
it loads ``rng_state.pth``. Everything else (which epoch, which batches, the log counters,
``TrainerState`` and callback states) is the Trainer's own code. Those loaders are private methods of
``Trainer`` (``_load_from_checkpoint``, ``_load_optimizer_and_scheduler``, ``_load_scaler``,
``_load_rng_state``, stable since transformers 4.x); if a release renames one, the Trainer would look
for its files in the temporary directory and fail loudly, never resume silently wrong.

``trainer.train(resume_from_checkpoint=PATH)`` still resumes from an HF directory, and
``resume_from_checkpoint=False`` starts afresh: an earlier run's checkpoints on the tiers are set
aside first (``Runner.start_fresh``), so that a later plain ``train()`` resumes this run, not that one.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
import json
import logging
import os
import tempfile
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Literal

from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments, trainer_callback
from typing_extensions import override

from tierstate import CheckpointHandle, ObjectProvider, PipelineConfig, RNGProvider, Runner, TierstateError

from ..tiers.reading.stored import StoredCheckpoint, read_first_clean

TRAINER_STATE_NAME = "trainer_state.json"  # the file HF's resume path reads the TrainerState from
TRAINER_STATE_KEY = "trainer/value"  # the checkpoint item holding that file's text

Config = str | os.PathLike[str] | Mapping[str, Any] | PipelineConfig | None
FreshStart = Literal["set_aside", "refuse"]
log = logging.getLogger("tierstate")

# Callbacks whose state the Trainer checkpoints (EarlyStoppingCallback, TrainerControl); older transformers have none.
STATEFUL_CALLBACK: type | tuple[()] = getattr(trainer_callback, "ExportableState", ())


class TrainerIntegrationError(TierstateError, RuntimeError):
    """The callback cannot do its work with this Trainer (added after it was built, DeepSpeed, a foreign checkpoint)."""


class _RNGWhenAsked:
    """The RNG provider, whose restore keeps the values until the Trainer asks for them (:meth:`apply`):
    HF puts the RNGs back after fetching the first batches of the resumed epoch, not when it loads the model."""

    def __init__(self) -> None:
        self.rng = RNGProvider()
        self.state: dict[str, Any] | None = None

    def describe(self) -> list[Any]:
        return self.rng.describe()

    def restore(self, state: Mapping[str, Any]) -> None:
        self.state = dict(state)

    def apply(self) -> None:
        if self.state is not None:
            self.rng.restore(self.state)
            self.state = None


class TierstateCallback(TrainerCallback):
    """Checkpoints ``Trainer`` training through tierstate every ``every`` steps and resumes from the newest.

    ``config``: the pipeline config (a YAML path, a packaged config's name, a mapping, a
    :class:`PipelineConfig`; None = the packaged default, tiers under ``./checkpoints``). Pass the
    callback to ``Trainer(callbacks=[...])``: it must see the Trainer being built to resume it.
    ``handle`` is the newest checkpoint's :class:`CheckpointHandle` (None before the first).
    ``on_fresh_start``: what ``train(resume_from_checkpoint=False)`` does with an earlier run's
    checkpoints on the tiers: ``"set_aside"`` (renamed aside, kept, never resumed) or ``"refuse"``
    (an ExistingCheckpointsError before the first step).
    """

    def __init__(self, config: Config = None, every: int = 500, on_fresh_start: FreshStart = "set_aside") -> None:
        if isinstance(every, bool) or not isinstance(every, int) or every < 1:
            raise ValueError(f"TierstateCallback(every=...): a whole number of steps of at least 1, got {every!r}")
        if on_fresh_start not in ("set_aside", "refuse"):
            raise ValueError(f"TierstateCallback(on_fresh_start=...): 'set_aside' or 'refuse', got {on_fresh_start!r}")
        self.on_fresh_start = on_fresh_start
        self.config = config
        self.every = every
        self.runner: Runner | None = None
        self.handle: CheckpointHandle | None = None
        self._trainer: Trainer | None = None
        self._rng = _RNGWhenAsked()
        self._registered = False
        self._pending: int | None = None  # a step whose checkpoint waits for the step's work to be over
        self._unlogged: list[CheckpointHandle] = []  # requested, their figures not yet in the Trainer's log

    # --- binding to the Trainer ---------------------------------------------------------------
    @override
    def on_init_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        trainer = _trainer_building(self)
        if trainer is None:
            raise TrainerIntegrationError(
                "TierstateCallback: on_init_end did not come from a transformers Trainer being built"
            )
        if getattr(trainer, "is_deepspeed_enabled", False):
            raise TrainerIntegrationError(
                "TierstateCallback: DeepSpeed keeps model and optimizer in its own engine and checkpoint format; "
                "use the Trainer's own checkpoints (save_strategy) with DeepSpeed"
            )
        self._trainer = trainer
        trainer.train = functools.wraps(trainer.train)(functools.partial(self._train, trainer, trainer.train))

    def _train(
        self,
        trainer: Trainer,
        train: Callable[..., Any],
        resume_from_checkpoint: str | bool | None = None,
        *args: Any,
        **kwargs: Any,
    ) -> Any:
        """``Trainer.train`` of the bound Trainer: a plain call resumes from the tiers' newest checkpoint."""
        runner = self.runner = _runner(self.config)
        self._registered, self._pending, self._unlogged = False, None, []
        try:
            newest = None
            trial = args[0] if args else kwargs.get("trial")
            if resume_from_checkpoint is None and trial is None:  # a search's trials start afresh, as in HF
                newest = _newest_trainer_state(runner)
            if resume_from_checkpoint is False and trial is None:
                self._start_fresh(runner)
            if newest is None:
                return train(resume_from_checkpoint or None, *args, **kwargs)
            step, text, where = newest
            # HF's own default is to start afresh: a resume the user did not ask for is said at the default level.
            log.warning("TierstateCallback: resuming from step %d (%s); trainer.train(resume_from_checkpoint=False) "
                        "starts afresh instead", step, where)  # fmt: skip
            with tempfile.TemporaryDirectory(prefix="tierstate-resume-") as marker:
                Path(marker, TRAINER_STATE_NAME).write_text(text)
                with self._loading_from(trainer, runner, marker, step):
                    return train(marker, *args, **kwargs)
        finally:
            runner.close()  # every checkpoint requested is durable (or reported failed) when train() returns

    def _start_fresh(self, runner: Runner) -> None:
        """``train(resume_from_checkpoint=False)``: the new run, not an older one on the tiers, is what a
        later plain ``train()`` resumes; the old run's checkpoints are set aside (kept, never listed),
        or with ``on_fresh_start="refuse"`` the run stops before its first step, saying why."""
        held = runner.start_fresh(set_aside=self.on_fresh_start == "set_aside")
        if held:
            listed = "; ".join(f"{name}: steps {steps}" for name, steps in sorted(held.items()))
            log.warning("TierstateCallback: a fresh start: set aside the earlier run's checkpoints (%s), kept "
                        "under set-aside-<time> in each tier", listed)  # fmt: skip

    @contextmanager
    def _loading_from(self, trainer: Trainer, runner: Runner, marker: str, step: int) -> Iterator[None]:
        """While HF resumes from ``marker``, its loaders read tierstate's checkpoint ``step`` instead."""

        def restore_all() -> None:  # the optimizer and scheduler exist from here on
            self._register(trainer, runner)
            runner.restore(step)

        ours: dict[str, Callable[[], None]] = {
            "_load_from_checkpoint": lambda: None,  # weights are restored with the optimizer, before any forward
            "_load_optimizer_and_scheduler": restore_all,
            "_load_scaler": lambda: None,  # restored with the optimizer
            "_load_rng_state": self._rng.apply,
        }
        for name, load in ours.items():
            original = getattr(trainer, name)

            def redirected(
                checkpoint: str | None,
                *args: Any,
                _load: Callable[[], None] = load,
                _original: Callable[..., None] = original,
                **kwargs: Any,
            ) -> None:
                if checkpoint == marker:
                    _load()
                else:
                    _original(checkpoint, *args, **kwargs)

            setattr(trainer, name, redirected)
        try:
            yield
        finally:
            for name in ours:
                delattr(trainer, name)  # the class's methods again

    def _register(self, trainer: Trainer, runner: Runner) -> None:
        """What a checkpoint holds, once per ``train()``: the optimizer exists from HF's optimizer loading on."""
        if self._registered:
            return
        state: dict[str, Any] = {"model": trainer.model, "optim": trainer.optimizer}
        if trainer.lr_scheduler is not None:
            state["sched"] = trainer.lr_scheduler
        scaler = getattr(trainer.accelerator, "scaler", None)
        if scaler is not None:
            state["scaler"] = scaler
        runner.register(**state, rng=self._rng, trainer=ObjectProvider(functools.partial(_state_json, trainer)))
        self._registered = True

    # --- saving -------------------------------------------------------------------------------
    @override
    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if self._trainer is None or self.runner is None:
            raise TrainerIntegrationError(
                "TierstateCallback must be given to Trainer(callbacks=[...]): added later "
                "(trainer.add_callback), it cannot resume the Trainer"
            )
        self._register(self._trainer, self.runner)

    @override
    def on_step_end(self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any) -> None:
        if state.global_step % self.every == 0 or control.should_training_stop:
            self._pending = state.global_step

    @override
    def on_step_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._checkpoint_pending()

    @override
    def on_epoch_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._checkpoint_pending()

    @override
    def on_epoch_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        if control.should_training_stop:
            self._checkpoint_pending()

    @override
    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._checkpoint_pending()
        self._log_finished(wait=True)

    def _checkpoint_pending(self) -> None:
        self._log_finished()
        if self._pending is None or self.runner is None:
            return
        step, self._pending = self._pending, None
        self.handle = self.runner.checkpoint(step)  # returns at once; failures are on the handle and in the log
        self._unlogged.append(self.handle)

    def _log_finished(self, wait: bool = False) -> None:
        """Each finished checkpoint's figures (``tierstate/blocked_s``, ``durable_s``, ``gbps``, ``bytes``,
        ``failures``) through ``Trainer.log``: into ``state.log_history`` and every reporting integration
        (TensorBoard, W&B, MLflow), on the training thread, as the Trainer logs its own. ``wait``: at the
        end of training, for the last ones to finish first."""
        trainer = self._trainer
        while self._unlogged and (wait or self._unlogged[0].done()):
            handle = self._unlogged.pop(0)
            handle.wait()
            if trainer is not None:
                trainer.log(handle.stats.figures())


def _runner(config: Config) -> Runner:
    if isinstance(config, PipelineConfig):
        return Runner(config)
    if isinstance(config, Mapping):
        return Runner.from_dict(config)
    return Runner.from_yaml(config)


def _trainer_building(callback: TierstateCallback) -> Trainer | None:
    """The Trainer whose ``__init__`` is calling ``callback.on_init_end``: up the stack, the first
    ``self`` that is a Trainer holding this callback (Trainer subclasses' ``__init__`` included)."""
    frame = inspect.currentframe()
    try:
        while frame is not None:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, Trainer) and any(cb is callback for cb in candidate.callback_handler.callbacks):
                return candidate
            frame = frame.f_back
        return None
    finally:
        del frame  # a frame kept alive keeps every local of the stack alive


def _state_json(trainer: Trainer) -> str:
    """``trainer_state.json`` as HF's own checkpoint would hold it now (``TrainerState.save_to_json``),
    with the current state of every stateful callback and of ``TrainerControl``; the live state is not changed."""
    if trainer.hp_search_backend is None:
        trainer.store_flos()  # as HF's checkpoint does: the FLOPs counted so far into state.total_flos
    document = dataclasses.asdict(trainer.state)
    states: dict[str, list[Any]] = {}
    for callback in [*trainer.callback_handler.callbacks, trainer.control]:
        if isinstance(callback, STATEFUL_CALLBACK):
            states.setdefault(type(callback).__name__, []).append(callback.state())
    document["stateful_callbacks"] = {name: each[0] if len(each) == 1 else each for name, each in states.items()}
    return json.dumps(document, indent=2, sort_keys=True) + "\n"


def _newest_trainer_state(runner: Runner) -> tuple[int, str, str] | None:
    """The newest step on the runner's tiers whose Trainer state reads clean, that state's JSON text, and
    where it was read (tier and directory)."""
    tiers = [*runner.tiers, *runner.buckets]  # a bucket's copy too: a new machine's tiers are empty
    listed = {tier.name: tier.steps() for tier in tiers}
    steps = sorted({step for held in listed.values() for step in held}, reverse=True)
    problems: list[str] = []

    def read(stored: StoredCheckpoint) -> tuple[str, str]:
        return _trainer_state_text(stored), stored.where

    for step in steps:  # a damaged copy: the next tier's, or an older step
        found = read_first_clean(tiers, step, read, problems, listed)
        if found is not None:
            tier, (text, where) = found
            return step, text, f"tier {tier.name}, {where}"
    if problems:
        raise TrainerIntegrationError("no checkpoint on the tiers reads clean: " + "; ".join(problems))
    return None


def _trainer_state_text(checkpoint: StoredCheckpoint) -> str:
    """The Trainer state's JSON text that ``checkpoint`` holds; a checkpoint without one was not written by
    the callback, which is an error, not a damaged copy to pass over."""
    if TRAINER_STATE_KEY not in checkpoint.keys:
        raise TrainerIntegrationError(
            f"{checkpoint.where}: no Trainer state ({TRAINER_STATE_KEY}): not written by "
            "TierstateCallback; point it at tiers of its own, or resume with resume_from_checkpoint"
        )
    return checkpoint.read([TRAINER_STATE_KEY])[TRAINER_STATE_KEY]
