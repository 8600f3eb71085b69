"""HDF5 is written with h5py, an optional dependency (``pip install 'tierstate[hdf5]'``).

Only writing an HDF5 checkpoint or export needs it: reading one goes through the frames of its
manifest like any checkpoint. So a runner with ``format: frames`` never imports h5py (0.1 s), and
a machine without it still restores every checkpoint. A config asking for ``format: hdf5`` without
h5py is refused when it loads (pipeline/config_checks.py), naming the key; a command that would
write HDF5 fails with :class:`Hdf5UnavailableError`. This module imports nothing heavy, so the
config checks can name the extra without loading the container.
"""

from __future__ import annotations

from types import ModuleType

from tierstate.errors import TierstateError

HDF5_NEEDS_H5PY = "format hdf5 is written with h5py, which is not installed: pip install 'tierstate[hdf5]'"


class Hdf5UnavailableError(TierstateError, ImportError):
    """HDF5 was asked for, and h5py (the extra ``tierstate[hdf5]``) is not installed."""


def h5py_module() -> ModuleType:
    """h5py, imported on first use."""
    try:
        import h5py
    except ImportError as exc:
        raise Hdf5UnavailableError(HDF5_NEEDS_H5PY) from exc
    return h5py
