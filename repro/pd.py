"""Multi-server runs (PD disaggregation: prefill + decode + router): one stack, one session, evidence per server.

A scenario whose ``[server] topology`` is not ``single`` runs every role of the adapter's
:class:`~repro.targets.base.Topology` (SGLang ``pd``: ``repro.targets.sglang.pd``). This module gives the runner
what it needs for that, in the single-server shapes it already uses:

- :class:`Stack`: every role started by :func:`repro.launcher.start_server` (one process group each), healthy when
  every role's health answers 200 and the router lists every engine server healthy; ``url`` is the entry role's
  (the router's); ``stop`` ends every tree (router first) on every path;
- :class:`PDSession`: ``repro.runner.Session`` over a Stack. Each engine role has its own plan, arm file and
  injector folder under ``servers/<role>/`` of the session folder (an injection's ``server`` field picks its role;
  ranks of two servers never share a record), so arming, acknowledgement, capture, analysis, the ledger and the
  completion checks run per server; the run is DEADLOCKED when some server's ranks are;
- :func:`finish_pd_evidence`: ``servers/<role>/`` gets that server's REPORT.md / verdict.json / analysis / ledger;
  the run folder's REPORT.md is the report of the server that diverged (or the first engine server) plus a
  "Servers" table naming which server diverged; ``verdict.json`` gains ``servers``.

Rank names: ``prefill TP2``, ``decode TP0`` (role + rank in that server's TP group).
"""

from __future__ import annotations

import dataclasses
import json
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from repro import evidence as ev
from repro.diagnosis import md_cell
from repro.targets.base import LaunchSpec, ServerRole
from repro.verdict import DEADLOCKED, INCONCLUSIVE, SUCCEEDED, Verdict, exit_code_for

WORKERS_POLL_S = 0.5


def rank_name(role: str, rank: int) -> str:
    """``prefill TP2``: a rank named apart by its server."""
    return f"{role} TP{rank}"


@dataclass
class RoleRun:
    """One role of a stack as prepared for a session.

    Attributes:
        role: the topology's role (name, kind, TP size, args, env).
        adapter: the adapter that starts it (the engine's, or the router's).
        spec: its launch spec (ports 0 until :meth:`Stack.start` picks them).
        folder: ``servers/<role>/`` of the session folder (an ``EvidenceDir`` view: injector/, stacks/).
        plan: the role's plan (engine roles), None for a router.
        arm_file: the role's arm file (engine roles).
        injection_ids: the ids of the plan's injections (armed only on this role).
    """

    role: ServerRole
    adapter: Any
    spec: LaunchSpec
    folder: ev.EvidenceDir
    plan: Optional[dict] = None
    arm_file: Optional[Path] = None
    injection_ids: list = field(default_factory=list)

    @property
    def name(self) -> str:
        return self.role.name

    @property
    def is_engine(self) -> bool:
        return self.role.kind == "engine"


def is_multi(p: Any) -> bool:
    """True when the prepared run's scenario asks for a multi-server topology."""
    return getattr(p.scenario.server, "topology", "single") != "single"


def injection_roles(scenario: Any) -> dict[str, Optional[str]]:
    """injection id → the role named by its ``server`` field (None: every engine role), over all variants."""
    return {i.id: getattr(i, "server", None) for v in scenario.variants for i in v.injections}


def injection_tp_sizes(scenario: Any, adapter: Any, tp_size: int) -> Optional[dict[str, tuple[str, int]]]:
    """On a multi-server topology: injection id → (the engine server it runs on, that server's TP size), for the
    gate-rank check (``repro.scenario.gate_rank_problem``); an injection without ``server`` runs on every engine
    server, so its ranks count against the widest. None on one server or a topology the adapter does not know.
    ``tp_size``: the first engine server's (``--tp`` or ``server.tp_size``), as :func:`prepare_roles` starts it."""
    try:
        topo = adapter.topology(scenario.server)
    except ValueError:
        return None
    engines = topo.engines()
    if len(topo.roles) < 2 or not engines:
        return None
    tps = {r.name: tp_size if k == 0 else (r.tp_size or tp_size) for k, r in enumerate(engines)}
    widest = max(tps, key=lambda n: tps[n])
    return {i: (r if r in tps else widest, tps[r if r in tps else widest]) for i, r in injection_roles(scenario).items()}


def topology_problem(scenario: Any, adapter: Any) -> Optional[str]:
    """What ``run`` / ``sites`` refuse before anything is written about a scenario's servers (the caller prefixes the
    file), else None: a topology the adapter does not know; on a multi-server topology a ``[server.roles.X]`` naming
    no role of it (a typo there was ignored: ``decoder`` left decode at its default TP) or an injection ``server``
    naming no engine server (prepare_roles' ValueError, raised only after the evidence folder was made); on one
    server an injection ``server`` other than that server's name (it was ignored without a word)."""
    try:
        topo = adapter.topology(scenario.server)
    except ValueError as e:
        return str(e)
    names = [r.name for r in topo.roles]
    engines = [r.name for r in topo.engines()]
    if len(topo.roles) < 2:  # one server: a `server` field picks nothing, so one naming another server was ignored
        for v in scenario.variants:
            for i in v.injections:
                server = getattr(i, "server", None)
                if server is not None and server not in engines:
                    return (f"variants.{v.name}.injections.{i.id}.server: {server!r} names no server of this "
                            f"one-server scenario (topology {getattr(scenario.server, 'topology', None) or 'single'!r}); "
                            "drop the field: it picks a server only on a multi-server topology such as 'pd'")
        return None
    for role in getattr(scenario.server, "roles", {}) or {}:
        if role not in names:
            return (f"server.roles.{role}: topology {scenario.server.topology!r} has no role {role!r} "
                    f"(its roles: {', '.join(names)})")
    for v in scenario.variants:
        for i in v.injections:
            server = getattr(i, "server", None)
            if server is not None and server not in engines:
                return (f"variants.{v.name}.injections.{i.id}.server: {server!r} names no engine server of topology "
                        f"{scenario.server.topology!r} (expected one of: {', '.join(engines)})")
    return None


