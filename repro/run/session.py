"""One server's session (:class:`Session`): start, arm, drive a burst, detect, stop; restart after a hang."""

from __future__ import annotations

import time
from typing import Any, Optional, Sequence

from repro import evidence as ev
from repro import nemeses
from repro.detect import DetectContext
from repro.detectors import default_detectors
from repro.driver import TOKEN_ID_RANGE, AbortPlan, BurstDriver, DriverState, make_prompts
from repro.launcher import lost_port_line, start_retrying_port_races
from repro.run.arm import ARM_ACK_TIMEOUT_S, POLL_S, arm_and_wait, write_arm_file
from repro.run.finish import Outcome, RunEvidence, save_server_procs, snapshot_session
from repro.run.options import Observer, Prepared, UnresolvedSitesError, _noop
from repro.run.records import injection_checks
from repro.scenario import Variant
from repro.verdict import DEADLOCKED, INCONCLUSIVE, Verdict, interrupt_exit_code, judge_completion


# Seconds stop() waits after SIGTERM before SIGKILL once a burst left the tree wedged (Session.wedged): 0, i.e. no
# SIGTERM, SIGKILL at once (repro.procs.stop_procs). A rank blocked in a gloo/NCCL collective never returns to the
# interpreter to run its handler, and the evidence is written before the stop, so any wait only delays the next run
# (docs: benchmarks/RESULTS.md, "Teardown of a wedged tree").
WEDGED_STOP_GRACE_S = 0.0


