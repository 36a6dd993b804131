"""Shared by the candidate-fix patch tests (tests/test_patch_*.py): the CPU testbed's sglang and a check that a patch
under scenarios/sglang/patches/ applies to it without fuzz (``repro.refs``, the same checks `repro compare --after
patch:…` runs)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from repro import refs, testbed
from repro.targets.sglang import SGLangAdapter

LOC = SGLangAdapter().ref_location


def sglang_of_testbed() -> tuple[str, Path]:
    """(the testbed interpreter, the installed ``sglang`` package folder); fails naming the set-up when absent."""
    py = testbed.testbed_python()
    if py is None:
        pytest.fail("the CPU testbed is not set up: run `bash scripts/cpu_testbed/setup.sh` (README, Set up)")
    return str(py), refs.package_location(str(py), loc=LOC)


def assert_applies_without_fuzz(patch: Path, package: Path, overlay: Path, strip: int = 2) -> None:
    """Copy the files ``patch`` touches from the installed ``package``'s parent into ``overlay`` and check it applies
    there cleanly at ``-p<strip>`` (raises ``repro.refs`` 's error naming the hunk otherwise)."""
    text = patch.read_text(encoding="utf-8")
    assert refs.patch_strip(patch, text, LOC) == strip
    for f in refs.patch_files(text):
        rel = Path(*f.split("/")[strip:])
        (overlay / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(package.parent / rel, overlay / rel)
    refs.check_patch_applies(patch, overlay, strip, LOC)
