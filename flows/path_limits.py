"""Whether a path a person gave (in a run spec, or as ``--workdir``/``--root``) can name a file here, checked
before anything reads or creates it.

The filesystem's own limits decide: no component longer than ``PC_NAME_MAX`` and no whole path longer than
``PC_PATH_MAX`` (both asked of the nearest existing directory on the way), and no NUL. Resolving a path turns
what the operating system refuses (ENAMETOOLONG, ELOOP, EACCES, ...) into a ``ValueError`` that says what to
change, so a bad path is a line naming its field, never a traceback.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

# POSIX's usual values, for a filesystem that does not answer pathconf.
FALLBACK_NAME_MAX = 255
FALLBACK_PATH_MAX = 4096
SHOWN_CHARACTERS = 60  # of an over-long value in a message

FIXES = {
    errno.ENAMETOOLONG: "use a shorter path",
    errno.ELOOP: "a symbolic link on the way points back into itself: fix or remove it",
    errno.EACCES: "this user may not look into a directory on the way: fix its permissions or choose another path",
    errno.EPERM: "this user may not look into a directory on the way: fix its permissions or choose another path",
    errno.ENOTDIR: "a part of the path that should be a directory is a file",
}


def shown(value: str, count: bool = True) -> str:
    """``value`` as a message shows it: repr, with the middle of a long value elided (and, with ``count``,
    its length said)."""
    if len(value) <= SHOWN_CHARACTERS:
        return repr(value)
    half = SHOWN_CHARACTERS // 2
    return repr(value[:half] + "..." + value[-half:]) + (f" ({len(value)} characters)" if count else "")


def filesystem_limits(path: Path) -> tuple[int, int]:
    """``(PC_NAME_MAX, PC_PATH_MAX)`` of the nearest existing directory at or above ``path``."""
    for directory in (path, *path.parents):
        try:
            if directory.is_dir():
                name_max, path_max = os.pathconf(directory, "PC_NAME_MAX"), os.pathconf(directory, "PC_PATH_MAX")
                return (name_max if name_max > 0 else FALLBACK_NAME_MAX,
                        path_max if path_max > 0 else FALLBACK_PATH_MAX)
        except (OSError, ValueError):  # too long or unreadable itself: ask its parent
            continue
    return FALLBACK_NAME_MAX, FALLBACK_PATH_MAX


def path_problem(value: str, base: Path | None = None, reserve: int = 0, what: str = "path") -> str | None:
    """Why ``value`` (relative to ``base`` unless absolute) cannot name a file on this filesystem, or None.
    ``reserve`` bytes are kept free for what the program later adds below it."""
    if "\x00" in value:
        return f"{shown(value)} contains a NUL character, which no path may hold"
    try:
        os.fsencode(value)
    except UnicodeEncodeError as error:
        return f"{shown(value)} contains {value[error.start]!r}, which no file name here can hold"
    path = Path(value)
    path = Path(os.path.abspath(path if base is None or path.is_absolute() else base / path))
    name_max, path_max = filesystem_limits(path)
    longest = max(path.parts, key=lambda part: len(os.fsencode(part)))
    if len(os.fsencode(longest)) > name_max:
        return (f"{shown(value)} has a path component of {len(os.fsencode(longest))} bytes ({shown(longest, False)}); "
                f"this filesystem allows at most {name_max} (PC_NAME_MAX): use a shorter name")
    length = len(os.fsencode(str(path)))
    if length + reserve > path_max:
        room = f", and comlrl adds up to {reserve} below it," if reserve else ""
        return (f"{shown(value)} is {length} bytes long as an absolute path{room} where this filesystem allows at most "
                f"{path_max} (PC_PATH_MAX): use a shorter {what}")
    return None


def os_error_problem(value: str, error: OSError) -> str:
    """What the operating system refused about ``value``, and what to do about it."""
    code = errno.errorcode.get(error.errno or 0, "error")
    fix = FIXES.get(error.errno or 0, "check the path")
    return f"{shown(value)} cannot be looked up ({error.strerror or error}, {code}): {fix}"


def checked_path(value: str, base: Path | None = None, reserve: int = 0, what: str = "path") -> Path:
    """``value`` resolved (relative to ``base`` unless absolute); a ``ValueError`` saying what to change when it
    breaks the filesystem's limits or the operating system refuses to resolve it."""
    problem = path_problem(value, base, reserve, what)
    if problem:
        raise ValueError(problem)
    path = Path(value)
    path = path if base is None or path.is_absolute() else base / path
    try:
        return path.resolve()
    except OSError as error:
        raise ValueError(os_error_problem(value, error)) from None
    except RuntimeError:  # Python 3.11's resolve() reports a symbolic-link loop so
        raise ValueError(os_error_problem(value, OSError(errno.ELOOP, os.strerror(errno.ELOOP)))) from None