class Session(RunEvidence):
    """One launched server with the injector loaded for a plan (one or more variants' injections), unarmed.

    ``start`` launches and waits for health; ``drive`` arms one variant's injections, sends the burst, detects and
    judges, then disarms; ``stop`` ends the whole tree. A session can drive several variants in turn (tests that do
    not hang a server, ``hunt``); after a hang or a crash it must be restarted (``restart``).

    Args:
        p: the prepared run (its evidence folder holds the server log, process list and injector records).
        observe: progress callback ``(event, data)``.
        detectors: the detect stage (``repro.detect``); default :func:`repro.detectors.default_detectors` per drive.
    """

    def __init__(self, p: Prepared, observe: Observer = _noop, detectors: Optional[Sequence[Any]] = None) -> None:
        self.p = p
        self.observe = observe
        self.detectors = list(detectors) if detectors is not None else None  # None: repro.detectors.default_detectors
        self.server: Any = None
        self.rank_pids: dict[int, int] = {}
        self.healthy_s: Optional[float] = None
        self.interrupted_in_teardown = False
        self._launched_t: Optional[float] = None  # launch() started the server; start() waits for it
        # seconds stop() lets the tree exit after SIGTERM before SIGKILL (repro hunt: 1 s — sglang's parent sleeps 5 s
        # after a child died before it exits, and a hunt's servers have nothing to drain)
        self.stop_grace_s = 10.0
        # set by drive() when a burst ended with the tree wedged (a deadlock, a desync, a dead rank): stop() then
        # SIGKILLs at once (WEDGED_STOP_GRACE_S = 0, no SIGTERM) — a rank blocked in a collective never runs its SIGTERM
        # handler, and the evidence is already written (issue 36: the tree is gone within 2 s of verdict.json)
        self.wedged = False

    def start(self) -> Optional[Verdict]:
        """Launch and wait healthy (a port taken during start-up is retried on new ports), record the tree, map the
        ranks, check every site resolved. Used by run, demo, serve, compare, hunt and the tests.

        Events: ``launch``, ``wait_healthy`` (url, pid, log, timeout_s), ``still_starting`` (waited_s, last_line,
        every ~15 s), ``relaunch``, ``healthy`` (waited_s).

        Returns:
            None when healthy, else the INCONCLUSIVE verdict saying why (the server may still run: call ``stop``).
        Raises:
            UnresolvedSitesError: an injection's site does not resolve in the server's engine.
        """
        from repro.launcher import LaunchError, start_server

        p, t0 = self.p, time.time()
        launched_t, self._launched_t = self._launched_t, None  # set by launch(): the server is already starting
        if launched_t is None or self.server is None:
            write_arm_file(p.arm_file, [])
            self.observe("launch", {"evidence": str(p.evidence.path)})
        else:
            t0 = launched_t
        started = False  # the current start launched (a failed wait stops it; a failed launch has nothing)

        def start(attempt: int) -> Any:
            nonlocal started
            started = False
            if attempt > 1 or launched_t is None or self.server is None:
                self.server = start_server(p.adapter, p.spec, p.evidence.server_log.path)
                save_server_procs(p.evidence, self.server)
            started = True
            return self.server

        def wait(server: Any) -> float:
            self.observe("wait_healthy", {"url": server.url, "pid": server.pid, "log": str(p.evidence.server_log.path),
                                          "timeout_s": p.scenario.server.startup_timeout_s})
            waited = server.wait_healthy(
                p.scenario.server.startup_timeout_s,
                progress=lambda w, line: self.observe("still_starting", {"waited_s": w, "last_line": line}))
            self.observe("healthy", {"waited_s": waited})
            return waited

        def stop(server: Any) -> None:
            server.stop()
            self.server = None

        # A free port picked at launch may be taken before the server binds it (gloo's ephemeral ports, another server
        # starting): start again on new ports (only ports the harness picked); the log keeps every attempt.
        try:
            start_retrying_port_races(
                start, wait, stop, observe=self.observe,
                lost=lambda e, server: lost_port_line(e, server) if p.spec.port == 0 and p.spec.nccl_port == 0 else None)
        except LaunchError as e:
            if started and self.server is not None:
                stop(self.server)
            return Verdict(INCONCLUSIVE, f"server failed to start: {e}")
        self.healthy_s = time.time() - t0
        self.rank_pids = self.server.rank_pids()
        save_server_procs(p.evidence, self.server)
        expected = list(range(p.spec.tp_size))
        if sorted(self.rank_pids) != expected:
            return Verdict(INCONCLUSIVE, f"expected scheduler ranks {expected}, found {sorted(self.rank_pids)} among the server's processes")
        self._check_sites()
        return None

    def _check_sites(self) -> None:
        """Before any burst: every injection of the plan must resolve in the server's sglang (the injector's own
        records; the resolver only when one is not patched yet). Raises UnresolvedSitesError naming the nearest names."""
        from repro.sites import SitesUnresolved, check_launched_sites

        p = self.p
        if getattr(self, "_sites_ok", False):
            return  # checked once for this plan (a restart after a hang loads the same sites)
        try:
            check_launched_sites(p.scenario, str(p.plan.get("variant") or p.variant.name).split(","),
                                 p.evidence.injector_dir, p.python, env=getattr(self.server, "env", None),
                                 adapter=p.adapter)
        except SitesUnresolved as e:
            raise UnresolvedSitesError(str(e)) from None
        self._sites_ok = True

    def launch(self) -> Optional[Verdict]:
        """Start the server's processes and return at once, without waiting for health (``repro hunt``'s spare
        server, started while another server serves trials); the next :meth:`start` waits for this one instead of
        launching again (``healthy_s`` then counts from this launch). Event: ``launch``.

        Returns:
            None when the processes started, else the INCONCLUSIVE verdict saying why (nothing left running).
        """
        from repro.launcher import LaunchError, start_server

        p = self.p
        write_arm_file(p.arm_file, [])
        self.observe("launch", {"evidence": str(p.evidence.path), "spare": True})
        try:
            self.server = start_server(p.adapter, p.spec, p.evidence.server_log.path)
        except LaunchError as e:
            return Verdict(INCONCLUSIVE, f"server failed to start: {e}")
        self._launched_t = time.time()
        save_server_procs(p.evidence, self.server)
        return None

    def stop(self) -> list:
        """End the whole server tree (idempotent); records what was left in ``teardown.json``."""
        self._launched_t = None
        if self.server is None:
            return []
        grace = min(self.stop_grace_s, WEDGED_STOP_GRACE_S) if self.wedged else self.stop_grace_s
        self.observe("teardown", {"grace_s": grace})
        t0 = time.time()
        try:
            left = self.server.stop(grace_s=grace)
        except KeyboardInterrupt as e:
            # Ctrl-C/SIGTERM arrived during the teardown itself: finish it (the CLI ignores further signals now),
            # then let the caller report the interruption.
            left = self.server.stop(grace_s=grace)
            self.interrupted_in_teardown = True
            self.teardown_exit_code = interrupt_exit_code(e)
        self.p.evidence.teardown.write({"left_running": [getattr(x, "pid", x) for x in left], "time": time.time(),
                                        "grace_s": grace, "wedged": self.wedged, "stop_s": round(time.time() - t0, 3)})
        self.server = None
        self.wedged = False
        return left

    def restart(self) -> Optional[Verdict]:
        """Stop and start again (after a hang or a crash)."""
        self.stop()
        return self.start()

    # ---- what drive() does per server (repro.pd.PDSession overrides these for a stack of several servers) ------
    def arm(self, ids: Sequence[str]) -> list:
        """Write the arm file with ``ids`` and wait for every rank's acknowledgement; returns the ranks that did not
        acknowledge within ``ARM_ACK_TIMEOUT_S``."""
        return arm_and_wait(self.p.arm_file, ids, self.p.evidence.injector_dir, self.rank_pids)

    def disarm(self) -> None:
        """Empty the arm file (every injection off)."""
        write_arm_file(self.p.arm_file, [])

    def armed_ranks(self) -> Any:
        """What the ``armed`` event names as the ranks (rank → pid)."""
        return self.rank_pids

    def make_detectors(self) -> list:
        """The detect stage of one drive (``repro.detect``): the session's, else :func:`repro.detectors.default_detectors`."""
        return list(self.detectors) if self.detectors is not None else default_detectors(self.p.plan)

    def detect_context(self, run_dir: ev.EvidenceDir, native: bool) -> DetectContext:
        """The detectors' view of this server for one drive."""
        p = self.p
        return DetectContext(self.rank_pids, list(range(p.spec.tp_size)), run_dir, p.evidence.injector_dir, p.plan,
                             p.scenario.stall_s, native=native, observe=self.observe,
                             server_log=getattr(self.server, "log_path", None))

    def down_detectors(self, detectors: Sequence[Any]) -> list:
        """The detectors polled once more when the server is found not running during the burst, before
        :meth:`died_reason` is the verdict (a single server: none; its rank death still names a dead rank after
        the burst, ``final_verdict``)."""
        return []

    def snapshot(self, p: Prepared, run_dir: ev.EvidenceDir) -> None:
        """Copy what the session holds of a driven variant into its run folder (:func:`snapshot_session`)."""
        snapshot_session(p, run_dir)

    def died_reason(self) -> str:
        """The INCONCLUSIVE reason when the server is not running during the burst."""
        return f"server died during the burst; log tail:\n{self.server.log_tail(20)}"

    def judge_burst(self, variant: Variant, verdict: Optional[Verdict], state: DriverState, ctx: DetectContext,
                    detectors: Sequence[Any]) -> tuple[Verdict, Any]:
        """The verdict after the burst loop: ``verdict`` when a detector decided (or the server died / the budget
        ended), else the completion rule on the injector's records. Returns (verdict, the InjectorReport read or None)."""
        if verdict is not None:
            return verdict, None
        time.sleep(0.5)  # let the injectors' counters reach disk (they flush every ~0.2 s)
        loaded, armed, checks, injector = injection_checks(self.p.evidence.injector_dir, variant, self.rank_pids)
        return judge_completion(state.requests, ctx.expected_ranks, loaded, armed, checks), injector

    def finish_outcome(self, out: Outcome, detectors: Sequence[Any]) -> Outcome:
        """The drive's Outcome, as callers get it (PD: with each server's verdict attached)."""
        return out

    def drive(self, variant: Variant, run_dir: ev.EvidenceDir, n_requests: Optional[int] = None, native: bool = False) -> Outcome:
        """Arm ``variant``'s injections, send the burst, watch for a stall, capture and judge, disarm.

        THE burst/detect loop of a session, single server or a stack of several (:mod:`repro.pd` overrides the
        per-server steps above: arming, detectors, judging, disarming).

        Args:
            variant: one of the variants whose injections are in this session's plan.
            run_dir: where this variant's requests.jsonl, stacks/ and stalls.json go.
            n_requests: override of the burst's request count.
            native: py-spy ``--native``.
        Returns:
            The Outcome; ``clean`` is False after a deadlock, a crash, or requests left outstanding.
        Raises:
            KeyboardInterrupt: passed through (the caller tears down); the driver is abandoned first.
        """
        p, server = self.p, self.server
        scenario, burst = p.scenario, p.scenario.burst
        timings: dict[str, float] = {}
        ids = [i.id for i in variant.injections]
        t_arm = time.time()
        # every rank armed before the first request: otherwise a rank that polls late meets its call site a tick late
        late = self.arm(ids)
        timings["arm_ack_s"] = time.time() - t_arm
        if late:
            self.observe("arm_not_acknowledged", {"ranks": late, "timeout_s": ARM_ACK_TIMEOUT_S})
        self.observe("armed", {"injections": ids, "ranks": self.armed_ranks()})
        workload = getattr(variant, "workload", None) or getattr(burst, "workload", None)  # repro.nemeses
        n_req, concurrency, input_len, max_new = nemeses.effective_sizes(burst, workload)
        prompts = (make_prompts(n_requests or n_req, input_len, burst.seed) if workload is None else
                   nemeses.make_prompts_for(nemeses.request_plans(n_requests or n_req, input_len, max_new, workload),
                                            burst.seed, TOKEN_ID_RANGE))
        prompts = nemeses.warm_prompts(prompts, workload)  # storage-warm: the after requests repeat burst prompts
        driver = BurstDriver(p.adapter, server.url, prompts, max_new, concurrency,
                             run_dir.requests.path, burst.request_timeout_s,
                             abort=AbortPlan.from_spec(getattr(variant, "abort", None) or getattr(burst, "abort", None)),  # the mass-abort action
                             workload=workload)
        verdict: Optional[Verdict] = None
        deciding = last_analysis = None
        last_reason = ""
        stall_history: list[dict] = []
        detectors = self.make_detectors()
        ctx = self.detect_context(run_dir, native)

        def take(det: Any, st: DriverState) -> bool:
            """Keep a detector's word (records and evidence written); True when it decided the verdict."""
            nonlocal verdict, deciding, last_analysis, last_reason
            if det is None:
                return False
            if det.analysis is not None:
                last_analysis = det.analysis
            if det.reason:
                last_reason = det.reason
            if det.record is not None:
                stall_history.append({**det.record, "detector": det.detector} if det.detector != "stall" else det.record)
                run_dir.stalls.write(stall_history)
            for member, obj in det.evidence.items():
                run_dir.member(member).write(obj)
            if det.decided and det.verdict is not None:
                deciding = det.analysis
                timings["last_progress_to_verdict_s"] = time.time() - (st.last_progress_t or t_burst)
                verdict = det.verdict
                return True
            return False

        t_burst = time.time()
        ctx.t_burst = t_burst
        for d in detectors:
            d.start(ctx)
        driver.start()
        self.observe("burst_started", {"url": server.url, "requests": len(prompts)})
        try:
            while True:
                time.sleep(POLL_S)
                now = time.time()
                st = driver.state()
                self.observe("burst", {"state": st})
                if st.finished:
                    break
                ctx.state, ctx.now = st, now
                if not server.is_running():
                    # the topology's last look first (a server spanning hosts: the rank that died is the cause)
                    for d in self.down_detectors(detectors):
                        if take(d.poll(ctx), st):
                            break
                    if verdict is None:
                        verdict = Verdict(INCONCLUSIVE, self.died_reason())
                    break
                if now - t_burst > scenario.budget_s:
                    why = last_reason or st.waiting_for()
                    verdict = Verdict(INCONCLUSIVE, f"budget of {scenario.budget_s:.0f} s ended without a verdict "
                                                     f"({st.tally(now)}): {why}")
                    break
                for d in detectors:
                    if take(d.poll(ctx), st):
                        break
                if verdict is not None:
                    break
        except BaseException:
            driver.abandon()
            self.interrupted_state = driver.state()  # what was sent so far: the report of an interrupted run says it
            self._open_drivers = getattr(self, "_open_drivers", []) + [driver]
            raise
        finally:
            for d in detectors:
                try:
                    d.stop(ctx)
                except Exception:
                    pass
        captures = sum(getattr(d, "captures", 0) for d in detectors)
        timings["burst_s"] = time.time() - t_burst
        timings["captures"] = float(captures)
        verdict, injector = self.judge_burst(variant, verdict, driver.state(), ctx, detectors)
        for d in detectors:  # the ledgers' word after the burst (repro.proof: DESYNCED, stated fallbacks) + timings
            if callable(getattr(d, "final_verdict", None)):
                verdict = d.final_verdict(verdict, ctx)
            timings.update(getattr(d, "timings", None) or {})
        self.disarm()
        final = driver.state()
        clean = (final.finished and verdict.verdict != DEADLOCKED and server.is_running()
                 and not any(getattr(d, "deaths", None) for d in detectors))  # a dead rank: restart first
        self.wedged = not clean
        driver.abandon()
        if clean:
            driver.close(wait_s=0.5)
        else:
            self._open_drivers = getattr(self, "_open_drivers", []) + [driver]
        return self.finish_outcome(Outcome(verdict, deciding or last_analysis, final, timings, clean, injector,
                                           topology=self), detectors)

    def close_drivers(self) -> None:
        """Close the history files of drivers whose requests were still outstanding (after the server stopped)."""
        for d in getattr(self, "_open_drivers", []):
            d.close(wait_s=2.0)
        self._open_drivers = []
