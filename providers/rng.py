"""Random number generator states: Python ``random``, NumPy's global generator, torch CPU and CUDA.

Unlike tensors of a model, generator states are copied when described: they change on every draw,
so the state that belongs to a checkpoint is the one at the moment it was requested.
"""

from __future__ import annotations

import hashlib
import random
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, cast

import torch

from .base import MissingRank, RestoreError, require_keys
from .items import Item, ObjectItem, TensorItem

if TYPE_CHECKING:
    from numpy import uint32
    from numpy.typing import NDArray

try:
    import numpy as np
except ImportError:  # numpy is optional; without it there is no NumPy state to keep
    np = None

PYTHON_KEY = "python"
NUMPY_KEY = "numpy"
TORCH_KEY = "torch"
CUDA_PREFIX = "cuda/"


class RNGProvider:
    """Items ``python``, ``numpy`` (when importable), ``torch`` and ``cuda/<device index>``.

    ``cuda=None`` includes CUDA generators when CUDA is available; ``True`` requires it; ``False``
    leaves them out (e.g. to restore a GPU run's checkpoint on a CPU-only machine). Restore expects
    the items this provider would describe now.

    Each rank's generators are its own (:class:`~tierstate.providers.base.RankLocal`): restored on
    more ranks than saved the checkpoint, a rank with no saved state of its own never takes another
    rank's. By default (``missing_rank="derive"``) its generators are seeded from a digest of rank 0's
    saved state and its own rank (:meth:`derive`), so every rank draws a stream of its own, the same
    on every restore of that checkpoint, named in ``RestoreResult.derived``; ``"keep"`` leaves them as
    they are (named in ``RestoreResult.kept``), ``"error"`` fails the restore.
    """

    def __init__(self, cuda: bool | None = None, missing_rank: MissingRank = "derive") -> None:
        if cuda and not torch.cuda.is_available():
            raise RuntimeError("RNGProvider(cuda=True) but torch.cuda.is_available() is False")
        if missing_rank not in ("derive", "keep", "error"):
            raise ValueError(f"RNGProvider(missing_rank=...): 'derive', 'keep' or 'error', got {missing_rank!r}")
        self.cuda = torch.cuda.is_available() if cuda is None else cuda
        self.missing_rank: MissingRank = missing_rank

    def _cuda_keys(self) -> list[str]:
        return [f"{CUDA_PREFIX}{i}" for i in range(torch.cuda.device_count())] if self.cuda else []

    def describe(self) -> list[Item]:
        version, internal, gauss_next = random.getstate()
        items: list[Item] = [
            ObjectItem(PYTHON_KEY, {"version": version, "state": list(internal), "gauss_next": gauss_next}),
            TensorItem(TORCH_KEY, torch.get_rng_state(), changes="never"),  # our own copy
        ]
        if np is not None:
            # The stub allows a dict (non-MT19937 generators); the global RandomState is always MT19937,
            # for which legacy=True returns this tuple.
            legacy = cast("tuple[str, NDArray[uint32], int, int, float]", np.random.get_state(legacy=True))
            name, key, pos, has_gauss, cached = legacy
            items.append(
                ObjectItem(
                    NUMPY_KEY,
                    {"name": name, "key": key.tolist(), "pos": pos, "has_gauss": has_gauss, "cached_gaussian": cached},
                )
            )
        cuda = enumerate(self._cuda_keys())
        items += [TensorItem(key, torch.cuda.get_rng_state(i), changes="never") for i, key in cuda]
        return items

    def restore(self, state: Mapping[str, Any]) -> None:
        cuda_keys = self._cuda_keys()
        require_keys("rng", state, {PYTHON_KEY, TORCH_KEY, *cuda_keys} | ({NUMPY_KEY} if np is not None else set()))
        py = state[PYTHON_KEY]
        random.setstate((py["version"], tuple(py["state"]), py["gauss_next"]))
        torch.set_rng_state(_generator_state(state[TORCH_KEY], TORCH_KEY))
        if np is not None:
            npy = state[NUMPY_KEY]
            key = np.asarray(npy["key"], dtype=np.uint32)
            np.random.set_state((npy["name"], key, npy["pos"], npy["has_gauss"], npy["cached_gaussian"]))
        for i, key in enumerate(cuda_keys):
            torch.cuda.set_rng_state(_generator_state(state[key], key), i)


    def digest(self) -> bytes:
        """A digest of every generator's state as it is now (after a restore: the saved one)."""
        hashed = hashlib.blake2b(digest_size=16)
        version, internal, gauss_next = random.getstate()
        hashed.update(repr((version, internal, gauss_next)).encode())
        hashed.update(torch.get_rng_state().numpy().tobytes())
        if np is not None:
            legacy = cast("tuple[str, NDArray[uint32], int, int, float]", np.random.get_state(legacy=True))
            name, key, pos, has_gauss, cached = legacy
            hashed.update(key.tobytes() + repr((name, pos, has_gauss, cached)).encode())
        for i, _key in enumerate(self._cuda_keys()):
            hashed.update(torch.cuda.get_rng_state(i).numpy().tobytes())
        return hashed.digest()

    def derive(self, digest: bytes, rank: int) -> None:
        """Seed every generator from ``digest`` (another rank's saved state) and ``rank``: a stream of this
        rank's own, never a copy of another's, and the same whenever the same checkpoint is restored."""
        seed = int.from_bytes(hashlib.blake2b(digest + rank.to_bytes(8, "little"), digest_size=8).digest(), "little")
        random.seed(seed)
        torch.manual_seed(seed)  # CPU and every CUDA device
        if np is not None:
            np.random.seed([seed & 0xFFFFFFFF, seed >> 32])


def _generator_state(value: Any, key: str) -> torch.Tensor:
    """A generator state torch can take as it is: its own contiguous uint8 CPU tensor at offset 0.

    A restore may hand over a view into a larger read buffer (a resharded read packs several
    items into one); ``torch.set_rng_state`` reads the storage from its start, ignoring the
    view's offset, and crashed the process on such a view.
    """
    if not isinstance(value, torch.Tensor) or value.dtype != torch.uint8 or value.dim() != 1:
        raise RestoreError(f"rng: item {key!r} must be a 1-d uint8 tensor, got {_describe(value)}")
    return value.detach().to("cpu").clone(memory_format=torch.contiguous_format)


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dim()}-d {value.dtype} tensor"
    return type(value).__name__