def prepare_roles(p: Any) -> list[RoleRun]:
    """The roles of ``p``'s topology, each with its own spec, folder, plan and arm file. Launches nothing.

    Engine roles: args = ``server.args`` + the role's (mode flags first), env = the session spec's env + the role's
    + ``REPRO_PLAN`` = the role's plan, plus the adapter's testbed profile for the role's args when on the testbed.
    Routers: no injector plan (the router is not a rank process).

    Raises:
        ValueError: the adapter knows no such topology, or an injection names a role that is not an engine server.
    """
    from repro.scenario import PLAN_ENV

    topo = p.adapter.topology(p.scenario.server)
    engines = [r.name for r in topo.engines()]
    where = injection_roles(p.scenario)
    bad = sorted({f"{i} → {r!r}" for i, r in where.items() if r is not None and r not in engines})
    if bad:
        raise ValueError(f"injection server field(s) {', '.join(bad)} name no engine server of the topology "
                         f"(expected one of: {', '.join(engines)})")
    out: list[RoleRun] = []
    base_env = {k: v for k, v in p.spec.env.items() if k != PLAN_ENV}
    for role in topo.roles:
        folder = p.evidence.server(role.name)
        if role.kind != "engine":
            spec = LaunchSpec(python=p.spec.python, model=p.spec.model, tp_size=1, args=list(role.args),
                              env=dict(role.env))
            out.append(RoleRun(role, p.adapter.role_adapter(role), spec, folder))
            continue
        tp = role.tp_size or p.spec.tp_size
        if role.name == topo.engines()[0].name:
            tp = p.spec.tp_size  # the first engine server takes --tp / server.tp_size
        args = [*role.args, *p.scenario.server.args]
        arm_file = folder.arm.path
        plan = json.loads(json.dumps(p.plan))
        plan["out_dir"] = str(folder.injector_dir.resolve())
        plan["arm_file"] = str(arm_file.resolve())
        plan["injections"] = [i for i in plan["injections"] if where.get(i["id"]) in (None, role.name)]
        plan["server_role"] = role.name
        ledger = dict(plan.get("ledger") or {})
        ledger["tick_function"] = p.adapter.tick_function_for(args)
        plan["ledger"] = ledger
        folder.plan.write(plan)
        env = {**base_env, **dict(role.env), PLAN_ENV: str(folder.plan.path.resolve())}
        spec = LaunchSpec(python=p.spec.python, model=p.spec.model, tp_size=tp, args=args, env=env,
                          pythonpath_prepend=list(p.spec.pythonpath_prepend))
        if p.on_testbed:
            extra_args, extra_env, tb_prepend = p.adapter.testbed_profile(spec, args)
            spec = dataclasses.replace(spec, args=[*args, *extra_args], env={**env, **extra_env},
                                       pythonpath_prepend=[*spec.pythonpath_prepend, *tb_prepend])
        out.append(RoleRun(role, p.adapter, spec, folder, plan, arm_file, [i["id"] for i in plan["injections"]]))
    return out


