"""The reader gate (one cheap test per line before the format handlers) changes nothing that is read.

``parse_lines(gate=False)`` offers every line to every handler, as the readers did before the gate; the gated
reading must give the same processes, threads, frames, notes and warnings on every pasted fixture, and on inputs
made by shuffling those fixtures' lines among junk lines (so each reader sees its lines in odd places).
"""

from __future__ import annotations

import random
import string
from pathlib import Path

import pytest

from repro.readers import parse_lines

FIXTURES = Path(__file__).resolve().parent / "fixtures"
TEXT_FILES = sorted(p for p in FIXTURES.rglob("*") if p.is_file() and p.suffix in (".txt", ".log", ".md", "")
                    and "_make" not in p.parts)


def _both(lines: list[str]):
    a = [d.model_dump() for d in parse_lines(lines, gate=True)]
    b = [d.model_dump() for d in parse_lines(lines, gate=False)]
    return a, b


def test_there_are_fixture_texts_to_compare():
    assert len(TEXT_FILES) >= 40


@pytest.mark.parametrize("path", TEXT_FILES, ids=lambda p: str(p.relative_to(FIXTURES)))
def test_gated_reading_equals_the_full_reading_on_each_fixture(path):
    lines = path.read_text(errors="replace").splitlines()
    a, b = _both(lines)
    assert a == b


def test_gated_reading_equals_the_full_reading_on_shuffled_fixture_lines_among_junk():
    rnd = random.Random(14)
    pool = [ln for p in TEXT_FILES for ln in p.read_text(errors="replace").splitlines()]
    alphabet = string.ascii_letters + string.digits + " .,;:!?()<>#-_[]|'\"\t→←"
    for trial in range(30):
        lines = []
        for _ in range(400):
            r = rnd.random()
            if r < 0.5:
                lines.append(rnd.choice(pool))
            elif r < 0.6:
                start = rnd.randrange(len(pool))
                lines.extend(pool[start:start + rnd.randint(2, 30)])
            elif r < 0.9:
                lines.append("".join(rnd.choice(alphabet) for _ in range(rnd.randint(0, 60))))
            else:
                lines.append(rnd.choice(["", "   ", "```", "> " + rnd.choice(pool), "[rank1]:" + rnd.choice(pool),
                                         "2026-12-01 09:59:27,944 " + rnd.choice(pool),
                                         "\x1b[33m" + rnd.choice(pool), "worker-1: " + rnd.choice(pool),
                                         rnd.choice(pool).replace(" ", "\xa0"),
                                         "[2026-12-01 10:04:27 TP1] " + rnd.choice(pool),
                                         "ERROR 12-01 09:59:27 [x.py:5] " + rnd.choice(pool),
                                         rnd.choice(string.ascii_letters)]))
        a, b = _both(lines)
        assert a == b, f"trial {trial}"


def test_junk_costs_no_handler_call(monkeypatch):
    """Lines no reader can take (prose, random text) never reach the format handlers."""
    import repro.readers as readers

    calls = []

    def spy(h):
        return lambda asm, line, n: calls.append(line) or h(asm, line, n)

    monkeypatch.setattr(readers, "_GATED", tuple((s, sub, spy(h)) for s, sub, h in readers._GATED))
    lines = ["lorem ipsum dolor sit amet, consectetur adipiscing elit!"] * 1000 + ["Thread 12 (idle): \"MainThread\""]
    dumps = parse_lines(lines)
    assert calls == ["Thread 12 (idle): \"MainThread\""]
    assert dumps[0].fmt == "py-spy"


def test_after_a_long_stretch_without_a_stack_only_dump_starts_are_sought_and_a_late_dump_is_still_read():
    """A huge file with no stack in its first ``give_up_chars`` characters is scanned for a dump's first line only
    (said in the first warning); a real py-spy dump at its end is still read in full."""
    junk = ["lorem ipsum dolor sit amet, consectetur adipiscing elit!"] * 8192
    dump = (FIXTURES / "pasted" / "pyspy_text_gloo3" / "rank0.txt").read_text().splitlines()
    late = parse_lines(junk + dump, give_up_chars=100_000)
    full = parse_lines(dump)
    assert [t.model_dump() for t in late[0].threads] == [t.model_dump() for t in full[0].threads]
    assert late[0].pid == full[0].pid and "only lines that start a dump were looked for" in late[0].warnings[0]
    assert "one found at line 8193" in late[0].warnings[0]
    none = parse_lines(junk, give_up_chars=100_000)
    assert none[0].fmt == "unknown" and "none found" in none[0].warnings[0]
    assert parse_lines(junk)[0].warnings[0].startswith("first line:")  # under the limit: every line read
