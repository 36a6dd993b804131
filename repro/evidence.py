"""The store: one evidence folder per run, its layout named in one place, a typed reader and writer per file.

Layout: ``evidence/<scenario>/<UTC-time>-<label>/`` with ``evidence/<scenario>/latest`` pointing at the newest run.
``run.json`` says ``running`` from the start and ``complete`` or ``interrupted`` at the end, so a folder left by a
harness that was killed reads as partial, not as a silent success. ``verdict.json`` is written atomically and last.

Every file of a folder is a **member** of :class:`EvidenceDir` (``evd.verdict``, ``evd.plan``, ``evd.server_log``,
…, and per process / per rank ``evd.fire_log(pid)``, ``evd.stack_text(rank, tag)``): the file names are written
here and nowhere else in ``repro/``. A member is a :class:`File` bound to the folder: ``.path``, ``.exists()``,
``.read()`` (typed: a pydantic record for JSON files with a known shape, ``list[dict]`` for JSON lines, ``str``
for text) and ``.write(data)`` (atomic; a record or a dict of its shape). A file that is truncated, not JSON or of
the wrong shape raises :class:`EvidenceFileError` naming the file, what it should hold and what to do.

Members (who writes each one; ``repro.runner`` unless said):

==========================  ===================================================================================
``run.json``                life-cycle (``running`` / ``complete`` / ``interrupted`` / ``cleaned-up``)
``verdict.json``            the verdict, written last (:class:`VerdictRecord`; runs and the watch alike)
``REPORT.md``               the PR-ready page (``repro.report``; the watch's own for a watch folder)
``scenario.toml``           the scenario as run; ``plan.json`` the plan the injector reads; ``ARM`` the arm file
``command.txt``             the command that reproduces the run; ``env.json`` versions (:class:`EnvRecord`)
``server.log``              the server tree's output; ``requests.jsonl`` the driver's request history
``processes.json``          the server tree (``repro.procs``); ``owned_dirs.json`` temp folders it owns
``teardown.json``           what survived the stop; ``stalls.json`` each capture's judgement
``analysis.json``           the deciding capture's analysis; ``analysis-first.json`` the watch's first capture
``ledger.json``             the collective ledgers' alignment (``repro.ledger``); ``timeline.svg`` its picture
``proof.json``              the ledger proof of a deadlock (``repro.proof``); ``rank_deaths.json`` dead ranks
``session.json``            a run folder of a multi-variant session; ``serve.json`` a ``repro serve`` server
``injector/``               ``loaded-<pid>.json``, ``fires-<pid>.jsonl``, ``ledger-<pid>[.N].jsonl``,
                            ``digest-<pid>[.N].jsonl``, ``faulthandler-<pid>.txt``, ``ticks-<pid>.txt``,
                            ``errors.log`` (written by the injector, which names them in ``repro_injector/files.py``)
``stacks/``                 ``rank<k><tag>.txt`` / ``.json`` (``repro.capture``)
watch folders               ``watch.json``, ``probes.jsonl``, ``hang.json``, ``metrics.txt``, ``on_hang.json``,
                            ``on_hang.log``
compare folders             ``COMPARISON.md``, ``compare.json``
hunt folders                ``HUNT.md``, ``hunt.jsonl``, ``matrix.json``, ``scenarios/`` (``baseline.toml``,
                            ``trials.toml``, ``<trial>.toml``, ``workload-<w>.toml``), ``FINDING-<w>.md``,
                            ``findings/<trial>/FINDING.md``, ``discovery/`` (``DISCOVERY.md``, ``discover.json``,
                            ``catalogue.toml``, ``PRECISION.md``, ``tally.json``)
reproduce folders           ``REPRODUCTION.md``, ``reproduce.toml``, ``reproducer.toml``
bisect folders              ``BISECT.md``, ``bisect.json``
``servers/<role>/``         a multi-server run (``repro.pd``): each engine server's own run folder; ``stack.json``
``hosts/<host>/``           a run across hosts (``repro.multihost``): each host's ``injector/`` and ``server.log``;
                            ``hosts.json``, ``links.json``
==========================  ===================================================================================
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Generic, Optional, Type, TypeVar, Union

from pydantic import BaseModel, ConfigDict, Field, ValidationError

DEFAULT_EVIDENCE_DIR = Path("evidence")


def utc_stamp(t: Optional[float] = None) -> str:
    """``20261130T055501Z`` for ``t`` (seconds since the epoch; default now)."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(t))


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to ``path`` via a temporary file in the same folder and ``os.replace`` (never half-written)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, default=str)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """Write text to ``path`` atomically (temporary file + ``os.replace``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=str(path.parent))
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _own_create_time() -> Optional[float]:
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # pragma: no cover - psutil is a dependency; be safe in odd sandboxes
        return None


def _slug(text: str) -> str:
    """``text`` as one safe path component: other characters become ``-``; empty or only dots (``.``, ``..``: the
    folder itself or its parent, e.g. a hunt shard's folder named ``x/..``) becomes ``run``."""
    s = re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-")
    return s if s.strip(".") else "run"


class EvidenceError(OSError):
    """The evidence folder cannot be written; the message names the path and the fix."""


class EvidenceFileError(ValueError):
    """A file of an evidence folder is missing, truncated, not JSON or of the wrong shape.

    The message names the file, what it should hold and the fix; ``path`` is the file.
    """

    def __init__(self, path: Path, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = Path(path)


# ------------------------------------------------------------------------------------------------------ records
class _Record(BaseModel):
    """A JSON file's typed view: known fields typed, unknown fields kept (files may gain fields)."""

    model_config = ConfigDict(extra="allow")

    def to_json(self) -> dict:
        """The record as the plain dict written to disk (unset optional fields left out)."""
        return self.model_dump(mode="json", exclude_unset=True)


class RunStatus(_Record):
    """``run.json``: ``status`` is ``running`` / ``complete`` / ``interrupted`` / ``cleaned-up``; ``time`` epoch
    seconds; ``pid`` / ``harness_create_time`` identify the harness process (``repro cleanup`` checks them)."""

    status: str
    time: float
    pid: Optional[int] = None
    harness_create_time: Optional[float] = None


class VerdictRecord(_Record):
    """``verdict.json`` of a run, a served session's run or a watch hang (one shape for all).

    Attributes:
        verdict: ``DEADLOCKED`` / ``ALL REQUESTS SUCCEEDED`` / ``INCONCLUSIVE``; reason: one sentence; notes: more.
        exit_code: the process exit code this verdict gave (``repro.verdict.exit_code_for``).
        scenario / variant / variant_expects / expect: what ran (a watch: ``scenario`` = its folder name, no variant).
        partial: the run was interrupted; timings: seconds by phase; rank_pids: rank (as a string) -> pid.
        evidence: this folder; kind: ``run`` or ``watch`` (a watch also says ``hang``: the /health label).
        state_divergence: the first divergent lockstep state (``repro.state_digest``; never changes the verdict);
            None in folders written before the state digest, or without a ledger.
    """

    verdict: str
    reason: str = ""
    notes: list[str] = Field(default_factory=list)
    exit_code: Optional[int] = None
    scenario: Optional[str] = None
    variant: Optional[str] = None
    variant_expects: Optional[str] = None
    expect: Optional[str] = None
    partial: bool = False
    timings: dict[str, float] = Field(default_factory=dict)
    rank_pids: dict[str, int] = Field(default_factory=dict)
    evidence: Optional[str] = None
    kind: str = "run"
    state_divergence: Optional[dict[str, Any]] = None  # repro.state_digest.StateDivergence.to_dict(); None: older

    def pids(self) -> list[int]:
        """The rank pids, in rank order (empty when none were recorded)."""
        return [int(v) for _, v in sorted(self.rank_pids.items(), key=lambda kv: int(kv[0]))]


class PlanRecord(_Record):
    """``plan.json``: the injector's contract (``repro.scenario.compile_plan`` documents every field); typed here
    are the fields the harness reads back: ``arm_file``, ``out_dir`` and the injection ids."""

    arm_file: str
    out_dir: Optional[str] = None
    injections: list[dict] = Field(default_factory=list)

    def injection_ids(self) -> list[str]:
        return [str(i.get("id")) for i in self.injections]


class EnvRecord(_Record):
    """``env.json``: versions — harness python, platform, target interpreter, the run's engine (``engine``: the
    adapter's name) and the python/torch/engine versions the injector saw inside the server (``engine_version``;
    also under the engine's distribution name, e.g. ``sglang``, which older folders have alone: kept as an extra
    field), py-spy's version and path (``py-spy 0.4.3 (/usr/bin/py-spy)``; folders before 2026-12-06 hold the path
    alone). All optional (``None`` / absent: unknown)."""

    harness_python: Optional[str] = None
    platform: Optional[str] = None
    target_python: Optional[str] = None
    engine: Optional[str] = None
    engine_version: Optional[str] = None
    python: Optional[str] = None
    torch: Optional[str] = None
    py_spy: Optional[str] = None
    testbed: Optional[str] = None  # the release testbed that ran, e.g. "sglang 0.5.20 (overlay: its wheel over the 0.5.18 venv)"


class ServeRecord(_Record):
    """``serve.json`` of a ``repro serve`` server: URL, root pid, rank (string) -> pid, injections, arm file."""

    url: str
    pid: Optional[int] = None
    rank_pids: dict[str, int] = Field(default_factory=dict)
    injections: list[str] = Field(default_factory=list)
    arm_file: Optional[str] = None

    def ranks(self) -> dict[int, int]:
        return {int(k): int(v) for k, v in self.rank_pids.items()}


class SessionRecord(_Record):
    """``session.json`` of a run folder driven on a shared server: the session folder and the rank pids."""

    session: str
    rank_pids: dict[str, int] = Field(default_factory=dict)
    hunt: Optional[str] = None


class TeardownRecord(_Record):
    """``teardown.json``: pids still alive after the stop (empty: the whole tree ended) and when."""

    left_running: list[int] = Field(default_factory=list)
    time: float
    # seconds between SIGTERM and SIGKILL; 0: no SIGTERM, SIGKILL at once (repro.runner.WEDGED_STOP_GRACE_S, wedged)
    grace_s: Optional[float] = None
    wedged: Optional[bool] = None  # the burst left the tree deadlocked / desynced / with a dead rank
    stop_s: Optional[float] = None  # seconds the stop took


R = TypeVar("R")


# ------------------------------------------------------------------------------------------------------ members
@dataclass(frozen=True)
class Member:
    """One file (or folder) of an evidence folder: its name relative to the folder, its format, what it holds.

    ``kind``: ``json`` (read into ``record`` when given, else any JSON value), ``jsonl`` (list of dicts; a torn
    last line is skipped, a malformed line before it is an error), ``text``, ``dir``.
    """

    name: str
    kind: str
    what: str
    record: Optional[Type[BaseModel]] = None

    def at(self, folder: Union[str, Path]) -> Path:
        """This member's path in ``folder`` (an evidence folder that may not exist, or one opened elsewhere)."""
        return Path(folder) / self.name


class File(Generic[R]):
    """A :class:`Member` bound to one folder: ``path``, ``exists()``, typed ``read()`` and atomic ``write()``."""

    def __init__(self, folder: Path, member: Member) -> None:
        self.member = member
        self.path = Path(folder) / member.name

    def __fspath__(self) -> str:
        return str(self.path)

    def __repr__(self) -> str:
        return f"File({self.path})"

    def exists(self) -> bool:
        return self.path.exists()

    # -- reading
    def read(self, missing_ok: bool = False, numbered: bool = False) -> Any:
        """The file's content, typed by the member's kind.

        Args:
            missing_ok: return None for a missing file instead of raising.
            numbered: a ``jsonl`` member only: ``(1-based line number, value)`` pairs, so that a reader checking the
                lines' shape can name the line (the values are whatever JSON each line holds, not only objects).
        Raises:
            EvidenceFileError: missing (unless ``missing_ok``), unreadable, not JSON, or not of the record's shape.
        """
        m = self.member
        try:
            if m.kind == "jsonl":
                lines = self._read_jsonl()
                return lines if numbered else [v for _, v in lines]
            text = self.path.read_text(encoding="utf-8", errors="replace" if m.kind == "text" else "strict")
        except FileNotFoundError:
            if missing_ok:
                return None
            raise EvidenceFileError(self.path, f"not found (expected {m.what}); is this the folder the harness "
                                               "printed, and did that run get this far?") from None
        except (OSError, UnicodeDecodeError) as e:
            raise EvidenceFileError(self.path, f"cannot be read ({e}); expected {m.what}") from None
        if m.kind == "text":
            return text
        try:
            data = json.loads(text)
        except json.JSONDecodeError as e:
            trunc = " (truncated: the writer was stopped mid-write?)" if e.pos >= len(text.rstrip()) else ""
            raise EvidenceFileError(self.path, f"not valid JSON at line {e.lineno} column {e.colno}: {e.msg}{trunc}; "
                                               f"expected {m.what}; re-run, or remove the file") from None
        if m.record is None:
            return data
        try:
            return m.record.model_validate(data)
        except ValidationError as e:
            err = e.errors()[0]
            loc = ".".join(str(x) for x in err.get("loc", ())) or "(top level)"
            raise EvidenceFileError(self.path, f"field {loc}: {err.get('msg')}; expected {m.what}") from None

    def _read_jsonl(self) -> list[tuple[int, Any]]:
        out: list[tuple[int, Any]] = []
        with open(self.path, encoding="utf-8", errors="replace") as f:
            lines = f.read().split("\n")
        last = max((i for i, ln in enumerate(lines) if ln.strip()), default=-1)
        for i, line in enumerate(lines):
            if not line.strip():
                continue
            try:
                out.append((i + 1, json.loads(line)))
            except json.JSONDecodeError as e:
                if i == last:
                    break  # a torn last line: the writer was killed mid-line
                raise EvidenceFileError(self.path, f"line {i + 1} is not JSON ({e.msg}); expected {self.member.what}, "
                                                   "one JSON object per line") from None
        return out

    # -- writing
    def append(self, record: dict) -> Path:
        """Append one JSON line to a ``jsonl`` member (a stream written as it happens: a reader skips a torn last
        line). Not atomic, by design: what was appended before a kill stays."""
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(json.dumps(record, default=str) + "\n")
        return self.path

    def write(self, data: Any) -> Path:
        """Write atomically: a record, or data of the record's shape (checked first), or text for a text member.

        Raises:
            EvidenceFileError: ``data`` does not have the member's shape (nothing is written).
        """
        m = self.member
        if m.kind == "text":
            write_text_atomic(self.path, str(data))
        elif m.kind == "jsonl":
            write_text_atomic(self.path, "".join(json.dumps(r, default=str) + "\n" for r in data))
        else:
            if isinstance(data, BaseModel):
                data = data.to_json() if isinstance(data, _Record) else data.model_dump(mode="json")
            elif m.record is not None:
                try:
                    m.record.model_validate(data)
                except ValidationError as e:
                    err = e.errors()[0]
                    loc = ".".join(str(x) for x in err.get("loc", ())) or "(top level)"
                    raise EvidenceFileError(self.path, f"refusing to write: field {loc}: {err.get('msg')}; "
                                                       f"expected {m.what}") from None
            write_json_atomic(self.path, data)
        return self.path


def _member(name: str, kind: str, what: str, record: Optional[Type[BaseModel]] = None) -> Member:
    return Member(name, kind, what, record)


class Layout:
    """Every file name of an evidence folder, once (see the module docstring for who writes what)."""

    RUN = _member("run.json", "json", "the run's life-cycle {status, time, pid, harness_create_time}", RunStatus)
    VERDICT = _member("verdict.json", "json", "the verdict {verdict, reason, notes, exit_code, …}", VerdictRecord)
    REPORT = _member("REPORT.md", "text", "the run's report (markdown)")
    SCENARIO = _member("scenario.toml", "text", "the scenario file as run")
    PLAN = _member("plan.json", "json", "the injector plan {arm_file, out_dir, injections, …}", PlanRecord)
    ARM = _member("ARM", "text", "the arm file: one armed injection id per line")
    COMMAND = _member("command.txt", "text", "the command that reproduces the run")
    ENV = _member("env.json", "json", "versions {harness_python, platform, target_python, engine, engine_version, torch, …}", EnvRecord)
    SERVER_LOG = _member("server.log", "text", "the server tree's stdout and stderr")
    REQUESTS = _member("requests.jsonl", "jsonl", "the driver's request history")
    PROCESSES = _member("processes.json", "json", "the server tree's processes (repro.procs.save_procs)")
    OWNED_DIRS = _member("owned_dirs.json", "json", "a JSON list of temp folders the server owned")
    TEARDOWN = _member("teardown.json", "json", "{left_running: [pid…], time, grace_s, wedged, stop_s}", TeardownRecord)
    STALLS = _member("stalls.json", "json", "a JSON list of each capture's judgement")
    ANALYSIS = _member("analysis.json", "json", "the stack analysis (repro.analysis.Analysis)")
    ANALYSIS_FIRST = _member("analysis-first.json", "json", "the first capture's stack analysis")
    LEDGER = _member("ledger.json", "json", "the collective ledgers' alignment (repro.ledger.LedgerDiagnosis)")
    TIMELINE = _member("timeline.svg", "text", "the per-rank collective timeline (SVG)")
    PROOF = _member("proof.json", "json", "the ledger proof of a deadlock (the wait edges; repro.proof)")
    RANK_DEATHS = _member("rank_deaths.json", "json", "rank processes that died during the run (repro.checker)")
    STACK = _member("stack.json", "json", "a multi-server topology's servers (repro.pd)")
    SESSION = _member("session.json", "json", "{session, rank_pids} of a run on a shared server", SessionRecord)
    SERVE = _member("serve.json", "json", "{url, pid, rank_pids, injections, arm_file} of `repro serve`", ServeRecord)
    WATCH = _member("watch.json", "json", "the watch's options")
    PROBES = _member("probes.jsonl", "jsonl", "the watch's probes before the hang")
    HANG = _member("hang.json", "json", "the watch's hang record")
    METRICS = _member("metrics.txt", "text", "the server's /metrics text")
    ON_HANG = _member("on_hang.json", "json", "the --on-hang command's result")
    ON_HANG_LOG = _member("on_hang.log", "text", "the --on-hang command's output")
    COMPARISON = _member("COMPARISON.md", "text", "the before/after comparison (markdown)")
    COMPARE_JSON = _member("compare.json", "json", "the before/after comparison (JSON)")
    HUNT_MD = _member("HUNT.md", "text", "the hunt's findings (markdown)")
    HUNT_JSONL = _member("hunt.jsonl", "jsonl", "the hunt's events and trial results")
    HOSTS_JSON = _member("hosts.json", "json", "the nodes of a run across hosts: rank -> host and pid there (repro.multihost)")
    LINKS = _member("links.json", "json", "each host's data link, as a run across hosts checked it (repro.multihost)")
    MATRIX = _member("matrix.json", "json", "the hunt matrix's server groups (repro.hunt.matrix)")
    FINDING = _member("FINDING.md", "text", "a confirmed hunt finding, ready to file upstream (findings/<trial>/)")
    HUNT_BASELINE = _member("baseline.toml", "text", "the hunt's observe-only baseline scenario (in scenarios/)")
    HUNT_TRIALS = _member("trials.toml", "text", "the hunt's trial scenario, every trial a variant (in scenarios/)")
    DISCOVERY_MD = _member("DISCOVERY.md", "text", "what discovery scanned and proposed (in discovery/)")
    DISCOVERY_JSON = _member("discover.json", "json", "discovery's scan and candidates (in discovery/)")
    DISCOVERY_POINTS = _member("catalogue.toml", "text", "the points discovery added, as hunt catalogue TOML (in discovery/)")
    PRECISION = _member("PRECISION.md", "text", "discovery judged by the hunt (in discovery/)")
    TALLY = _member("tally.json", "json", "discovery's points reached / fired / deadlocked in the hunt (in discovery/)")
    REPRODUCTION = _member("REPRODUCTION.md", "text", "what `repro reproduce` found (markdown)")
    REPRODUCE_SCENARIO = _member("reproduce.toml", "text", "the scenario `repro reproduce` wrote: one variant per candidate")
    REPRODUCER = _member("reproducer.toml", "text", "the scenario of the candidate that reproduced the hang")
    BISECT_MD = _member("BISECT.md", "text", "the release bisection (markdown)")
    BISECT_JSON = _member("bisect.json", "json", "the release bisection (JSON)")
    INJECTOR = _member("injector", "dir", "the injector's records")
    STACKS = _member("stacks", "dir", "captured stacks")
    HUNT_SCENARIOS = _member("scenarios", "dir", "scenario files the hunt wrote")
    SERVERS = _member("servers", "dir", "one evidence folder per engine server of a multi-server topology (repro.pd)")
    HOSTS = _member("hosts", "dir", "one folder per host of a run across hosts: its injector records and log")
    FINDINGS = _member("findings", "dir", "one folder per confirmed hunt finding (FINDING.md)")
    DISCOVERY = _member("discovery", "dir", "what `repro hunt --discover` proposed and how it fared")
    # inside injector/ (written by injectors/repro_injector, which names them in its files.py; read by
    # repro.injection_records, repro.ledger and repro.state_digest; tests/test_store_names.py checks both agree)
    LOADED_GLOB = "loaded-*.json"
    FIRES_GLOB = "fires-*.jsonl"
    FAULTHANDLER_GLOB = "faulthandler-*.txt"
    LEDGER_GLOB = "ledger-*.jsonl"
    LEDGER_FILE_RE = re.compile(r"^ledger-(\d+)(?:\.(\d+))?\.jsonl$")
    DIGEST_FILE_RE = re.compile(r"^digest-(\d+)(?:\.(\d+))?\.jsonl$")
    INJECTOR_ERRORS = "errors.log"

    @staticmethod
    def loaded_marker(pid: int) -> str:
        """``loaded-<pid>.json``: the injector's loaded marker of process ``pid``."""
        return f"loaded-{pid}.json"

    @staticmethod
    def fire_log(pid: int) -> str:
        """``fires-<pid>.jsonl``: the fire log of process ``pid``."""
        return f"fires-{pid}.jsonl"

    @staticmethod
    def ledger_file(pid: int, part: int = 0) -> str:
        """``ledger-<pid>.jsonl`` (part 0) or ``ledger-<pid>.<part>.jsonl``: the collective ledger of ``pid``."""
        return f"ledger-{pid}.{part}.jsonl" if part else f"ledger-{pid}.jsonl"

    @staticmethod
    def ledger_stem(key: Any) -> str:
        """``ledger-<key>``: what a ledger file's name starts with (``key``: a pid, or a rank in a hosts' mirror)."""
        return f"ledger-{key}"

    @staticmethod
    def digest_file(pid: int, part: int = 0) -> str:
        """``digest-<pid>.jsonl`` (part 0) or ``digest-<pid>.<part>.jsonl``: the state digest's ring of ``pid``."""
        return f"digest-{pid}.{part}.jsonl" if part else f"digest-{pid}.jsonl"

    @staticmethod
    def faulthandler_file(pid: int) -> str:
        """``faulthandler-<pid>.txt``: the in-process stack dumps of ``pid``."""
        return f"faulthandler-{pid}.txt"

    @staticmethod
    def mp_names_file(pid: int) -> str:
        """``mpnames-<pid>.txt``: names process ``pid`` registered with multiprocessing's resource tracker
        (``<rtype> <name>`` lines: ``semaphore /mp-…``); the launcher unlinks their /dev/shm files at stop."""
        return f"mpnames-{pid}.txt"

    @staticmethod
    def mp_names_glob() -> str:
        """``mpnames-*.txt``: every :meth:`mp_names_file` of a folder (a shell / ``glob`` pattern)."""
        return "mpnames-*.txt"

    @staticmethod
    def ticks_file(pid: int) -> str:
        """``ticks-<pid>.txt``: every scheduler tick's start (benchmarks only)."""
        return f"ticks-{pid}.txt"

    @staticmethod
    def workload_finding(workload: str) -> str:
        """``FINDING-<workload>.md``: a hunt workload that hung with no perturbation."""
        return f"FINDING-{workload}.md"

    @staticmethod
    def workload_scenario(workload: str) -> str:
        """``workload-<workload>.toml`` (in scenarios/): that workload's scenario, no injection."""
        return f"workload-{workload}.toml"

    @staticmethod
    def trial_scenario(trial: str) -> str:
        """``<trial>.toml`` (in scenarios/): a hunt trial's ready-to-run scenario."""
        return f"{trial}.toml"

    @staticmethod
    def pid_of(name: str) -> Optional[int]:
        """The pid in ``loaded-<pid>.json`` / ``fires-<pid>.jsonl`` / ``ledger-<pid>[.N].jsonl``; None otherwise."""
        m = re.match(r"^(?:loaded|fires|ledger|faulthandler)-(\d+)(?:\.\d+)?\.(?:json|jsonl|txt)$", name)
        return int(m.group(1)) if m else None

    @staticmethod
    def stack_label(rank: int) -> str:
        """``rank0``: the stem of rank ``rank``'s files in ``stacks/`` (``repro.capture`` appends tag and suffix)."""
        return f"rank{rank}"

    @staticmethod
    def server_dir(folder: Union[str, Path], role: str) -> Path:
        """``<folder>/servers/<role>/``: one engine server's folder of a multi-server run (``role`` may be a glob)."""
        return Path(folder) / Layout.SERVERS.name / role

    @staticmethod
    def host_dir(folder: Union[str, Path], name: str) -> Path:
        """``<folder>/hosts/<host>/``: one host's folder of a run across hosts."""
        return Path(folder) / Layout.HOSTS.name / name

    @staticmethod
    def capture_meta(tag: str = "") -> str:
        """``capture-1.json``: what capture ``tag`` did per process (in ``stacks/``; ``repro.capture``)."""
        return f"capture{tag}.json"

    @staticmethod
    def stack_name(rank: int, tag: str = "", ext: str = "txt") -> str:
        """``rank0-1.txt``: rank ``rank``'s capture ``tag`` (``""``, ``-1``, ``-1b``, ``-2``…), text or ``json``."""
        return f"{Layout.stack_label(rank)}{tag}.{ext}"


class EvidenceDir:
    """One evidence folder (a run's, a watch hang's, a comparison's or a hunt's) and its named members.

    ``EvidenceDir(root, scenario, label)`` creates a new folder ``<root>/<scenario>/<UTC-time>-<label>/`` (with
    ``injector/`` and ``stacks/``, ``latest`` pointing at it, ``run.json`` = running); :meth:`open` wraps an
    existing one without changing it.

    Args:
        root: the evidence root (default ``./evidence``).
        scenario: scenario name (first path level).
        label: run label (variant name by default), part of the folder name.
    Raises:
        EvidenceError: the folder cannot be created (message names the path and ``--evidence-dir``).
    """

    layout = Layout

    def __init__(self, root: Path, scenario: str, label: str) -> None:
        self.root = Path(root)
        base = self.root / _slug(scenario)
        name = f"{utc_stamp()}-{_slug(label)}"
        path = base / name
        n = 2
        try:
            base.mkdir(parents=True, exist_ok=True)
            while True:
                try:
                    path.mkdir()
                    break
                except FileExistsError:
                    path = base / f"{name}-{n}"
                    n += 1
        except OSError as e:
            raise EvidenceError(f"cannot create the evidence folder under {base}: {e.strerror}; choose another with --evidence-dir") from None
        self.path = path
        self.scenario_dir = base
        for sub in (Layout.INJECTOR.name, Layout.STACKS.name):
            (path / sub).mkdir(exist_ok=True)
        self._update_latest()
        self.set_status("running")

    @classmethod
    def open(cls, path: Union[str, Path]) -> "EvidenceDir":
        """An existing folder, unchanged (no ``latest`` link, no ``run.json`` written).

        Raises:
            EvidenceFileError: ``path`` is not a folder.
        """
        p = Path(path)
        if not p.is_dir():
            why = "is a file" if p.exists() else "does not exist"
            raise EvidenceFileError(p, f"{why}; expected an evidence folder (the one the harness printed)")
        self = cls.__new__(cls)
        self.path = p
        self.scenario_dir = p.parent
        self.root = p.parent.parent
        return self

    def __fspath__(self) -> str:
        return str(self.path)

    def _f(self, member: Member) -> File:
        return File(self.path, member)

    def member(self, member: Member) -> File:
        """The file of any :class:`Layout` member in this folder (``evd.member(Layout.PROOF)`` is ``evd.proof``)."""
        return File(self.path, member)

    # -- members (one property per file; the name lives in Layout)
    run = property(lambda self: self._f(Layout.RUN), doc="``run.json`` (:class:`RunStatus`)")
    verdict = property(lambda self: self._f(Layout.VERDICT), doc="``verdict.json`` (:class:`VerdictRecord`)")
    report = property(lambda self: self._f(Layout.REPORT), doc="``REPORT.md``")
    scenario = property(lambda self: self._f(Layout.SCENARIO), doc="``scenario.toml``")
    plan = property(lambda self: self._f(Layout.PLAN), doc="``plan.json`` (:class:`PlanRecord`)")
    arm = property(lambda self: self._f(Layout.ARM), doc="the arm file ``ARM``")
    command = property(lambda self: self._f(Layout.COMMAND), doc="``command.txt``")
    env = property(lambda self: self._f(Layout.ENV), doc="``env.json`` (:class:`EnvRecord`)")
    server_log = property(lambda self: self._f(Layout.SERVER_LOG), doc="``server.log``")
    requests = property(lambda self: self._f(Layout.REQUESTS), doc="``requests.jsonl``")
    processes = property(lambda self: self._f(Layout.PROCESSES), doc="``processes.json`` (``repro.procs``)")
    owned_dirs = property(lambda self: self._f(Layout.OWNED_DIRS), doc="``owned_dirs.json``")
    teardown = property(lambda self: self._f(Layout.TEARDOWN), doc="``teardown.json`` (:class:`TeardownRecord`)")
    stalls = property(lambda self: self._f(Layout.STALLS), doc="``stalls.json``")
    analysis = property(lambda self: self._f(Layout.ANALYSIS), doc="``analysis.json``")
    analysis_first = property(lambda self: self._f(Layout.ANALYSIS_FIRST), doc="``analysis-first.json``")
    ledger = property(lambda self: self._f(Layout.LEDGER), doc="``ledger.json``")
    proof = property(lambda self: self._f(Layout.PROOF), doc="``proof.json``")
    rank_deaths = property(lambda self: self._f(Layout.RANK_DEATHS), doc="``rank_deaths.json``")
    timeline = property(lambda self: self._f(Layout.TIMELINE), doc="``timeline.svg``")
    session = property(lambda self: self._f(Layout.SESSION), doc="``session.json`` (:class:`SessionRecord`)")
    serve = property(lambda self: self._f(Layout.SERVE), doc="``serve.json`` (:class:`ServeRecord`)")
    watch = property(lambda self: self._f(Layout.WATCH), doc="``watch.json``")
    probes = property(lambda self: self._f(Layout.PROBES), doc="``probes.jsonl``")
    hang = property(lambda self: self._f(Layout.HANG), doc="``hang.json``")
    metrics = property(lambda self: self._f(Layout.METRICS), doc="``metrics.txt``")
    on_hang = property(lambda self: self._f(Layout.ON_HANG), doc="``on_hang.json``")
    on_hang_log = property(lambda self: self._f(Layout.ON_HANG_LOG), doc="``on_hang.log``")
    comparison = property(lambda self: self._f(Layout.COMPARISON), doc="``COMPARISON.md``")
    compare_json = property(lambda self: self._f(Layout.COMPARE_JSON), doc="``compare.json``")
    hunt_md = property(lambda self: self._f(Layout.HUNT_MD), doc="``HUNT.md``")
    hunt_jsonl = property(lambda self: self._f(Layout.HUNT_JSONL), doc="``hunt.jsonl``")
    stack = property(lambda self: self._f(Layout.STACK), doc="``stack.json`` (``repro.pd``)")
    hosts_json = property(lambda self: self._f(Layout.HOSTS_JSON), doc="``hosts.json`` (``repro.multihost``)")
    links = property(lambda self: self._f(Layout.LINKS), doc="``links.json`` (``repro.multihost``)")
    matrix = property(lambda self: self._f(Layout.MATRIX), doc="``matrix.json``")
    finding = property(lambda self: self._f(Layout.FINDING), doc="``FINDING.md`` (of a ``findings/<trial>/`` folder)")
    hunt_baseline = property(lambda self: self._f_in(Layout.HUNT_SCENARIOS, Layout.HUNT_BASELINE),
                             doc="``scenarios/baseline.toml``")
    hunt_trials = property(lambda self: self._f_in(Layout.HUNT_SCENARIOS, Layout.HUNT_TRIALS),
                           doc="``scenarios/trials.toml``")
    discovery_md = property(lambda self: self._f(Layout.DISCOVERY_MD), doc="``DISCOVERY.md`` (of ``discovery/``)")
    discovery_json = property(lambda self: self._f(Layout.DISCOVERY_JSON), doc="``discover.json`` (of ``discovery/``)")
    discovery_points = property(lambda self: self._f(Layout.DISCOVERY_POINTS), doc="``catalogue.toml`` (of ``discovery/``)")
    precision = property(lambda self: self._f(Layout.PRECISION), doc="``PRECISION.md`` (of ``discovery/``)")
    tally = property(lambda self: self._f(Layout.TALLY), doc="``tally.json`` (of ``discovery/``)")
    reproduction = property(lambda self: self._f(Layout.REPRODUCTION), doc="``REPRODUCTION.md``")
    reproduce_scenario = property(lambda self: self._f(Layout.REPRODUCE_SCENARIO), doc="``reproduce.toml``")
    reproducer = property(lambda self: self._f(Layout.REPRODUCER), doc="``reproducer.toml``")
    bisect_md = property(lambda self: self._f(Layout.BISECT_MD), doc="``BISECT.md``")
    bisect_json = property(lambda self: self._f(Layout.BISECT_JSON), doc="``bisect.json``")

    def _f_in(self, folder: Member, member: Member) -> File:
        return File(self.path / folder.name, member)

    def workload_finding(self, workload: str) -> File:
        """``FINDING-<workload>.md`` of a hunt folder."""
        return self._f(Member(Layout.workload_finding(workload), "text", f"workload {workload}'s finding (markdown)"))

    def hunt_scenario(self, name: str) -> Path:
        """``scenarios/<name>`` of a hunt folder (``Layout.trial_scenario`` / ``workload_scenario`` name the files)."""
        return self.hunt_scenarios_dir / name

    def sub(self, folder: Member, name: str = "", *, runs: bool = False) -> "EvidenceDir":
        """A sub-folder of this one as an evidence folder of its own (created when missing): ``folder``'s
        ``<name>/`` (``servers/<role>/``, ``hosts/<host>/``, ``findings/<trial>/``) or ``folder`` itself
        (``discovery/``). With ``runs``, it gets ``injector/`` and ``stacks/`` as a run folder does."""
        path = self.path / folder.name / name if name else self.path / folder.name
        path.mkdir(parents=True, exist_ok=True)
        if runs:
            for sub in (Layout.INJECTOR.name, Layout.STACKS.name):
                (path / sub).mkdir(exist_ok=True)
        return EvidenceDir.open(path)

    def server(self, role: str) -> "EvidenceDir":
        """``servers/<role>/``: one engine server's run folder of a multi-server topology (``repro.pd``)."""
        return self.sub(Layout.SERVERS, role, runs=True)

    def server_path(self, role: str) -> Path:
        """``servers/<role>/`` without creating it (``role`` may be a glob such as ``*``)."""
        return Layout.server_dir(self.path, role)

    def host(self, name: str) -> "EvidenceDir":
        """``hosts/<host>/``: one host's copied injector records and server log (``repro.multihost``)."""
        return self.sub(Layout.HOSTS, name)

    def host_path(self, name: str) -> Path:
        """``hosts/<host>/`` without creating it."""
        return Layout.host_dir(self.path, name)

    @property
    def discovery(self) -> "EvidenceDir":
        """``discovery/`` of a hunt folder (created when missing)."""
        return self.sub(Layout.DISCOVERY)

    def finding_dir(self, trial: str) -> "EvidenceDir":
        """``findings/<trial>/`` of a hunt folder (created when missing)."""
        return self.sub(Layout.FINDINGS, trial)

    @property
    def injector_dir(self) -> Path:
        return self.path / Layout.INJECTOR.name

    @property
    def stacks_dir(self) -> Path:
        return self.path / Layout.STACKS.name

    @property
    def hunt_scenarios_dir(self) -> Path:
        return self.path / Layout.HUNT_SCENARIOS.name

    def fire_log(self, pid: int) -> Path:
        """``injector/fires-<pid>.jsonl`` (read with ``repro.injection_records``)."""
        return self.injector_dir / Layout.fire_log(pid)

    def loaded_marker(self, pid: int) -> Path:
        """``injector/loaded-<pid>.json``."""
        return self.injector_dir / Layout.loaded_marker(pid)

    def stack_text(self, rank: int, tag: str = "") -> Path:
        """``stacks/rank<k><tag>.txt``."""
        return self.stacks_dir / Layout.stack_name(rank, tag)

    def stack_json(self, rank: int, tag: str = "") -> Path:
        """``stacks/rank<k><tag>.json`` (py-spy ``--json``)."""
        return self.stacks_dir / Layout.stack_name(rank, tag, "json")

    def file(self, name: str) -> Path:
        """A file of the folder by name (prefer the named members)."""
        return self.path / name

    def _update_latest(self) -> None:
        link = self.scenario_dir / "latest"
        tmp = self.scenario_dir / f".latest.{os.getpid()}"
        try:
            if tmp.is_symlink() or tmp.exists():
                tmp.unlink()
            tmp.symlink_to(self.path.name)
            os.replace(tmp, link)
        except OSError:
            pass  # a filesystem without symlinks: the timestamped folder is still there

    def set_status(self, status: str, **extra: Any) -> None:
        """Record the run's life-cycle in ``run.json`` (``running``, ``complete``, ``interrupted``)."""
        data = {"status": status, "time": time.time(), "pid": os.getpid(), "harness_create_time": _own_create_time()}
        data.update(extra)
        self.run.write(data)

    def write_json(self, name: str, data: Any) -> Path:
        p = self.path / name
        write_json_atomic(p, data)
        return p

    def write_text(self, name: str, text: str) -> Path:
        p = self.path / name
        write_text_atomic(p, text)
        return p


def verdict_record(verdict: Any, *, exit_code: int, evidence: Path, scenario: Optional[str] = None,
                   variant: Optional[str] = None, variant_expects: Optional[str] = None, expect: Optional[str] = None,
                   partial: bool = False, timings: Optional[dict] = None, rank_pids: Optional[dict] = None,
                   kind: str = "run", **extra: Any) -> VerdictRecord:
    """The one shape of ``verdict.json`` (runs, served sessions' runs, watch hangs).

    Args:
        verdict: a ``repro.verdict.Verdict`` (its ``to_json()``: verdict, reason, notes, exit_code).
        exit_code: the exit code the command gives for it; evidence: the folder; timings: seconds by phase (rounded
            to ms); rank_pids: rank -> pid; extra: more fields (the watch: ``hang``).
    """
    base = dict(verdict.to_json()) if hasattr(verdict, "to_json") else dict(verdict)
    base.update(scenario=scenario, variant=variant, variant_expects=variant_expects, expect=expect,
                exit_code=exit_code, partial=partial,
                timings={k: round(float(v), 3) for k, v in (timings or {}).items()},
                rank_pids={str(k): int(v) for k, v in (rank_pids or {}).items()}, evidence=str(evidence), kind=kind)
    base.update(extra)
    return VerdictRecord.model_validate(base)


def read_json(path: Path) -> Any:
    """Read a JSON file; ``None`` when it is missing (for files outside an evidence folder's members)."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


def read_jsonl(path: Path) -> list[dict]:
    """Read a JSON-lines file, skipping a torn last line (the writer may have been killed mid-line)."""
    out: list[dict] = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        pass
    return out


def unique_folder(root: Path, scenario: str, kind: str, label: str) -> Path:
    """Create and return ``<root>/<scenario>/<UTC stamp>-<kind>-<label>`` (``-2``, ``-3``… when it exists already):
    the folder of a verb that joins several runs (``compare``, ``bisect``)."""
    base = Path(root) / _slug(scenario)
    base.mkdir(parents=True, exist_ok=True)
    name = f"{utc_stamp()}-{kind}-{_slug(label)}"
    path, n = base / name, 2
    while True:
        try:
            path.mkdir()
            return path
        except FileExistsError:
            path = base / f"{name}-{n}"
            n += 1
