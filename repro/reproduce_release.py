"""Which engine release ``repro reproduce`` maps a dump onto, and why (issue 34, ``repro.releases``).

Order: ``--release V`` (forced); else what the report says (a pasted ``python3 -m sglang.check_env`` block, a log's
version line) in ``--report`` files, the dump files themselves, and the ``*.txt`` / ``*.log`` / ``*.md`` at the top
of dump folders; else the range of releases the dump's frames fit (``repro.releases.infer_releases``: module,
function, line inside the function's span; releases whose factory never builds the frames' classes left out), the
newest of them that is set up, else the newest. The chosen release's interpreter maps and runs the candidates,
unless ``--python`` was given (then the choice is reported only). Nothing is imported from the engine.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

from repro.frames import is_injector_frame, is_ledger_frame
from repro.readers.types import RankCapture
from repro.releases import FrameRef, ReleaseChoice, ReleaseError, choose_release, load_index, release_python, release_setup

MAX_REPORT_BYTES = 1 << 20  # read at most this much of one report / log file
REPORT_SUFFIXES = (".txt", ".log", ".md")


def report_texts(dump_paths: Sequence[str], reports: Sequence[str] = ()) -> list[tuple[str, str]]:
    """``(source, text)`` of every file that may name the release: the ``--report`` files first, then the dump
    files, then the top-level ``*.txt``/``*.log``/``*.md`` of dump folders (each read up to
    :data:`MAX_REPORT_BYTES`; unreadable files, folders and FIFOs skipped)."""
    files: list[Path] = [Path(r) for r in reports if Path(r).is_file()]  # a FIFO would block the read for ever
    for p in map(Path, dump_paths):
        if p.is_file():
            files.append(p)
        elif p.is_dir():
            files += sorted(f for f in p.iterdir() if f.is_file() and f.suffix in REPORT_SUFFIXES)
    out = []
    for f in files:
        try:
            with open(f, "rb") as fh:
                out.append((str(f), fh.read(MAX_REPORT_BYTES).decode("utf-8", errors="replace")))
        except OSError:
            continue
    return out


def dump_frames(captures: Sequence[RankCapture]) -> list[FrameRef]:
    """Every Python frame of every thread of every rank (injector and ledger frames left out: a reproduction's own
    wrappers say nothing about the release), as inference reads them."""
    out, seen = [], set()
    for c in captures:
        for t in c.threads:
            for f in t.frames:
                if f.native or is_injector_frame(f) or is_ledger_frame(f):
                    continue
                key = (f.module_or_file, f.function, f.line)
                if key not in seen:
                    seen.add(key)
                    out.append(FrameRef(*key))
    return out


def pick_release(adapter: Any, captures: Sequence[RankCapture], dump_paths: Sequence[str], *,
                 reports: Sequence[str] = (), forced: Optional[str] = None,
                 python: Optional[str] = None) -> tuple[Optional[str], ReleaseChoice]:
    """The interpreter to map and run on, and the release choice.

    Returns:
        ``(interpreter or None, choice)``: None when ``--python`` was given (the caller uses it) or no release was
        inferred (the caller keeps its default interpreter).
    Raises:
        ReleaseError: ``--release`` / the report names a release the index does not know, or the chosen release
            is not set up and no ``--python`` was given (one line: the choice, why, and the command that sets it up).
    """
    try:
        index = load_index(adapter)
    except ReleaseError as e:
        if forced:
            raise
        return None, ReleaseChoice(None, "none", str(e))
    choice = choose_release(index, forced=forced, texts=report_texts(dump_paths, reports), frames=dump_frames(captures),
                            is_set_up=lambda v: release_setup(v, adapter).python is not None)
    if reports and choice.source != "report":  # a --report that named nothing is said, never silently passed over
        choice.reason += (f" ({', '.join(map(str, reports))} named no {index.engine} release: no line like "
                          f"'{index.engine}: 0.5.18', '{index.engine}==0.5.18' or '{index.engine} version 0.5.18')")
    if python or choice.version is None:
        if python and choice.version:
            choice.reason += f" (--python {python} given: the frames are mapped onto that interpreter's engine)"
        return None, choice
    try:
        return release_python(choice.version, adapter), choice
    except ReleaseError as e:
        raise ReleaseError(f"{choice.reason}; {e}; or map onto one that is set up with --release V / --python PATH") from None
