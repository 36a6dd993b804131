"""Boot hook of the CPU-testbed compat layer (copied into the testbed venv by scripts/cpu_testbed/setup.sh).

Imported from ``repro_testbed_compat.pth`` only when ``REPRO_TESTBED_COMPAT=1``. Loads the package
``repro_testbed_compat`` from ``$REPRO_TESTBED_COMPAT_DIR`` (the repo's ``scripts/cpu_testbed/compat``, set by the
adapter's testbed profile) and calls its ``install()``. It never puts that folder on ``sys.path`` and never touches
PYTHONPATH, so it cannot collide with the injector's ``sitecustomize``. Any error shrinks to one stderr line: the
server then runs without the layer (and HiCache on CPU fails visibly later).
"""

import os
import sys


def _boot() -> None:
    import importlib.util

    d = os.environ.get("REPRO_TESTBED_COMPAT_DIR", "")
    init = os.path.join(d, "repro_testbed_compat", "__init__.py")
    if not d or not os.path.isfile(init):
        sys.stderr.write(
            f"repro testbed compat: REPRO_TESTBED_COMPAT=1 but REPRO_TESTBED_COMPAT_DIR={d!r} has no "
            f"repro_testbed_compat package; launch through the repro adapter's testbed profile\n"
        )
        return
    spec = importlib.util.spec_from_file_location(
        "repro_testbed_compat", init, submodule_search_locations=[os.path.dirname(init)]
    )
    mod = importlib.util.module_from_spec(spec)
    sys.modules["repro_testbed_compat"] = mod
    spec.loader.exec_module(mod)
    mod.install()


try:
    _boot()
except Exception as e:  # never break interpreter start-up
    sys.stderr.write(f"repro testbed compat: not installed: {type(e).__name__}: {e}\n")
