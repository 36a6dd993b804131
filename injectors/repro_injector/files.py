"""The names of every file the injector writes into the plan's ``out_dir`` (the evidence folder's ``injector/``),
declared once. The harness's store (``repro.evidence.Layout``) names the same files on its side (this package never
imports ``repro``); ``tests/test_store.py`` checks that both agree.

- ``loaded-<pid>.json``: the loaded marker (``_runtime.Runtime.write_marker``; written via ``<name>.tmp``);
- ``fires-<pid>.jsonl``: the fire log (``_runtime.Runtime.event``);
- ``errors.log``: one line per exception inside the injector (``_runtime.Runtime.error``);
- ``faulthandler-<pid>.txt``: all threads' stacks at each ``faulthandler_signal`` (``_runtime``);
- ``ledger-<pid>.jsonl``, its previous part ``ledger-<pid>.1.jsonl`` and the two parts kept from the latest arming
  ``ledger-<pid>.3.jsonl`` / ``.2.jsonl`` (oldest first): the collective ledger (``_ledger``);
- ``digest-<pid>.jsonl`` and ``digest-<pid>.1.jsonl``: the state digest's ring (``_digest``);
- ``ticks-<pid>.txt``: every scheduler tick's start, benchmarks only (``_ledger``, ``bench_alternate_s``);
- ``mpnames-<pid>.txt``: the names this process registered with multiprocessing's resource tracker (``_proc``).
"""

from __future__ import annotations

ERRORS_LOG = "errors.log"
TMP_SUFFIX = ".tmp"  # an atomic rewrite's temporary file: <name>.tmp, then os.replace


def loaded_marker(pid: int) -> str:
    """``loaded-<pid>.json``."""
    return f"loaded-{pid}.json"


def fire_log(pid: int) -> str:
    """``fires-<pid>.jsonl``."""
    return f"fires-{pid}.jsonl"


def faulthandler_file(pid: int) -> str:
    """``faulthandler-<pid>.txt``."""
    return f"faulthandler-{pid}.txt"


def ledger_file(pid: int, part: int = 0) -> str:
    """``ledger-<pid>.jsonl`` (part 0, the current one) or ``ledger-<pid>.<part>.jsonl``."""
    return f"ledger-{pid}.{part}.jsonl" if part else f"ledger-{pid}.jsonl"


def digest_file(pid: int, part: int = 0) -> str:
    """``digest-<pid>.jsonl`` (part 0, the current one) or ``digest-<pid>.<part>.jsonl``."""
    return f"digest-{pid}.{part}.jsonl" if part else f"digest-{pid}.jsonl"


def mp_names_file(pid: int) -> str:
    """``mpnames-<pid>.txt``: ``<rtype> <name>`` lines (``semaphore /mp-…``), one per resource-tracker registration."""
    return f"mpnames-{pid}.txt"


def ticks_file(pid: int) -> str:
    """``ticks-<pid>.txt`` (benchmarks only)."""
    return f"ticks-{pid}.txt"
