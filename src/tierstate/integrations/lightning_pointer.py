"""The pointer file written at each Lightning checkpoint path: which tierstate checkpoint it stands for.

A few hundred bytes of JSON (``kind``, ``step``, ...) after a short pickle that makes ``torch.load`` fail
saying what the file is and how to load it (see :func:`_torch_load_trap`); written whole or not at all
(beside the path, fsynced, renamed over it), read without ever being unpickled.
"""

from __future__ import annotations

import io as io_module
import json
import os
import pickletools
import struct
from collections.abc import Mapping
from pathlib import Path
from typing import Any

POINTER_KIND = "tierstate lightning checkpoint"
"""The ``kind`` of the pointer written at each Lightning checkpoint path."""
LOAD_HINT = (
    "a pointer to a tierstate checkpoint, not a torch file: load it with "
    "tierstate.integrations.lightning.load_from_checkpoint(YourModule, this_path, config), or resume with "
    "Trainer(plugins=[TierstateCheckpointIO(config)]).fit(model, ckpt_path=this_path)"
)
"""What to do with a pointer: the message ``torch.load`` raises on one, and its JSON's ``load`` field."""
_POINTER_MAX = 1 << 16  # a pointer is a few hundred bytes; a torch .ckpt is a zip that never parses as JSON


def _torch_load_trap(message: str) -> bytes:
    """A pickle of ``torch.device(message)``, a call that ``torch.load`` allows even with ``weights_only``.

    ``LightningModule.load_from_checkpoint`` reads a path with ``torch.load`` itself, with no hook a plugin
    could use. A pointer therefore starts with this pickle: ``torch.load`` (weights-only or not, whatever
    ``map_location``) unpickles it first and raises ``RuntimeError: Invalid device string: 'this file is a
    pointer to a tierstate checkpoint ... load it with ...'``, instead of torch's own advice to retry with
    ``weights_only=False``, which would fail as well. Written opcode by opcode with no protocol header,
    and ``message`` padded so that its length's bytes are ASCII too, the pointer stays a text file:
    ``cat`` shows the message, then the JSON."""
    while any(byte >= 0x80 for byte in struct.pack("<I", len(message.encode()))):
        message += " "
    text = message.encode()
    return b"ctorch\ndevice\n(X" + struct.pack("<I", len(text)) + text + b"tR.\n"


_TORCH_LOAD_TRAP = _torch_load_trap(f"this file is {LOAD_HINT}")
"""The first bytes of every pointer; its JSON follows on the next line."""


def read_pointer(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The pointer at ``path`` (``{"kind", "step", ...}``), or None if the file there is not one."""
    with open(path, "rb") as f:
        head = f.read(_POINTER_MAX + 1)
    if len(head) > _POINTER_MAX:
        return None
    try:
        pointer = json.loads(_pointer_json(head))
    except ValueError:
        return None
    if not isinstance(pointer, dict) or pointer.get("kind") != POINTER_KIND or not isinstance(pointer.get("step"), int):
        return None
    return pointer


def _pointer_json(head: bytes) -> bytes:
    """The JSON part of a file that may be a pointer: what follows the leading pickle (found by walking its
    opcodes, never by unpickling), or the whole file for a pointer written before the trap existed."""
    if head.lstrip().startswith(b"{"):
        return head
    for opcode, _argument, position in pickletools.genops(io_module.BytesIO(head)):  # ValueError if no pickle
        if opcode.name == "STOP" and position is not None:  # a position always, read from bytes
            return head[position + 1 :]
    raise ValueError("a pickle without STOP")


def write_pointer(path: Path, pointer: Mapping[str, Any]) -> None:
    """``path`` holds ``pointer`` whole, or keeps what it held: written beside it, fsynced, renamed over it."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(temporary, "wb") as f:
        f.write(_TORCH_LOAD_TRAP + json.dumps(pointer, indent=1).encode() + b"\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(temporary, path)
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
