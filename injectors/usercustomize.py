"""repro injector entry (usercustomize): runs a usercustomize this file shadows, then ``repro_injector.activate()``.

Python imports only the first ``usercustomize`` on ``sys.path``; with ``injectors/`` on PYTHONPATH this file wins
over a user one, so that one is found further down the path and executed here. ``activate()`` does nothing
unless the env var ``REPRO_PLAN`` names a plan file. Stdlib only; errors shrink to one line on stderr (and, once a
plan is known, to ``<out_dir>/errors.log``).
"""


def _repro_entry(kind):
    import os
    import sys

    here = os.path.dirname(os.path.realpath(__file__))
    try:
        from importlib.machinery import PathFinder
        import importlib.util

        rest = [p for p in sys.path if isinstance(p, str) and os.path.realpath(p or os.getcwd()) != here]
        spec = PathFinder.find_spec(kind, rest)
        if spec is not None and spec.loader is not None and spec.origin and os.path.realpath(spec.origin) != os.path.realpath(__file__):
            mod = importlib.util.module_from_spec(spec)
            sys.modules["_repro_shadowed_" + kind] = mod
            spec.loader.exec_module(mod)
    except Exception as e:  # mirror site.py: one line, never break start-up
        sys.stderr.write(f"repro injector: error in shadowed {kind}: {type(e).__name__}: {e}\n")
    if os.environ.get("REPRO_PLAN"):
        try:
            if here not in sys.path:
                sys.path.append(here)
            import repro_injector

            repro_injector.activate()
        except Exception as e:
            sys.stderr.write(f"repro injector: activation failed: {type(e).__name__}: {e}\n")


_repro_entry("usercustomize")
del _repro_entry
