"""Which tensors a checkpoint may copy lazily, and a snapshot of all the others before it returns.

Lazy capture is safe only for a tensor that nothing changes before its copy is done. The runner
can promise that for exactly one writer: ``optimizer.step()`` of an attached optimizer, whose step
pre-hook waits for the pending capture. So an item is copied lazily when it declares (``changes``):
``"step"`` and an attached optimizer holds its storage (as a parameter or as optimizer state);
``"never"`` (a frozen parameter, a provider's own fresh copy); or ``"guarded"`` (the user calls
``runner.wait_captured()`` before changing it). Everything else, buffers updated in forward above
all, is snapshotted on the trainer's thread before ``checkpoint()`` returns: a clone on the same
device (on a GPU it is queued on the trainer's stream, ahead of the next forward's kernels).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import torch
import xxhash
from torch.utils.hooks import RemovableHandle

from tierstate.errors import TierstateError

from ..providers.dtensor import storage_of
from ..providers.items import TensorItem

log = logging.getLogger("tierstate")


class AttachError(TierstateError, TypeError):
    """``attach()`` was given something that is not a torch optimizer nor a wrapper of one."""


def inner_optimizer(obj: object) -> torch.optim.Optimizer | None:
    """The torch optimizer ``obj`` is or wraps, None if neither: accelerate's ``AcceleratedOptimizer``
    keeps it as ``.optimizer``, Lightning's ``LightningOptimizer`` as ``._optimizer``. Both wrappers
    pass an isinstance check for ``torch.optim.Optimizer`` without having its hooks, so the inner
    optimizer is looked for first."""
    current = obj
    for _ in range(8):  # wrappers of wrappers, bounded
        inner = getattr(current, "optimizer", None) or getattr(current, "_optimizer", None)
        if not isinstance(inner, torch.optim.Optimizer) or inner is current:
            break
        current = inner
    return current if isinstance(current, torch.optim.Optimizer) else None


def unwrap_optimizer(optimizer: object) -> torch.optim.Optimizer:
    """The torch optimizer to attach; TypeError saying what was given instead, and what to do with it."""
    inner = inner_optimizer(optimizer)
    if inner is None:
        given = type(optimizer).__name__
        hint = "; register the model with register(model=...)" if isinstance(optimizer, torch.nn.Module) else ""
        raise AttachError(
            f"attach() expects a torch.optim.Optimizer (or a wrapper of one, such as accelerate's), got {given}{hint}"
        )
    return inner


@dataclass(frozen=True)
class EagerSnapshot:
    """What snapshotting cost on the trainer's thread, for the handle and the log."""

    tensors: int
    nbytes: int
    uncovered: tuple[str, ...]  # "step" items that no attached optimizer covers


class CaptureRules:
    """The attached optimizers and, from them, which items may be captured lazily."""

    def __init__(self) -> None:
        self._optimizers: list[torch.optim.Optimizer] = []
        self._signature: tuple[tuple[int, int, int, int], ...] = ()
        self._held: Sequence[object] = ()  # the state mappings whose ids are in the signature
        self._covered: frozenset[int] = frozenset()
        self._warned = False
        self._hooks: list[RemovableHandle] = []

    @property
    def optimizers(self) -> tuple[torch.optim.Optimizer, ...]:
        return tuple(self._optimizers)

    def attach(self, optimizer: torch.optim.Optimizer, before_step: Callable, before_load: Callable) -> None:
        """Remember ``optimizer`` and hook ``before_step`` and ``before_load`` on it, unless it was attached already."""
        if any(o is optimizer for o in self._optimizers):
            return
        self._optimizers.append(optimizer)
        self._hooks.append(optimizer.register_step_pre_hook(before_step))
        self._hooks.append(optimizer.register_load_state_dict_pre_hook(before_load))

    def detach_all(self) -> None:
        """Take every hook off the attached optimizers: a closed runner's would hold it (its host memory, its
        slots' mappings) alive as long as the optimizer, and run at every step of a later runner's training."""
        for handle in self._hooks:
            handle.remove()
        self._hooks.clear()
        self._optimizers.clear()
        self._held, self._signature, self._covered = (), (), frozenset()

    def covered(self, refresh: bool = False) -> frozenset[int]:
        """Storages of every parameter and state tensor of the attached optimizers.

        Computed afresh with ``refresh`` (whenever a plan is made: the cost is then per tensor anyway), else
        only when an optimizer gains parameters or state or gets a new state mapping (``load_state_dict``
        replaces it, and the tensors in it), so a reused plan of 10^5 tensors pays nothing here. The state
        mappings are held, so that their ids in the signature cannot be reused by others.
        """
        held = [o.state for o in self._optimizers]
        signature = tuple(
            (id(o), id(state), len(state), sum(len(group["params"]) for group in o.param_groups))
            for o, state in zip(self._optimizers, held, strict=True)
        )
        if refresh or signature != self._signature:
            storages: set[int] = set()
            for optimizer in self._optimizers:
                for group in optimizer.param_groups:
                    storages.update(storage_of(p) for p in group["params"])
                for state in optimizer.state.values():
                    storages.update(storage_of(v) for v in state.values() if isinstance(v, torch.Tensor))
            self._signature, self._held, self._covered = signature, held, frozenset(storages)
        return self._covered

    def lazy(self, item: TensorItem, covered: frozenset[int]) -> bool:
        if item.changes in ("never", "guarded"):
            return True
        return item.changes == "step" and storage_of(item.tensor) in covered

    def eager(self, tensors: Iterable[TensorItem], covered: frozenset[int] | None = None) -> list[TensorItem]:
        """The items that may not be captured lazily, which must be copied before ``checkpoint()`` returns.

        ``covered``: the attached optimizers' storages as just computed (default: computed afresh now; a
        stale set could hold the address of a freed state tensor that another tensor now occupies).
        Warns once about "step" items no attached optimizer covers (they are among them)."""
        covered = self.covered(refresh=True) if covered is None else covered
        eager = [item for item in tensors if not self.lazy(item, covered)]
        uncovered = [item.key for item in eager if item.changes == "step"]
        if uncovered and not self._warned:
            self._warned = True
            log.warning(
                "%d tensors that only optimizer.step() changes (e.g. %s) are not covered by an attached "
                "optimizer, so they are copied before checkpoint() returns; register the optimizer "
                "(OptimizerProvider) or call runner.attach(optimizer) to capture them while training goes on",
                len(uncovered), uncovered[0],
            )
        return eager

    def snapshot_eager(
        self, tensors: Iterable[TensorItem], covered: frozenset[int] | None = None
    ) -> tuple[EagerSnapshot, list[TensorItem]]:
        """Replace each item's tensor that may not be captured lazily by its own copy, now.

        Returns what it cost and the items now holding copies, which the checkpoint gives back with
        :func:`release_copies` when it ends (a failed checkpoint's error may keep its plan alive).
        """
        copied = self.eager(tensors, covered)
        for item in copied:
            item.tensor = _copy(item.tensor)
        uncovered = tuple(item.key for item in copied if item.changes == "step")
        return EagerSnapshot(len(copied), sum(item.nbytes for item in copied), uncovered), copied


