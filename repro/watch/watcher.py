"""``repro watch``: probe a live server's generate path, declare a hang, keep the evidence, then run ``--on-hang``.

The incident this answers: a TP job wedged for 18 minutes while ``/health`` returned 200; the operator restarted it
and the forensic state was gone. The watch is the external probe of the generate path, and it writes the evidence
(every rank's stacks twice, the diagnosis, raw ``/metrics``) *before* any restart command runs.

One probe round every ``interval_s`` seconds (start to start; a round never overlaps the previous one):

- a 1-token **generate** probe (the adapter's request body: ``input_ids`` work on a tokenizer-less server), bounded
  by ``probe_timeout_s``; a probe that does not answer in time is abandoned (its connection closed by the client
  timeout) and, if its thread is somehow still running at the next round, that round's probe is *skipped* and
  counts as a failure: probes never pile up;
- a **/health** probe in its own thread, bounded by ``health_timeout_s`` (default 25 s, above sglang's 20 s), never
  more than one in flight. In sglang 0.5.23 (``srt/entrypoints/http_server.py`` ``health_generate``) ``/health``
  runs a 1-token generate and answers 503 when nothing came back for ``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s); with
  ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=0`` it answers 200 at once, straight through a deadlock.

``failures`` consecutive generate probes that reached the server but failed (timeout, HTTP error, bad answer)
declare a hang (with ``probe_timeout_s <= interval_s`` within ``failures × interval_s + probe_timeout_s`` seconds of
its start; a timed-out round delays the next, so otherwise within ``interval_s + failures × probe_timeout_s``), reported by what ``/health`` said meanwhile: ``silent`` (200: a liveness check would not notice),
``health-error`` (e.g. 503), ``health-timeout`` (no answer yet) or ``health-unreachable``. Consecutive connection
failures (refused, DNS, connect timeout) are reported as ``unreachable`` instead: a server that is down is not hung.
A server that has never answered a generate probe successfully and answers 404/405/501 within a second, or closes
the connection at once, is *misconfigured* (not this engine's API, or a wrong URL): the watch ends with exit 8,
captures nothing and does not run ``on_hang`` (:func:`wrong_api`). After one success the same fast errors count as
failures (a router answers fast 5xx when its workers hang).

On a hang: discover the local rank processes (under ``pid_root``, by title ``match``, or under the process listening
on the URL's port), capture them all in parallel twice ``confirm_gap_s`` apart (:func:`repro.capture.capture_ranks`,
the same code as ``repro run``), analyse (:func:`repro.analysis.analyze`), apply the DEADLOCKED rule
(:func:`repro.verdict.judge_stall`), write the evidence folder (``verdict.json`` atomically, last), and only then run
``on_hang`` with ``REPRO_EVIDENCE_DIR`` set. One declaration per hang: the next needs a successful probe first.

Every probe round and every event is one JSON object handed to the ``log`` callback (the CLI prints one line each
on stdout). Library code never prints.
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional, Sequence
from urllib.parse import urlsplit

import psutil
import requests

from repro import evidence as ev
from repro import procs as _procs
from repro.procs import ProcInfo
from repro.verdict import DEADLOCKED, EXIT_CODES, INCONCLUSIVE

PROBE_INPUT_IDS = (1, 2, 3, 4)  # token ids of the generate probe (valid in any vocabulary of >= 5 tokens)
EVIDENCE_ENV = "REPRO_EVIDENCE_DIR"
FALLBACK_EVIDENCE_ROOT = Path(tempfile.gettempdir()) / "repro-watch-evidence"
LEDGER_POLL_S = 0.2  # how often the ledgers are followed while a probe is in flight (watch --ledger-dir)
HISTORY_ROUNDS = 200  # probe rounds kept in memory and written to probes.jsonl on a hang
ON_HANG_OUTPUT_TAIL_CHARS = 2000

EXIT_HEALTHY = 0
EXIT_HUNG_DEADLOCK = EXIT_CODES[DEADLOCKED]  # 3
EXIT_HUNG_NO_EVIDENCE = EXIT_CODES[INCONCLUSIVE]  # 4
EXIT_UNREACHABLE = 6
EXIT_MISCONFIGURED = 8  # the URL answers, but not as this engine's generate API: never a hang

# A server that never answered a generate probe successfully and answers one of these statuses (or closes the
# connection) within WRONG_API_FAST_S is "not this engine's API / misconfigured URL", not hung: a hang is a probe
# that does not answer in time. After a success, fast errors count toward a hang again (a router answers fast 5xx
# when its workers hang).
WRONG_API_STATUSES = (404, 405, 501)
WRONG_API_FAST_S = 1.0

# generate-probe outcomes
OK, TIMEOUT, REFUSED, HTTP_ERROR, BAD_ANSWER, SKIPPED, ERROR, INTERRUPTED = (
    "ok", "timeout", "refused", "http_error", "bad_answer", "skipped", "error", "interrupted")
# hang kinds, by what /health said while the generate probes failed
SILENT, HEALTH_ERROR, HEALTH_TIMEOUT, HEALTH_UNREACHABLE, HEALTH_UNKNOWN = (
    "silent", "health-error", "health-timeout", "health-unreachable", "health-unknown")

LogSink = Callable[[dict], None]


class WatchConfigError(ValueError):
    """Bad watch options; the message names the option (``--interval`` …) and what was expected."""


class DiscoveryError(RuntimeError):
    """The rank processes could not be found or told apart; the message says which flag fixes it."""


# ------------------------------------------------------------------------------------------------------------
# options


@dataclass(frozen=True)
class WatchOptions:
    """What to watch and how.

    Attributes:
        url: base URL of the server (``http://host:port``).
        interval_s: seconds from one probe round's start to the next (a slow round delays the next, never overlaps).
        probe_timeout_s: seconds a generate probe may take before it counts as failed (and is abandoned).
        health_timeout_s: seconds a /health probe may take (default 25 s: above sglang's 20 s, so its 503 is seen).
        failures: consecutive failed generate probes that declare a hang (``--once`` declares on the first).
        pid_root: look for rank processes under this pid (the server's launcher), else None.
        match: rank processes are those whose title contains this text (e.g. ``sglang::scheduler``), else None.
            With neither, the tree of the process listening on the URL's port is used, then the default title.
        evidence_root: evidence root; a hang's folder is ``<root>/watch-<host>-<port>/<UTC>-hang``.
        on_hang: shell command run after the evidence is on disk, with ``REPRO_EVIDENCE_DIR`` set; None for none.
        on_hang_timeout_s: seconds the command may run before its process group is ended.
        once: one probe round, then exit (see :meth:`Watcher.run` for the exit codes).
        max_rounds: stop after this many probe rounds (None: until stopped).
        confirm_gap_s: seconds between the first capture and the confirming one.
        capture_timeout_s: per-process py-spy bound in seconds.
        native: ask py-spy for native frames too.
        metrics_path: Prometheus endpoint kept raw in the evidence (sglang serves it with ``--enable-metrics``).
        ledger_dir: the injector folder holding the ranks' collective ledgers (``<serve evidence>/injector``, or
            the ``out_dir`` of a plan loaded into a production launch); None: probes only. With it the ranks'
            ledgers are followed between and after probe rounds (every 0.2 s) and a ledger proof of a deadlock
            (``repro.proof``) declares the hang at once, without waiting for ``failures`` failed probes; a desync
            the ledgers show is logged (``desync`` event).
        hosts: the hosts a multi-node server spans (``repro.hosts.HostSpec``; ``--hosts``): its ranks are listed
            and dumped on each host through that host's runner (``repro/remote_watch.py``); empty: this host.
    """

    url: str
    interval_s: float = 10.0
    probe_timeout_s: float = 5.0
    health_timeout_s: float = 25.0
    failures: int = 3
    pid_root: Optional[int] = None
    match: Optional[str] = None
    evidence_root: Path = Path("evidence")
    on_hang: Optional[str] = None
    on_hang_timeout_s: float = 600.0
    once: bool = False
    max_rounds: Optional[int] = None
    confirm_gap_s: float = 1.0
    capture_timeout_s: float = 10.0
    native: bool = False
    metrics_path: str = "/metrics"
    ledger_dir: Optional[Path] = None  # the injector folder with the ranks' ledger-<pid>.jsonl (repro.proof reads it)
    hosts: tuple = ()  # repro.hosts.HostSpec of each host the server spans: ranks found and captured there (repro/remote_watch.py)

    def validate(self) -> "WatchOptions":
        """Check every field; returns self with the URL normalised (no trailing slash).

        Raises:
            WatchConfigError: a value is out of range; the message names the flag and what was expected.
        """
        try:
            parts = urlsplit(self.url)
            parts.port  # noqa: B018 - raises ValueError for a port outside 0..65535
        except ValueError as e:
            raise WatchConfigError(f"--url must look like http://HOST:PORT (got {self.url!r}: {e})") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise WatchConfigError(f"--url must look like http://HOST:PORT (got {self.url!r})")
        for name, flag in (("interval_s", "--interval"), ("probe_timeout_s", "--probe-timeout"),
                           ("health_timeout_s", "--health-timeout"), ("on_hang_timeout_s", "--on-hang-timeout"),
                           ("capture_timeout_s", "--capture-timeout")):
            v = getattr(self, name)
            if not v > 0:
                raise WatchConfigError(f"{flag} must be a positive number of seconds (got {v})")
        if self.confirm_gap_s < 0:
            raise WatchConfigError(f"confirm gap must be >= 0 seconds (got {self.confirm_gap_s})")
        if self.failures < 1:
            raise WatchConfigError(f"--failures must be >= 1 consecutive failed probes (got {self.failures})")
        if self.max_rounds is not None and self.max_rounds < 1:
            raise WatchConfigError(f"--count must be >= 1 probe rounds (got {self.max_rounds})")
        if self.pid_root is not None and _procs.proc_info(self.pid_root) is None:
            raise WatchConfigError(f"--pid-root {self.pid_root}: no such process; pass the pid of the server's "
                                   "launcher (the process that started the rank processes)")
        if self.match is not None and not self.match.strip():
            raise WatchConfigError("--match must be a non-empty piece of the rank processes' titles (what `ps -o args` "
                                   "shows for them)")
        return replace(self, url=self.url.rstrip("/"))


# ------------------------------------------------------------------------------------------------------------
# probes


@dataclass(frozen=True)
class ProbeResult:
    """One HTTP probe.

    Attributes:
        kind: ``generate`` or ``health``.
        outcome: ``ok``, ``timeout`` (no answer within the timeout: abandoned), ``refused`` (could not connect:
            refused, DNS failure, connect timeout), ``http_error`` (a non-200 status), ``bad_answer`` (200 but the
            body is not a 1-token answer), ``skipped`` (the previous probe of this kind was still running) or
            ``error`` (anything else), ``interrupted`` (a stop was requested while it was in flight: not counted).
        status: HTTP status, when an answer came.
        latency_s: seconds from sending to the answer (or to giving up).
        started: start time, seconds since the epoch.
        error: short description when not ok.
        round: probe round that started it (0 before it is assigned).
    """

    kind: str
    outcome: str
    status: Optional[int] = None
    latency_s: float = 0.0
    started: float = 0.0
    error: str = ""
    round: int = 0

    @property
    def ok(self) -> bool:
        return self.outcome == OK

    @property
    def reached(self) -> bool:
        """The server was reached (not refused / unresolvable)."""
        return self.outcome != REFUSED

    def to_json(self) -> dict[str, Any]:
        d = {"outcome": self.outcome, "status": self.status, "latency_s": round(self.latency_s, 3),
             "round": self.round}
        if self.error:
            d["error"] = self.error
        return d


def _http(method: str, url: str, timeout_s: float, body: Optional[dict] = None) -> tuple[str, Optional[int], Any, str, float]:
    """(outcome, status, response or None, error, latency_s) of one request; never raises."""
    t0 = time.monotonic()
    try:
        r = requests.request(method, url, json=body, timeout=(min(timeout_s, 3.0), timeout_s))
        return OK, r.status_code, r, "", time.monotonic() - t0
    except requests.exceptions.ConnectTimeout:
        return REFUSED, None, None, f"connect timed out after {min(timeout_s, 3.0):.1f} s", time.monotonic() - t0
    except requests.exceptions.ConnectionError as e:
        # A read timeout on a kept connection can surface as ConnectionError(ReadTimeoutError).
        text = str(e)
        if "Read timed out" in text:
            return TIMEOUT, None, None, f"no answer within {timeout_s:.1f} s", time.monotonic() - t0
        if "RemoteDisconnected" in text or "Connection aborted" in text:
            return ERROR, None, None, "the server closed the connection without answering", time.monotonic() - t0
        return REFUSED, None, None, _short_conn_error(text), time.monotonic() - t0
    except requests.exceptions.Timeout:
        return TIMEOUT, None, None, f"no answer within {timeout_s:.1f} s", time.monotonic() - t0
    except requests.RequestException as e:
        return ERROR, None, None, f"{type(e).__name__}: {str(e)[:200]}", time.monotonic() - t0


def _short_conn_error(text: str) -> str:
    for needle, short in (("Connection refused", "connection refused"), ("Name or service not known", "host not found"),
                          ("No route to host", "no route to host"), ("Network is unreachable", "network unreachable")):
        if needle in text:
            return short
    return text[:200]


def probe_generate(adapter: Any, url: str, timeout_s: float) -> ProbeResult:
    """POST a 1-token greedy generate (``adapter.generate_body(PROBE_INPUT_IDS, 1, stream=False)``).

    Ok iff HTTP 200 and ``adapter.parse_response`` reports no error and at least one output id.

    Args:
        adapter: engine adapter (``generate_path``, ``generate_body``, ``parse_response``).
        url: base URL.
        timeout_s: seconds to wait for the answer; past it the request is abandoned (connection closed).
    """
    started = time.time()
    outcome, status, resp, err, lat = _http("POST", url + adapter.generate_path, timeout_s,
                                            adapter.generate_body(list(PROBE_INPUT_IDS), 1, stream=False))
    if outcome != OK:
        return ProbeResult("generate", outcome, status, lat, started, err)
    if status != 200:
        return ProbeResult("generate", HTTP_ERROR, status, lat, started, f"HTTP {status}: {resp.text[:200]}")
    try:
        upd = adapter.parse_response(resp.json())
    except ValueError:
        return ProbeResult("generate", BAD_ANSWER, status, lat, started, f"not JSON: {resp.text[:200]}")
    if upd.error:
        return ProbeResult("generate", BAD_ANSWER, status, lat, started, f"engine error: {upd.error[:200]}")
    if not upd.output_ids:
        return ProbeResult("generate", BAD_ANSWER, status, lat, started, "answered with no output id")
    return ProbeResult("generate", OK, status, lat, started)


def probe_health(adapter: Any, url: str, timeout_s: float) -> ProbeResult:
    """GET ``adapter.health_path``; ok iff HTTP 200 within ``timeout_s`` seconds."""
    started = time.time()
    outcome, status, resp, err, lat = _http("GET", url + adapter.health_path, timeout_s)
    if outcome != OK:
        return ProbeResult("health", outcome, status, lat, started, err)
    if status != 200:
        return ProbeResult("health", HTTP_ERROR, status, lat, started, f"HTTP {status}")
    return ProbeResult("health", OK, status, lat, started)


def wrong_api(gen: ProbeResult) -> Optional[str]:
    """Why a failed generate probe looks like "not this engine's API / misconfigured URL", else None.

    That is an answer within ``WRONG_API_FAST_S`` (1 s) that is HTTP 404 / 405 / 501 (no such route or method), or
    a connection the server closed without answering. Only meaningful before any generate probe succeeded: the
    caller (:meth:`Watcher._account`) checks that. A refused connection is *unreachable*, a slow answer a failure.
    """
    if gen.latency_s >= WRONG_API_FAST_S:
        return None
    if gen.outcome == HTTP_ERROR and gen.status in WRONG_API_STATUSES:
        return f"HTTP {gen.status} within {gen.latency_s * 1000:.0f} ms"
    if gen.outcome == ERROR and "closed the connection" in gen.error:
        return f"the connection was closed without an answer within {gen.latency_s * 1000:.0f} ms"
    return None


class _Slot:
    """At most one probe of a kind in flight, in a daemon thread; its result is taken by the watch loop."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._done = threading.Event()
        self._result: Optional[ProbeResult] = None
        self.started_mono = 0.0
        self.round = 0

    def busy(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive()

    def start(self, fn: Callable[[], ProbeResult], round_no: int) -> None:
        done = threading.Event()

        def target() -> None:
            try:
                r = fn()
            except Exception as e:  # noqa: BLE001 - a probe must never kill the watch
                r = ProbeResult(self.name, ERROR, None, 0.0, time.time(), f"{type(e).__name__}: {e}")
            with self._lock:
                self._result = replace(r, round=round_no)
            done.set()

        self._done = done
        self.started_mono = time.monotonic()
        self.round = round_no
        self._thread = threading.Thread(target=target, name=f"repro-watch-{self.name}", daemon=True)
        self._thread.start()

    def wait(self, timeout_s: float, stop: threading.Event) -> bool:
        """Wait up to ``timeout_s`` seconds for the probe in flight; False if still running (or stop was asked)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if self._done.wait(min(0.1, max(0.0, left))):
                return True
            if left <= 0 or stop.is_set():
                return False

    def take(self) -> Optional[ProbeResult]:
        with self._lock:
            r, self._result = self._result, None
        return r


# ------------------------------------------------------------------------------------------------------------
# health classification


@dataclass(frozen=True)
class HealthView:
    """What /health said while the generate probes failed.

    Attributes:
        kind: ``silent`` (answered 200), ``health-error`` (answered another status), ``health-timeout`` (did not
            answer within its timeout, or still in flight), ``health-unreachable`` or ``health-unknown``.
        detail: one sentence for people.
        status: the HTTP status of the answer used, if any.
        in_flight_s: seconds the health probe in flight has been waiting, when it decided the kind.
    """

    kind: str
    detail: str
    status: Optional[int] = None
    in_flight_s: Optional[float] = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def classify_health(answers: Sequence[ProbeResult], since_round: int, in_flight: Optional[tuple[int, float]],
                    probe_timeout_s: float) -> HealthView:
    """Classify a hang by what /health said since the first failed generate probe.

    Args:
        answers: completed /health probes (``round`` = the probe round that started each).
        since_round: probe round of the first failed generate probe; answers of earlier rounds do not count.
        in_flight: (round, seconds waiting) of the /health probe still in flight, or None.
        probe_timeout_s: a probe in flight at least this long (seconds) counts as not answering.
    Returns:
        The newest answer's kind (``silent`` for 200, ``health-error``, ``health-timeout``, ``health-unreachable``);
        ``health-timeout`` when the newest probe is still in flight past ``probe_timeout_s``; else
        ``health-unknown``.
    """
    recent = [a for a in answers if a.round >= since_round]
    last = max(recent, key=lambda a: a.round) if recent else None
    if in_flight is not None and in_flight[0] >= since_round and in_flight[1] >= probe_timeout_s \
            and (last is None or last.round < in_flight[0]):
        return HealthView(HEALTH_TIMEOUT, f"/health has not answered for {in_flight[1]:.1f} s while generate probes "
                                          "fail", None, round(in_flight[1], 3))
    if last is None:
        return HealthView(HEALTH_UNKNOWN, "no /health answer since the generate probes started failing")
    if last.outcome == OK:
        return HealthView(SILENT, "silent hang: /health still answers 200 while generate probes fail "
                                  "(a liveness check or load balancer would not notice)", last.status)
    if last.outcome == HTTP_ERROR:
        return HealthView(HEALTH_ERROR, f"/health answers HTTP {last.status} while generate probes fail", last.status)
    if last.outcome == TIMEOUT:
        return HealthView(HEALTH_TIMEOUT, f"/health did not answer within {last.latency_s:.1f} s either")
    if last.outcome == REFUSED:
        return HealthView(HEALTH_UNREACHABLE, f"/health is unreachable ({last.error})")
    return HealthView(HEALTH_ERROR, f"/health failed: {last.error}", last.status)


# ------------------------------------------------------------------------------------------------------------
# discovery


@dataclass(frozen=True)
class Discovery:
    """The local rank processes of the watched server.

    Attributes:
        rank_pids: rank → pid (empty when none was found: then ``note`` says why).
        method: ``pid-root``, ``match``, ``listener`` (tree of the process listening on the URL's port),
            ``default-title``, ``none`` (the URL is another host's) or ``given`` (a callable supplied by the caller).
        procs: the processes considered (root first for tree methods).
        note: why nothing (or something unexpected) was found, naming the flag that fixes it.
        servers: behind a router (``router-workers``): server name (the worker's type, ``prefill`` / ``decode``)
            → that server's own rank → pid; the hang is then captured and judged per server
            (:func:`repro.checker.check_groups`). Empty for a single server.
        where: where the ranks run, for ``repro.checker.check_stall`` (None: this machine;
            ``repro.remote_watch.HostRanks`` for ``--hosts``).
    """

    rank_pids: dict[int, int]
    method: str
    procs: list[ProcInfo] = field(default_factory=list)
    note: str = ""
    servers: dict[str, dict[int, int]] = field(default_factory=dict)
    where: Any = None

    def stall_groups(self, base: Path, stacks_dir: Path) -> list:
        """The TP groups a hang is captured and judged by (``repro.checker.RankGroup``): behind a router one per
        server (its stacks in ``<base>/servers/<name>/stacks``), else one group of every rank in ``stacks_dir``."""
        from repro.checker import LocalRanks, RankGroup

        if self.servers:
            return [RankGroup(n, LocalRanks(pids), ev.Layout.server_dir(base, n) / ev.Layout.STACKS.name,
                              list(range(max(pids) + 1)) if pids else []) for n, pids in self.servers.items()]
        where = self.where if self.where is not None else LocalRanks(self.rank_pids)
        return [RankGroup(None, where, Path(stacks_dir), list(range(max(self.rank_pids) + 1)))]


def _listener_pid(url: str) -> Optional[int]:
    """pid of the local process listening on the URL's TCP port (as root every socket is visible), else None."""
    parts = urlsplit(url)
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(parts.hostname, port, proto=socket.IPPROTO_TCP)}
    except OSError:
        return None
    wild = {"0.0.0.0", "::", ""}
    try:
        conns = psutil.net_connections(kind="tcp")
    except (psutil.AccessDenied, OSError):
        return None
    for c in conns:
        if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
            if c.laddr.ip in addrs or c.laddr.ip in wild:
                return c.pid
    return None


def _is_local_host(host: str) -> bool:
    """True when ``host`` resolves to a loopback address or to an address of one of this host's interfaces."""
    try:
        addrs = {ai[4][0] for ai in socket.getaddrinfo(host, None)}
    except OSError:
        return False
    local = {"127.0.0.1", "::1"}
    try:
        for nic in psutil.net_if_addrs().values():
            local.update(a.address.split("%", 1)[0] for a in nic)
    except OSError:
        pass
    return any(a in local or a.startswith("127.") for a in addrs)


def _all_procs() -> list[ProcInfo]:
    out = []
    for p in psutil.process_iter():
        i = _procs.proc_info(p.pid)
        if i is not None:
            out.append(i)
    return out


def discover_ranks(adapter: Any, url: str, pid_root: Optional[int] = None, match: Optional[str] = None) -> Discovery:
    """Find the rank processes of the server at ``url`` on this host.

    Order: ``pid_root`` (its tree, filtered by ``match`` when given); else ``match`` over every process; else the
    tree of the process listening on the URL's port (and nothing else when that tree has no rank); else, when the
    URL's host is this host, every process whose title holds the adapter's ``watch_defaults.title_match`` (never
    another host's server). Ranks come
    from the titles (``adapter.rank_pids``: ``sglang::scheduler_TP{k}`` → k).

    Returns:
        A :class:`Discovery`; ``rank_pids`` empty with a ``note`` when nothing was found.
    Raises:
        DiscoveryError: several processes map to one rank (e.g. two servers on this host): the message names
            them and says to pass ``--pid-root``.
    """

    def ranks_of(procs: list[ProcInfo], method: str, where: str) -> Discovery:
        sel = [p for p in procs if match is None or match in p.title]
        try:
            rp = adapter.rank_pids(sel)
        except ValueError as e:
            raise DiscoveryError(f"{e} — {where}; pass --pid-root PID (the launcher of the server at {url}) to "
                                 "watch one server") from None
        note = ""
        if not rp:
            example = adapter.watch_defaults.title_example or adapter.watch_defaults.title_match
            what = f"titled *{match}*" if match else f"with a rank title ({example})"
            note = f"no process {what} {where}"
            if sel and match:
                note += f" has a rank title ({', '.join(p.title[:40] for p in sel[:3])}…)"
        return Discovery(dict(rp), method, sel, note)

    if pid_root is not None:
        tree = _procs.snapshot_tree(pid_root)
        if not tree:
            return Discovery({}, "pid-root", [], f"--pid-root {pid_root}: the process no longer exists")
        return ranks_of(tree, "pid-root", f"under --pid-root {pid_root}")
    if match is not None:
        return ranks_of(_all_procs(), "match", "on this host (--match)")
    lp = _listener_pid(url)
    if lp is not None:
        d = ranks_of(_procs.snapshot_tree(lp), "listener", f"under pid {lp} (listening on {url})")
        if not d.rank_pids:
            routed = _ranks_behind_router(adapter, url, ranks_of)
            if routed is not None:
                return routed
            d = replace(d, note=d.note + "; pass --pid-root PID (the launcher of the rank processes) or --match TITLE")
        return d
    host = urlsplit(url).hostname or ""
    if not _is_local_host(host):
        return Discovery({}, "none", [], f"{host} is not an address of this host, so its rank processes cannot be "
                                          "captured from here: run the watch on the server's host, or pass --pid-root "
                                          "PID / --match TITLE")
    match = adapter.watch_defaults.title_match
    d = ranks_of(_all_procs(), "default-title", "on this host")
    if not d.rank_pids:
        d = replace(d, note=d.note + "; pass --pid-root PID or --match TITLE")
    return d


def _ranks_behind_router(adapter: Any, url: str, ranks_of: Callable) -> Optional[Discovery]:
    """A router (e.g. PD disaggregation's) has no ranks itself: ask it for its workers (the adapter's
    ``router_workers(url)``, e.g. SGLang's router ``GET /workers``) and find every worker's ranks under the process
    listening on that worker's port. Ranks are numbered across the workers in the router's order (the note names
    which numbers are which server's, e.g. ``prefill TP0..3 = ranks 0..3``); None when ``url`` lists no workers."""
    fn = getattr(adapter, "router_workers", None)
    workers = fn(url) if callable(fn) else None
    if not workers:
        return None
    rank_pids: dict[int, int] = {}
    servers: dict[str, dict[int, int]] = {}
    procs: list[ProcInfo] = []
    names: list[str] = []
    for w in sorted(workers, key=lambda w: (w.get("worker_type") != "prefill", str(w.get("url")))):
        wurl, kind = str(w.get("url") or ""), str(w.get("worker_type") or "worker")
        name = kind if kind not in servers else f"{kind}{sum(1 for n in servers if n.startswith(kind)) + 1}"
        lp = _listener_pid(wurl) if wurl else None
        if lp is None:
            names.append(f"{kind} {wurl}: no local listener")
            continue
        d = ranks_of(_procs.snapshot_tree(lp), "router-workers", f"under pid {lp} (listening on {wurl})")
        base = len(rank_pids)
        for k, pid in sorted(d.rank_pids.items()):
            rank_pids[base + k] = pid
        if d.rank_pids:
            servers[name] = dict(sorted(d.rank_pids.items()))
        procs += d.procs
        names.append(f"{kind} TP0..{len(d.rank_pids) - 1} = ranks {base}..{len(rank_pids) - 1} ({wurl})"
                     if d.rank_pids else f"{kind} {wurl}: {d.note}")
    return Discovery(rank_pids, "router-workers", procs, "the router's workers: " + "; ".join(names), servers)


# ------------------------------------------------------------------------------------------------------------
# the watch


@dataclass
class HangOutcome:
    """What one declared hang produced.

    Attributes:
        verdict: ``DEADLOCKED`` (the DEADLOCKED rule held on two captures) or ``INCONCLUSIVE``.
        reason: one sentence.
        exit_code: 3 (hung with deadlock evidence) or 4 (hung without it).
        health: what /health said (:class:`HealthView`).
        evidence: the evidence folder written (None when nothing could be written anywhere).
        evidence_errors: paths that could not be written, with the reason.
        analysis: the confirming capture's ``repro.analysis.Analysis`` (None when nothing was captured).
        on_hang: the command's result (``rc``, ``duration_s``, ``timed_out``, ``output_tail``), or None if not run.
    """

    verdict: str
    reason: str
    exit_code: int
    health: HealthView
    evidence: Optional[Path] = None
    evidence_errors: list[str] = field(default_factory=list)
    analysis: Any = None
    on_hang: Optional[dict] = None


def _iso(t: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int((t % 1) * 1000):03d}Z"


class Watcher:
    """The probe loop. Use :meth:`run`; call :meth:`stop` (e.g. from a SIGINT/SIGTERM handler) to end it.

    Args:
        opts: validated :class:`WatchOptions`.
        log: receives one JSON-serialisable dict per probe round (``event: probe``) and per event (``start``,
            ``discovery``, ``hang``, ``unreachable``, ``recovered``, ``evidence``, ``evidence_error``, ``on_hang``,
            ``on_hang_skipped``, ``stop``).
        adapter: engine adapter (default: the registry's default, ``repro.targets.registry.get_adapter()``).
        discover: callable returning rank → pid, replacing :func:`discover_ranks` (for embedding and tests).
    """

    def __init__(self, opts: WatchOptions, log: Optional[LogSink] = None, adapter: Any = None,
                 discover: Optional[Callable[[], dict[int, int]]] = None) -> None:
        if adapter is None:
            from repro.targets.registry import get_adapter

            adapter = get_adapter()
        self.opts = opts
        self.adapter = adapter
        self._log_sink = log or (lambda _e: None)
        self._discover_fn = discover
        self._remote_ranks: dict = {}  # rank -> repro.hosts.RemoteRank (opts.hosts)
        self._stop = threading.Event()
        self._follower: Any = None
        self._follow_since = 0.0
        self._desyncs_seen: set = set()
        self._ledger_error = ""
        self.ledger_proof: Any = None
        self.state_divergence: Optional[dict] = None  # the first divergent lockstep state seen live (warning logged)
        self._gen = _Slot("generate")
        self._health = _Slot("health")
        self.health_answers: deque[ProbeResult] = deque(maxlen=HISTORY_ROUNDS)
        self.history: deque[dict] = deque(maxlen=HISTORY_ROUNDS)
        self.state = "starting"
        self.round = 0
        self.failures = 0
        self.unreachable = 0
        self.first_failure_t: Optional[float] = None
        self.first_failure_round = 0
        self.ever_ok = False  # a generate probe succeeded at least once (then fast errors can be a hang)
        self.misconfigured = 0
        self._last_gen: Optional[ProbeResult] = None
        self.hangs: list[HangOutcome] = []
        self._on_hang_proc: Optional[subprocess.Popen] = None

    # ---- control -----------------------------------------------------------------------------------------------
    def stop(self) -> None:
        """Ask the loop to end after the current step (safe from a signal handler and from other threads)."""
        self._stop.set()

    @property
    def stopping(self) -> bool:
        return self._stop.is_set()

    def _log(self, event: str, **data: Any) -> dict:
        rec = {"ts": _iso(time.time()), "event": event, "url": self.opts.url, **data}
        self._log_sink(rec)
        return rec

    # ---- discovery ---------------------------------------------------------------------------------------------
    def discover(self) -> Discovery:
        """Find the rank processes now (see :func:`discover_ranks`); never raises: problems go into ``note``."""
        if self.opts.hosts:  # ranks on other hosts: listed and captured through each host's runner
            from repro.remote_watch import discover_on_hosts

            disc, self._remote_ranks = discover_on_hosts(self.adapter, self.opts.hosts, self.opts.match)
            return disc
        if self._discover_fn is not None:
            try:
                return Discovery(dict(self._discover_fn()), "given")
            except Exception as e:  # noqa: BLE001
                return Discovery({}, "given", [], f"rank discovery failed: {type(e).__name__}: {e}")
        try:
            return discover_ranks(self.adapter, self.opts.url, self.opts.pid_root, self.opts.match)
        except DiscoveryError as e:
            return Discovery({}, "ambiguous", [], str(e))

    # ---- the ledgers (repro.proof) ------------------------------------------------------------------------------
    def _ledger_check(self) -> bool:
        """Follow the ranks' ledgers once; True when a ledger proof of a deadlock newly holds (state becomes hung).
        A desync is logged once per (group, sequence number). Never raises: problems are logged once."""
        o = self.opts
        if o.ledger_dir is None or self.state == "hung":
            return False
        try:
            from repro.ledger_follow import shared_follower
            from repro.proof import find_desyncs, find_proof, judge_slots, live_ranks

            if self._follower is None:
                pids = self.discover().rank_pids
                if not pids:
                    return False
                self._follower = shared_follower(Path(o.ledger_dir), pids)  # the server's one follower (kept)
                self._follow_since = time.time()
            if not self._follower.poll() and self._follower.lines:
                return False
            st = self._follower.state.check()  # the lockstep state digest, live (repro.state_follow)
            if st is not None:
                self.state_divergence = st
                self._log("state_divergence", level="warning", reason="First divergent state: " + st["summary"],
                          tick=st["tick"], ranks=st["ranks"], fields=st["fields"])
            al = self._follower.alignment
            # slots every rank left are judged once and dropped (memory and work stay bounded on a long watch)
            for d in judge_slots(al) + find_desyncs(al):
                key = (d.group, d.seq)
                if key not in self._desyncs_seen:
                    self._desyncs_seen.add(key)
                    self._log("desync", verdict="DESYNCED", reason=d.summary, desync=d.to_dict())
            proof = find_proof(al, live_ranks(self._follower.rank_pids))
        except Exception as e:  # noqa: BLE001 - the ledger must not end the watch
            if not self._ledger_error:
                self._ledger_error = f"{type(e).__name__}: {e}"
                self._log("ledger_error", error=self._ledger_error)
            return False
        if proof is None:
            return False
        self.ledger_proof = proof
        self.state = "hung"
        if self.first_failure_t is None:
            self.first_failure_t = proof.closing.t_enter
        self._log("ledger_proof", reason=proof.summary, proof=proof.to_dict(),
                  latency_s=round(time.time() - proof.closing.t_enter, 3))
        return True

    # ---- one round -------------------------------------------------------------------------------------------
    def probe_round(self) -> dict:
        """Run one probe round and update the hang bookkeeping; returns the round's log record.

        The generate probe is waited for at most ``probe_timeout_s`` (+0.5 s for the client to give up); the
        health probe started this round is waited for within the same bound and otherwise left running.
        """
        o = self.opts
        self.round += 1
        n = self.round
        t_start = time.time()
        if self._gen.busy():
            gen = ProbeResult("generate", SKIPPED, None, 0.0, time.time(),
                              f"the previous generate probe (round {self._gen.round}) is still running; not piling up",
                              round=n)
        else:
            self._gen.start(lambda: probe_generate(self.adapter, o.url, o.probe_timeout_s), n)
            gen = None
        if not self._health.busy():
            self._health.start(lambda: probe_health(self.adapter, o.url, o.health_timeout_s), n)
        t_wait = time.monotonic()
        proven = False
        if gen is None:
            if self._wait_probe_or_proof(o.probe_timeout_s + 0.5):
                gen = self._gen.take()
            elif self.ledger_proof is not None and self.state == "hung":  # the ledgers proved it meanwhile
                proven = True
                gen = ProbeResult("generate", INTERRUPTED, None, time.monotonic() - t_wait, t_start,
                                  "still in flight when the ledgers proved a deadlock (abandoned)", round=n)
            elif self._stop.is_set():
                gen = ProbeResult("generate", INTERRUPTED, None, time.monotonic() - t_wait, t_start,
                                  "stop requested while the probe was in flight", round=n)
            else:
                gen = ProbeResult("generate", TIMEOUT, None, time.monotonic() - t_wait, t_start,
                                  f"no answer within {o.probe_timeout_s:.1f} s (abandoned)", round=n)
        left = 0.0 if proven else o.probe_timeout_s - (time.monotonic() - t_wait)
        if left > 0 and self._health.round == n:
            self._health.wait(left, self._stop)
        h = self._health.take()
        if h is not None:
            self.health_answers.append(h)
        assert gen is not None
        health_json: dict[str, Any]
        if self._health.busy():
            health_json = {"outcome": "pending", "in_flight_s": round(time.monotonic() - self._health.started_mono, 3),
                           "round": self._health.round}
        elif self.health_answers:
            health_json = self.health_answers[-1].to_json()
        else:
            health_json = {"outcome": "none"}
        self._last_gen = gen
        event = "hang" if proven else self._account(gen)
        rec = self._log("probe", round=n, state=self.state, consecutive_failures=self.failures,
                        generate=gen.to_json(), health=health_json, **({"transition": event} if event else {}))
        self.history.append(rec)
        return rec

    def _wait_probe_or_proof(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for the generate probe in flight, following the ledgers every
        ``LEDGER_POLL_S`` meanwhile (``ledger_dir`` given): True when the probe answered; False on a timeout, a stop
        request, or a ledger proof of a deadlock (then ``ledger_proof`` is set and the state is hung)."""
        if self.opts.ledger_dir is None:
            return self._gen.wait(timeout_s, self._stop)
        end = time.monotonic() + timeout_s
        while True:
            left = end - time.monotonic()
            if left <= 0 or self._stop.is_set():
                return False
            if self._gen.wait(min(LEDGER_POLL_S, left), self._stop):
                return True
            if self._ledger_check():
                return False

    def _account(self, gen: ProbeResult) -> Optional[str]:
        """Update counters and state from a generate result; returns ``hang``/``unreachable``/``misconfigured``/
        ``recovered``/None."""
        o = self.opts
        need = 1 if o.once else o.failures
        if gen.outcome == INTERRUPTED:
            return None
        if not gen.ok and not self.ever_ok and wrong_api(gen) is not None:
            self.failures = self.unreachable = 0
            self.first_failure_t, self.first_failure_round = None, 0
            self.misconfigured += 1
            if self.misconfigured >= need and self.state != "misconfigured":
                self.state = "misconfigured"
                return "misconfigured"
            return None
        self.misconfigured = 0
        if gen.ok:
            was = self.state
            self.ever_ok = True
            self.failures = self.unreachable = 0
            self.first_failure_t, self.first_failure_round = None, 0
            self.state = "healthy"
            return "recovered" if was in ("hung", "unreachable") else None
        if gen.outcome == REFUSED:
            self.failures = 0
            self.first_failure_t, self.first_failure_round = None, 0
            self.unreachable += 1
            if self.unreachable >= need and self.state != "unreachable":
                self.state = "unreachable"
                return "unreachable"
            if self.state not in ("unreachable", "hung"):
                self.state = "failing"
            return None
        self.unreachable = 0
        self.failures += 1
        if self.first_failure_t is None:
            self.first_failure_t = gen.started
            self.first_failure_round = gen.round
        if self.state == "hung":
            return None
        if self.failures >= need:
            self.state = "hung"
            return "hang"
        self.state = "failing"
        return None

    def _health_view(self) -> HealthView:
        in_flight = (self._health.round, time.monotonic() - self._health.started_mono) if self._health.busy() else None
        return classify_health(list(self.health_answers), self.first_failure_round or self.round, in_flight,
                               self.opts.probe_timeout_s)

    def declare_bound_s(self) -> float:
        """Seconds from a hang's start to its declaration, at most (before capture): ``failures × interval +
        probe timeout`` when the probe timeout is at most the interval, else ``interval + failures × probe
        timeout`` (a timed-out probe delays the next round: probes never overlap). Plus ~0.5 s of client grace."""
        o = self.opts
        k = 1 if o.once else o.failures
        if o.probe_timeout_s <= o.interval_s:
            return k * o.interval_s + o.probe_timeout_s
        return o.interval_s + k * o.probe_timeout_s

    # ---- loop --------------------------------------------------------------------------------------------------
    def run(self) -> int:
        """Probe until stopped (or ``max_rounds``), handling hangs; with ``once`` one round.

        Returns:
            With ``once``: 0 healthy, 3 hung with deadlock evidence, 4 hung without it, 6 unreachable.
            Otherwise 0 when stopped (SIGINT/SIGTERM or ``max_rounds``). In both modes 8 (and the loop ends) when
            the URL is not this engine's API (:func:`wrong_api` for ``failures`` rounds, 1 with ``once``, before
            any generate probe succeeded): nothing is captured and ``on_hang`` is not run.
        """
        o = self.opts
        self._log("start", adapter=getattr(self.adapter, "name", None), interval_s=o.interval_s, probe_timeout_s=o.probe_timeout_s, health_timeout_s=o.health_timeout_s,
                  failures=1 if o.once else o.failures, once=o.once, evidence_root=str(o.evidence_root),
                  on_hang=o.on_hang, pid_root=o.pid_root, match=o.match,
                  declare_within_s=round(self.declare_bound_s(), 3))
        d = self.discover()
        self._log("discovery", method=d.method, rank_pids={str(k): v for k, v in d.rank_pids.items()},
                  **({"note": d.note} if d.note else {}))
        code = EXIT_HEALTHY
        next_t = time.monotonic()
        try:
            while not self._stop.is_set():
                rec = self.probe_round()
                tr = rec.get("transition")
                if tr is None and self._ledger_check():
                    tr = "hang"
                if tr == "hang":
                    outcome = self.handle_hang()
                    code = outcome.exit_code
                elif tr == "unreachable":
                    gen = rec["generate"]
                    self._log("unreachable", consecutive=self.unreachable,
                              detail=f"the server does not accept connections ({gen.get('error', '')}); down, not hung: "
                                     "no capture")
                    code = EXIT_UNREACHABLE
                elif tr == "misconfigured":
                    self._log("misconfigured", consecutive=self.misconfigured, status=rec["generate"].get("status"),
                              detail=f"{wrong_api(self._last_gen)} from {o.url}{self.adapter.generate_path}; this is "
                                     "not this engine's generate API (wrong URL, port or engine?): not a hang, no "
                                     "capture, --on-hang not run")
                    return EXIT_MISCONFIGURED
                elif tr == "recovered":
                    self._log("recovered", detail="a generate probe succeeded again")
                    self.ledger_proof, self._follower = None, None
                if o.once:
                    if self.state == "healthy":
                        code = EXIT_HEALTHY
                    return code
                if o.max_rounds is not None and self.round >= o.max_rounds:
                    break
                next_t = max(next_t + o.interval_s, time.monotonic())
                while not self._stop.is_set() and time.monotonic() < next_t:  # the ledgers, between probe rounds
                    self._stop.wait(max(0.0, min(0.2, next_t - time.monotonic())))
                    if self._ledger_check():
                        outcome = self.handle_hang()
                        code = outcome.exit_code
                        if o.once:
                            return code
            return EXIT_HEALTHY
        finally:
            self._end_on_hang_proc()
            self._log("stop", rounds=self.round, state=self.state, hangs=len(self.hangs),
                      reason="stop requested" if self._stop.is_set() else "done")

    # ---- hang --------------------------------------------------------------------------------------------------
    def handle_hang(self) -> HangOutcome:
        """Capture ×2, analyse, write the evidence folder, then run ``on_hang``. Never raises for I/O problems:
        they are logged (``evidence_error`` names the path) and the watch goes on."""
        from repro.checker import check_groups

        o = self.opts
        t_decl = time.time()
        health = self._health_view()
        last_gen = self.history[-1]["generate"] if self.history else {}
        declared_after = t_decl - self.first_failure_t if self.first_failure_t else None
        self._log("hang", kind=health.kind, detail=health.detail, consecutive_failures=self.failures,
                  first_failure=_iso(self.first_failure_t) if self.first_failure_t else None,
                  declared_after_first_failure_s=round(declared_after, 3) if declared_after is not None else None,
                  last_generate=last_gen)
        errors: list[str] = []
        evd = self._make_evidence(errors)
        stacks_dir = evd.stacks_dir if evd is not None else Path(tempfile.mkdtemp(prefix="repro-watch-stacks-"))
        disc = self.discover()
        writes: list[tuple[str, Callable[[], Any]]] = []
        if evd is not None:
            writes.append((ev.Layout.WATCH.name, lambda: evd.watch.write({
                "kind": "watch", "options": {k: (str(v) if isinstance(v, Path) else v) for k, v in asdict(o).items()},
                "pid": os.getpid()})))
            writes.append((ev.Layout.PROBES.name, lambda: evd.probes.write(list(self.history))))
            if disc.procs:
                writes.append((ev.Layout.PROCESSES.name, lambda: _procs.save_procs(evd.processes.path, disc.procs)))
        self._write_all(evd, writes, errors)
        metrics = self._fetch_metrics(evd, errors)
        t_cap = time.time()
        a1 = a2 = None
        judgement = None
        verdict, reason = INCONCLUSIVE, ""
        rank_pids = disc.rank_pids
        report_stacks = stacks_dir  # the raw stacks REPORT.md shows (behind a router: the diverged server's)
        per_server: dict[str, Any] = {}
        diverged: Optional[str] = None
        if not rank_pids:
            reason = f"hung without deadlock evidence: no rank process found to capture ({disc.note})"
        else:
            try:
                # the confirm gap is not cut short by a stop request: the confirmation needs it
                kw = dict(tag="", second_tag="-2", confirm_gap_s=o.confirm_gap_s, timeout_s=o.capture_timeout_s,
                          native=o.native)
                # one check for every topology: each TP group captured where its ranks run and judged alone
                # (behind a router: each server into servers/<name>/; --hosts: every rank on its own host)
                groups = disc.stall_groups(evd.path if evd is not None else stacks_dir, stacks_dir)
                res = check_groups(groups, **kw)
                chk = res.group_check()
                per_server = {n: c for n, c in res.checks.items() if n is not None}
                diverged = res.diverged
                report_stacks = next(g.stacks_dir for g in groups if g.name == res.shown)
                if evd is not None:
                    for g in groups:
                        g.where.write_record(evd)
                a1, a2, judgement = chk.first_analysis, chk.second_analysis, chk.judgement
                if self.ledger_proof is not None:  # proven from the ledgers: the stacks are for the report
                    verdict, reason = DEADLOCKED, self.ledger_proof.summary
                elif judgement.deadlocked:
                    verdict, reason = DEADLOCKED, (f"the {diverged} server deadlocked: " if diverged else "") + judgement.reason
                elif per_server:
                    reason = "hung without deadlock evidence: " + "; ".join(
                        f"{n} server: {c.judgement.reason}" for n, c in per_server.items())
                else:
                    reason = f"hung without deadlock evidence: {judgement.reason}"
            except OSError as e:
                errors.append(f"{stacks_dir}: {e.strerror or e}")
                self._log("evidence_error", path=str(stacks_dir), error=str(e))
                reason = f"hung; the stacks could not be captured: {e}"
            except Exception as e:  # noqa: BLE001 - a capture problem must not end the watch
                reason = f"hung; capture failed: {type(e).__name__}: {e}"
        if self.ledger_proof is not None and verdict != DEADLOCKED:  # proven: a failed capture does not cost it
            verdict, reason = DEADLOCKED, self.ledger_proof.summary
        capture_s = time.time() - t_cap
        health_after = self._health_view()
        exit_code = EXIT_HUNG_DEADLOCK if verdict == DEADLOCKED else EXIT_HUNG_NO_EVIDENCE
        out = HangOutcome(verdict, reason, exit_code, health, evd.path if evd is not None else None, errors, a2)
        hang_json = {
            "verdict": verdict, "reason": reason, "exit_code": exit_code, "url": o.url,
            **({"proof": self.ledger_proof.to_dict()} if self.ledger_proof is not None else {}),
            "declared_at": _iso(t_decl), "first_failure_at": _iso(self.first_failure_t) if self.first_failure_t else None,
            "consecutive_failures": self.failures, "failures_to_declare": 1 if o.once else o.failures,
            "last_generate": last_gen, "health_at_declaration": health.to_json(), "health_after_capture": health_after.to_json(),
            "discovery": {"method": disc.method, "rank_pids": {str(k): v for k, v in rank_pids.items()}, "note": disc.note},
            "timings_s": {"declared_after_first_failure": round(declared_after, 3) if declared_after is not None else None,
                          "capture": round(capture_s, 3),
                          **({"proof_record_t": self.ledger_proof.closing.t_enter, "declared_t": t_decl,
                              "declared_after_proof_record": round(t_decl - self.ledger_proof.closing.t_enter, 3)}
                             if self.ledger_proof is not None else {})},
            "metrics": metrics,
            **({"state_divergence": self.state_divergence} if self.state_divergence is not None else {}),
            "judgement": ({"deadlocked": judgement.deadlocked, "reason": judgement.reason,
                           "cpu_percent": {str(k): round(v, 1) for k, v in judgement.cpu_percent.items()}}
                          if judgement is not None else None),
        }
        if disc.servers:
            hang_json["diverged_server"] = diverged
            hang_json["servers"] = {
                n: {"rank_pids": {str(k): v for k, v in pids.items()},
                    "stacks": str(ev.Layout.server_dir("", n) / ev.Layout.STACKS.name),
                    **({"deadlocked": per_server[n].judgement.deadlocked, "reason": per_server[n].judgement.reason,
                        "summary": per_server[n].second_analysis.summary} if n in per_server else
                       {"deadlocked": None, "reason": "not captured"})}
                for n, pids in disc.servers.items()}
        if evd is not None:
            writes = []
            if a2 is not None:
                writes.append((ev.Layout.ANALYSIS.name, lambda: evd.analysis.write(a2.to_dict())))
                writes.append((ev.Layout.ANALYSIS_FIRST.name, lambda: evd.analysis_first.write(a1.to_dict())))
            for n, c in per_server.items():  # each server's own analysis next to its stacks
                writes.append((str(ev.Layout.server_dir("", n) / ev.Layout.ANALYSIS.name), lambda n=n, c=c:
                               evd.sub(ev.Layout.SERVERS, n).analysis.write(c.second_analysis.to_dict())))
            writes.append((ev.Layout.HANG.name, lambda: evd.hang.write(hang_json)))
            writes.append((ev.Layout.REPORT.name, lambda: evd.report.write(watch_report(
                o, hang_json, a2, list(self.history), disc, report_stacks))))
            # verdict.json takes a run's shape (repro.evidence.VerdictRecord), plus kind = watch and the hang label
            timings = {"declared_after_first_failure_s": declared_after, "capture_s": capture_s}
            writes.append((ev.Layout.VERDICT.name, lambda: evd.verdict.write(ev.verdict_record(
                {"verdict": verdict, "reason": reason, "notes": [health.detail]}, exit_code=exit_code,
                evidence=evd.path, scenario=evd.scenario_dir.name, partial=False,
                timings={k: v for k, v in timings.items() if v is not None}, rank_pids=rank_pids, kind="watch",
                hang=health.kind, **({"state_divergence": self.state_divergence} if self.state_divergence else {})))))
            writes.append((ev.Layout.RUN.name, lambda: evd.set_status("complete")))
            ok = self._write_all(evd, writes, errors)
        else:
            ok = False
        out.evidence_errors = errors
        on_disk = evd is not None and ok
        self._log("evidence", verdict=verdict, reason=reason, hang=health.kind, health_after_capture=health_after.kind,
                  path=str(evd.path) if evd is not None else None, complete=on_disk, capture_s=round(capture_s, 3),
                  summary=getattr(a2, "summary", None), exit_code=exit_code,
                  **({"errors": errors} if errors else {}))
        if evd is None:
            shutil.rmtree(stacks_dir, ignore_errors=True)
        if o.on_hang:
            if not on_disk:
                self._log("on_hang_skipped", command=o.on_hang,
                          reason="the evidence is not (completely) on disk; a restart now would lose the forensic state",
                          errors=errors)
            elif self._stop.is_set():
                self._log("on_hang_skipped", command=o.on_hang, reason="stop requested before the command could run")
            else:
                out.on_hang = self._run_on_hang(evd, verdict)
        self.hangs.append(out)
        return out

    def _make_evidence(self, errors: list[str]) -> Optional[ev.EvidenceDir]:
        parts = urlsplit(self.opts.url)
        scen = f"watch-{parts.hostname}-{parts.port or ''}"
        try:
            return ev.EvidenceDir(self.opts.evidence_root, scen, "hang")
        except OSError as e:
            where = Path(self.opts.evidence_root) / scen
            msg = f"cannot write the evidence under {where}: {getattr(e, 'strerror', None) or e}"
            errors.append(msg)
        try:
            evd = ev.EvidenceDir(FALLBACK_EVIDENCE_ROOT, scen, "hang")
            self._log("evidence_error", path=str(where), error=msg, fallback=str(evd.path),
                      fix="pass a writable --evidence-dir")
            return evd
        except OSError as e2:
            errors.append(f"cannot write the fallback evidence under {FALLBACK_EVIDENCE_ROOT}: {e2}")
            self._log("evidence_error", path=str(where), error=msg, fallback=None,
                      fallback_error=str(e2), fix="pass a writable --evidence-dir")
            return None

    def _write_all(self, evd: Optional[ev.EvidenceDir], writes: list[tuple[str, Callable[[], Any]]],
                   errors: list[str]) -> bool:
        ok = True
        for name, fn in writes:
            try:
                fn()
            except OSError as e:
                ok = False
                path = str(evd.file(name)) if evd is not None else name
                errors.append(f"{path}: {e.strerror or e}")
                self._log("evidence_error", path=path, error=str(e), fix="pass a writable --evidence-dir")
        return ok

    def _fetch_metrics(self, evd: Optional[ev.EvidenceDir], errors: list[str]) -> dict:
        """GET the Prometheus endpoint and keep its body raw as ``metrics.txt``; returns what happened."""
        o = self.opts
        outcome, status, resp, err, lat = _http("GET", o.url + o.metrics_path, o.probe_timeout_s)
        if outcome != OK:
            return {"path": o.metrics_path, "outcome": outcome, "error": err}
        if status != 200:
            return {"path": o.metrics_path, "outcome": HTTP_ERROR, "status": status,
                    "note": "sglang serves /metrics only with --enable-metrics"}
        info = {"path": o.metrics_path, "outcome": OK, "status": status, "bytes": len(resp.content),
                "latency_s": round(lat, 3), "file": ev.Layout.METRICS.name}
        if evd is not None:
            try:
                evd.metrics.write(resp.content.decode("utf-8", errors="replace"))
            except OSError as e:
                errors.append(f"{evd.metrics.path}: {e.strerror or e}")
                self._log("evidence_error", path=str(evd.metrics.path), error=str(e))
                info["file"] = None
        return info

    # ---- on-hang -----------------------------------------------------------------------------------------------
    def _run_on_hang(self, evd: ev.EvidenceDir, verdict: str) -> dict:
        """Run ``on_hang`` in its own process group with ``REPRO_EVIDENCE_DIR``; bounded; logged; never raises."""
        o = self.opts
        env = dict(os.environ, **{EVIDENCE_ENV: str(evd.path), "REPRO_WATCH_URL": o.url, "REPRO_VERDICT": verdict})
        log_path = evd.on_hang_log.path
        t0 = time.time()
        res: dict[str, Any] = {"command": o.on_hang, "evidence": str(evd.path), "started": _iso(t0)}
        try:
            with open(log_path, "wb") as logf:
                p = subprocess.Popen(o.on_hang, shell=True, env=env, stdin=subprocess.DEVNULL, stdout=logf,
                                     stderr=subprocess.STDOUT, start_new_session=True)
                self._on_hang_proc = p
                timed_out = False
                while p.poll() is None:
                    if self._stop.is_set():
                        res["stopped"] = True
                        break
                    if time.time() - t0 > o.on_hang_timeout_s:
                        timed_out = True
                        break
                    time.sleep(0.05)
                if p.poll() is None:
                    self._end_on_hang_proc()
                res.update(rc=p.returncode, timed_out=timed_out)
        except OSError as e:
            res.update(rc=None, error=f"could not run the command: {e}")
        finally:
            self._on_hang_proc = None
        res["duration_s"] = round(time.time() - t0, 3)
        try:
            text = log_path.read_text(encoding="utf-8", errors="replace")
            res["output_tail"] = text[-ON_HANG_OUTPUT_TAIL_CHARS:]
        except OSError:
            res["output_tail"] = ""
        try:
            evd.on_hang.write(res)
        except OSError as e:
            self._log("evidence_error", path=str(evd.on_hang.path), error=str(e))
        self._log("on_hang", **res)
        return res

    def _end_on_hang_proc(self) -> None:
        p = self._on_hang_proc
        if p is None or p.poll() is not None:
            return
        for sig, wait_s in ((signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)):
            try:
                os.killpg(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass
            try:
                p.wait(timeout=wait_s)
                return
            except subprocess.TimeoutExpired:
                continue


# ------------------------------------------------------------------------------------------------------------
# report


def watch_report(opts: WatchOptions, hang: dict, analysis: Any, history: Sequence[dict], disc: Discovery,
                 stacks_dir: Path, last_rounds: int = 15) -> str:
    """REPORT.md of a watch hang: verdict line first, the hang (what /health said), diagnosis + rank table,
    the probes before it, processes, metrics, what runs next, raw stacks."""
    from repro.diagnosis import md_cell
    from repro.report import rank_table, stacks_details

    lines = [f"# {hang['verdict']} — watch {opts.url}", "", f"**Reason:** {hang['reason']}", ""]
    h = hang["health_at_declaration"]
    ha = hang["health_after_capture"]
    lines += ["## Hang", "",
              f"- declared at {hang['declared_at']} after {hang['consecutive_failures']} consecutive failed generate "
              f"probes (first failure {hang['first_failure_at']}; probe timeout {opts.probe_timeout_s:g} s, "
              f"interval {opts.interval_s:g} s)",
              f"- last generate probe: `{json.dumps(hang['last_generate'])}`",
              f"- /health at declaration: **{h['kind']}** — {h['detail']}",
              f"- /health after capture: **{ha['kind']}** — {ha['detail']}", ""]
    st = hang.get("state_divergence")
    if st:  # seen live before the hang (repro.state_follow): the cause leads, the symptom follows
        lines += ["## Diagnosis", "", f"**First divergent state:** {md_cell(str(st.get('summary', '')))}", ""]
    if analysis is not None:
        lines += ([] if st else ["## Diagnosis", ""]) + [str(analysis.summary), ""] + rank_table(analysis) + [""]
        j = hang.get("judgement") or {}
        if j:
            cpu = ", ".join(f"TP{k} {v}%" for k, v in j.get("cpu_percent", {}).items())
            lines += [f"DEADLOCKED rule: {'holds' if j['deadlocked'] else 'does not hold'} — {j['reason']} "
                      f"(CPU between the two captures: {cpu or 'unknown'})", ""]
    servers = hang.get("servers") or {}
    if servers:
        shown = hang.get("diverged_server")
        lines += ["## Servers", "",
                  (f"**The {shown} server diverged**; the diagnosis above is its ranks'." if shown else
                   f"No server's ranks are deadlocked; the diagnosis above is the {stacks_dir.parent.name} server's."),
                  "Each server is captured and judged on its own (its ranks are its own TP group).", "",
                  "| server | ranks (pid) | deadlocked | reason | stacks |", "|---|---|---|---|---|"]
        for n, x in servers.items():
            ranks = ", ".join(f"{n} TP{k} ({pid})" for k, pid in x["rank_pids"].items())
            lines.append(f"| {n} | {ranks} | {x.get('deadlocked')} | {md_cell(str(x.get('reason', '')))[:300]} | "
                         f"`{x['stacks']}/` |")
        lines.append("")
    lines += ["## Probes before the hang", "", "| time | round | generate | health |", "|---|---|---|---|"]
    for r in list(history)[-last_rounds:]:
        g, hh = r.get("generate", {}), r.get("health", {})
        gtxt = f"{g.get('outcome')} {g.get('status') or ''} {g.get('latency_s', '')} s"
        htxt = f"{hh.get('outcome')} {hh.get('status') or ''}" + (f" ({hh['in_flight_s']} s)" if "in_flight_s" in hh else "")
        lines.append(f"| {r['ts']} | {r.get('round')} | {gtxt} | {htxt} |")
    lines += ["", "## Processes", "", f"Found by `{disc.method}`" + (f" ({disc.note})" if disc.note else "") + ".", ""]
    titles = {p.pid: p.title for p in disc.procs}
    for k, pid in sorted(disc.rank_pids.items()):
        lines.append(f"- TP{k}: pid {pid} `{titles.get(pid, '')[:80]}`")
    m = hang.get("metrics") or {}
    lines += ["", "## Metrics", "",
              (f"Raw `{m['path']}` kept in `{ev.Layout.METRICS.name}` ({m.get('bytes')} bytes)." if m.get("file")
               else f"`{m.get('path')}` not kept: {m.get('error') or m.get('note') or m.get('status')}"), ""]
    lines += ["## Next", "",
              (f"`{opts.on_hang}` runs after this folder is complete (`REPRO_EVIDENCE_DIR` = this folder); its exit "
               f"status and output are in `{ev.Layout.ON_HANG.name}` / `{ev.Layout.ON_HANG_LOG.name}`." if opts.on_hang
               else "No --on-hang command."),
              "", "Re-analyse: `repro analyze " + shlex.quote(str(stacks_dir.parent)) + "`", ""]
    lines += ["## Raw stacks", ""]
    if servers:
        for n in servers:
            lines += [f"### {n} server", ""] + stacks_details(stacks_dir.parent.parent / n / ev.Layout.STACKS.name)
    else:
        lines += stacks_details(stacks_dir)
    return "\n".join(lines) + "\n"
