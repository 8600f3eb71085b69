"""The installed release of tierstate, from the package's metadata.

A module of its own so that the CLI's parser (``--version``) reads it without importing the facade
it sits under, and the facade re-exports it as ``tierstate.__version__``.
"""

from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("tierstate")
except PackageNotFoundError:  # imported from a source tree that was never installed
    __version__ = "0+unknown"
