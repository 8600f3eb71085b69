"""Torch optimizers, whose ``load_state_dict`` needs one extra step to own its memory."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import torch

from .base import ReadState, RestoreError, fresh_keys
from .dtensor import is_dtensor, layout_target, like_live, storage_of
from .items import Item, Serializer, TensorBatch, TensorItem
from .optimizer_batch import StateLister
from .optimizer_check import check_optimizer_state
from .stateful import SKELETON_KEY, StatefulProvider

if TYPE_CHECKING:
    from torch.distributed.tensor import DTensor

STEP = "step"
"""The state name torch keeps as it is given (a plain scalar tensor), whatever the parameter's layout."""


class OptimizerProvider(StatefulProvider):
    """A torch optimizer: ``state/<param index>/<name>`` tensors (``step`` included), param groups in the skeleton.

    ``Optimizer.load_state_dict`` keeps the given tensors whenever no dtype/device cast is needed
    (always for ``step``), so the optimizer would share memory with buffers the pipeline may reuse.
    After loading, every optimizer tensor that aliases an input is replaced by its own copy, unless the
    input is fresh (see :class:`~providers.base.ReadState`: just read, referenced by nothing else).

    State of a DTensor parameter (FSDP2, tensor parallel) shaped like it (``exp_avg``, ``exp_avg_sq``,
    ``momentum_buffer``) is a DTensor laid out like it, each rank holding its part; ``step`` stays a
    plain tensor. A fresh optimizer holds no state before its first step, so :meth:`restore_targets`
    tells a restore on many ranks which part of each such tensor this rank will hold, and
    :meth:`restore` hands ``load_state_dict`` DTensors: plain tensors would make ``step()`` fail
    (``got mixed torch.Tensor and DTensor``) and hold the whole state on every rank.
    """

    def __init__(
        self, optimizer: torch.optim.Optimizer, serializer: Serializer = "msgpack", replicated: bool = False
    ) -> None:
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"OptimizerProvider needs a torch.optim.Optimizer, got {type(optimizer).__name__}")
        super().__init__(optimizer, serializer, replicated)
        self.optimizer = optimizer
        self._live: dict[tuple[int, str], torch.Tensor] = {}
        self._targeted: frozenset[str] = frozenset()  # keys for which the restore reads only this rank's part
        self._lister = StateLister()

    def describe(self) -> list[Item]:
        """Its tensors change only in ``optimizer.step()``: lazy once this optimizer is attached."""
        items = super().describe()
        for item in items:
            if isinstance(item, TensorItem):
                item.changes = "step"
        return items

    def tensor_batch(self) -> TensorBatch | None:
        """What :meth:`describe` gives, listed for plan reuse without ``state_dict()`` (see optimizer_batch.py)."""
        return self._lister.batch(self.optimizer, self.serializer, self.replicated)

    def regrouped(self, previous: TensorBatch) -> TensorBatch | None:
        """``previous`` (the latest :meth:`tensor_batch` or :meth:`relisted`) with the parameter groups as they
        are now, or None if the state may have other tensors since: for a runner whose optimizer step waits
        for its capture, which then lists the state in the background (see optimizer_batch.py)."""
        return self._lister.regrouped(self.optimizer, previous, self.serializer, self.replicated)

    def relisted(self) -> TensorBatch | None:
        """The state's tensors as :meth:`tensor_batch` lists them, without the parameter groups."""
        return self._lister.relisted(self.optimizer)

    def restated(self, key: str, value: Any) -> Any:
        """An item of ``others`` snapshotted at a request, brought up to date with the latest listing: the
        skeleton gets that listing's state part; the other items (group tensors) depend on no listing."""
        return self._lister.restated(value) if key == SKELETON_KEY else value

    def optimizer_to_attach(self) -> torch.optim.Optimizer:
        """The optimizer ``register()`` attaches (its step waits for a pending capture)."""
        return self.optimizer

    def restore_targets(self, global_shapes: Mapping[str, tuple[int, ...]]) -> dict[str, TensorItem]:
        """Layouts for saved state the live optimizer does not hold yet, keyed like :meth:`describe`.

        ``global_shapes`` gives the global shape of each saved tensor the live state does not
        describe. Those of a DTensor parameter's state shaped like the parameter get its layout;
        the next :meth:`restore` then expects this rank's part of them, and the whole of the others.
        """
        targets = {}
        params = self._params()
        for key, shape in global_shapes.items():
            param = _sharded_param(key, params)
            if param is not None and tuple(param.shape) == tuple(shape):
                targets[key] = layout_target(key, param)
        self._targeted = frozenset(targets)
        return targets

    def check(self, state: Mapping[str, Any]) -> None:
        """Parameter groups and state shapes against the live optimizer, before anything is restored."""
        check_optimizer_state(self._owner, self.optimizer, state)

    def restore(self, state: Mapping[str, Any]) -> None:
        # The optimizer's tensors before loading: where one matches a loaded value, the value is copied
        # into it instead of cloned, so a restore into a live optimizer (a rollback) allocates nothing
        # new; fresh memory must be faulted in, which is slower than the copy (~1.4 vs ~5 GB/s here).
        self._live = {
            (id(param), name): value
            for param, param_state in self.optimizer.state.items()
            for name, value in param_state.items()
            if isinstance(value, torch.Tensor)
        }
        try:
            super().restore(self._laid_out(state))
        finally:
            self._live, self._targeted = {}, frozenset()

    def _laid_out(self, state: Mapping[str, Any]) -> ReadState:
        """``state`` with the values of DTensor parameters' state wrapped as DTensors (their local memory kept).

        A value is this rank's part where the reader was told so: by the live state's item (a DTensor,
        described) or by :meth:`restore_targets`. Any other value was read whole; one shaped like its
        DTensor parameter is that parameter's state, which is this rank's part only where one rank
        holds all of it (one process restoring).
        """
        values = dict(state)
        params = self._params()
        for key, value in state.items():
            param = _sharded_param(key, params)
            if param is None or not isinstance(value, torch.Tensor) or is_dtensor(value):
                continue
            live = self._live.get((id(param), key.rsplit("/", 1)[1]))
            if is_dtensor(live):
                values[key] = _as_part_of(key, live, value)
            elif key in self._targeted or tuple(value.shape) == tuple(param.shape):
                values[key] = _as_part_of(key, param, value)
        return ReadState(values, fresh_keys(state))

    def _loadable(self, state_dict: Any) -> Any:
        """Each saved group's ``params`` as :class:`ParamIds` (the same ids, in order)."""
        groups = state_dict.get("param_groups") if isinstance(state_dict, dict) else None
        if isinstance(groups, list):
            for group in groups:
                if isinstance(group, dict) and type(group.get("params")) is list:
                    group["params"] = ParamIds(group["params"])
        return state_dict

    def _params(self) -> list[torch.Tensor]:
        """The parameters in the order of their indices in ``state_dict()``."""
        return [param for group in self.optimizer.param_groups for param in group["params"]]

    def _after_load(self, state: Mapping[str, Any]) -> None:
        inputs = {storage_of(v) for v in state.values() if isinstance(v, torch.Tensor)}
        fresh = {id(state[key]) for key in fresh_keys(state)}  # state holds them, so their ids stay theirs
        live = self._live
        for param, param_state in self.optimizer.state.items():
            for name, value in list(param_state.items()):
                if id(value) in fresh:
                    continue  # the restore's own fresh memory: the optimizer may simply keep it
                if isinstance(value, torch.Tensor) and storage_of(value) in inputs:
                    old = live.get((id(param), name))
                    if (
                        old is not None
                        and (type(old), old.shape, old.dtype, old.device)
                        == (type(value), value.shape, value.dtype, value.device)
                        and storage_of(old) not in inputs
                    ):
                        param_state[name] = old.copy_(value)
                    else:
                        param_state[name] = value.clone()


