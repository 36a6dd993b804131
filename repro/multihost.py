"""One run of a scenario whose server spans several hosts (docs/pipeline.md, each node through its host's runner).

``repro.runner``'s own loop — ``Session.drive`` for one variant, ``run_variants`` for several — on a
:class:`MultiHostSession` (the topology: a ``repro.runner.Session`` subclass), plan → server → arm → burst →
stall? → capture ×2 → verdict → evidence, with every step that touches a rank going through ``repro.hosts.Runner``
(ssh or a command template), because the harness may not see the hosts' processes at all (another machine, pod,
or PID namespace):

- start: each host reachable first (else INCONCLUSIVE naming it; nothing is started); the injector package, the
  plan (its ``out_dir`` and ``arm_file`` rewritten to the host's run folder) and an empty arm file are copied to
  every host; each node is started detached in its own session with the adapter's multi-node flags
  (``adapter.multinode``: sglang ``--nnodes/--node-rank/--dist-init-addr``, ``GLOO_SOCKET_IFNAME``,
  ``SGLANG_HOST_IP``); node 0's ``/health`` is polled over HTTP while every node's tree is watched through its runner;
- ranks: read from each host's session (process titles → ``adapter.parse_title``): rank → (host, pid there);
- arm: the arm file is written here and copied to every host; each rank's fire log on its host must show the arming;
- burst from here to node 0's HTTP port; on a stall every rank is dumped on its own host (``capture_remote``, all
  hosts at once, one deadline), twice, and the DEADLOCKED rule applied (``repro.verdict.judge_stall``, each rank's
  CPU use over the whole check: ``repro.checker.check_stall`` on ``repro.hosts.HostRanks``) — unless a
  host's data link is down or a host cannot be reached, which makes the run INCONCLUSIVE naming that host;
- stop: node 0's group gets SIGTERM first (sglang's nodes ≥ 1 ignore SIGTERM and wait for node 0's shutdown), then
  every node's group SIGKILL (a wedged tree: SIGKILL at once, no SIGTERM); each host's session is checked empty; the
  /dev/shm files each node's tree made are removed on its host (``repro/shm_files.py``, run there); each host's server
  log and injector records are copied back under ``hosts/<host>/`` and its run folder removed.

Run: ``python -m repro.remote_run SCENARIO --variant V --hosts HOSTS.json [--evidence-dir D] [--expect E]``
(``HOSTS.json``: a list of ``repro.hosts.HostSpec`` fields). Exit codes as ``repro run``.
"""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shlex
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from repro import evidence as ev
from repro import resources
from repro.hosts import HostError, HostSpec, RemoteRank, Runner, in_parallel
from repro.launcher import harness_opt_ins
from repro.procs import LAUNCH_TOKEN_ENV
from repro.run.arm import write_arm_file
from repro.run.options import Observer, RunOptions, _noop
from repro.run.session import WEDGED_STOP_GRACE_S, Session
from repro.scenario import PLAN_ENV
from repro.verdict import DEADLOCKED, INCONCLUSIVE, InjectionCheck, Verdict, judge_completion


POLL_S = 0.25


NODE_WATCH_S = 3.0  # seconds between checks that every node's tree is alive (a runner call each)


CONFIRM_GAP_S = 1.0


CAPTURE_DEADLINE_S = 20.0


ARM_ACK_TIMEOUT_S = 15.0


STOP_GRACE_S = 10.0


LINK_PROBE_S = 2.0


# a file in each node's run workdir holding the session's launch token: `repro cleanup` removes a recorded workdir
# only when it holds the token recorded in processes.json (a hand-written file cannot point rm -rf elsewhere)
LAUNCH_TOKEN_FILE = ".repro-launch-token"


@dataclass
class Node:
    """One node of the server: its host's runner, its run folder there, the pid of its root (= session = group)."""

    host: HostSpec
    runner: Runner
    workdir: str
    http_port: int = 0
    root_pid: int = 0

    @property
    def name(self) -> str:
        return self.host.name


# A free TCP port on the host (bound to port 0 there, then released).
_FREE_PORT_PY = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"


# Data-link check on a host: is the interface up (``/sys/class/net/IF/operstate``), and which peer addresses answer a
# TCP connect (any answer, even a refusal, proves the link). argv: ifname-or-"-", timeout, addr:port ...
_LINK_PY = r'''
import json, socket, sys
ifname, timeout, peers = sys.argv[1], float(sys.argv[2]), sys.argv[3:]
out = {"ifname": ifname, "operstate": None, "peers": {}}
if ifname != "-":
    try:
        out["operstate"] = open("/sys/class/net/%s/operstate" % ifname).read().strip()
    except OSError as e:
        out["operstate"] = "missing"
for p in peers:
    host, port = p.rsplit(":", 1)
    try:
        socket.create_connection((host, int(port)), timeout).close(); out["peers"][p] = "ok"
    except ConnectionRefusedError:
        out["peers"][p] = "ok"
    except OSError as e:
        out["peers"][p] = str(e) or type(e).__name__
print(json.dumps(out))
'''


# The start time of a process on its host, in clock ticks since that host's boot (/proc/PID/stat field 22).
_START_TICKS_PY = "import sys; print(open('/proc/%s/stat' % sys.argv[1]).read().rsplit(')', 1)[1].split()[19])"


def _q(*argv: str) -> str:
    return " ".join(shlex.quote(str(a)) for a in argv)