class Stack:
    """The servers of one multi-server topology, started together, each in its own process group.

    Exposes what ``repro.runner.Session`` uses of a single :class:`repro.launcher.Server`: ``url`` (the entry
    role's), ``procs``, ``is_running``, ``log_tail``, ``owned_dirs``, ``launch_mark``, ``stop``, ``pid``.

    Args:
        roles: from :func:`prepare_roles`, in start order; the router (kind ``router``) is given the engine
            servers' URLs and the prefill bootstrap port.
        entry: the role that receives the burst.
    """

    def __init__(self, roles: Sequence[RoleRun], entry: str) -> None:
        self.roles = list(roles)
        self.entry = entry
        self.servers: dict[str, Any] = {}
        self.healthy_s: dict[str, float] = {}

    @property
    def engine_adapter(self) -> Any:
        """The engine's adapter (the first engine role's): it knows how the roles find each other."""
        return next(r.adapter for r in self.roles if r.is_engine)

    # ---- start -------------------------------------------------------------------------------------------------
    def start(self) -> None:
        """Pick distinct free ports (HTTP, rendezvous, bootstrap) and start every role (not waiting for health).

        Raises:
            repro.launcher.LaunchError: a role could not be started (the roles already started are stopped).
        """
        from repro.launcher import pick_free_port, start_server

        used: list[int] = []

        def port() -> int:
            q = pick_free_port("127.0.0.1", exclude=tuple(used) + tuple(u + 1 for u in used))
            used.extend((q, q + 1))
            return q

        specs: dict[str, LaunchSpec] = {}
        for r in [*(r for r in self.roles if r.is_engine), *(r for r in self.roles if not r.is_engine)]:
            specs[r.name] = dataclasses.replace(r.spec, port=port(), nccl_port=port())
        # the engine's adapter connects the roles (PD: bootstrap port, the router's worker arguments)
        specs = self.engine_adapter.wire_roles([r.role for r in self.roles], specs, port)
        try:
            for r in self.roles:
                self.servers[r.name] = start_server(r.adapter, specs[r.name], r.folder.server_log.path)
        except BaseException:
            self.stop()
            raise

    def engine_urls(self) -> list[str]:
        return [self.servers[r.name].url for r in self.roles if r.is_engine and r.name in self.servers]

    def wait_healthy(self, timeout_s: float, observe: Any = None) -> float:
        """Wait until every role answers its health check and the router lists every engine server healthy.

        Returns:
            Seconds waited.
        Raises:
            repro.launcher.LaunchError: a role exited, or ``timeout_s`` passed (message names the role and what
                was missing).
        """
        from repro.launcher import PORT_CHECK_S, LaunchError, port_lost_error

        t0 = time.monotonic()
        deadline = t0 + timeout_s
        next_port_check = t0 + PORT_CHECK_S
        pending = [r.name for r in self.roles]
        while pending:
            check_ports = time.monotonic() >= next_port_check
            if check_ports:
                next_port_check = time.monotonic() + PORT_CHECK_S
            for name in list(pending):
                s = self.servers[name]
                s.procs()
                lost = s.port_lost() if check_ports or not s.is_running() else None
                if lost:  # a role that lost a port may stay alive without ever answering (its HTTP bind failed)
                    raise port_lost_error(f"{name} server", lost, s.log_path, s.log_tail())
                if not s.is_running():
                    err = LaunchError(f"{name} server exited with code {s.popen.poll()} during start-up: "
                                      f"{_last_line(s.log_tail())} (full log: {s.log_path})")
                    err.log_tail = s.log_tail()  # type: ignore[attr-defined]
                    raise err
                if s.health_ok(timeout_s=2.0):
                    s.note_healthy()
                    pending.remove(name)
                    self.healthy_s[name] = time.monotonic() - t0
                    if observe:
                        observe("role_healthy", {"role": name, "after_s": self.healthy_s[name]})
            if pending and time.monotonic() >= deadline:
                err = LaunchError(f"{', '.join(pending)} not healthy after {timeout_s:.0f} s: " + "; ".join(
                    f"{n}'s last log line {_last_line(self.servers[n].log_tail())!r} (log: {self.servers[n].log_path})"
                    for n in pending) + " (raise startup_timeout_s if it was still loading)")
                err.log_tail = self.servers[pending[0]].log_tail()  # type: ignore[attr-defined]
                raise err
            if pending:
                time.sleep(WORKERS_POLL_S)
        routers = [r.name for r in self.roles if not r.is_engine]
        want = self.engine_urls()
        why = ""
        while routers:
            ok, why = self.engine_adapter.stack_ready(self.servers[routers[0]].url, want)
            if ok:
                self.healthy_s["workers"] = time.monotonic() - t0
                break
            if time.monotonic() >= deadline:
                raise LaunchError(f"the router at {self.url} does not list every server healthy after {timeout_s:.0f} s: "
                                  f"{why} (GET /workers)")
            for name, s in self.servers.items():
                if not s.is_running():
                    raise LaunchError(f"{name} server exited while the router registered its workers: "
                                      f"{_last_line(s.log_tail())} (full log: {s.log_path})")
            time.sleep(WORKERS_POLL_S)
        return time.monotonic() - t0

    # ---- what Session uses of a Server --------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return self.servers[self.entry].url

    @property
    def pid(self) -> int:
        return next(iter(self.servers.values())).pid

    @property
    def owned_dirs(self) -> list[Path]:
        out: list[Path] = []
        for s in self.servers.values():
            out += [d for d in s.owned_dirs if d not in out]
        return out

    def server(self, role: str) -> Any:
        return self.servers[role]

    def procs(self) -> list:
        """Every role's live tree (the union of the process groups)."""
        out = []
        for s in self.servers.values():
            out += s.procs()
        return out

    def launch_mark(self) -> dict:
        """The first role's launch mark with every role's launch token and root (``repro cleanup`` ends the whole
        union recorded with it, each process only when it carries one of the tokens or is in the session of a role's
        root that does: an engine's scheduler rewrites its environ with its title)."""
        marks = [s.launch_mark() for s in self.servers.values()]
        tokens = [t for m in marks for t in m.get("tokens", [])]
        roots = [m["root"] for m in marks if isinstance(m.get("root"), dict)]
        return {**marks[0], **({"tokens": tokens} if tokens else {}), **({"roots": roots} if len(roots) > 1 else {})}

    def rank_pids_by_role(self) -> dict[str, dict[int, int]]:
        """role → rank → pid, for the engine roles."""
        return {r.name: self.servers[r.name].rank_pids() for r in self.roles if r.is_engine and r.name in self.servers}

    def rank_pids(self) -> dict[int, int]:
        """The first engine role's ranks (single-server callers); see :meth:`rank_pids_by_role`."""
        by = self.rank_pids_by_role()
        return next(iter(by.values()), {})

    def is_running(self) -> bool:
        return bool(self.servers) and all(s.is_running() for s in self.servers.values())

    def dead_roles(self) -> list[str]:
        return [n for n, s in self.servers.items() if not s.is_running()]

    def log_tail(self, lines: int = 20) -> str:
        """The last lines of every role's log (dead roles first), each under a ``== role ==`` line."""
        order = sorted(self.servers, key=lambda n: self.servers[n].is_running())
        return "\n".join(f"== {n} ==\n{self.servers[n].log_tail(lines)}" for n in order)

    def stop(self, grace_s: float = 10.0) -> list:
        """Stop every role at once, each :meth:`repro.launcher.Server.stop` in a thread of its own (issue 36: one after
        another, a stack's stop was the sum of its roles' grace periods). Idempotent; a KeyboardInterrupt while
        waiting (it reaches the main thread only) does not skip any role: the wait goes on and it is re-raised at the
        end. A role whose stop raised is stopped again here (Server.stop retries what did not finish).

        Returns:
            Every role's processes still alive after SIGKILL (empty: the whole stack ended).
        """
        results: dict[str, list] = {}
        failed: dict[str, BaseException] = {}

        def one(name: str) -> None:
            try:
                results[name] = self.servers[name].stop(grace_s=grace_s)
            except BaseException as e:  # reported below, after every role's stop ended
                failed[name] = e

        threads = [threading.Thread(target=one, args=(n,), name=f"repro-stop-{n}", daemon=True) for n in self.servers]
        for t in threads:
            t.start()
        interrupted = False
        for t in threads:
            while t.is_alive():
                try:
                    t.join()
                except KeyboardInterrupt:
                    interrupted = True
        for name in failed:
            results[name] = self.servers[name].stop(grace_s=grace_s)
        left = [p for n in self.servers for p in results.get(n, [])]
        if interrupted:
            raise KeyboardInterrupt
        return left


