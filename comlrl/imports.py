"""What code a run spec (or a team model's settings) may name: the allow-list, decided in one place.

A spec names code only as an import path ``package.module:function`` (``reward``,
``reward_processor``, ``formatters``, ``transition``, ``dataset.*.entry_point``). A path is
allowed when its module is

1. ``comlrl.tasks`` or a module below it (the bundled tasks);
2. a module of the spec root: the root directory (``--root``, the directory the spec's data
   paths start from) holds its top-level package or module as ``ROOT/<name>.py`` or
   ``ROOT/<name>/__init__.py``, and no standard-library, library (``comlrl``, ``flows``),
   installed or already imported module has that name; it is imported from the root (which goes
   in front of ``sys.path`` for that import only);
3. a module the operator lists, comma-separated, in the environment variable
   ``COMLRL_SPEC_ALLOWED_MODULES`` (an entry allows that module and every module below it).
   The spec itself cannot extend the list.

The object found must itself be defined in an allowed module (``my_task:Path``, pathlib's class
imported there, is refused), and the attribute path may not pass through another module
(``my_task:os.system``) or a dunder name. Whatever the list says, these are always refused: the
standard library's process, exec/eval, import and deserialisation entry points and file-tree
removal (:data:`DENIED_MODULES`: ``subprocess``, ``os``, ``builtins``, ``importlib``, ``runpy``,
``pickle``, ``marshal``, ``ctypes``, ``shutil`` ...) and other packages' unpickling loaders
(:data:`DENIED_CALLABLES`: ``torch:load`` ...), also when an allowed module re-exports them.

:func:`check_import_path` decides from the path and the file system alone and imports nothing,
so a refused module never runs; :func:`resolve_callable` checks first, imports only then, and
checks the object it found again. Validation and :mod:`flows.build` both call it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import re
import sys
import threading
import types
from pathlib import Path
from typing import Any, Callable

IMPORT_PATH = r"^[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*:[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)*$"
ALLOWED_MODULES_VARIABLE = "COMLRL_SPEC_ALLOWED_MODULES"
BUNDLED_MODULES = ("comlrl.tasks",)
# Top-level names a root module may not take: the library itself (only comlrl.tasks is allowed).
LIBRARY_PACKAGES = ("comlrl", "flows")

# Modules (and everything below them) that start processes, execute or compile code, import by
# name, deserialise objects, or remove file trees: never nameable, even when the operator lists them.
DENIED_MODULES = frozenset({
    "builtins", "__builtin__", "sys", "os", "posix", "nt", "_posixsubprocess", "_winapi",
    "subprocess", "pty", "pipes", "signal", "multiprocessing", "concurrent.futures.process",
    "asyncio.subprocess", "asyncio.unix_events", "asyncio.windows_events",
    "importlib", "imp", "pkgutil", "zipimport", "runpy", "code", "codeop", "compileall", "py_compile",
    "pdb", "bdb", "trace", "timeit", "profile", "cProfile", "doctest",
    "ctypes", "_ctypes", "cffi",
    "pickle", "_pickle", "pickletools", "marshal", "shelve", "dill", "cloudpickle", "joblib",
    "shutil", "webbrowser", "ensurepip", "venv", "pip", "setuptools", "distutils", "site",
})
# Single callables of otherwise nameable packages that unpickle or construct arbitrary objects.
DENIED_CALLABLES = frozenset({
    "torch:load", "torch.serialization:load", "torch.hub:load", "torch.jit:load",
    "numpy:load", "numpy.lib.npyio:load", "pandas:read_pickle", "pandas.io.pickle:read_pickle",
    "yaml:load", "yaml:load_all", "yaml:unsafe_load", "yaml:unsafe_load_all", "yaml:full_load",
    "yaml:full_load_all",
})

_SYS_PATH = threading.Lock()


class ImportRefused(ValueError):
    """An import path a run spec may not name (or that does not resolve to a callable)."""


def _within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def denied_module(module: str) -> str | None:
    """The entry of :data:`DENIED_MODULES` that covers ``module``, if any."""
    return next((prefix for prefix in sorted(DENIED_MODULES) if _within(module, prefix)), None)


def operator_modules() -> tuple[str, ...]:
    """The modules listed in ``COMLRL_SPEC_ALLOWED_MODULES`` (read at every check, never cached)."""
    entries = [entry.strip() for entry in os.environ.get(ALLOWED_MODULES_VARIABLE, "").split(",") if entry.strip()]
    bad = [entry for entry in entries if not re.match(r"^[A-Za-z_]\w*(\.[A-Za-z_]\w*)*$", entry)]
    if bad:
        raise ImportRefused(f"{ALLOWED_MODULES_VARIABLE} lists {bad}, which are not module names "
                            "(give dotted module names separated by commas, e.g. mypkg,otherpkg.rewards)")
    return tuple(entries)


def root_module_file(module: str, root: Path) -> Path | None:
    """The file under ``root`` that the top-level name of ``module`` stands for, if the root holds it."""
    top = module.split(".")[0]
    for candidate in (root / f"{top}.py", root / top / "__init__.py"):
        if candidate.is_file():
            resolved = candidate.resolve()
            linked = candidate.is_symlink() or (root / top).is_symlink()
            if linked or not resolved.is_relative_to(Path(root).resolve()):
                raise ImportRefused(f"the spec root's module {top!r} is a symbolic link to {str(resolved)!r}: a root "
                                    "module must be a file of the root (it was not imported)")
            return resolved
    return None


def _allow_list_text(root: Path | None, listed: tuple[str, ...]) -> str:
    where = f"modules in the spec root {str(root)!r} (ROOT/<name>.py or ROOT/<name>/__init__.py)" if root else \
        "modules in the spec root (none: no root given)"
    return (f"a spec may name {', '.join(BUNDLED_MODULES)}, {where}, and the modules the operator lists in "
            f"{ALLOWED_MODULES_VARIABLE} (now: {', '.join(listed) if listed else 'none'})")


def module_kind(module: str, root: str | Path | None) -> str:
    """Why code of ``module`` may run (``"bundled"``, ``"operator"`` or ``"root"``); raises
    :class:`ImportRefused` otherwise. Decides from the name and the file system alone: imports nothing."""
    denied = denied_module(module)
    if denied is not None:
        raise ImportRefused(f"module {denied!r} starts processes, runs or imports code, deserialises objects or "
                            f"removes files; a spec may never name it, even when {ALLOWED_MODULES_VARIABLE} lists it")
    if any(_within(module, allowed) for allowed in BUNDLED_MODULES):
        return "bundled"
    listed = operator_modules()
    if any(_within(module, allowed) for allowed in listed):
        return "operator"
    root = Path(root).resolve() if root is not None else None
    top = module.split(".")[0]
    if top in LIBRARY_PACKAGES:
        raise ImportRefused(f"module {module!r} is not on the spec allow-list: of the library itself only "
                            f"{', '.join(BUNDLED_MODULES)} may be named; {_allow_list_text(root, listed)}")
    if root is not None and root_module_file(module, root) is not None:
        if top in sys.stdlib_module_names:
            raise ImportRefused(f"{str(root_module_file(module, root))!r} in the spec root has the name of the "
                                f"standard-library module {top!r}; rename it")
        return "root"
    raise ImportRefused(f"module {module!r} is not on the spec allow-list: {_allow_list_text(root, listed)}")


def check_import_path(path: Any, root: str | Path | None) -> str:
    """:func:`module_kind` of ``path``'s module, after the checks on the whole path; raises
    :class:`ImportRefused` naming the path. Imports nothing."""
    if not isinstance(path, str) or not re.match(IMPORT_PATH, path):
        raise ImportRefused(f"{path!r} is not an import path of the form package.module:function")
    module, _, attribute = path.partition(":")
    if path in DENIED_CALLABLES:
        raise ImportRefused(f"{path!r} is refused: it loads pickled objects, which can run any code; "
                            "a spec may never name it")
    if any(part.startswith("__") for part in attribute.split(".")):
        raise ImportRefused(f"{path!r} is refused: dunder attributes (__name__) are not nameable")
    try:
        return module_kind(module, root)
    except ImportRefused as error:
        raise ImportRefused(f"{path!r} is refused: {error}") from None


def _import_root_module(module: str, root: Path) -> types.ModuleType:
    """Import a module of the spec root from the root; a name that an installed or already imported
    module takes is refused (importing the root's copy would shadow it for the whole process)."""
    expected = root_module_file(module, root)
    top = module.split(".")[0]
    with _SYS_PATH:
        importlib.invalidate_caches()  # the root's files may be newer than the finders' directory caches
        loaded = sys.modules.get(top)
        # A top-level find_spec only looks for files: it runs no module code.
        origin = getattr(loaded, "__file__", None) if loaded is not None else \
            getattr(importlib.util.find_spec(top), "origin", None)
        if (loaded is not None or origin is not None) and (origin is None or Path(origin).resolve() != expected):
            raise ImportRefused(f"the spec root's {str(expected)!r} has the name of the module {top!r} found at "
                                f"{origin!r}; rename the root's module")
        sys.path.insert(0, str(root))
        try:
            target = importlib.import_module(module)
        finally:
            sys.path.remove(str(root))
    if not Path(getattr(target, "__file__", None) or "/").resolve().is_relative_to(root):
        raise ImportRefused(f"module {module!r} was imported from {target.__file__!r}, outside the spec root {str(root)!r}")
    return target


def _refused_callables() -> dict[int, str]:
    """``id -> path`` of the refused callables whose modules are already imported (nothing is imported here)."""
    found = {}
    for path in DENIED_CALLABLES:
        module, _, name = path.partition(":")
        target = getattr(sys.modules.get(module), name, None)
        if target is not None:
            found[id(target)] = path
    return found


def defined_in(target: Any) -> str | None:
    """The module that defines a callable: its own ``__module__``, or for a C function its bound
    module (``os.system`` is ``posix``'s), for a ``functools.partial`` or a bound method what it wraps,
    for an instance its class's."""
    for _ in range(16):  # partials of partials: unwrap a few levels, never loop
        if isinstance(target, functools.partial):
            target = target.func
        elif isinstance(target, types.MethodType):
            target = target.__func__
        else:
            break
    owner = getattr(target, "__self__", None)
    if isinstance(target, types.BuiltinFunctionType) and isinstance(owner, types.ModuleType):
        return owner.__name__
    name = getattr(target, "__module__", None)
    return name if isinstance(name, str) else None


def resolve_callable(path: str, root: str | Path | None) -> Callable:
    """The callable ``path`` names, imported only after :func:`check_import_path` allowed its module;
    the object found must itself be defined in an allowed module and be no refused callable."""
    kind = check_import_path(path, root)
    module_name, _, attribute = path.partition(":")
    try:
        target: Any = _import_root_module(module_name, Path(root).resolve()) if kind == "root" \
            else importlib.import_module(module_name)
    except ImportError as error:
        raise ImportRefused(f"cannot import module {module_name!r}: {error}") from None
    for part in attribute.split("."):
        if not hasattr(target, part):
            raise ImportRefused(f"module {module_name!r} has no attribute {attribute!r}")
        target = getattr(target, part)
        if isinstance(target, types.ModuleType):
            raise ImportRefused(f"{path!r} is refused: {part!r} is a module; name the function in its own "
                                "module (package.module:function), where the allow-list applies")
    if not callable(target):
        raise ImportRefused(f"{path} is a {type(target).__name__}, not a callable")
    refused = _refused_callables().get(id(target))
    if refused is not None:
        raise ImportRefused(f"{path!r} is refused: it is {refused}, which a spec may never name")
    origin = defined_in(target)
    try:
        if origin is None:
            raise ImportRefused("its defining module is unknown")
        module_kind(origin, root)
    except ImportRefused as error:
        raise ImportRefused(f"{path!r} is refused: it is defined in module {origin!r}, not in {module_name!r}, "
                            f"and a spec may only name code defined in allowed modules ({error})") from None
    return target