#: ``changes`` that make an item lazy on the user's word alone: no pre-hook guards them, so the tripwire does.
DECLARED_LAZY = ("never", "guarded")


class VersionWatch:
    """The always-on tripwire: each lazily captured tensor declared ``never`` or ``guarded`` has its
    version counter (``Tensor._version``, bumped by every in-place op through autograd's view of it)
    recorded at the request; if one moved by the time capture is done, the copy may hold later bytes,
    and the checkpoint fails naming the keys.

    What it cannot see: writes that bypass autograd's counter (``tensor.data.mul_()``, a numpy view,
    a DLPack consumer) — which is why nothing undeclared is lazy: a frozen parameter is copied before
    ``checkpoint()`` returns unless declared ``never``. Tensors guarded by an attached optimizer's
    pre-hook (``step``) are not read here: reading 10^5 counters would cost the trainer ~6 ms at
    every request (``policies.check_capture`` hashes them all, as a debugging aid).
    """

    def __init__(self, items: Iterable[TensorItem]) -> None:
        self._watched = [(item.key, item.tensor, item.tensor._version) for item in items]  # noqa: SLF001

    @staticmethod
    def declared(items: Iterable[TensorItem]) -> list[TensorItem]:
        return [item for item in items if item.changes in DECLARED_LAZY]

    def moved(self) -> list[str]:
        return sorted(key for key, tensor, version in self._watched if tensor._version != version)  # noqa: SLF001


def release_copies(items: Iterable[TensorItem]) -> None:
    """Free the copies :meth:`CaptureRules.snapshot_eager` made, once their checkpoint has ended."""
    for item in items:
        item.tensor = item.tensor.new_empty(0)


def _copy(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous copy on the same device; by bytes for dtypes torch cannot copy elementwise (int1..7, bits)."""
    source = tensor.detach()
    if source.is_contiguous() and source.element_size() and source.dtype.itemsize == source.element_size():
        copy = torch.empty_like(source, memory_format=torch.contiguous_format)
        copy.reshape(-1).view(torch.uint8).copy_(source.reshape(-1).view(torch.uint8))
        return copy
    return source.clone(memory_format=torch.contiguous_format)


def fingerprints(items: Iterable[TensorItem]) -> dict[str, int]:
    """A hash of each item's current bytes (the capture check compares them before and after the copy)."""
    return {item.key: _fingerprint(item.tensor) for item in items}


def changed_keys(before: dict[str, int], items: Iterable[TensorItem]) -> list[str]:
    return sorted(item.key for item in items if item.key in before and _fingerprint(item.tensor) != before[item.key])


def _fingerprint(tensor: torch.Tensor) -> int:
    flat = tensor.detach().to("cpu").contiguous().reshape(-1)
    return xxhash.xxh3_64_intdigest(flat.view(torch.uint8).numpy().data if flat.numel() else b"")