class _HostsServer:
    """What ``repro.runner.Session.drive`` uses of its server, for a server spanning hosts: node 0's URL, and
    whether every node's tree is alive — checked through each host's runner at most every ``NODE_WATCH_S``
    (a runner call each), the last answer kept in between (``dead``: one sentence per node found gone)."""

    def __init__(self, session: "MultiHostSession") -> None:
        self.session = session
        self.checked_t = 0.0
        self.dead: list[str] = []

    @property
    def url(self) -> str:
        return self.session.url

    def is_running(self) -> bool:
        if time.time() - self.checked_t > NODE_WATCH_S:
            self.checked_t = time.time()
            self.dead = self.session._dead_nodes()
        return not self.dead

    def log_tail(self, lines: int = 20) -> str:
        return self.session._log_tails(lines)


class HostsStallDetector:
    """The stall rule (``repro.detectors.StallDetector``) of a server spanning hosts: no progress for ``stall_s`` →
    every rank captured twice on its own host, CPU use read on its host → the DEADLOCKED rule; unless a host's
    data link is down or a rank could not be captured (a host not answering), which decides INCONCLUSIVE naming
    the host — its ranks cannot be judged a deadlock."""

    name = "stall"

    def __init__(self, session: "MultiHostSession") -> None:
        self.session = session
        self.captures = 0
        self.last_capture_t = 0.0

    def start(self, ctx: Any) -> None:
        self.captures = 0
        self.last_capture_t = 0.0

    def poll(self, ctx: Any) -> Any:
        from repro.checker import check_stall
        from repro.detect import Detection
        from repro.hosts import HostRanks

        s = self.session
        stalled = ctx.state.stalled_for(ctx.now) if ctx.state is not None else 0.0
        if stalled < ctx.stall_s or ctx.now - self.last_capture_t < ctx.stall_s:
            return None
        self.captures += 1
        tag = f"-{self.captures}"
        ctx.emit("capture", {"n": self.captures, "stalled_s": stalled, "hosts": sorted({r.host for r in s.ranks.values()})})
        # two captures on the ranks' hosts; CPU use over the whole check (as a local run measures it: a dump's own
        # fraction of a second is too short to tell a blocked rank from a busy one)
        where = HostRanks(s.ranks, ctx.plan.get("faulthandler_signal") or "SIGUSR2")
        chk = check_stall(where.rank_pids, ctx.run_dir.stacks_dir, list(ctx.expected_ranks), tag=tag,
                          second_tag=tag + "b", confirm_gap_s=CONFIRM_GAP_S, timeout_s=CAPTURE_DEADLINE_S / 2,
                          where=where)
        self.last_capture_t = time.time()
        missing = [f"rank {c.rank} on host {s.host_of_rank.get(c.rank)}: {c.error}" for c in chk.second if not c.ok]
        faults = s.link_faults()
        why = ""
        if faults:
            why = "stalled, but " + "; ".join(faults) + f" — its ranks {s._ranks_on(faults)} cannot be judged a deadlock"
        else:
            unreachable = [m for m in missing if "unreachable" in m or "timed out" in m or "no answer" in m]
            if unreachable:
                why = "stalled, but some ranks could not be captured: " + "; ".join(unreachable)
        if why:
            return Detection(self.name, True, Verdict(INCONCLUSIVE, why), chk.second_analysis, why,
                             {"capture": self.captures, "reason": why, "deadlocked": False})
        cpu, j = chk.cpu_percent, chk.judgement
        record = {"capture": self.captures, "tag": tag, "stalled_s": round(stalled, 2), "deadlocked": j.deadlocked,
                  "reason": j.reason, "cpu_percent": {str(k): v for k, v in cpu.items()}, "time": self.last_capture_t}
        ctx.emit("judged", {"judgement": j})
        return Detection(self.name, j.deadlocked, Verdict(DEADLOCKED, j.reason) if j.deadlocked else None,
                         chk.second_analysis, j.reason, record)

    def stop(self, ctx: Any) -> None:
        pass