def start_healthy(roles: Sequence[RoleRun], entry: str, timeout_s: float, observe: Any = None,
                  started: Any = None) -> tuple[Stack, float]:
    """Start a :class:`Stack` and wait until it is healthy (:meth:`Stack.wait_healthy`). When a role lost a port it
    was given (another process bound it after :meth:`Stack.start` picked it free: ``LaunchError.port_race``), the
    whole stack is stopped and started again on new ports, up to ``repro.launcher.PORT_RACE_ATTEMPTS`` starts in all;
    ``observe("relaunch", {"attempt", "why"})`` says so (the roles' logs keep every attempt).

    Args:
        roles, entry: as for :class:`Stack`; timeout_s: seconds each start may take to become healthy;
        observe: ``observe(event, data)`` for ``role_healthy`` and ``relaunch``; started: called with each new stack
            right after its processes started (the session records it as its server, so Ctrl-C stops it).
    Returns:
        ``(stack, seconds waited by the start that became healthy)``.
    Raises:
        repro.launcher.LaunchError: a start failed for another reason, or the last attempt lost a port too; the
            failing stack is left running for the caller to stop (``started`` saw it).
    """
    from repro.launcher import start_retrying_port_races

    def start(_attempt: int) -> Stack:
        stack = Stack(roles, entry)
        stack.start()
        if started is not None:
            started(stack)
        return stack

    return start_retrying_port_races(start, lambda st: st.wait_healthy(timeout_s, observe), lambda st: st.stop(),
                                     observe=observe)


