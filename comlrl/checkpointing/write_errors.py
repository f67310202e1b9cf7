"""Why a checkpoint file could not be written, in words an operator acts on.

``torch.save`` reports a full disk as ``RuntimeError: [enforce fail at inline_container.cc] ...
unexpected pos``, safetensors as ``SafetensorError`` or ``OSError``: :func:`describe` turns each
into "no space left on device: 3.1 MB free in /runs/x, this checkpoint needs ~48.0 MB" or "file
too large: ...", checking the free space and the process's file-size limit itself when the
exception does not say.
"""

from __future__ import annotations

import errno
import resource
import shutil
from pathlib import Path
from typing import Any

import torch


def tensor_bytes(value: Any) -> int:
    """Bytes of every tensor in ``value`` (modules, nested dicts, lists, tuples)."""
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, torch.nn.Module):
        return sum(tensor_bytes(t) for t in value.state_dict().values())
    if isinstance(value, dict):
        return sum(tensor_bytes(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(tensor_bytes(v) for v in value)
    return 0


def _megabytes(count: float) -> str:
    return f"{count / 2**20:.1f} MB" if count >= 2**20 else f"{count / 2**10:.1f} KB"


def file_size_limit() -> int | None:
    """The process's file-size limit in bytes (``ulimit -f``), None when unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def describe(error: BaseException, directory: Path, needed: int) -> tuple[str, int | None]:
    """``(cause in words, errno)`` of a failed write of a checkpoint that needs ~``needed`` bytes in ``directory``."""
    code = getattr(error, "errno", None)
    try:
        free = shutil.disk_usage(directory).free
    except OSError:
        free = None
    limit = file_size_limit()
    space = (f"no space left on device: {_megabytes(free) if free is not None else 'unknown'} free in {directory}, "
             f"this checkpoint needs ~{_megabytes(needed)}")
    too_large = (f"file too large: the process's file-size limit (ulimit -f) is {_megabytes(limit or 0)}, "
                 f"this checkpoint's files need up to ~{_megabytes(needed)}")
    if code == errno.ENOSPC or code == errno.EDQUOT:
        return space, code
    if code == errno.EFBIG:
        return too_large, code
    if isinstance(error, OSError) and code is not None:
        return f"{error.strerror or error} ({errno.errorcode.get(code, code)})", code
    # torch.save / safetensors without an errno: judge from the disk and the limit
    if free is not None and free < needed:
        return space, errno.ENOSPC
    if limit is not None and limit < needed:
        return too_large, errno.EFBIG
    text = " ".join(str(error).split())
    return f"{type(error).__name__}: {text[:300]}", code