class MultiHostSession(Session):
    """A server spanning ``hosts``: a ``repro.runner.Session`` whose every step that touches a rank goes through
    each host's runner. Driven by the one loop (``Session.drive``, ``repro.runner.run_variants``); this class
    supplies the topology's steps — start / stop, arming, the detector set, the judge after the burst, and the
    parts of the run folder that differ (``repro.runner.RunEvidence``: ``hosts/<host>/`` copied in, the ledger
    diagnosis from the hosts' ledger mirror, ``rank_hosts`` in verdict.json).

    Args:
        p: the prepared run (``repro.runner.prepare``): scenario, variant, evidence folder, plan, launch spec.
        hosts: one HostSpec per node (node ranks 0..n-1; node 0 serves HTTP).
        observe: progress callback ``(event, data)``.
    """

    def __init__(self, p: Any, hosts: Sequence[HostSpec], observe: Observer = _noop) -> None:
        super().__init__(p, observe)
        self.run_dir = p.evidence  # the folder the current drive writes (hosts/<host>/, links.json)
        self.ledger_dir: Optional[Path] = None  # the current drive's ledger mirror folder (None: no ledger)
        self._drive_mirror: Any = None
        run_id = p.evidence.path.name
        self.nodes = [Node(h, Runner(h), f"{h.workdir.rstrip('/')}/{run_id}") for h in sorted(hosts, key=lambda h: h.node_rank)]
        # the per-session launch token every node's tree carries in its environment (repro.procs.LAUNCH_TOKEN_ENV)
        # and each node's workdir in LAUNCH_TOKEN_FILE; recorded in processes.json for `repro cleanup`
        self.launch_token = secrets.token_hex(16)
        self.ranks: dict[int, RemoteRank] = {}
        self.started = False
        self.healthy_s: Optional[float] = None
        self.dist_port = 0
        self.host_of_rank: dict[int, str] = {}
        self.ledger_root = p.evidence.path / "host-ledgers"  # the session's: one mirror folder per server start
        self.mirror: Any = None  # repro.host_ledgers.HostLedgerMirror of the running server's ranks
        self._starts = 0
        # host -> (its node's start, seconds since the epoch on that host's clock; the /dev/shm files its tree mapped)
        self.shm: dict[str, tuple[Optional[float], set[str]]] = {}

    # ---- the ranks' ledgers, followed live (repro.host_ledgers) -------------------------------------------------
    def ledger_mirror(self) -> Any:
        """The running server's :class:`repro.host_ledgers.HostLedgerMirror` (started on first use; a new one
        after a restart), or None when the plan's ledger is off or no rank is known."""
        from repro.host_ledgers import HostLedgerMirror

        if not ((self.p.plan or {}).get("ledger") or {}).get("enabled") or not self.ranks:
            return None
        key = {k: (r.host, r.pid) for k, r in self.ranks.items()}
        if self.mirror is None or getattr(self.mirror, "key", None) != key:
            if self.mirror is not None:
                self.mirror.stop()
            self._starts += 1
            self.mirror = HostLedgerMirror(self.ranks, self.ledger_root / f"server-{self._starts}")
            self.mirror.key = key
            self.mirror.fetch()
            self.mirror.start()
        return self.mirror

    def make_detectors(self, mirror: Any = None) -> list:
        """The detector set of every topology (``repro.detectors.detector_set``) on the hosts' ranks, in polling
        order: rank death (their hosts' /proc, via ``mirror``), the ledger proof (on ``mirror``'s copies), then the
        stall rule (:class:`HostsStallDetector`: captures on the hosts, with the data-link checks). ``mirror``:
        the running server's :meth:`ledger_mirror` when None; without a ledger only the stall rule."""
        from repro.detectors import detector_set
        from repro.host_ledgers import HostsLedgerProofDetector, hosts_rank_death_detector

        mirror = mirror if mirror is not None else self.ledger_mirror()
        self._drive_mirror = mirror
        stall = HostsStallDetector(self)
        if mirror is None:
            return [stall]
        on_hosts = {"rank-death": lambda: hosts_rank_death_detector(mirror),
                    "ledger-proof": lambda: HostsLedgerProofDetector(self.ranks, self.p.plan.get("faulthandler_signal")
                                                                     or "SIGUSR2")}
        return [on_hosts[d.name]() if d.name in on_hosts else d for d in detector_set(self.p.plan, stall)]

    def stop_mirror(self) -> None:
        """Stop following the hosts' ledgers (one last copy first: the report's diagnosis reads the mirror)."""
        if self.mirror is not None:
            self.mirror.stop()
            try:
                self.mirror.fetch()
            except Exception:
                pass

    # ---- paths -------------------------------------------------------------------------------------------------
    @staticmethod
    def injector_dir(n: Node) -> str:
        return f"{n.workdir}/{ev.Layout.INJECTOR.name}"

    @staticmethod
    def log_path(n: Node) -> str:
        """The node's server log on its host (``<workdir>/server.log``)."""
        return f"{n.workdir}/{ev.Layout.SERVER_LOG.name}"

    @staticmethod
    def arm_path(n: Node) -> str:
        return f"{n.workdir}/{ev.Layout.ARM.name}"

    @property
    def url(self) -> str:
        n0 = self.nodes[0]
        return f"http://{n0.host.http_address or n0.host.address}:{n0.http_port}"

    def host_dir(self, n: Node) -> ev.EvidenceDir:
        """``hosts/<host>/`` of the folder being written (the current drive's run folder, the session's at stop)."""
        return self.run_dir.host(n.name)

    # ---- start -------------------------------------------------------------------------------------------------
    def start(self) -> Optional[Verdict]:
        """Check every host, copy the plan and injector, start every node, wait for node 0's /health, map ranks.

        Returns:
            None when healthy with every rank found, else the INCONCLUSIVE verdict naming the host concerned.
        """
        p = self.p
        adapter = p.adapter
        self.ranks, self.host_of_rank, self.healthy_s = {}, {}, None  # a restart maps the new tree afresh
        self.rank_pids, self.server, self.run_dir, self.ledger_dir = {}, None, p.evidence, None
        self.shm = {}
        for n in self.nodes:
            n.root_pid = n.http_port = 0
        if adapter.multinode(len(self.nodes), 0, "") is None:  # asked before anything is started
            return Verdict(INCONCLUSIVE, f"the {adapter.name} adapter has no multi-node launch (adapter.multinode)")
        reach = in_parallel({n.name: (lambda left, n=n: n.runner.reachable(min(left, 15.0))) for n in self.nodes}, 30.0)
        bad = [f"{n.name} ({n.host.reach}): {reach[n.name][1][1] if reach[n.name][0] else reach[n.name][1]}"
               for n in self.nodes if not (reach[n.name][0] and reach[n.name][1][0])]
        if bad:
            return Verdict(INCONCLUSIVE, "host unreachable at start, nothing was started: " + "; ".join(bad))
        self.observe("launch", {"evidence": str(p.evidence.path)})
        write_arm_file(p.arm_file, [])
        arm_bytes = Path(p.arm_file).read_bytes()
        ports = {}
        for n in self.nodes:
            ports[n.name] = [int(n.runner.run(_q(n.host.python, "-c", _FREE_PORT_PY)).text.strip()) for _ in range(2)]
        n0 = self.nodes[0]
        self.dist_port = ports[n0.name][1]
        dist_addr = f"{n0.host.address}:{self.dist_port}"
        t0 = time.time()
        local_prepend = str(resources.injectors_dir())
        for n in self.nodes:
            n.http_port = ports[n.name][0]
            n.runner.run(_q("mkdir", "-p", self.injector_dir(n)))
            n.runner.put_tree(Path(local_prepend), f"{n.workdir}/injectors")
            plan = dict(p.plan, out_dir=self.injector_dir(n), arm_file=self.arm_path(n))
            n.runner.put(json.dumps(plan, indent=2).encode(), f"{n.workdir}/{ev.Layout.PLAN.name}")
            n.runner.put(arm_bytes, self.arm_path(n))
            argv, env = self.node_launch(n, dist_addr, ports[n.name][1], local_prepend)
            self.observe("node_launch", {"host": n.name, "argv": argv})
            n.root_pid = self.start_node(n, argv, env, self.log_path(n))
            self.started = True
        self._save_launch()
        timeout_s = p.scenario.server.startup_timeout_s
        self.observe("wait_healthy", {"url": self.url, "timeout_s": timeout_s,
                                      "pid": f"{n0.name}:{n0.root_pid}", "log": f"{n0.name}:{self.log_path(n0)}"})
        deadline = time.time() + timeout_s
        last_watch = 0.0
        while True:
            if self._health_ok():
                break
            if time.time() > deadline:
                return Verdict(INCONCLUSIVE, f"server failed to start: node 0 ({n0.name}) /health did not answer 200 "
                                             f"within {timeout_s:.0f} s; {self._log_tails()}")
            if time.time() - last_watch > NODE_WATCH_S:
                last_watch = time.time()
                dead = self._dead_nodes()
                if dead:
                    return Verdict(INCONCLUSIVE, "server failed to start: " + "; ".join(dead) + f"; {self._log_tails()}")
            time.sleep(0.5)
        self.healthy_s = time.time() - t0
        self.observe("healthy", {"waited_s": self.healthy_s})
        expected = list(range(p.spec.tp_size))
        for n in self.nodes:
            for pid, title in n.runner.session_procs(n.root_pid):
                rt = adapter.parse_title(title)
                if rt is not None:  # the adapter parses only its rank processes' titles
                    self.ranks[rt.tp] = RemoteRank(rt.tp, n.runner, pid, self.injector_dir(n))
                    self.host_of_rank[rt.tp] = n.name
        self.rank_pids = {k: r.pid for k, r in self.ranks.items()}
        self.note_shm()
        self.server = _HostsServer(self)
        self._save_launch()
        self.save_processes()
        if sorted(self.ranks) != expected:
            return Verdict(INCONCLUSIVE, f"expected scheduler ranks {expected} across the hosts, found "
                                         f"{ {k: f'{r.host}:{r.pid}' for k, r in sorted(self.ranks.items())} }")
        return None

    def note_shm(self) -> None:
        """Remember the /dev/shm files each node's tree maps now, and when the node started (its host's clock), for
        :meth:`stop` — as a local server's ``repro.launcher.Server.note_healthy``: a rank that dies before the stop
        maps nothing by then (SGLang's ``sglang_loads_*.shm``). Called once healthy and at the stop; a host that
        cannot be read adds nothing."""
        for n in self.nodes:
            if not n.root_pid:
                continue
            try:
                since, files = n.runner.shm_files(n.root_pid)
            except HostError:
                continue
            old_since, old = self.shm.get(n.name, (None, set()))
            self.shm[n.name] = (old_since if old_since is not None else since, old | files)

    def _remove_shm(self, left: dict[str, list]) -> dict[str, Any]:
        """Unlink, on each host whose node's session is empty, the files :meth:`note_shm` saw and those the node's
        ranks registered with multiprocessing's resource tracker (``mpnames-*.txt`` in its injector folder), each only
        if made since the node started (``repro.shm_files``). Returns host -> paths removed, or why none were."""
        out: dict[str, Any] = {}
        for n in self.nodes:
            since, files = self.shm.get(n.name, (None, set()))
            if left.get(n.name):
                out[n.name] = "not removed: the node's session is not empty, or the host could not be checked"
            elif since is None:
                out[n.name] = "not removed: the node's start time was never read on its host"
            else:
                try:
                    out[n.name] = n.runner.remove_shm(since, f"{self.injector_dir(n)}/{ev.Layout.mp_names_glob()}", files)
                except HostError as e:
                    out[n.name] = f"not removed: {e}"
        return out

    def node_launch(self, n: Node, dist_addr: str, nccl_port: int, local_prepend: str) -> tuple[list[str], dict]:
        """The command line and the whole environment node ``n`` is started with (``n.http_port`` already picked).

        The environment is built from nothing but the launch spec (a node started over ssh or a command template does
        not inherit this process's environment), the adapter's multi-node variables, the plan's path on the host and
        the harness's opt-ins set here (``repro.launcher.harness_opt_ins``: ``REPRO_FORK_RANKS=1`` forks the node's
        ranks as a local launch's are; without it in the node's own environment a node silently spawned them).

        Args:
            dist_addr: node 0's ``address:port`` for the engine's distributed init.
            nccl_port: the node's rendezvous port.
            local_prepend: this machine's injectors folder; in the spec's PYTHONPATH prepend it becomes the host's copy.
        """
        p, adapter = self.p, self.p.adapter
        extra_args, extra_env = adapter.multinode(len(self.nodes), n.host.node_rank, dist_addr,  # type: ignore[misc]
                                                  n.host.address, n.host.ifname)
        prepend = [f"{n.workdir}/injectors" if x == local_prepend else x for x in p.spec.pythonpath_prepend]
        spec = dataclasses.replace(p.spec, host="0.0.0.0", port=n.http_port, nccl_port=nccl_port,
                                   args=[*p.spec.args, *extra_args],
                                   env={**p.spec.env, **extra_env, PLAN_ENV: f"{n.workdir}/{ev.Layout.PLAN.name}"},
                                   pythonpath_prepend=prepend)
        return adapter.launch_command(spec), adapter.launch_env(spec, harness_opt_ins(os.environ))

    def _health_ok(self) -> bool:
        import requests

        try:
            return requests.get(self.url + self.p.adapter.health_path, timeout=2.0).status_code == 200
        except requests.RequestException:
            return False

    def _dead_nodes(self) -> list[str]:
        out = []
        for n in self.nodes:
            try:
                if not n.runner.alive(n.root_pid):
                    out.append(f"node {n.host.node_rank} on host {n.name} exited")
            except HostError as e:
                out.append(f"host {n.name} ({n.host.reach}) not reachable: {e}")
        return out

    def _log_tails(self, lines: int = 8) -> str:
        parts = []
        for n in self.nodes:
            try:
                t = n.runner.run(f"tail -n {lines} {shlex.quote(self.log_path(n))}", check=False).text
            except HostError as e:
                t = f"(log not readable: {e})"
            parts.append(f"[{n.name} {ev.Layout.SERVER_LOG.name}]\n{t.strip()}")
        return "\n".join(parts)

    def _save_launch(self, evd: Optional[ev.EvidenceDir] = None) -> None:
        """``hosts.json`` (nodes, rank → host and pid there) of ``evd`` (default: the session's folder)."""
        (evd or self.p.evidence).hosts_json.write({
            "nodes": [{"host": n.name, "node_rank": n.host.node_rank, "reach": n.host.reach, "address": n.host.address,
                       "workdir": n.workdir, "root_pid": n.root_pid, "http_port": n.http_port} for n in self.nodes],
            "dist_init_addr": f"{self.nodes[0].host.address}:{self.dist_port}",
            "ranks": {str(k): {"host": r.host, "pid": r.pid} for k, r in sorted(self.ranks.items())},
            "note": "pids are as each host sees them (its own PID namespace or machine)",
        })

    def start_node(self, n: Node, argv: Sequence[str], env: dict, log_path: str) -> int:
        """Start a node's tree on its host (``Runner.start``: its own session) with the session's launch token in its
        environment and in ``LAUNCH_TOKEN_FILE`` of its workdir, so ``repro cleanup`` knows it as this run's.

        Returns:
            The root pid as the host sees it (= the node's session id there).
        Raises:
            HostError: the host could not be reached or the command not started.
        """
        n.runner.put(self.launch_token.encode(), f"{n.workdir}/{LAUNCH_TOKEN_FILE}")
        return n.runner.start(argv, {**env, LAUNCH_TOKEN_ENV: self.launch_token}, log_path, n.workdir)

    def save_processes(self) -> None:
        """``processes.json`` of a server spanning hosts, for ``repro cleanup`` after a killed harness: the launch
        mark (this harness; ``tokens``: the session's launch token, in every node's tree's environment and in each
        workdir's LAUNCH_TOKEN_FILE), and per host its spec (how to reach it), the node's root pid (= session and
        process group there), that root's start ticks on the host (clock ticks since its boot: a reused pid is told
        apart) and the session's processes as the host listed them. ``processes`` is empty: no pid here is local."""
        from repro.procs import launch_mark

        hosts = {}
        for n in self.nodes:
            if not n.root_pid:
                continue
            try:
                ticks: Optional[int] = int(n.runner.run(_q(n.host.python, "-c", _START_TICKS_PY, str(n.root_pid))).text)
                procs = n.runner.session_procs(n.root_pid)
            except (HostError, ValueError):
                ticks, procs = None, []
            hosts[n.name] = {"host": {**dataclasses.asdict(n.host), "ssh_options": list(n.host.ssh_options)},
                             "root_pid": n.root_pid, "root_start_ticks": ticks, "workdir": n.workdir,
                             "processes": [{"pid": pid, "cmdline": t} for pid, t in procs]}
        self.p.evidence.processes.write({**launch_mark(None, root_pid=0, tokens=[self.launch_token]), "hosts": hosts,
                                         "processes": []})

    # ---- arm ---------------------------------------------------------------------------------------------------
    def _armed_count(self, r: RemoteRank) -> int:
        f = shlex.quote(f"{r.injector_dir}/{ev.Layout.fire_log(r.pid)}")
        res = r.runner.run(f"grep -c '\"armed\"' {f} 2>/dev/null; true", check=False)
        try:
            return int((res.text.strip().splitlines() or ["0"])[-1])
        except ValueError:
            return 0

    def arm(self, ids: Sequence[str]) -> list[int]:
        """Write the arm file here, copy it to every host, wait for every rank's acknowledgement in its fire log.

        Returns:
            The ranks that did not acknowledge within ``ARM_ACK_TIMEOUT_S`` (empty when every rank did, or disarming).
        """
        before = {k: self._armed_count(r) for k, r in self.ranks.items()} if ids else {}
        write_arm_file(self.p.arm_file, ids)
        data = Path(self.p.arm_file).read_bytes()
        in_parallel({n.name: (lambda left, n=n: n.runner.put(data, self.arm_path(n), timeout_s=left)) for n in self.nodes}, 30.0)
        if not ids:
            return []
        pending = dict(before)
        deadline = time.time() + ARM_ACK_TIMEOUT_S
        while pending and time.time() < deadline:
            for k in list(pending):
                if self._armed_count(self.ranks[k]) > pending[k]:
                    del pending[k]
            time.sleep(0.2)
        return sorted(pending)

    # ---- faults ------------------------------------------------------------------------------------------------
    def link_faults(self) -> list[str]:
        """Each host's data link: its interface up, and the other hosts' data addresses answering a TCP connect.

        Returns:
            One sentence per host whose data link is lost (interface down or missing, or no peer answers while it
            is the host every other host fails to reach); empty when every link is up.
        """
        peers = {n.name: f"{n.host.address}:{n.http_port}" for n in self.nodes}
        calls = {}
        for n in self.nodes:
            others = [peers[m.name] for m in self.nodes if m is not n]
            cmd = _q(n.host.python, "-", n.host.ifname or "-", str(LINK_PROBE_S), *others)
            calls[n.name] = (lambda left, n=n, cmd=cmd: json.loads(n.runner.run(cmd, input=_LINK_PY.encode(), timeout_s=left).text))
        res = in_parallel(calls, 15.0)
        faults = []
        self.run_dir.links.write({k: (v[1] if v[0] else f"error: {v[1]}") for k, v in res.items()})
        for n in self.nodes:
            ok, r = res[n.name]
            if not ok:
                faults.append(f"host {n.name} ({n.host.reach}) not reachable to check its data link: {r}")
                continue
            if r.get("operstate") not in (None, "up", "unknown"):
                faults.append(f"host {n.name}'s data link is lost: interface {r['ifname']} is {r['operstate']} "
                              f"(data address {n.host.address})")
        if not faults:
            for n in self.nodes:  # no interface said down: the host no peer reaches (and that reaches no peer)
                me = peers[n.name]
                others = [m for m in self.nodes if m is not n and res[m.name][0]]
                if len(self.nodes) > 2 and others and all(res[m.name][1]["peers"].get(me) != "ok" for m in others):
                    faults.append(f"host {n.name}'s data address {n.host.address} answers no other host")
        return faults

    # ---- what Session.drive does per topology (repro.runner) ---------------------------------------------------
    def disarm(self) -> None:
        """Empty the arm file on every host."""
        self.arm([])

    def armed_ranks(self) -> Any:
        """rank → ``host:pid`` (the pid as its host sees it), for the ``armed`` event."""
        return {k: f"{r.host}:{r.pid}" for k, r in self.ranks.items()}

    def detect_context(self, run_dir: ev.EvidenceDir, native: bool) -> Any:
        """The detectors' view of the hosts' ranks for one drive: rank → its ledger mirror's key and the mirror's
        folder (the ledgers copied as they grow), else rank → pid on its host."""
        from repro.detect import DetectContext

        p, mirror = self.p, self._drive_mirror
        self.run_dir = run_dir
        self.ledger_dir = mirror.dir if mirror is not None else None
        return DetectContext(mirror.rank_keys if mirror is not None else dict(self.rank_pids),
                             list(range(p.spec.tp_size)), run_dir, self.ledger_dir, p.plan, p.scenario.stall_s,
                             native=native, observe=self.observe)

    def down_detectors(self, detectors: Sequence[Any]) -> list:
        """A node found gone: copy the ledgers once more and poll rank death and the proof (a rank that died first
        is the cause worth naming, from its host's /proc and log)."""
        if self._drive_mirror is None:
            return []
        try:
            self._drive_mirror.fetch()
        except Exception:  # noqa: BLE001 - the node's death is still reported
            pass
        return [d for d in detectors if d.name != "stall"]

    def died_reason(self) -> str:
        """A lost data link is the cause worth naming first, then the nodes that exited."""
        faults = self.link_faults()
        dead = self.server.dead if self.server is not None else []
        return "; ".join(faults) + ("; then " if faults else "") + "server died during the burst: " + "; ".join(dead)

    def judge_burst(self, variant: Any, verdict: Optional[Verdict], state: Any, ctx: Any,
                    detectors: Sequence[Any]) -> tuple[Verdict, Any]:
        """Without a decided verdict, the completion rule on every host's injector records (copied in first);
        then one more copy of the ledgers, for the detectors' word after the burst."""
        if verdict is None:
            time.sleep(0.5)  # the injectors flush their counters every ~0.2 s
            self.gather(final_only=True)
            loaded, armed, checks = self.injection_checks(variant)
            verdict = judge_completion(state.requests, list(ctx.expected_ranks), loaded, armed, checks)
        if self._drive_mirror is not None:
            try:
                self._drive_mirror.fetch()
            except Exception:  # noqa: BLE001 - the ledger must not cost the verdict
                pass
        return verdict, None

    def finish_outcome(self, out: Any, detectors: Sequence[Any]) -> Any:
        out.timings.setdefault("healthy_s", self.healthy_s or 0.0)
        return out

    def snapshot(self, p: Any, run_dir: ev.EvidenceDir) -> None:
        """Nothing: :meth:`write_evidence` copies each host's records into the run folder."""

    # ---- the run folder (repro.runner.RunEvidence) -------------------------------------------------------------
    def write_evidence(self, p: Any, opts: RunOptions, variant: Any, evd: ev.EvidenceDir, outcome: Any,
                       rank_pids: dict, interrupted: bool) -> None:
        """``hosts/<host>/`` (each host's server log and injector records), ``hosts.json`` and the merged
        ``server.log`` copied into ``evd`` first, then the run folder as every topology writes it."""
        self.run_dir = evd
        if self.started:
            self.gather()
            self._save_launch(evd)
            self.write_server_log()
        super().write_evidence(p, opts, variant, evd, outcome, rank_pids, interrupted)

    def ledger_evidence(self, evd: ev.EvidenceDir, rank_pids: dict) -> Any:
        return _ledger_evidence_from(evd, self.ledger_dir, sorted(rank_pids))

    def evidence_checks(self, p: Any, variant: Any, outcome: Any, rank_pids: dict) -> list:
        return self.injection_checks(variant)[2] if self.ranks else []

    def evidence_versions(self, p: Any, outcome: Any) -> dict:
        from repro.run.records import collect_versions

        h0_inj = self.run_dir.host_path(self.nodes[0].name) / ev.Layout.INJECTOR.name
        return collect_versions(h0_inj if h0_inj.is_dir() else self.run_dir.injector_dir, p.python, p.adapter)

    def verdict_fields(self) -> dict:
        return {"rank_hosts": {str(k): h for k, h in self.host_of_rank.items()}}

    def command_prefix(self) -> str:
        return "python -m repro.remote_run"

    def _ranks_on(self, faults: Sequence[str]) -> list[int]:
        names = {n.name for n in self.nodes if any(f"host {n.name}" in f for f in faults)}
        return sorted(k for k, h in self.host_of_rank.items() if h in names)

    def injection_checks(self, variant: Any) -> tuple[list[int], list[int], list[InjectionCheck]]:
        """Loaded / armed ranks and per-injection counts, read from each host's copied injector records."""
        from repro.run.records import injection_checks

        loaded: set = set()
        armed: set = set()
        merged: dict[str, dict] = {}
        for n in self.nodes:
            mine = {k: r.pid for k, r in self.ranks.items() if r.host == n.name}
            d = self.run_dir.host_path(n.name) / ev.Layout.INJECTOR.name
            if not mine or not d.is_dir():
                continue
            lo, ar, checks, _ = injection_checks(d, variant, mine)
            loaded |= set(lo)
            armed |= set(ar)
            for c in checks:
                m = merged.setdefault(c.injection_id, {"site": c.site, "entered": {}, "matched": {}, "fired": {},
                                                       "absent": c.absent, "required": c.required})
                for key in ("entered", "matched", "fired"):
                    m[key].update({k: v for k, v in getattr(c, key).items() if k in mine})
        out = [InjectionCheck(i, m["site"], m["entered"], m["matched"], m["fired"], m["absent"], m["required"])
               for i, m in merged.items()]
        return sorted(loaded), sorted(armed), out

    # ---- stop / gather -------------------------------------------------------------------------------------------
    def gather(self, final_only: bool = False) -> dict[str, list[str]]:
        """Copy each host's server log and injector records into ``hosts/<host>/`` (all hosts at once)."""
        def one(n: Node) -> Callable[[float], list[str]]:
            def go(left: float) -> list[str]:
                d = self.host_dir(n)
                got = n.runner.get_tree(self.injector_dir(n), d.injector_dir, timeout_s=left)
                if not final_only:
                    log = n.runner.get(self.log_path(n), timeout_s=left)
                    if log is not None:
                        d.server_log.path.write_bytes(log)
                        got.append(d.server_log.member.name)
                return got
            return go
        res = in_parallel({n.name: one(n) for n in self.nodes if n.root_pid}, 60.0)
        return {k: (v if ok else [f"error: {v}"]) for k, (ok, v) in res.items()}

    def write_server_log(self) -> None:
        """The folder's ``server.log``: every host's copied log (``hosts/<host>/server.log``), host by host."""
        logs = []
        for n in self.nodes:
            f = ev.Layout.SERVER_LOG.at(self.run_dir.host_path(n.name))
            if f.exists():
                logs.append(f"===== host {n.name} (node rank {n.host.node_rank}) =====\n" + f.read_text(errors="replace"))
        self.run_dir.server_log.write("\n".join(logs))

    def stop(self) -> dict[str, list]:
        """Node 0's group SIGTERM first, then every node's group SIGKILL after ``STOP_GRACE_S`` — at once, with no
        SIGTERM, when the burst left the tree wedged (``self.wedged``: a rank blocked in a collective never runs its
        handler; ``WEDGED_STOP_GRACE_S``); on each host whose session is empty, remove the node's /dev/shm files
        (:meth:`_remove_shm`); gather the logs and records; remove each host's run folder. ``teardown.json`` records
        the grace used, ``wedged``, the seconds until every node's session was checked and ``shm_removed``.
        Returns host -> pids still in its session (empty lists: clean)."""
        if not self.started:
            return {}
        self.run_dir = self.p.evidence  # the stop's copies and teardown.json go to the session's folder
        self.server = None
        self.stop_mirror()
        self.mirror = None
        left: dict[str, list] = {}
        n0 = self.nodes[0]
        grace = WEDGED_STOP_GRACE_S if self.wedged else STOP_GRACE_S
        t0 = time.time()
        self.note_shm()
        try:
            if grace > 0:
                n0.runner.signal_group(n0.root_pid, "TERM")
            deadline = time.time() + grace
            while time.time() < deadline and n0.runner.session_procs(n0.root_pid):
                time.sleep(0.5)
        except HostError:
            pass
        for n in self.nodes:
            try:
                n.runner.signal_group(n.root_pid, "KILL")
            except HostError as e:
                left[n.name] = [f"not reachable to stop: {e}"]
        time.sleep(0.5)
        for n in self.nodes:
            if n.name in left:
                continue
            try:
                left[n.name] = [pid for pid, _ in n.runner.session_procs(n.root_pid)]
            except HostError as e:
                left[n.name] = [f"not reachable to check: {e}"]
        stop_s = round(time.time() - t0, 3)
        shm_removed = self._remove_shm(left)
        gathered = self.gather()
        self.write_server_log()
        for n in self.nodes:
            try:
                n.runner.run(f"rm -rf {shlex.quote(n.workdir)}", check=False)
            except HostError:
                pass
        # left_running: the pids (each as its host sees it; by_host says which host, or why it could not be checked)
        self.p.evidence.teardown.write({"left_running": [pid for pids in left.values() for pid in pids if isinstance(pid, int)],
                                        "by_host": left, "gathered": gathered, "time": time.time(),
                                        "grace_s": grace, "wedged": self.wedged, "stop_s": stop_s,
                                        "shm_removed": shm_removed})
        self.started = False
        self.wedged = False
        return left


