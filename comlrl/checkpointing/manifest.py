"""A checkpoint's seal: ``manifest.json`` lists every file with its size and sha256, and ``COMPLETE``
holds the sha256 of ``manifest.json``.

Sealing is the last step of a save (:func:`seal`); verifying is the first step of a load
(:func:`verify`): a file that is missing, changed, truncated or added after the save, or a damaged
manifest, is refused with the file's name before anything is parsed. The manifest lists every
file of the directory except itself and ``COMPLETE``.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from comlrl.errors import CheckpointError

MANIFEST_FILE = "manifest.json"
COMPLETE_MARKER = "COMPLETE"
MANIFEST_VERSION = 1
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_CHUNK = 1 << 20


def sha256_file(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for chunk in iter(lambda: handle.read(_CHUNK), b""):
            digest.update(chunk)
    return digest.hexdigest()


def checkpoint_files(directory: Path) -> list[str]:
    """Every file under ``directory`` (relative, ``/``-separated) except the manifest and ``COMPLETE``."""
    found = [p for p in directory.rglob("*") if not p.is_dir() or p.is_symlink()]
    names = sorted(p.relative_to(directory).as_posix() for p in found)
    return [name for name in names if name not in (MANIFEST_FILE, COMPLETE_MARKER)]


def seal(directory: Path) -> None:
    """Write ``manifest.json`` for the files in ``directory``, then ``COMPLETE`` (the manifest's sha256)."""
    files = {name: {"size": (directory / name).stat().st_size, "sha256": sha256_file(directory / name)}
             for name in checkpoint_files(directory)}
    text = json.dumps({"version": MANIFEST_VERSION, "files": files}, indent=1, sort_keys=True)
    (directory / MANIFEST_FILE).write_text(text)
    (directory / COMPLETE_MARKER).write_text(hashlib.sha256(text.encode()).hexdigest() + "\n")


def is_sealed(directory: Path) -> bool:
    return (directory / MANIFEST_FILE).exists()


def read_manifest(directory: Path) -> dict[str, dict[str, Any]]:
    """The manifest's file table, once ``COMPLETE`` confirms the manifest is the one the save wrote."""
    raw = (directory / MANIFEST_FILE).read_bytes()
    recorded = (directory / COMPLETE_MARKER).read_bytes().strip().decode(errors="replace")
    if hashlib.sha256(raw).hexdigest() != recorded:
        shown = recorded if _SHA256.match(recorded) else f"{len(recorded)} characters that are not a sha256"
        raise CheckpointError(directory, MANIFEST_FILE, f"its sha256 is not the one recorded in {COMPLETE_MARKER} "
                              f"({shown}); the manifest or {COMPLETE_MARKER} is damaged")
    try:
        manifest = json.loads(raw)
    except ValueError as error:  # JSONDecodeError, UnicodeDecodeError
        raise CheckpointError(directory, MANIFEST_FILE, f"is not valid JSON ({error})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(manifest, dict) or manifest.get("version") != MANIFEST_VERSION or not isinstance(files, dict):
        raise CheckpointError(directory, MANIFEST_FILE, f"is not a version-{MANIFEST_VERSION} manifest "
                              "({\"version\": 1, \"files\": {path: {\"size\", \"sha256\"}}})")
    for name, entry in files.items():
        if (not isinstance(entry, dict) or isinstance(entry.get("size"), bool) or not isinstance(entry.get("size"), int)
                or not isinstance(entry.get("sha256"), str) or not _SHA256.match(entry["sha256"])
                or name.startswith("/") or ".." in name.split("/")):
            raise CheckpointError(directory, MANIFEST_FILE, f"has a malformed entry for {name!r}: {entry!r}")
    return files


def verify_file(directory: Path, name: str, entry: dict[str, Any] | None) -> None:
    """``directory/name`` has the size and sha256 that ``entry`` (its manifest entry) records."""
    path = directory / name
    if entry is None:
        raise CheckpointError(directory, name, f"is not listed in {MANIFEST_FILE}: it was added or renamed after "
                              "the checkpoint was saved")
    if not path.is_file():
        raise CheckpointError(directory, name, f"is missing (listed in {MANIFEST_FILE})")
    size = path.stat().st_size
    if size != entry["size"]:
        raise CheckpointError(directory, name, f"has {size} bytes but {entry['size']} were saved "
                              "(truncated or overwritten)")
    if sha256_file(path) != entry["sha256"]:
        raise CheckpointError(directory, name, "its contents changed since the save (sha256 differs from "
                              f"{MANIFEST_FILE})")


def verify(directory: Path) -> None:
    """Every file the manifest lists is present and unchanged, and no other file is present."""
    files = read_manifest(directory)
    for name in sorted(files):
        verify_file(directory, name, files[name])
    for name in checkpoint_files(directory):
        if name not in files:
            verify_file(directory, name, None)
