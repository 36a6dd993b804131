"""The end-of-session report of processes a test session left running (tests/conftest.py ``left_running``)."""

from __future__ import annotations

import subprocess
import sys
import time

from conftest import left_running


def test_a_process_started_since_is_listed_with_its_cpu_until_it_is_ended():
    since = time.time()
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        time.sleep(0.3)
        assert [x for x in left_running(since) if x[0] == p.pid], "a running python child was not listed"
        assert not [x for x in left_running(time.time() + 3600) if x[0] == p.pid], "listed though started earlier"
    finally:
        p.kill()
        p.wait()
    assert not [x for x in left_running(since) if x[0] == p.pid]
