"""The watch loop (:class:`Watcher`): probe rounds, the hang declaration, the captures and the evidence, then
``--on-hang``."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections import deque
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

from repro import evidence as ev
from repro import procs as _procs
from repro.verdict import DEADLOCKED, INCONCLUSIVE
from repro.watch.discovery import Discovery, discover_ranks
from repro.watch.options import (DiscoveryError, EVIDENCE_ENV, EXIT_HEALTHY, EXIT_HUNG_DEADLOCK,
                                 EXIT_HUNG_NO_EVIDENCE, EXIT_MISCONFIGURED, EXIT_UNREACHABLE, FALLBACK_EVIDENCE_ROOT,
                                 HISTORY_ROUNDS, LEDGER_POLL_S, LogSink, ON_HANG_OUTPUT_TAIL_CHARS, WatchOptions)
from repro.watch.probes import (HTTP_ERROR, HealthView, INTERRUPTED, OK, ProbeResult, REFUSED, SKIPPED, TIMEOUT,
                                _Slot, _http, classify_health, probe_generate, probe_health, wrong_api)
from repro.watch.report import HangOutcome, _iso, watch_report


class Watcher:
    """The probe loop. Use :meth:`run`; call :meth:`stop` (e.g. from a SIGINT/SIGTERM handler) to end it.

    Args:
        opts: validated :class:`WatchOptions`.
        log: receives one JSON-serialisable dict per probe round (``event: probe``) and per event (``start``,
            ``discovery``, ``hang``, ``unreachable``, ``recovered``, ``evidence``, ``evidence_error``, ``on_hang``,
            ``on_hang_skipped``, ``stop``).
        adapter: engine adapter (None: the registry's default adapter, *assumed*: the ``start`` event, watch.json and
            the CLI say so, with ``--adapter NAME`` as the fix).
        discover: callable returning rank → pid, replacing :func:`discover_ranks` (for embedding and tests).
    """

    def engine_record(self) -> dict:
        """``{"engine": name, "engine_assumed": bool}``: which engine's titles, rules and API the watch uses, and
        whether it was assumed (no ``--adapter``) rather than given."""
        return {"engine": self.adapter.name, "engine_assumed": self.adapter_assumed}

    def __init__(self, opts: WatchOptions, log: Optional[LogSink] = None, adapter: Any = None,
                 discover: Optional[Callable[[], dict[int, int]]] = None) -> None:
        self.adapter_assumed = adapter is None
        if adapter is None:
            from repro.targets.registry import DEFAULT_ADAPTER, get_adapter

            adapter = get_adapter(DEFAULT_ADAPTER)
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
            from repro.watch.hosts import discover_on_hosts

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
        self._log("start", adapter=self.adapter.name, **self.engine_record(), interval_s=o.interval_s, probe_timeout_s=o.probe_timeout_s, health_timeout_s=o.health_timeout_s,
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
                "pid": os.getpid(), **self.engine_record()})))
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
            note = self.adapter.watch_defaults.metrics_note
            return {"path": o.metrics_path, "outcome": HTTP_ERROR, "status": status, **({"note": note} if note else {})}
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
