"""Issue 29 item 0: a reader never invents a rank. A process starts only where the text says one does: a process
header (py-spy's ``Process <pid>:``), a file, a rank prefix or heading, or, in a format that writes no header
(faulthandler, pystack, gdb), the next dump as that format's writer delimits it; never at a blank line. Successive
dumps of one process are one process. Every input here is real tool output (the fixtures' py-spy, pystack and gdb
dumps, a faulthandler dump CPython writes in the test) with only its layout changed, as a paste changes it.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from typer.testing import CliRunner

from repro.analysis import analyze_paths
from repro.cli import EXIT_USAGE, app
from repro.readers import load_dump_file, parse_dump

FIXTURES = Path(__file__).resolve().parent / "fixtures"
SGLANG_RANK1 = FIXTURES / "dumps" / "sglang_tp2_cpu_hang" / "rank1.txt"  # real py-spy 0.4.3, one process, 3 threads


def _blank_between_threads(text: str) -> str:
    """The dump with a blank line before every thread but the first (as a paste or an editor leaves it)."""
    out, seen = [], False
    for line in text.splitlines():
        if line.startswith("Thread "):
            if seen:
                out.append("")
            seen = True
        out.append(line)
    return "\n".join(out) + "\n"


def _one_process_blank(tmp_path: Path, src: Path = SGLANG_RANK1) -> Path:
    f = tmp_path / "oneproc_blank.txt"
    f.write_text(_blank_between_threads(src.read_text()))
    return f


@pytest.mark.parametrize("src,rank", [
    (SGLANG_RANK1, 1),
    # real py-spy 0.4.3: the main thread idle in the interpreter's shutdown, a background thread in an all_reduce
    (FIXTURES / "pasted" / "interpreter_shutdown_thread_collective" / "rank0.txt", 0),
])
def test_analyze_one_pyspy_process_with_blank_lines_between_threads_is_one_rank(tmp_path, src, rank):
    f = _one_process_blank(tmp_path, src)
    r = CliRunner().invoke(app, ["analyze", str(f)])
    out = " ".join(r.output.split())
    assert r.exit_code == 0, r.output
    assert f"Only rank {rank} was captured" in out and "py-spy text (1 process)" in out, r.output
    assert "DIVERGED" not in out and f"rank {1 - rank}" not in out, r.output


def test_reproduce_no_run_writes_no_candidates_for_one_pyspy_process(tmp_path):
    f = _one_process_blank(tmp_path)
    out_dir = tmp_path / "out"
    r = CliRunner().invoke(app, ["reproduce", str(f), "--no-run", "--out", str(out_dir), "--python",
                                 "/nonexistent/python"])
    lines = [ln for ln in r.output.splitlines() if ln.strip()]
    assert r.exit_code == EXIT_USAGE, r.output
    assert len(lines) == 1 and "only one rank's dump was read" in lines[0], r.output
    assert not out_dir.exists() or not any(out_dir.rglob("*.toml")), list(out_dir.rglob("*"))


def test_pyspy_text_without_a_header_repeated_is_one_process():
    body = SGLANG_RANK1.read_text().split("\n", 2)[2]  # the dump without its 'Process' and 'Python' lines
    dumps = parse_dump(_blank_between_threads(body) * 3, "noheader.txt")
    assert [(d.fmt, len(d.threads)) for d in dumps] == [("py-spy", 3)], [(d.fmt, d.block) for d in dumps]
    assert any("6 repeated thread block(s)" in n for n in dumps[0].notes), dumps[0].notes


def test_a_second_mainthread_under_one_header_is_said_not_read_as_a_rank():
    """Two ranks' real dumps in one file, the second one's header lost: read as the one process its header names,
    with a warning that says how to have them read as two."""
    r0 = (FIXTURES / "dumps" / "sglang_tp2_cpu_hang" / "rank0.txt").read_text()
    r1 = SGLANG_RANK1.read_text().split("\n", 2)[2]
    dumps = parse_dump(r0 + "\n" + r1, "two.txt")
    assert len(dumps) == 1 and dumps[0].pid == 9282, [(d.pid, d.block) for d in dumps]
    assert [t.thread_id for t in dumps[0].threads if t.is_main] == ["9282"]
    assert any("2 threads named 'MainThread' in one process (pid 9282)" in w and "'Process <pid>:' line" in w
               for w in dumps[0].warnings), dumps[0].warnings


def _real_faulthandler_dump(tmp_path: Path) -> str:
    """A faulthandler dump CPython writes: a background thread dumps while holding the GIL, so its 'Current thread'
    comes first, then the idle worker and the main thread, a blank line between them."""
    prog = tmp_path / "fh.py"
    prog.write_text(textwrap.dedent("""
        import faulthandler, sys, threading
        ev = threading.Event()
        def dumper():
            faulthandler.dump_traceback(sys.stdout, all_threads=True)
            sys.stdout.flush()
            ev.set()
        w = threading.Thread(target=ev.wait, name="idle-worker")
        w.start()
        t = threading.Thread(target=dumper, name="dumper")
        t.start()
        t.join()
        w.join()
    """))
    text = subprocess.run([sys.executable, str(prog)], capture_output=True, text=True, timeout=60, check=True).stdout
    assert text.startswith("Current thread 0x") and text.count("\n\n") == 2, text
    return text


def test_faulthandler_dump_without_its_blank_lines_is_one_process(tmp_path):
    text = _real_faulthandler_dump(tmp_path)
    stripped = "\n".join(ln for ln in text.splitlines() if ln.strip()) + "\n"
    for label, t in (("as written", text), ("blank lines lost", stripped), ("dumped twice", text + text),
                     ("twice, blank lines lost", stripped + stripped)):
        dumps = parse_dump(t, "fh.txt")
        assert [(d.fmt, len(d.threads)) for d in dumps] == [("faulthandler", 3)], (label, [len(d.threads) for d in dumps])


def test_two_processes_faulthandler_dumps_in_one_file_stay_two():
    """The writer's own boundary still separates processes: the real two-rank file of the corpus."""
    dumps = load_dump_file(FIXTURES / "pasted" / "faulthandler_two_ranks_one_file" / "pasted.txt")
    assert len(dumps) == 2 and all(len(d.threads) == 2 for d in dumps)


