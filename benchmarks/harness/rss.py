"""This process's resident memory and its kernel-kept high-water mark, for the memory benchmark."""

from __future__ import annotations

import contextlib
import ctypes
import gc

from .machine import write_kernel_knob


def _status_kib(field_name: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field_name + ":"):
                return int(line.split()[1])
    raise KeyError(f"/proc/self/status has no {field_name!r} line")


def rss_bytes() -> int:
    return _status_kib("VmRSS") * 1024


def peak_rss_bytes() -> int:
    """VmHWM: the kernel's exact high-water mark of resident memory, no sampling gaps."""
    return _status_kib("VmHWM") * 1024


def trim_heap() -> None:
    """Hand freed heap pages back to the OS (glibc ``malloc_trim``), so a baseline RSS holds no free
    memory that a later allocation could reuse without showing up in the peak."""
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux ``clear_refs`` 5), so a peak can be taken per phase."""
    return write_kernel_knob("/proc/self/clear_refs", "5")