def _last_line(tail: str) -> str:
    lines = [ln.strip() for ln in tail.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "Exception" in ln:
            return ln[:300]
    return lines[-1][:300] if lines else "(empty log)"


# ---- the session ---------------------------------------------------------------------------------------------------
class PDStallDetector:
    """The stall rule per server: no progress for ``stall_s`` → capture every engine server's ranks twice (into
    ``servers/<role>/stacks/`` of the run folder) → DEADLOCKED when some server's ranks are deadlocked
    (``repro.verdict.judge_stall`` on that server's ranks alone: an idle server's normal shape — TP0 in the idle
    path, its peers in the request broadcast — is a server that agrees with itself, not a divergence)."""

    name = "stall"

    def __init__(self, session: "Any") -> None:
        self.session = session
        self.captures = 0
        self.last_capture_t = 0.0
        self.by_role: dict[str, Any] = {}

    def start(self, ctx: Any) -> None:
        self.captures = 0
        self.last_capture_t = 0.0
        self.by_role = {}

    def poll(self, ctx: Any) -> Any:
        from repro.checker import check_stall
        from repro.detect import Detection

        stalled = ctx.state.stalled_for(ctx.now) if ctx.state is not None else 0.0
        if stalled < ctx.stall_s or ctx.now - self.last_capture_t < ctx.stall_s:
            return None
        self.captures += 1
        tag = f"-{self.captures}"
        ctx.emit("capture", {"n": self.captures, "stalled_s": stalled})
        run_dir = ctx.run_dir
        record: dict[str, Any] = {"capture": self.captures, "tag": tag, "stalled_s": round(stalled, 2), "servers": {}}
        decided_role = None
        reasons = []
        for r in self.session.engine_roles():
            pids = self.session.role_pids.get(r.name, {})
            stacks = run_dir.server(r.name).stacks_dir
            chk = check_stall(pids, stacks, list(range(r.spec.tp_size)), tag=tag, native=ctx.native,
                              injector_dir=r.folder.injector_dir, fallback_signal=r.plan.get("faulthandler_signal"))
            j = chk.judgement
            self.by_role[r.name] = chk
            record["servers"][r.name] = {"deadlocked": j.deadlocked, "reason": j.reason,
                                         "cpu_percent": {str(k): round(v, 1) for k, v in chk.cpu_percent.items()}}
            reasons.append(f"{r.name} server: {j.reason}")
            if j.deadlocked and decided_role is None:
                decided_role = r.name
        self.last_capture_t = time.time()
        record["time"] = self.last_capture_t
        record["deadlocked"] = decided_role is not None
        record["diverged_server"] = decided_role
        record["reason"] = "; ".join(reasons)
        role = decided_role or self.session.engine_roles()[0].name
        analysis = self.by_role[role].second_analysis
        ctx.emit("judged", {"judgement": self.by_role[role].judgement, "analysis": analysis})
        if decided_role is not None:
            reason = f"the {decided_role} server deadlocked: {self.by_role[decided_role].judgement.reason}"
            return Detection(self.name, True, Verdict(DEADLOCKED, reason), analysis, reason, record)
        return Detection(self.name, False, None, analysis, record["reason"], record)

    def stop(self, ctx: Any) -> None:
        pass


def make_session_class():
    """The PD session class (defined lazily: ``repro.runner`` imports this module only for multi-server runs)."""
    from repro.run.session import Session

    class PDSession(Session):
        """``repro.runner.Session`` over a :class:`Stack`: every role started and healthy, armed and judged per
        server. ``rank_pids`` is the first engine server's; ``role_pids`` holds every engine server's."""

        def __init__(self, p: Any, observe: Any = None, detectors: Any = None) -> None:
            super().__init__(p, observe or (lambda e, d: None), detectors)
            self.roles = prepare_roles(p)
            self.topology = p.adapter.topology(p.scenario.server)
            self.role_pids: dict[str, dict[int, int]] = {}

        def engine_roles(self) -> list[RoleRun]:
            return [r for r in self.roles if r.is_engine]

        def write_evidence(self, p: Any, opts: Any, variant: Any, evd: ev.EvidenceDir, outcome: Any,
                           rank_pids: dict, interrupted: bool) -> None:
            """The stack's run folder (``repro.runner.RunEvidence``): one folder per server plus the run's
            (:func:`finish_pd_evidence`); a stack that never drove (its start failed, Ctrl-C before a verdict)
            writes the run folder alone, as a single server's."""
            if getattr(outcome, "pd", None) is None:
                return super().write_evidence(p, opts, variant, evd, outcome, rank_pids, interrupted)
            finish_pd_evidence(p, opts, variant, evd, outcome, interrupted)

        def start(self) -> Optional[Verdict]:
            from repro.launcher import LaunchError
            from repro.run.arm import write_arm_file
            from repro.run.finish import save_server_procs

            p, t0 = self.p, time.time()
            for r in self.engine_roles():
                write_arm_file(r.arm_file, [])
            write_arm_file(p.arm_file, [])
            self.observe("launch", {"evidence": str(p.evidence.path), "roles": [r.name for r in self.roles]})

            def started(stack: Stack) -> None:
                self.server = stack
                save_server_procs(p.evidence, stack)
                self.observe("wait_healthy", {"url": stack.url, "pid": stack.pid,
                                              "log": str(ev.Layout.SERVER_LOG.at(p.evidence.server_path("*"))),
                                              "timeout_s": p.scenario.server.startup_timeout_s})

            try:
                stack, waited = start_healthy(self.roles, self.topology.entry, p.scenario.server.startup_timeout_s,
                                              self.observe, started)
                self.observe("healthy", {"waited_s": waited})
            except LaunchError as e:
                if self.server is not None:
                    save_server_procs(p.evidence, self.server)
                return Verdict(INCONCLUSIVE, f"server failed to start: {e}")
            save_server_procs(p.evidence, stack)
            self.healthy_s = time.time() - t0
            p.evidence.stack.write(self.stack_record())
            self.role_pids = stack.rank_pids_by_role()
            self.rank_pids = stack.rank_pids()
            for r in self.engine_roles():
                got = sorted(self.role_pids.get(r.name, {}))
                want = list(range(r.spec.tp_size))
                if got != want:
                    return Verdict(INCONCLUSIVE, f"expected {r.name} server ranks {want}, found {got} among its processes")
            p.evidence.stack.write(self.stack_record())
            self._check_role_sites()
            return None

        def _check_role_sites(self) -> None:
            """Every injection resolves in the server that takes it (that server's injector records), before any
            burst; raises ``repro.runner.UnresolvedSitesError`` naming the nearest names."""
            from repro.run.options import UnresolvedSitesError
            from repro.sites import SitesUnresolved, check_launched_sites

            if getattr(self, "_sites_ok", False):
                return
            for r in self.engine_roles():
                if not r.injection_ids:
                    continue
                sc = self.p.scenario
                variants = [v.model_copy(update={"injections": [i for i in v.injections if i.id in r.injection_ids]})
                            for v in sc.variants]
                sc_r = sc.model_copy(update={"variants": variants})
                names = [v.name for v in variants if v.injections and v.name in str(self.p.plan.get("variant") or "").split(",")]
                if not names:
                    continue
                try:
                    check_launched_sites(sc_r, names, r.folder.injector_dir, self.p.python,
                                         env=getattr(self.server.servers.get(r.name), "env", None), adapter=self.p.adapter)
                except SitesUnresolved as e:
                    raise UnresolvedSitesError(f"{r.name} server: {e}") from None
            self._sites_ok = True

        def stack_record(self) -> dict:
            """Roles, URLs, ports, pids and health times, for ``stack.json`` (``repro arm``/``watch`` read it)."""
            s = self.server
            out = {"entry": self.topology.entry, "url": s.url if s else None, "roles": []}
            for r in self.roles:
                srv = s.servers.get(r.name) if s else None
                out["roles"].append({
                    "name": r.name, "kind": r.role.kind, "tp_size": r.spec.tp_size,
                    "url": srv.url if srv else None, "pid": srv.pid if srv else None,
                    "folder": str(r.folder.path), "arm_file": str(r.arm_file) if r.arm_file else None,
                    "injection_ids": list(r.injection_ids),
                    "rank_pids": {str(k): v for k, v in self.role_pids.get(r.name, {}).items()},
                    "healthy_s": round(s.healthy_s[r.name], 2) if s and r.name in s.healthy_s else None,
                })
            if s and "workers" in s.healthy_s:
                out["workers_ready_s"] = round(s.healthy_s["workers"], 2)
            return out

        def arm(self, ids: Sequence[str]) -> list[str]:
            """Write every engine role's arm file with its own share of ``ids`` and wait for each rank's
            acknowledgement. Returns the rank names that did not acknowledge (``prefill TP2``)."""
            from repro.run.arm import ARM_ACK_TIMEOUT_S, arm_and_wait

            late: list[str] = []
            for r in self.engine_roles():
                mine = [i for i in ids if i in r.injection_ids]
                k = arm_and_wait(r.arm_file, mine, r.folder.injector_dir, self.role_pids.get(r.name, {}),
                                 ARM_ACK_TIMEOUT_S)
                late += [rank_name(r.name, x) for x in k]
            return late

        # ---- the per-server steps of repro.runner.Session.drive (THE burst/detect loop) ---------------------------
        def disarm(self) -> None:
            """Empty every engine server's arm file."""
            from repro.run.arm import write_arm_file

            for r in self.engine_roles():
                write_arm_file(r.arm_file, [])

        def armed_ranks(self) -> Any:
            """role → rank → pid, for the ``armed`` event."""
            return {n: v for n, v in self.role_pids.items()}

        def make_detectors(self) -> list:
            """The detector set of every topology (``repro.detectors.detector_set``): each engine server's rank death
            and ledger proof, scoped to its ranks, ledgers and log (``repro.detect.ScopedDetector``), then
            :class:`PDStallDetector` (capture and judge per server). Detectors passed to the session replace the
            scoped ones (a stall detector among them is replaced by the per-server one)."""
            from repro.detect import ScopedDetector
            from repro.detectors import detector_set

            self._stall = PDStallDetector(self)
            if self.detectors is not None:
                return [d for d in self.detectors if getattr(d, "name", "") != "stall"] + [self._stall]
            scoped: list = []
            for r in self.engine_roles():
                for d in detector_set(r.plan)[:-1]:
                    scoped.append(ScopedDetector(d, r.name, self.role_pids.get(r.name, {}), r.folder.injector_dir,
                                                 r.plan or {}, r.folder.server_log.path,
                                                 lambda run_dir, n=r.name: run_dir.server(n)))
            # every server's rank death before any server's proof (a crash is not a deadlock), then the stall rule
            scoped.sort(key=lambda d: 0 if d.name == "rank-death" else 1)
            return scoped + [self._stall]

        def detect_context(self, run_dir: ev.EvidenceDir, native: bool) -> Any:
            from repro.detect import DetectContext

            p = self.p
            return DetectContext(self.rank_pids, list(self.rank_pids), run_dir, None, p.plan, p.scenario.stall_s,
                                 native=native, observe=self.observe)

        def died_reason(self) -> str:
            return f"{', '.join(self.server.dead_roles())} server died during the burst; log tail:\n{self.server.log_tail(20)}"

        def judge_burst(self, variant: Any, verdict: Optional[Verdict], state: Any, ctx: Any,
                        detectors: Sequence[Any]) -> tuple[Verdict, Any]:
            """Judge every engine server on its own records (its injections, ranks, loaded/armed markers): DEADLOCKED
            where the stall detector found its ranks deadlocked; a server that did not diverge while another did is
            INCONCLUSIVE ("its requests waited on the deadlocked server"). Without a decided verdict the run's is the
            first server's that did not succeed, else SUCCEEDED. Keeps the per-server results for
            :meth:`finish_outcome`."""
            from repro.run.records import injection_checks
            from repro.verdict import judge_completion

            if verdict is None:
                time.sleep(0.5)  # the injectors' counters reach disk every ~0.2 s
            det = getattr(self, "_stall", None)
            # a server whose own detector decided (its ledger proof, a rank of it that died): that server's verdict
            decided_by = {d.server: d for d in detectors
                          if getattr(d, "server", None) and verdict is not None and
                          (getattr(d, "proof", None) is not None or getattr(d, "deaths", None))}
            per_role: dict[str, dict] = {}
            for r in self.engine_roles():
                pids = self.role_pids.get(r.name, {})
                v_r = role_variant(variant, r)
                try:
                    loaded, armed, checks, rep = injection_checks(r.folder.injector_dir, v_r, pids)
                except Exception:
                    loaded, armed, checks, rep = [], [], [], None
                chk = det.by_role.get(r.name) if det is not None else None
                rv = judge_completion(state.requests, list(range(r.spec.tp_size)), loaded, armed, checks)
                if r.name in decided_by:
                    rv = verdict
                elif chk is not None and chk.judgement.deadlocked:
                    rv = Verdict(DEADLOCKED, chk.judgement.reason)
                elif verdict is not None and verdict.verdict != DEADLOCKED:
                    rv = verdict
                elif verdict is not None:
                    rv = Verdict(INCONCLUSIVE, f"did not diverge (its requests waited on the deadlocked server); "
                                               f"its ranks: {chk.judgement.reason if chk else 'not captured'}")
                mine = decided_by.get(r.name)
                analysis = (mine.last_analysis if mine is not None and getattr(mine, "last_analysis", None) is not None
                            else chk.second_analysis if chk else None)
                per_role[r.name] = {"verdict": rv, "analysis": analysis,
                                    "injector": rep, "variant": v_r, "pids": pids}
            if verdict is None:
                bad = [(n, x["verdict"]) for n, x in per_role.items() if x["verdict"].verdict != SUCCEEDED]
                verdict = (Verdict(bad[0][1].verdict, f"{bad[0][0]} server: {bad[0][1].reason}") if bad
                           else Verdict(SUCCEEDED, "; ".join(f"{n} server: {x['verdict'].reason}" for n, x in per_role.items())))
            self._per_role = per_role
            return verdict, None

        def finish_outcome(self, out: Any, detectors: Sequence[Any]) -> Any:
            """The Outcome with ``pd``: each server's verdict, analysis, injector records, variant and pids, the
            server that diverged (or None), and this session (:func:`finish_pd_evidence` reads it)."""
            per_role = getattr(self, "_per_role", {})
            det = getattr(self, "_stall", None)
            if det is not None:  # every server's stall captures and its ledger proof's (repro.proof), as one count
                out.timings["captures"] = float(sum(getattr(d, "captures", 0) for d in detectors if d is not det)
                                                + det.captures)
            out.pd = {"roles": per_role, "diverged": next((n for n, x in per_role.items()
                                                           if x["verdict"].verdict == DEADLOCKED), None),
                      "session": self}
            return out

    return PDSession


def role_variant(variant: Any, role: RoleRun) -> Any:
    """``variant`` with only the injections armed on ``role`` (its ``server`` field, or every engine server)."""
    keep = [i for i in variant.injections if i.id in role.injection_ids]
    return variant.model_copy(update={"injections": keep})


def _snapshot_role(src: ev.EvidenceDir, dst: ev.EvidenceDir) -> None:
    """Copy a server's injector records, plan and log from the session's ``servers/<role>/`` into a variant's."""
    import shutil

    try:
        shutil.copytree(src.injector_dir, dst.injector_dir, dirs_exist_ok=True)
        for member in (ev.Layout.SERVER_LOG, ev.Layout.PLAN):
            if src.member(member).exists():
                shutil.copyfile(src.member(member).path, dst.member(member).path)
    except OSError:
        pass


def after_abort(evd: ev.EvidenceDir, servers: dict, top_n: int = 6) -> Optional[dict]:
    """What each rank did after the driver's mass abort: for every server, rank → (number of collectives entered
    between the ``abort`` event of ``requests.jsonl`` and the burst's last event, the ``top_n`` most frequent ``op ← call site`` with counts).

    Args:
        servers: role → (its injector folder holding the ledgers, rank → pid).
    Returns:
        ``{"t": abort time, "aborted": n, "servers": {role: {rank: (total, [(what, count)])}}}``, or None when the
        run had no mass abort or no ledger.
    """
    from collections import Counter

    from repro.ledger import load_ledgers

    t_abort = None
    t_end = 0.0  # the burst's last event: a shared stack's ledger goes on with the next variants
    n = 0
    try:
        for rec in evd.requests.read():
            t_end = max(t_end, float(rec.get("t") or 0.0))
            if rec.get("event") == "abort":
                t_abort, n = float(rec["t"]), len(rec.get("requests") or [])
    except (ev.EvidenceFileError, ValueError, KeyError, TypeError):
        return None
    if t_abort is None:
        return None
    out: dict[str, dict] = {}
    for role, (inj_dir, pids) in servers.items():
        try:
            ledgers = load_ledgers(inj_dir, list(pids.values()) or None)
        except Exception:
            continue
        per: dict[int, tuple] = {}
        for rank, led in ledgers.items():
            after = [r for r in led.records if t_abort <= r.t_enter <= t_end]
            c = Counter(f"{r.op}{'(' + r.red + ')' if r.red else ''} ← {r.call_site(2)}" for r in after)
            per[int(rank)] = (len(after), c.most_common(top_n))
        if per:
            out[role] = per
    return {"t": t_abort, "aborted": n, "servers": out} if out else None


def entered_by_rank(report: Any, variant: Any, pids: dict) -> dict[int, list[tuple[str, int]]]:
    """Per rank, ``(injection id, times its site was entered after the last arming)`` for every injection of one
    server's ``variant``, from its ``repro.injection_records.InjectorReport`` (``{}`` when either is missing)."""
    if report is None or variant is None:
        return {}
    out: dict[int, list[tuple[str, int]]] = {int(k): [] for k in pids}
    for inj in getattr(variant, "injections", []):
        try:
            entered = report.counts_by_rank(inj.id)["entered"]
        except Exception:
            continue
        for k in out:
            out[k].append((inj.id, int(entered.get(k, 0))))
    return out


def finish_pd_evidence(p: Any, opts: Any, variant: Any, evd: ev.EvidenceDir, outcome: Any, interrupted: bool) -> None:
    """Per server: ``servers/<role>/`` of ``evd`` gets that server's analysis, ledger, env, REPORT.md and
    verdict.json (``repro.runner.finish_evidence`` on the server's own records). Then the run folder's REPORT.md is
    the report of the server that diverged (else the first engine server), with a "Servers" section, and its
    verdict.json the run's verdict with ``servers`` (role → verdict, ranks, pids, folder) and ``diverged_server``:
    each file written once, by ``finish_evidence`` (``Outcome.report_sections`` / ``verdict_fields``)."""
    from repro.run.finish import Outcome, finish_evidence

    info = outcome.pd
    session = info["session"]
    roles = {r.name: r for r in session.engine_roles()}
    rows = []
    for name, x in info["roles"].items():
        r = roles[name]
        folder = evd.server(name)
        if Path(folder.path).resolve() != Path(r.folder.path).resolve():  # a variant's folder on a shared stack
            _snapshot_role(r.folder, folder)
        p_r = dataclasses.replace(p, evidence=r.folder, spec=r.spec, plan=r.plan, arm_file=r.arm_file)
        o_r = Outcome(x["verdict"], x["analysis"], outcome.state, dict(outcome.timings), outcome.clean, x["injector"])
        try:
            finish_evidence(p_r, opts, x["variant"], folder, o_r, x["pids"], interrupted)
        except Exception as e:  # one server's report must not cost the run's
            folder.report.write(f"# {name} server: report failed: {type(e).__name__}: {e}\n")
        rows.append((name, r, x, folder))
    diverged = info.get("diverged")
    top = diverged or next(iter(info["roles"]))
    r, x = roles[top], info["roles"][top]
    p_top = dataclasses.replace(p, evidence=r.folder, spec=r.spec, plan=r.plan, arm_file=r.arm_file)
    try:  # the run folder's own injector/ holds the reported server's records: its ledger diagnosis is the run's
        import shutil

        if Path(r.folder.injector_dir).resolve() != Path(evd.injector_dir).resolve():
            shutil.copytree(r.folder.injector_dir, evd.injector_dir, dirs_exist_ok=True)
    except OSError:
        pass
    lines = ["", "## Servers", ""]
    if diverged:
        lines.append(f"**The {diverged} server diverged**; the diagnosis above is its ranks'. "
                     + ", ".join(f"the {n} server: {xx['verdict'].verdict}" for n, _, xx, _ in rows if n != diverged) + ".")
    else:
        lines.append("No server's ranks diverged. The diagnosis above is the " + top + " server's.")
    lines += ["", "| server | TP | ranks (pid) | verdict | reason | evidence |", "|---|---|---|---|---|---|"]
    for n, rr, xx, folder in rows:
        ranks = ", ".join(f"{rank_name(n, k)} ({pid})" for k, pid in sorted(xx["pids"].items())) or "none found"
        reason = md_cell(xx["verdict"].reason)[:300]
        lines.append(f"| {n} | {rr.spec.tp_size} | {ranks} | {xx['verdict'].verdict} | {reason} | "
                     f"`{folder.report.path.relative_to(evd.path)}` |")
    after = after_abort(evd, {n: (roles[n].folder.injector_dir, xx["pids"]) for n, _, xx, _ in rows})
    if after:
        lines += ["", "## After the mass abort", "",
                  f"The driver disconnected {after['aborted']} request(s) at once at {after['t']:.3f}; per rank, the "
                  "collectives it issued after that instant (ledger; op ← call site, count):", ""]
        for n, per in after["servers"].items():
            for k, (total, top) in sorted(per.items()):
                kinds = ", ".join(f"{what} ×{c}" for what, c in top) or "none"
                lines.append(f"- {rank_name(n, k)}: {total} collective(s): {kinds}")
        lines += ["", "Per rank, how often each counted site was entered during the burst (after arming): the aborts "
                  "it handled, and through which path (see the variant's description):", ""]
        for n, _, xx, _ in rows:
            for k, counts in sorted(entered_by_rank(xx.get("injector"), xx.get("variant"), xx["pids"]).items()):
                lines.append(f"- {rank_name(n, k)}: " + (", ".join(f"`{i}` {c}" for i, c in counts) or "no counted site"))
    stack = session.server
    if stack is not None and getattr(stack, "healthy_s", None):
        lines += ["", "Start-up: " + ", ".join(f"{k} healthy after {v:.1f} s" for k, v in stack.healthy_s.items()) + "."]
    fields = {"diverged_server": diverged,
              "servers": {n: {"verdict": xx["verdict"].verdict, "reason": xx["verdict"].reason, "tp_size": rr.spec.tp_size,
                              "rank_pids": {str(k): pid for k, pid in xx["pids"].items()},
                              "ranks": [rank_name(n, k) for k in sorted(xx["pids"])],
                              "evidence": str(folder.path)} for n, rr, xx, folder in rows}}
    o_top = Outcome(outcome.verdict, x["analysis"] or outcome.analysis, outcome.state, outcome.timings, outcome.clean,
                    x["injector"], report_sections=tuple(lines), verdict_fields=fields)
    finish_evidence(p_top, opts, x["variant"], evd, o_top, x["pids"], interrupted)
