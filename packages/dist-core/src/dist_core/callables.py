"""Send a module-level function to a worker by name, loading its file when needed.

Pickle sends functions by reference (module and name), and the worker must import
that module by name. Test files collected by pytest's ``--import-mode=importlib`` and
scripts run by path have names the worker cannot import; the reference made here
also carries the module's file, and the worker loads the file under the same name
when importing by name fails. Arguments travel as pickled bytes, unpickled only once
the function's module is loaded, so they may be instances of classes from that file.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any


@dataclass(frozen=True)
class CallableRef:
    """Where a module-level callable lives: module name, module file, qualified name."""

    module: str
    file: str | None
    qualname: str

    @classmethod
    def of(cls, target: Callable[..., Any]) -> CallableRef | None:
        """A reference to ``target``; None when it is not a module-level function."""
        qualname = getattr(target, "__qualname__", None)
        module = getattr(target, "__module__", None)
        if not isinstance(qualname, str) or not isinstance(module, str):
            return None
        if "<locals>" in qualname or "<lambda>" in qualname:
            return None
        loaded = sys.modules.get(module)
        file = getattr(loaded, "__file__", None) if loaded is not None else None
        return cls(module, file if isinstance(file, str) else None, qualname)

    def resolve(self) -> Callable[..., Any]:
        """Imports (or loads from its file) the module, and returns the callable.

        Raises:
            ImportError: Neither the module name nor its file can be loaded.
            TypeError: The name does not denote a callable.
        """
        target: Any = _load(self.module, self.file)
        for part in self.qualname.split("."):
            target = getattr(target, part)
        if not callable(target):
            raise TypeError(f"{self.module}.{self.qualname} is not callable")
        return target  # type: ignore[no-any-return]


def _from_file(module: ModuleType, file: str | None) -> bool:
    found = getattr(module, "__file__", None)
    if file is None or not isinstance(found, str):
        return True
    return os.path.realpath(found) == os.path.realpath(file)


def _load(name: str, file: str | None) -> ModuleType:
    candidates = ["__mp_main__", "__main__"] if name == "__main__" else [name]
    for candidate in candidates:
        module = sys.modules.get(candidate)
        if module is not None and _from_file(module, file):
            return module
    if name != "__main__":
        try:
            module = importlib.import_module(name)
        except ImportError:
            module = None
        if module is not None and _from_file(module, file):
            return module
    if file is None:
        raise ImportError(f"cannot import module {name!r}, and it has no file to load")
    alias = "__mp_main__" if name == "__main__" else name
    spec = importlib.util.spec_from_file_location(alias, file)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {file} as module {alias!r}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[alias] = module
    _insert_parents(alias, module)
    spec.loader.exec_module(module)
    return module


def _insert_parents(name: str, module: ModuleType) -> None:
    """Gives a dotted name loaded from a file its parent modules, as pytest does.

    ``__import__("a.b.c")`` (which pickle uses) needs ``a`` and ``a.b`` in
    ``sys.modules`` even when ``a.b.c`` is there; empty placeholders stand in for
    parents that are not importable packages.
    """
    parts = name.split(".")
    child = module
    for depth in range(len(parts) - 1, 0, -1):
        parent_name = ".".join(parts[:depth])
        parent = sys.modules.get(parent_name)
        if parent is None:
            parent = ModuleType(parent_name)
            sys.modules[parent_name] = parent
        setattr(parent, parts[depth], child)
        child = parent