def test_pystack_and_gdb_dumps_repeated_are_one_process(tmp_path):
    for fmt, src in (("pystack", FIXTURES / "pasted" / "pystack_gloo3" / "rank0.txt"),
                     ("gdb", FIXTURES / "pasted" / "gdb_bt_gloo3" / "rank0.txt")):
        text = "\n".join(ln for ln in src.read_text().splitlines() if not ln.startswith("[Inferior"))
        one = parse_dump(text, "one.txt")
        twice = parse_dump(text + "\n" + text, "twice.txt")
        assert len(one) == 1 and len(twice) == 1, (fmt, len(twice))
        assert twice[0].fmt == fmt and len(twice[0].threads) == len(one[0].threads)
        assert any("2 successive dumps of one process" in n for n in twice[0].notes), (fmt, twice[0].notes)
        f = tmp_path / f"{fmt}_twice.txt"
        f.write_text(text + "\n" + text)
        assert [r.rank for r in analyze_paths([f]).ranks] == [0], fmt


def test_two_single_thread_faulthandler_dumps_are_two_processes(tmp_path):
    """No blank line anywhere (one thread each), but each dump has its own 'Current thread': two processes."""
    prog = "import faulthandler, sys; faulthandler.dump_traceback(sys.stdout, all_threads=True)"
    texts = [subprocess.run([sys.executable, "-c", prog], capture_output=True, text=True, timeout=60,
                            check=True).stdout for _ in range(2)]
    assert all(t.startswith("Current thread 0x") and "\n\n" not in t for t in texts), texts
    ids = {t.split()[2] for t in texts}
    dumps = parse_dump(texts[0] + texts[1], "two.txt")
    assert len(dumps) == len(ids), (ids, [d.threads[0].thread_id for d in dumps])
