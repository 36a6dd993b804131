"""Loading captures from what someone has: an evidence folder, a stacks folder, dump files of any supported format
(:func:`load_captures`, :func:`analyze_paths`); bounded inputs, every file accounted for."""

from __future__ import annotations

import re
from collections import OrderedDict
from pathlib import Path
from typing import Iterable, Optional, Union

from repro.analysis.ranks import analyze
from repro.analysis.types import Analysis
from repro.evidence import Layout
from repro.stacks import ProcessDump, RankCapture, load_dump_file, rank_from_filename, render_pyspy_text


class AnalyzeInputError(ValueError):
    """A path given to :func:`analyze_paths` cannot be used; the message says what was expected."""


EXPECTED_INPUT = ("expected an evidence folder, a stacks/ folder, or dump files (py-spy text or --json, "
                  "faulthandler), one file per rank")  # what `repro analyze` reads, for its error lines

_DUMP_EXTS = (".txt", ".json", ".log", ".dump", ".out")


def _collect_files(paths: Iterable[Union[str, Path]], tag: Optional[str]) -> list[Path]:
    files: list[Path] = []
    for raw in paths:
        p = Path(raw)
        if not p.exists():
            raise AnalyzeInputError(f"{p}: no such file or folder; {EXPECTED_INPUT}")
        if p.is_file():
            files.append(p)
            continue
        if not p.is_dir():
            raise AnalyzeInputError(f"{p}: not a regular file or folder (a FIFO, socket or device); save the dump "
                                    "to a file first and pass that file")
        folder = p / Layout.STACKS.name if (p / Layout.STACKS.name).is_dir() else p
        cands = sorted(f for f in folder.iterdir() if f.is_file() and f.suffix in _DUMP_EXTS
                       and not f.name.startswith(("capture", "analysis", "verdict")))
        if (folder / Layout.STACKS.name).exists() or folder.name == Layout.STACKS.name or any(f.name.startswith("rank") for f in cands):
            rank_files = [f for f in cands if re.match(r"rank\d+", f.name)]
            if rank_files:
                tags = sorted({re.sub(r"^rank\d+", "", f.stem) for f in rank_files})
                if tag is not None:
                    want = tag
                elif "" in tags:
                    want = ""
                else:  # several tagged captures (repro run writes -1, -1b, -2, ...): the newest decided
                    newest = max(rank_files, key=lambda f: (f.stat().st_mtime, f.name))
                    want = re.sub(r"^rank\d+", "", newest.stem)
                if want not in tags:
                    raise AnalyzeInputError(f"{folder}: no capture with tag {want!r}; found tags {tags}")
                cands = [f for f in rank_files if re.sub(r"^rank\d+", "", f.stem) == want]
        if not cands:
            raise AnalyzeInputError(f"{folder}: no dump files (*.txt, *.json, *.log) found; expected rank<k>.txt "
                                    "files or an evidence folder with stacks/")
        files.extend(cands)
    return files


def is_engine_title(title: str) -> bool:
    """A process of a known engine that is not a rank (``sglang::detokenizer``): asked of the adapter registry."""
    from repro.targets.registry import is_engine_title as known

    return known(title)


def _title_examples() -> str:
    from repro.targets.registry import all_adapters

    ex = [a.watch_defaults.title_example for a in all_adapters().values()]
    return " or ".join(e for e in ex if e) or "a rank title"


MAX_RANKS = 1024  # ranks one analysis reads (the readers' per-file bound, repro.readers.assemble.MAX_PROCESSES)


MAX_RAW_TEXT_CHARS = 256 * 1024  # raw dump text kept per rank for reports; longer dumps are re-rendered


def _src(f: Path, d: ProcessDump, multi: bool) -> str:
    return f"{f.name}, block {d.block}" if multi and d.block else f.name


def _one_capture(items: list[tuple[Path, ProcessDump, str]]) -> bool:
    """True when a rank's several dumps are the two formats of one capture: the harness writes py-spy ``--json``
    and text of the same dump (``stacks/rank<k>-<tag>.json`` and ``.txt``). Same file stem, one file each, one
    py-spy JSON among them, and no two different pids; anything else is two captures competing (warned)."""
    files = [x[0] for x in items]
    pids = {x[1].pid for x in items if x[1].pid is not None}
    return (len({f.stem for f in files}) == 1 and len(set(files)) == len(files) and len(pids) <= 1
            and sum(x[1].fmt == "py-spy-json" for x in items) == 1)