def _ledger_evidence_from(evd: ev.EvidenceDir, mirror_dir: Optional[Path], ranks: Sequence[int]) -> Any:
    """``ledger.json`` + ``timeline.svg`` of a ``--hosts`` run from its ledger mirror (``repro.host_ledgers``:
    ``ledger-<rank>.jsonl``), written by the local run's writer (``repro.runner._ledger_evidence``: a rank that
    died is marked so, never said to wait); the ``LedgerDiagnosis`` or None (no mirror, no ledger, or unreadable:
    the error goes into ``ledger.json``, the report keeps the stack analysis)."""
    if mirror_dir is None or not Path(mirror_dir).is_dir():
        return None
    from repro.run.finish import _ledger_evidence

    return _ledger_evidence(evd, {}, ledger_dir=Path(mirror_dir), keys=list(ranks), extra={"mirror": str(mirror_dir)})


def _session_has_token(r: Runner, sid: int, token: str) -> bool:
    """Whether some live process of session ``sid`` on the host carries ``REPRO_LAUNCH_TOKEN=<token>`` in its
    ``/proc/<pid>/environ`` (the environment :meth:`MultiHostSession` started the node's tree with)."""
    want = shlex.quote(f"{LAUNCH_TOKEN_ENV}={token}")
    line = (f"for p in $(ps -o pid= -s {int(sid)}); do tr '\\0' '\\n' < /proc/$p/environ 2>/dev/null | "
            f"grep -qxF {want} && {{ echo ours; break; }}; done; true")
    return "ours" in r.run(line, check=False).text