class ParamIds(list[Any]):
    """A saved parameter group's ids as ``Optimizer.load_state_dict`` receives them, answering ``in`` from a set.

    torch asks ``param_id in group["params"]`` of the saved groups once per state tensor it loads
    (``_process_value_according_to_param_policy``): a list scan, quadratic in the parameter count
    (Adam over 25,000 parameters: 75,000 scans of up to 25,000 ids, most of a ~28 s restore). The ids,
    their order, and what torch copies and compares are unchanged; the groups the optimizer keeps
    take the live ``params`` lists, not these.
    """

    def __contains__(self, value: object) -> bool:
        try:
            members = self.__dict__.get("_members")
            if members is None or self.__dict__.get("_count") != len(self):
                members = self.__dict__["_members"] = frozenset(self)
                self.__dict__["_count"] = len(self)
            return value in members
        except TypeError:  # something unhashable: only a scan can compare it
            return list.__contains__(self, value)


def _sharded_param(key: str, params: list[torch.Tensor]) -> DTensor | None:
    """The DTensor parameter whose state ``key`` (``state/<param index>/<name>``) is, unless it is ``step``."""
    parts = key.split("/")
    if len(parts) != 3 or parts[0] != "state" or not parts[1].isdigit() or parts[2] == STEP:
        return None
    index = int(parts[1])
    param = params[index] if index < len(params) else None
    return param if is_dtensor(param) else None


def _as_part_of(key: str, like: DTensor, value: torch.Tensor) -> torch.Tensor:
    """``value`` as this rank's part of a DTensor laid out like ``like``; refused if it is not that part's shape
    (the whole tensor read by a process that holds only a part of it), since it would claim the wrong elements."""
    part = like.to_local().shape
    if value.shape != part:
        raise RestoreError(
            f"optimizer state {key!r}: this rank holds a part of shape {list(part)} of a DTensor of global shape "
            f"{list(like.shape)}, the value read back has shape {list(value.shape)}"
        )
    return like_live(like, value)