def load_captures(paths: Iterable[Union[str, Path]], tag: Optional[str] = None) -> list[RankCapture]:
    """Read dump files/folders (any format :mod:`repro.readers` reads) into one :class:`RankCapture` per rank.

    Every process read is kept as a rank or skipped, with its reason. The rank comes from, in order: the process
    title (every registered adapter's parser, then the data title rules: ``sglang::scheduler_TP1``,
    ``VLLM::Worker_TP0_EP0``; with a PP part ``pp * tp_size + tp``), a rank the text states (``[rank3]:``, an
    mpirun tag, a ``rank 3:`` heading, a watchdog message), the log prefix's name, the file name (``rank<k>``,
    ``tp<k>``) when the file holds one process, else the file order (said so). Skipped: titles that name a
    process that is not a rank (``sglang::detokenizer``, ``VLLM::EngineCore``, ``ray::IDLE``, launchers), a
    process without a title whose frames show a launcher (torchrun's elastic agent), and —
    when other processes carry rank titles — processes whose title names no rank (the HTTP server). When a rank
    has several dumps (``.json`` and ``.txt``) the JSON stacks are used and the text supplies title and raw text;
    a warning names the dumps only when they are different captures (other file stems or pids), not when they are
    the JSON and text of one capture as ``repro run`` writes them.

    Raises:
        AnalyzeInputError: a path does not exist or a folder holds no dump file.
    """
    from repro.readers.rules import not_rank_by_frames
    from repro.readers.titles import identify_title

    files = _collect_files(paths, tag)
    entries: list[tuple[Path, ProcessDump]] = []
    per_file: dict[Path, int] = {}
    for f in files:
        for d in load_dump_file(f):
            entries.append((f, d))
            per_file[f] = per_file.get(f, 0) + 1
    infos = [identify_title(d.title) if d.title else None for _, d in entries]
    ranked = [i for i in infos if i is not None and i.role == "rank" and i.tp is not None]
    pp_any = any(i.pp is not None for i in ranked)
    tp_size = 1 + max((i.tp or 0) for i in ranked) if ranked else 1
    per_rank: "OrderedDict[int, list[tuple[Path, ProcessDump, str]]]" = OrderedDict()
    unranked: list[tuple[Path, ProcessDump]] = []
    skipped: list[str] = []
    skipped_inputs: list[dict] = []

    def skip(f: Path, d: ProcessDump, reason: str) -> None:
        multi = per_file[f] > 1
        skipped.append(f"{_src(f, d, multi)}: skipped pid {d.pid} {d.title[:60]!r} ({reason})")
        skipped_inputs.append({"file": _src(f, d, multi), "block": 0, "format": d.fmt, "pid": d.pid,
                               "title": d.title, "kept": False, "rank": None, "reason": reason})

    for (f, d), info in zip(entries, infos):
        multi = per_file[f] > 1
        if info is not None and info.role == "not-rank":
            skip(f, d, info.reason)
            continue
        if multi and not d.threads and d.fmt == "unknown":
            continue  # a part of a file with nothing readable: its warnings stay in the file's other dumps
        if info is None and d.threads:
            by_frames = not_rank_by_frames([(fr.function, fr.module_or_file) for t in d.threads
                                            for fr in t.python_frames])
            if by_frames:
                skip(f, d, by_frames)
                continue
        r: Optional[int] = None
        how = ""
        if info is not None and info.tp is not None:
            r = (info.pp or 0) * tp_size + info.tp if pp_any else info.tp
            how = info.reason
        if r is None and d.rank_hint is not None:
            r, how = d.rank_hint, d.rank_hint_source
        if r is None and d.label:
            r = rank_from_filename(d.label)
            how = f"log prefix {d.label!r}" if r is not None else ""
        if r is None and not multi:
            r = rank_from_filename(f.name)
            how = f"file name {f.name!r}" if r is not None else ""
        if r is None and ranked and info is None and d.title:
            skip(f, d, f"its title names no rank while other processes' titles do (such as {_title_examples()})")
            continue
        if r is None and info is not None and info.reason and not how:
            how = info.reason
        if r is None:
            unranked.append((f, d, how))
        else:
            per_rank.setdefault(r, []).append((f, d, how))
    next_rank = 0
    if len(per_rank) + len(unranked) > MAX_RANKS:
        # more ranks than one job's dumps plausibly hold (issue 29 item 1): the lowest-numbered ones are analysed,
        # then those numbered in file order; the rest are counted in one warning, never listed one by one
        ranked_keep = sorted(per_rank)[:MAX_RANKS]
        cut = len(per_rank) - len(ranked_keep) + max(0, len(unranked) - (MAX_RANKS - len(ranked_keep)))
        per_rank = OrderedDict((r, per_rank[r]) for r in ranked_keep)
        unranked = unranked[:MAX_RANKS - len(ranked_keep)]
        skipped.append(f"{cut} more ranks beyond the first {MAX_RANKS} not read (more than the world size one job's "
                       "dumps plausibly hold); analyze the ranks you need, or split the input per job")
    for f, d, how in unranked:
        while next_rank in per_rank:
            next_rank += 1
        multi = per_file[f] > 1
        w = (f"{_src(f, d, multi)}: no rank in the process title, prefixes or file name; numbered rank {next_rank} "
             "in file order (name files rank<k>.txt, or keep the [rankN] prefixes, to say)")
        per_rank[next_rank] = [(f, d.model_copy(update={"warnings": d.warnings + [w]}),
                                "file order" + (f"; {how}" if how else ""))]
    caps: list[RankCapture] = []
    for r in sorted(per_rank):
        items = per_rank[r]
        withthreads = [x for x in items if x[1].threads]
        best = next((x for x in withthreads if x[1].fmt == "py-spy-json"), withthreads[0] if withthreads else items[0])
        f, d, how = best
        title = next((x[1].title for x in items if x[1].title), d.title)
        pid = next((x[1].pid for x in items if x[1].pid is not None), None)
        non_json = [x for x in items if x[1].fmt != "py-spy-json"]
        raw = ""
        if non_json and per_file[non_json[0][0]] == 1 and non_json[0][0].stat().st_size <= MAX_RAW_TEXT_CHARS:
            raw = non_json[0][0].read_bytes().decode("utf-8", errors="replace")  # the file as given
        if not raw:
            raw = render_pyspy_text(d.threads, pid, title)
        warnings = [w for x in items for w in x[1].warnings]
        if len(items) > 1 and not _one_capture(items):
            warnings.append(f"rank {r}: {len(items)} dumps found ({', '.join(_src(x[0], x[1], per_file[x[0]] > 1) for x in items)}); "
                            f"used {_src(f, d, per_file[f] > 1)}")
        method = "faulthandler" if d.fmt == "faulthandler" else "file"
        how = "file order" if how.startswith("file order") else (how or "rank given")
        caps.append(RankCapture(rank=r, pid=pid, label=Layout.stack_label(r), ok=bool(d.threads), method=method,
                                error="" if d.threads else "; ".join(d.warnings) or "no stack in the dump",
                                text=raw, threads=d.threads, title=title, warnings=warnings, fmt=d.fmt,
                                source=_src(f, d, per_file[f] > 1), rank_source=how, notes=list(d.notes),
                                backend=d.backend, op=d.op, group_kind=d.group_kind))
    if skipped and caps:
        caps[0] = caps[0].model_copy(update={"warnings": skipped + caps[0].warnings, "inputs": skipped_inputs})
    return caps


def analyze_paths(paths: Iterable[Union[str, Path]], tag: Optional[str] = None) -> Analysis:
    """Analyse dumps on disk: an evidence folder (its ``stacks/``), a stacks folder, or loose dump files.

    Args:
        paths: folders and/or files; one file per rank, or files holding several processes' dumps.
        tag: which capture of an evidence folder (file suffix after ``rank<k>``, e.g. ``-1b``); default the
            untagged one if present, else the newest (the confirming capture of ``repro run``).
    Raises:
        AnalyzeInputError: a path does not exist or holds no dump (message says what was expected).
    """
    return analyze(load_captures(paths, tag))
