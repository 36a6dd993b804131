"""repro injector entry (usercustomize): runs a usercustomize this file shadows (user), then ``repro_injector.activate()``.

Inert unless the env var ``REPRO_PLAN`` names a plan file; see ``_repro_entry.py`` (imports nothing else until a plan is set).
"""

try:
    from _repro_entry import run_entry as _repro_run_entry

    _repro_run_entry("usercustomize", __file__)
    del _repro_run_entry
except Exception as _e:  # never break interpreter start-up
    import sys as _sys

    _sys.stderr.write(f"repro injector: entry failed: {type(_e).__name__}: {_e}\n")
