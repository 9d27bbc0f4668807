"""placerun's startup hook: stage 1 in a Python worker before its program, the program untouched.

placerun puts this file's directory first on PYTHONPATH, so the interpreter imports it at start
(`site`), before `__main__`. It first undoes its own traces (its directory on sys.path, PYTHONPATH
back to the user's value, so the program's own children never run it), then runs stage 1 for this
worker (placement.bootstrap.start_worker), then the `sitecustomize` the interpreter would have
imported without it. Where placement cannot be imported (PYTHON_EXEC names another interpreter)
or stage 1 fails, one line says so and the program runs unbound. Plain syntax and the standard
library only: any Python 3 imports this file.
"""
import os
import sys

_HOOK_DIR = os.path.dirname(os.path.abspath(__file__))
_USER_PYTHONPATH = "PLACEMENT_USER_PYTHONPATH"  # placement.launcher.USER_PYTHONPATH_ENV
_PLAN_FILE = "PLACEMENT_PLAN_FILE"  # placement.handoff.PLAN_FILE_ENV: placerun's one hand-off file


def _undo_traces():
    sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != _HOOK_DIR]
    user = os.environ.pop(_USER_PYTHONPATH, None)
    if user is None:
        os.environ.pop("PYTHONPATH", None)
    else:
        os.environ["PYTHONPATH"] = user


def _stage1():
    rank = os.environ.get("RANK", os.environ.get("LOCAL_RANK", "?"))
    try:
        from placement.bootstrap import start_worker
    except Exception as e:  # placement or its dependencies missing in this interpreter
        sys.stderr.write("placement: rank %s: cannot import placement in %s (%s: %s); this rank runs unbound\n"
                         % (rank, sys.executable, type(e).__name__, e))
        return
    start_worker()  # never raises: says what it could not do in one line


def _chain():
    """Run the sitecustomize this hook hides (the interpreter's own or the user's), as `sitecustomize`."""
    import importlib.machinery
    import importlib.util

    spec = importlib.machinery.PathFinder.find_spec("sitecustomize", sys.path)
    if spec is None or spec.origin is None or os.path.dirname(os.path.abspath(spec.origin)) == _HOOK_DIR:
        return
    module = importlib.util.module_from_spec(spec)
    sys.modules["sitecustomize"] = module
    spec.loader.exec_module(module)


_undo_traces()
if os.environ.get(_PLAN_FILE) and "LOCAL_RANK" in os.environ:
    _stage1()
_chain()