def cleanup_hosts(hosts: dict, tokens: Sequence[str] = ()) -> tuple[int, str]:
    """End a killed multi-host run's nodes through each host's runner (``repro cleanup`` on its folder).

    Args:
        hosts: the ``hosts`` of its ``processes.json`` (:meth:`MultiHostSession.save_processes`).
        tokens: the launch tokens of its mark (``tokens``): a node's session is signalled only when one of its
            processes carries one in ``/proc/<pid>/environ``, and its workdir removed only when it holds
            :data:`LAUNCH_TOKEN_FILE` with one of them. The /dev/shm files a stopped session mapped, and those its
            ranks registered (``mpnames-*.txt``), are removed on its host when made since it started (``repro.shm_files``).
    Returns:
        (exit code: 0 every host's session is gone, 1 a host could not be reached or still runs something, 2 refused:
        no token recorded (a hand-written file, or one an older harness wrote), nothing run on any host; one line per
        host saying what was done). A host whose recorded root pid now belongs to another process (other start ticks)
        or whose session lacks the token is left alone; a host not reachable is said so: run ``repro cleanup`` again
        once its link is back.
    """
    tokens = [t for t in tokens if isinstance(t, str) and t]
    if not tokens:
        return 2, (f"refused: {ev.Layout.PROCESSES.name} names host sessions but carries no launch token (written by hand "
                   "or by an older harness); nothing was signalled or removed on any host. End them yourself if they are yours: "
                   + ", ".join(f"{name}: session {rec.get('root_pid')}" for name, rec in hosts.items()))
    rc, lines = 0, []
    for name, rec in hosts.items():
        spec = HostSpec(**{**rec["host"], "ssh_options": tuple(rec["host"].get("ssh_options") or ())})
        r, root = Runner(spec), int(rec["root_pid"])
        try:
            live = r.session_procs(root)
            if not live:
                lines.append(f"{name}: nothing to clean (session {root} has no process)")
            else:
                ticks = r.run(_q(spec.python, "-c", _START_TICKS_PY, str(root)), check=False).text.strip()
                if ticks and rec.get("root_start_ticks") is not None and ticks != str(rec["root_start_ticks"]):
                    lines.append(f"{name}: pid {root} now belongs to another process (started at tick {ticks}, "
                                 f"recorded {rec['root_start_ticks']}): left alone")
                    continue
                if not any(_session_has_token(r, root, t) for t in tokens):
                    rc = max(rc, 2)
                    lines.append(f"{name}: no process of session {root} carries this run's launch token: not the tree "
                                 "repro launched for this run, left alone (nothing signalled or removed)")
                    continue
                try:
                    since, shm = r.shm_files(root)  # read before the tree is signalled (as MultiHostSession.stop)
                except HostError:
                    since, shm = None, set()
                r.signal_group(root, "KILL")
                time.sleep(0.5)
                left = r.session_procs(root)
                if left:
                    rc = max(rc, 1)
                removed = [] if left or since is None else r.remove_shm(
                    since, f"{rec['workdir']}/{ev.Layout.INJECTOR.name}/{ev.Layout.mp_names_glob()}", shm)
                lines.append(f"{name}: stopped session {root} ({len(live)} processes)" +
                             (f"; still running: {[p for p, _ in left]}" if left else "") +
                             (f"; removed {len(removed)} /dev/shm file(s) it made" if removed else ""))
            wd = shlex.quote(str(rec["workdir"]))
            f = shlex.quote(f"{rec['workdir']}/{LAUNCH_TOKEN_FILE}")
            same = " || ".join(f'[ "$(cat {f})" = {shlex.quote(t)} ]' for t in tokens)
            r.run(f"[ -f {f} ] && {{ {same}; }} && rm -rf {wd}; true", check=False)
        except HostError as e:
            rc = max(rc, 1)
            lines.append(f"{name} ({spec.reach}) not reachable: {e}; run `repro cleanup` again once it answers")
    return rc, "; ".join(lines)
