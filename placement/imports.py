"""Run a function right after a module is first imported, without importing it first.

What
    `when_imported(name, fn)`: fn(module) once `name` has finished executing its body; at once
    when it is imported already.

Why
    placerun's startup hook runs before the program, and importing torch there would change
    the program (a second or more of start-up, and torch read environment the program may set
    before its own `import torch`, such as CUDA_VISIBLE_DEVICES). So the automatic monitor
    waits for the program to import torch itself, as post-import hooks do (PEP 369's idea;
    wrapt's `when_imported`): a finder first on sys.meta_path that, for the names asked for,
    asks the finders after it for the spec and wraps its loader's exec_module.

Cost
    One dictionary look-up per import until every name asked for is imported; then the finder
    takes itself off sys.meta_path.
"""
from __future__ import annotations

import sys
import threading
from typing import Callable

_lock = threading.Lock()
_waiting: dict[str, list[Callable]] = {}


class _Loader:
    """The module's own loader, with fn run after its body."""

    def __init__(self, loader, name: str):
        self._loader = loader
        self._name = name

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module):
        self._loader.exec_module(module)
        module.__spec__.loader = self._loader  # the module's spec names its real loader again
        module.__loader__ = self._loader
        _run(self._name, module)

    def __getattr__(self, name):
        return getattr(self._loader, name)


class _Finder:
    """First on sys.meta_path while names are waiting."""

    def find_spec(self, name, path, target=None):
        if name not in _waiting:
            return None
        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(name, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _Loader(spec.loader, name)
                return spec
        return None


_finder = _Finder()


def when_imported(name: str, fn: Callable) -> None:
    module = sys.modules.get(name)
    if module is not None and getattr(getattr(module, "__spec__", None), "_initializing", False) is False:
        fn(module)
        return
    with _lock:
        _waiting.setdefault(name, []).append(fn)
        if _finder not in sys.meta_path:
            sys.meta_path.insert(0, _finder)


def _run(name: str, module) -> None:
    with _lock:
        fns = _waiting.pop(name, [])
        if not _waiting and _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
    for fn in fns:
        try:
            fn(module)
        except Exception as e:  # the program's import goes on whatever placement's hook does
            print(f"placement: after importing {name}: {type(e).__name__}: {e}; the automatic monitor "
                  "may miss what that module does", file=sys.stderr, flush=True)


def cancel(*fns: Callable) -> None:
    """Forget these functions wherever they still wait (the automatic monitor gave way to
    attach()); other callers' stay."""
    with _lock:
        for name in list(_waiting):
            _waiting[name] = [f for f in _waiting[name] if not any(f == fn for fn in fns)]
            if not _waiting[name]:
                del _waiting[name]
        if not _waiting and _finder in sys.meta_path:
            sys.meta_path.remove(_finder)
