"""What both entry files (``sitecustomize.py``, ``usercustomize.py``) do: run the file they shadow, then activate.

Python imports only the first ``sitecustomize`` (``usercustomize``) on ``sys.path``; with ``injectors/`` on
PYTHONPATH ours wins over a distro/conda/user one, so that one is found further down the path and executed here.
``activate()`` does nothing unless the env var ``REPRO_PLAN`` names a plan file. Stdlib only; errors shrink to one
line on stderr (and, once a plan is known, to ``<out_dir>/errors.log``), as site.py does: start-up never breaks.
A top-level module (not part of ``repro_injector``) so that without a plan the package is never even imported.
"""

import os
import sys


def run_entry(kind: str, entry_file: str) -> None:
    """Execute the ``kind`` module this entry file shadows (if any), then ``repro_injector.activate()``.

    Args:
        kind: ``"sitecustomize"`` or ``"usercustomize"``.
        entry_file: ``__file__`` of the entry file (skipped when searching for the shadowed module).
    """
    here = os.path.dirname(os.path.realpath(entry_file))
    try:
        import importlib.util
        from importlib.machinery import PathFinder

        rest = [p for p in sys.path if isinstance(p, str) and os.path.realpath(p or os.getcwd()) != here]
        spec = PathFinder.find_spec(kind, rest)
        if spec is not None and spec.loader is not None and spec.origin and os.path.realpath(spec.origin) != os.path.realpath(entry_file):
            mod = importlib.util.module_from_spec(spec)
            sys.modules["_repro_shadowed_" + kind] = mod
            spec.loader.exec_module(mod)
    except Exception as e:  # mirror site.py: one line, never break start-up
        sys.stderr.write(f"repro injector: error in shadowed {kind}: {type(e).__name__}: {e}\n")
    if os.environ.get("REPRO_PLAN"):
        try:
            from repro_injector import activate

            activate()
        except Exception as e:
            sys.stderr.write(f"repro injector: activation failed: {type(e).__name__}: {e}\n")
