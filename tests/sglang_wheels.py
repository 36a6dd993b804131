"""sglang's own wheels, for tests that read a release's source files (the fix patches for 0.5.18 / 0.5.20 apply to
them; the 0.5.18 dump fixture is generated from one): ``sglang_wheel("0.5.20")`` is the cached wheel, downloaded once
with ``pip download --no-deps`` (~25 MB, no dependencies, nothing installed) into
``~/.cache/tp-deadlock-repro/wheels/``.

These tests used to be skipped where the wheel was not cached, which was every CI run: the patch tests never ran.
Now a download that fails fails the test in CI (``CI=true``), naming the command; elsewhere (an offline laptop) it
skips naming the same command.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

WHEELS = Path.home() / ".cache" / "tp-deadlock-repro" / "wheels"
PLATFORM = "manylinux_2_34_x86_64"  # the testbed's wheel tag (cp311); the files read are pure Python either way


def sglang_wheel(version: str, timeout_s: float = 300.0) -> Path:
    """The path of ``sglang-<version>-cp311-cp311-manylinux_2_34_x86_64.whl`` under :data:`WHEELS`, downloaded when
    missing. Fails the calling test in CI (skips elsewhere) when pip cannot download it, with pip's last line."""
    wheel = WHEELS / f"sglang-{version}-cp311-cp311-{PLATFORM}.whl"
    if wheel.is_file():
        return wheel
    WHEELS.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version", "3.11",
           "--platform", PLATFORM, "-d", str(WHEELS), f"sglang=={version}"]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
        why = (r.stderr.strip().splitlines() or r.stdout.strip().splitlines() or [f"exit {r.returncode}"])[-1]
    except (OSError, subprocess.TimeoutExpired) as e:
        why = str(e)
    if wheel.is_file():
        return wheel
    msg = f"the sglang {version} wheel could not be downloaded to {WHEELS} ({why}); run: {' '.join(cmd)}"
    if os.environ.get("CI"):
        pytest.fail(msg)
    pytest.skip(msg)
