"""Whether a checkpoint's optimizer state fits the live optimizer: ``OptimizerProvider.check``.

``Optimizer.load_state_dict`` refuses other parameter groups, but only when it runs, which in a
restore of several providers is after the model was already overwritten; and it takes state
tensors of any shape, which fail only at the next ``step()``. Both are caught here, first.
"""

from __future__ import annotations

from collections.abc import Mapping
from itertools import chain
from typing import Any

import torch

from .base import RestoreError, require_keys
from .fit import misfits, require_fit
from .stateful import SKELETON_KEY
from .tree import join_tensors


def check_optimizer_state(owner: str, optimizer: torch.optim.Optimizer, state: Mapping[str, Any]) -> None:
    """Raise :class:`RestoreError` unless ``state`` has the live optimizer's parameter groups (count and sizes)
    and each state tensor the live optimizer already holds comes back in its shape; nothing is changed."""
    require_keys(owner, state, {SKELETON_KEY})
    saved = join_tensors(state[SKELETON_KEY], state, owner=owner)
    try:
        groups = [group["params"] for group in saved["param_groups"]]
        per_param = dict(saved["state"])
        sizes = [len(params) for params in groups]
    except (KeyError, TypeError, ValueError) as exc:
        raise RestoreError(f"{owner}: the checkpoint holds no optimizer state_dict ({exc!r})") from exc
    live_groups = [group["params"] for group in optimizer.param_groups]
    live_sizes = [len(params) for params in live_groups]
    if sizes != live_sizes:
        raise RestoreError(
            f"{owner}: the checkpoint has {len(sizes)} parameter group(s) of {sizes} parameters, "
            f"the optimizer {len(live_sizes)} of {live_sizes}"
        )
    params = dict(zip(chain.from_iterable(groups), chain.from_iterable(live_groups), strict=True))
    lines = []
    for index, values in per_param.items():
        param = params.get(index)
        live = optimizer.state.get(param) if param is not None else None  # a fresh optimizer holds no state yet
        if live and isinstance(values, Mapping):
            lines += misfits(
                {f"state/{index}/{name}": value for name, value in live.items()},
                {f"state/{index}/{name}": value for name, value in values.items()},
                dtypes=False,  # load_state_dict casts state to its parameter's dtype
            )
    require_fit(owner, lines)
