"""One run of a scenario whose server spans several hosts (docs/pipeline.md, each node through its host's runner).

The same pipeline as ``repro.runner`` — plan → server → arm → burst → stall? → capture ×2 → verdict → evidence —
with every step that touches a rank going through ``repro.hosts.Runner`` (ssh or a command template), because the
harness may not see the hosts' processes at all (another machine, pod, or PID namespace):

- start: each host reachable first (else INCONCLUSIVE naming it; nothing is started); the injector package, the
  plan (its ``out_dir`` and ``arm_file`` rewritten to the host's run folder) and an empty arm file are copied to
  every host; each node is started detached in its own session with the adapter's multi-node flags
  (``adapter.multinode``: sglang ``--nnodes/--node-rank/--dist-init-addr``, ``GLOO_SOCKET_IFNAME``,
  ``SGLANG_HOST_IP``); node 0's ``/health`` is polled over HTTP while every node's tree is watched through its runner;
- ranks: read from each host's session (process titles → ``adapter.parse_title``): rank → (host, pid there);
- arm: the arm file is written here and copied to every host; each rank's fire log on its host must show the arming;
- burst from here to node 0's HTTP port; on a stall every rank is dumped on its own host (``capture_remote``, all
  hosts at once, one deadline), twice, and the DEADLOCKED rule applied (``repro.verdict.judge_stall``, each rank's
  CPU use over the whole check: ``repro.remote_watch.check_stall_on_hosts``) — unless a
  host's data link is down or a host cannot be reached, which makes the run INCONCLUSIVE naming that host;
- stop: node 0's group gets SIGTERM first (sglang's nodes ≥ 1 ignore SIGTERM and wait for node 0's shutdown), then
  every node's group SIGKILL; each host's session is checked empty; each host's server log and injector records
  are copied back under ``hosts/<host>/`` and its run folder removed.

Run: ``python -m repro.remote_run SCENARIO --variant V --hosts HOSTS.json [--evidence-dir D] [--expect E]``
(``HOSTS.json``: a list of ``repro.hosts.HostSpec`` fields). Exit codes as ``repro run``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shlex
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from repro import evidence as ev
from repro import resources
from repro.hosts import HostError, HostSpec, RemoteRank, Runner, hosts_from_json, in_parallel
from repro.runner import Observer, RunOptions, RunResult, _noop, prepare, write_arm_file
from repro.scenario import PLAN_ENV
from repro.verdict import DEADLOCKED, INCONCLUSIVE, InjectionCheck, Verdict, exit_code_for, judge_completion

POLL_S = 0.25
NODE_WATCH_S = 3.0  # seconds between checks that every node's tree is alive (a runner call each)
CONFIRM_GAP_S = 1.0
CAPTURE_DEADLINE_S = 20.0
ARM_ACK_TIMEOUT_S = 15.0
STOP_GRACE_S = 10.0
LINK_PROBE_S = 2.0

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


class MultiHostSession:
    """A server spanning ``hosts``, driven like ``repro.runner.Session`` but only through each host's runner.

    Args:
        p: the prepared run (``repro.runner.prepare``): scenario, variant, evidence folder, plan, launch spec.
        hosts: one HostSpec per node (node ranks 0..n-1; node 0 serves HTTP).
        observe: progress callback ``(event, data)``.
    """

    def __init__(self, p: Any, hosts: Sequence[HostSpec], observe: Observer = _noop) -> None:
        self.p = p
        self.observe = observe
        run_id = p.evidence.path.name
        self.nodes = [Node(h, Runner(h), f"{h.workdir.rstrip('/')}/{run_id}") for h in sorted(hosts, key=lambda h: h.node_rank)]
        self.ranks: dict[int, RemoteRank] = {}
        self.started = False
        self.healthy_s: Optional[float] = None
        self.dist_port = 0
        self.host_of_rank: dict[int, str] = {}
        self.ledger_root = p.evidence.path / "host-ledgers"  # the session's: one mirror folder per server start
        self.mirror: Any = None  # repro.host_ledgers.HostLedgerMirror of the running server's ranks
        self._starts = 0

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

    def make_detectors(self, mirror: Any) -> list:
        """The detector set of every topology (``repro.detect.detector_set``) on the hosts' ranks, in polling
        order: rank death (their hosts' /proc, via ``mirror``), the ledger proof (on ``mirror``'s copies); the stall
        rule follows in :meth:`drive` (its captures on the hosts, with the data-link checks)."""
        from repro.host_ledgers import HostsLedgerProofDetector, hosts_rank_death_detector

        return [hosts_rank_death_detector(mirror),
                HostsLedgerProofDetector(self.ranks, self.p.plan.get("faulthandler_signal") or "SIGUSR2")]

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
        return f"{n.workdir}/injector"

    @staticmethod
    def arm_path(n: Node) -> str:
        return f"{n.workdir}/{ev.Layout.ARM.name}"

    @property
    def url(self) -> str:
        n0 = self.nodes[0]
        return f"http://{n0.host.http_address or n0.host.address}:{n0.http_port}"

    def host_dir(self, n: Node) -> Path:
        return self.p.evidence.path / "hosts" / n.name

    # ---- start -------------------------------------------------------------------------------------------------
    def start(self) -> Optional[Verdict]:
        """Check every host, copy the plan and injector, start every node, wait for node 0's /health, map ranks.

        Returns:
            None when healthy with every rank found, else the INCONCLUSIVE verdict naming the host concerned.
        """
        p = self.p
        adapter = p.adapter
        self.ranks, self.host_of_rank, self.healthy_s = {}, {}, None  # a restart maps the new tree afresh
        for n in self.nodes:
            n.root_pid = n.http_port = 0
        if not callable(getattr(adapter, "multinode", None)):
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
            n.runner.put(json.dumps(plan, indent=2).encode(), f"{n.workdir}/plan.json")
            n.runner.put(arm_bytes, self.arm_path(n))
            extra_args, extra_env = adapter.multinode(len(self.nodes), n.host.node_rank, dist_addr,
                                                      n.host.address, n.host.ifname)
            prepend = [f"{n.workdir}/injectors" if x == local_prepend else x for x in p.spec.pythonpath_prepend]
            spec = dataclasses.replace(p.spec, host="0.0.0.0", port=n.http_port, nccl_port=ports[n.name][1],
                                       args=[*p.spec.args, *extra_args],
                                       env={**p.spec.env, **extra_env, PLAN_ENV: f"{n.workdir}/plan.json"},
                                       pythonpath_prepend=prepend)
            env = adapter.launch_env(spec, {})
            argv = adapter.launch_command(spec)
            self.observe("node_launch", {"host": n.name, "argv": argv})
            n.root_pid = n.runner.start(argv, env, f"{n.workdir}/server.log", n.workdir)
            self.started = True
        self._save_launch()
        timeout_s = p.scenario.server.startup_timeout_s
        self.observe("wait_healthy", {"url": self.url, "timeout_s": timeout_s,
                                      "pid": f"{n0.name}:{n0.root_pid}", "log": f"{n0.name}:{n0.workdir}/server.log"})
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
        self._save_launch()
        self.save_processes()
        if sorted(self.ranks) != expected:
            return Verdict(INCONCLUSIVE, f"expected scheduler ranks {expected} across the hosts, found "
                                         f"{ {k: f'{r.host}:{r.pid}' for k, r in sorted(self.ranks.items())} }")
        return None

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
                t = n.runner.run(f"tail -n {lines} {shlex.quote(n.workdir + '/server.log')}", check=False).text
            except HostError as e:
                t = f"(log not readable: {e})"
            parts.append(f"[{n.name} server.log]\n{t.strip()}")
        return "\n".join(parts)

    def _save_launch(self) -> None:
        self.p.evidence.write_json("hosts.json", {
            "nodes": [{"host": n.name, "node_rank": n.host.node_rank, "reach": n.host.reach, "address": n.host.address,
                       "workdir": n.workdir, "root_pid": n.root_pid, "http_port": n.http_port} for n in self.nodes],
            "dist_init_addr": f"{self.nodes[0].host.address}:{self.dist_port}",
            "ranks": {str(k): {"host": r.host, "pid": r.pid} for k, r in sorted(self.ranks.items())},
            "note": "pids are as each host sees them (its own PID namespace or machine)",
        })

    def save_processes(self) -> None:
        """``processes.json`` of a server spanning hosts, for ``repro cleanup`` after a killed harness: the launch
        mark (this harness), and per host its spec (how to reach it), the node's root pid (= session and process
        group there), that root's start ticks on the host (clock ticks since its boot: a reused pid is told apart)
        and the session's processes as the host listed them. ``processes`` is empty: no pid here is local."""
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
        self.p.evidence.write_json(ev.Layout.PROCESSES.name, {**launch_mark(None, root_pid=0), "hosts": hosts,
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
        self.p.evidence.write_json("links.json", {k: (v[1] if v[0] else f"error: {v[1]}") for k, v in res.items()})
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

    # ---- drive -------------------------------------------------------------------------------------------------
    def drive(self, variant: Any, n_requests: Optional[int] = None) -> dict:
        """Arm ``variant``, send the burst to node 0, detect a stall, capture every rank on its host, judge.

        Returns:
            ``{"verdict": Verdict, "analysis": Analysis or None, "state": DriverState, "timings": {...}}``.
        """
        from repro.driver import BurstDriver, make_prompts
        from repro.remote_watch import check_stall_on_hosts

        p = self.p
        scenario, burst = p.scenario, p.scenario.burst
        expected = list(range(p.spec.tp_size))
        timings: dict = {}
        ids = [i.id for i in variant.injections]
        t = time.time()
        late = self.arm(ids)
        timings["arm_ack_s"] = time.time() - t
        if late:
            self.observe("arm_not_acknowledged", {"ranks": late, "timeout_s": ARM_ACK_TIMEOUT_S})
        self.observe("armed", {"injections": ids, "ranks": {k: f"{r.host}:{r.pid}" for k, r in self.ranks.items()}})
        from repro.detect import DetectContext

        mirror = self.ledger_mirror()
        dctx = None
        dets: list = []  # the detector set of a local run (repro.detect.detector_set), on the hosts' ranks
        if mirror is not None:  # rank death and the ledger proof, on the hosts' ledgers copied as they grow
            dets = self.make_detectors(mirror)
            dctx = DetectContext(mirror.rank_keys, expected, p.evidence, mirror.dir, p.plan, scenario.stall_s,
                                 observe=self.observe)

        def poll_dets(st: Any, now: float) -> Any:
            """Poll rank death, then the proof; the deciding Detection or None (records and evidence written)."""
            dctx.state, dctx.now = st, now
            for d in dets:
                det = d.poll(dctx)
                if det is None:
                    continue
                if det.record is not None:
                    stalls.append({**det.record, "detector": det.detector})
                    p.evidence.stalls.write(stalls)
                for name, obj in det.evidence.items():
                    p.evidence.write_json(name, obj)
                if det.decided and det.verdict is not None:
                    return det
            return None
        prompts = make_prompts(n_requests or burst.requests, burst.input_len, burst.seed)
        driver = BurstDriver(p.adapter, self.url, prompts, burst.max_new_tokens, burst.concurrency,
                             p.evidence.requests.path, burst.request_timeout_s)
        verdict = analysis = None
        stalls: list = []
        captures = 0
        last_capture_t = last_watch = 0.0
        t_burst = time.time()
        if dctx is not None:
            dctx.t_burst = t_burst
            for d in dets:
                d.start(dctx)
        driver.start()
        self.observe("burst_started", {"url": self.url, "requests": len(prompts)})
        try:
            while verdict is None:
                time.sleep(POLL_S)
                now = time.time()
                st = driver.state()
                self.observe("burst", {"state": st})
                if st.finished:
                    break
                if now - t_burst > scenario.budget_s:
                    verdict = Verdict(INCONCLUSIVE, f"budget of {scenario.budget_s:.0f} s ended without a verdict: "
                                                    f"{stalls[-1]['reason'] if stalls else st.waiting_for()}")
                    break
                if now - last_watch > NODE_WATCH_S:
                    last_watch = now
                    dead = self._dead_nodes()
                    if dead and dets:  # a rank that died first is the cause worth naming (its host's /proc, log)
                        try:
                            mirror.fetch()
                        except Exception:  # noqa: BLE001 - the node's death is still reported
                            pass
                        det = poll_dets(st, now)
                        if det is not None:
                            verdict, analysis = det.verdict, det.analysis
                            break
                    if dead:
                        faults = self.link_faults()  # a lost data link is the cause worth naming first
                        verdict = Verdict(INCONCLUSIVE, "; ".join(faults) + ("; then " if faults else "") +
                                          "server died during the burst: " + "; ".join(dead))
                        break
                det = poll_dets(st, now) if dets else None
                if det is not None:
                        verdict, analysis = det.verdict, det.analysis
                        timings["last_progress_to_verdict_s"] = time.time() - (st.last_progress_t or t_burst)
                        break
                stalled = st.stalled_for(now)
                if stalled < scenario.stall_s or now - last_capture_t < scenario.stall_s:
                    continue
                captures += 1
                tag = f"-{captures}"
                self.observe("capture", {"n": captures, "stalled_s": stalled, "hosts": sorted({r.host for r in self.ranks.values()})})
                # two captures on the ranks' hosts; CPU use over the whole check (as a local run measures it: a
                # dump's own fraction of a second is too short to tell a blocked rank from a busy one)
                chk = check_stall_on_hosts(self.ranks, p.evidence.stacks_dir, expected, tag=tag, second_tag=tag + "b",
                                           confirm_gap_s=CONFIRM_GAP_S, timeout_s=CAPTURE_DEADLINE_S / 2,
                                           fallback_signal=p.plan.get("faulthandler_signal") or "SIGUSR2")
                first, second = chk.first, chk.second
                last_capture_t = time.time()
                analysis = chk.second_analysis
                missing = [f"rank {c.rank} on host {self.host_of_rank.get(c.rank)}: {c.error}" for c in second if not c.ok]
                faults = self.link_faults()
                if faults:
                    verdict = Verdict(INCONCLUSIVE, "stalled, but " + "; ".join(faults) +
                                      f" — its ranks {self._ranks_on(faults)} cannot be judged a deadlock")
                    stalls.append({"capture": captures, "reason": verdict.reason, "deadlocked": False})
                    break
                unreachable = [m for m in missing if "unreachable" in m or "timed out" in m or "no answer" in m]
                if unreachable:
                    verdict = Verdict(INCONCLUSIVE, "stalled, but some ranks could not be captured: " + "; ".join(unreachable))
                    stalls.append({"capture": captures, "reason": verdict.reason, "deadlocked": False})
                    break
                cpu, j = chk.cpu_percent, chk.judgement
                stalls.append({"capture": captures, "tag": tag, "stalled_s": round(stalled, 2), "deadlocked": j.deadlocked,
                               "reason": j.reason, "cpu_percent": {str(k): v for k, v in cpu.items()}, "time": last_capture_t})
                p.evidence.stalls.write(stalls)
                self.observe("judged", {"judgement": j})
                if j.deadlocked:
                    timings["last_progress_to_verdict_s"] = time.time() - (st.last_progress_t or t_burst)
                    verdict = Verdict(DEADLOCKED, j.reason)
        finally:
            driver.abandon()
        if stalls:
            p.evidence.stalls.write(stalls)
        timings["burst_s"] = time.time() - t_burst
        timings["captures"] = float(captures)
        final = driver.state()
        if verdict is None:
            time.sleep(0.5)  # the injectors flush their counters every ~0.2 s
            self.gather(final_only=True)
            loaded, armed, checks = self.injection_checks(variant)
            verdict = judge_completion(final.requests, expected, loaded, armed, checks)
        if dets:  # the ledgers' and the deaths' word after the burst (DESYNCED, a dead rank), as a local run's
            try:
                mirror.fetch()
            except Exception:  # noqa: BLE001 - the ledger must not cost the verdict
                pass
            for d in reversed(dets):  # the proof's first, then rank death's (as repro.runner orders them)
                try:
                    verdict = d.final_verdict(verdict, dctx)
                except Exception:  # noqa: BLE001
                    pass
                timings.update(getattr(d, "timings", None) or {})
        self.arm([])
        driver.close(wait_s=0.5 if final.finished else 2.0)
        return {"verdict": verdict, "analysis": analysis, "state": final, "timings": timings,
                "ledger_dir": mirror.dir if mirror is not None else None}

    def _ranks_on(self, faults: Sequence[str]) -> list[int]:
        names = {n.name for n in self.nodes if any(f"host {n.name}" in f for f in faults)}
        return sorted(k for k, h in self.host_of_rank.items() if h in names)

    def injection_checks(self, variant: Any) -> tuple[list[int], list[int], list[InjectionCheck]]:
        """Loaded / armed ranks and per-injection counts, read from each host's copied injector records."""
        from repro.runner import injection_checks

        loaded: set = set()
        armed: set = set()
        merged: dict[str, dict] = {}
        for n in self.nodes:
            mine = {k: r.pid for k, r in self.ranks.items() if r.host == n.name}
            d = self.host_dir(n) / "injector"
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
                got = n.runner.get_tree(self.injector_dir(n), d / "injector", timeout_s=left)
                if not final_only:
                    log = n.runner.get(f"{n.workdir}/server.log", timeout_s=left)
                    if log is not None:
                        (d / "server.log").write_bytes(log)
                        got.append("server.log")
                return got
            return go
        res = in_parallel({n.name: one(n) for n in self.nodes if n.root_pid}, 60.0)
        return {k: (v if ok else [f"error: {v}"]) for k, (ok, v) in res.items()}

    def write_server_log(self) -> None:
        """The evidence folder's ``server.log``: every host's copied log (``hosts/<host>/server.log``), host by host."""
        logs = []
        for n in self.nodes:
            f = self.host_dir(n) / "server.log"
            if f.exists():
                logs.append(f"===== host {n.name} (node rank {n.host.node_rank}) =====\n" + f.read_text(errors="replace"))
        self.p.evidence.server_log.path.write_text("\n".join(logs))

    def stop(self) -> dict[str, list]:
        """Node 0's group SIGTERM first, then every node's group SIGKILL after ``STOP_GRACE_S``; gather the logs and
        records; remove each host's run folder. Returns host -> pids still in its session (empty lists: clean)."""
        if not self.started:
            return {}
        self.stop_mirror()
        self.mirror = None
        left: dict[str, list] = {}
        n0 = self.nodes[0]
        try:
            n0.runner.signal_group(n0.root_pid, "TERM")
            deadline = time.time() + STOP_GRACE_S
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
        gathered = self.gather()
        self.write_server_log()
        for n in self.nodes:
            try:
                n.runner.run(f"rm -rf {shlex.quote(n.workdir)}", check=False)
            except HostError:
                pass
        # left_running: the pids (each as its host sees it; by_host says which host, or why it could not be checked)
        self.p.evidence.teardown.write({"left_running": [pid for pids in left.values() for pid in pids if isinstance(pid, int)],
                                        "by_host": left, "gathered": gathered, "time": time.time()})
        self.started = False
        return left


def _finish(p: Any, opts: RunOptions, s: MultiHostSession, out: dict, interrupted: bool, left: dict,
            t0: float) -> RunResult:
    """Write one run folder's analysis, versions, REPORT.md, verdict.json and status from a drive's ``out``; a node
    left running after a stop (``left``: host -> pids) is added to the verdict's reason."""
    from repro.report import ReportInput, write_report
    from repro.runner import collect_versions

    evd = p.evidence
    verdict = out["verdict"] or Verdict(INCONCLUSIVE, "internal error before a verdict (see the console)")
    if any(left.values()):
        verdict = Verdict(verdict.verdict, verdict.reason + f"; left running after the stop: {left}")
    timings = {**out["timings"], "total_s": time.time() - t0}
    if out["analysis"] is not None:
        evd.analysis.write(out["analysis"].to_dict())
    rank_pids = {k: r.pid for k, r in s.ranks.items()}
    loaded, armed, checks = s.injection_checks(p.variant) if s.ranks else ([], [], [])
    h0_inj = s.host_dir(s.nodes[0]) / "injector"
    versions = collect_versions(h0_inj if h0_inj.is_dir() else evd.injector_dir, p.python)
    evd.env.write(versions)
    command = opts.command_line or f"python -m repro.remote_run {opts.scenario_path} --variant {p.variant.name}"
    ledger_diag = _ledger_evidence_from(evd, out.get("ledger_dir"), sorted(rank_pids))
    write_report(evd, ReportInput(
        scenario=p.scenario.name, mirrors=p.scenario.mirrors or "", description=p.scenario.description or "",
        variant=p.variant.name, variant_expects=p.variant.expect, variant_description=p.variant.description or "",
        has_injections=bool(p.variant.injections), verdict=verdict, analysis=out["analysis"],
        requests=out["state"], ranks=sorted(rank_pids) or list(range(p.spec.tp_size)), checks=checks,
        timings=timings, versions=versions, ledger=ledger_diag,
        timeline=ev.Layout.TIMELINE.name if ledger_diag is not None and evd.timeline.exists() else None,
        stacks_dir=evd.stacks_dir, command=command))
    code = exit_code_for(verdict.verdict, opts.expect)
    evd.verdict.write(ev.verdict_record(
        verdict, exit_code=code, evidence=evd.path, scenario=p.scenario.name, variant=p.variant.name,
        variant_expects=p.variant.expect, expect=opts.expect, partial=interrupted, timings=timings,
        rank_pids=rank_pids, rank_hosts={str(k): h for k, h in s.host_of_rank.items()}))
    evd.set_status("interrupted" if interrupted else "complete", timings=timings)
    reqs = out["state"].requests if out["state"] else []
    return RunResult(verdict, code, evd.path, opts.expect, out["analysis"], timings,
                     sum(1 for r in reqs if r.succeeded), len(reqs))


def _ledger_evidence_from(evd: ev.EvidenceDir, mirror_dir: Optional[Path], ranks: Sequence[int]) -> Any:
    """``ledger.json`` + ``timeline.svg`` of a ``--hosts`` run from its ledger mirror (``repro.host_ledgers``:
    ``ledger-<rank>.jsonl``), as ``repro.runner`` writes a local run's; the ``LedgerDiagnosis`` or None (no mirror,
    no ledger, or unreadable: the error goes into ``ledger.json``, the report keeps the stack analysis)."""
    if mirror_dir is None or not Path(mirror_dir).is_dir():
        return None
    from repro.ledger import diagnose
    from repro.timeline import render_timeline

    try:
        diag = diagnose(mirror_dir, list(ranks) or None)
    except Exception as e:  # noqa: BLE001 - a broken ledger must not cost the verdict
        evd.ledger.write({"error": f"{type(e).__name__}: {e}"})
        return None
    if diag is None:
        return None
    evd.ledger.write({**diag.to_dict(), "mirror": str(mirror_dir)})
    proof = ev.read_json(evd.path / "proof.json")
    evd.timeline.write(render_timeline(diag.ledgers, diag.divergence, proof=proof if isinstance(proof, dict) else None))
    return diag


def _empty_out() -> dict:
    return {"verdict": None, "analysis": None, "state": None, "timings": {}}


def run_multihost(opts: RunOptions, hosts: Sequence[HostSpec], observe: Observer = _noop) -> RunResult:
    """``repro run`` for a server spanning ``hosts``: launch, arm, drive, capture on each host, judge, evidence, stop.

    Never leaves a node running: every node is stopped on every outcome and on Ctrl-C (KeyboardInterrupt re-raised
    after teardown).

    Raises:
        repro.runner.RunError: bad scenario or options (nothing launched).
    """
    p = prepare(opts)
    p.evidence.command.write((opts.command_line or f"python -m repro.remote_run {opts.scenario_path}") + "\n")
    s = MultiHostSession(p, hosts, observe)
    t0 = time.time()
    out = _empty_out()
    interrupted = False
    left: dict = {"?": ["teardown interrupted"]}
    try:
        failed = s.start()
        if failed is not None:
            out["verdict"] = failed
        else:
            out = s.drive(p.variant, opts.requests)
            out["timings"]["healthy_s"] = s.healthy_s or 0.0
    except KeyboardInterrupt:
        interrupted = True
        out["verdict"] = Verdict(INCONCLUSIVE, "interrupted by the user (Ctrl-C/SIGTERM) before a verdict; evidence is partial")
    finally:
        try:
            left = s.stop()
        finally:
            res = _finish(p, opts, s, out, interrupted, left, t0)
    if interrupted:
        raise KeyboardInterrupt
    return res


def run_multihost_many(opts: RunOptions, variants: Sequence[str], hosts: Sequence[HostSpec],
                       observe: Observer = _noop, on_result: Optional[Callable[[RunResult], None]] = None
                       ) -> tuple[list[RunResult], dict[str, list]]:
    """Several variants of one scenario on ONE server spanning ``hosts`` (``repro.runner.run_many`` for hosts).

    The plan holds every listed variant's injections (ids unique across them); each variant is armed in turn and
    gets its own run folder (``session.json`` names the session folder; ``hosts/<host>/`` holds that host's log and
    injector records as they were when the variant ended). A variant that leaves the server unusable (any verdict
    but ALL REQUESTS SUCCEEDED) makes the server restart before the next one (never after the last). The session
    folder keeps ``teardown.json`` of the last stop. Every node is stopped at the end, on failure and on Ctrl-C.

    Args:
        on_result: called with each variant's RunResult as soon as its folder is complete.
    Returns:
        (one RunResult per variant, in order; host -> pids left running after the final stop, empty lists: clean).
    Raises:
        repro.runner.RunError: bad scenario or options (nothing launched).
        KeyboardInterrupt: after teardown.
    """
    from repro.verdict import SUCCEEDED

    p = prepare(opts, label_default="session", variants=variants)
    p.evidence.command.write((opts.command_line or f"python -m repro.remote_run {opts.scenario_path}") + "\n")
    s = MultiHostSession(p, hosts, observe)
    results: list[RunResult] = []
    left: dict = {"?": ["teardown interrupted"]}
    interrupted = False
    try:
        failed = s.start()
        for i, name in enumerate(variants):
            if i and results[-1].verdict.verdict != SUCCEEDED:
                s.p = p
                s.stop()
                failed = s.start()
            variant = p.scenario.variant(name)
            run_dir = ev.EvidenceDir(p.evidence.root, p.scenario.name, name)
            run_dir.session.write({"session": str(p.evidence.path),
                                   "rank_pids": {str(k): r.pid for k, r in s.ranks.items()}})
            run_dir.command.write((opts.command_line or f"python -m repro.remote_run {opts.scenario_path}") + "\n")
            rp = dataclasses.replace(p, evidence=run_dir, variant=variant)
            s.p = rp
            t0 = time.time()
            out = _empty_out()
            try:
                if failed is not None:
                    out["verdict"] = failed
                else:
                    out = s.drive(variant, opts.requests)
                    out["timings"]["healthy_s"] = s.healthy_s or 0.0
            except KeyboardInterrupt:
                interrupted = True
                out["verdict"] = Verdict(INCONCLUSIVE, "interrupted by the user (Ctrl-C/SIGTERM) before a verdict; "
                                                       "evidence is partial")
                raise
            finally:
                if s.started:
                    s.gather()
                    s._save_launch()
                    s.write_server_log()
                res = _finish(rp, opts, s, out, interrupted, {}, t0)
                results.append(res)
                if on_result is not None:
                    on_result(res)
    except KeyboardInterrupt:
        interrupted = True
    finally:
        s.p = p
        left = s.stop()
        p.evidence.set_status("interrupted" if interrupted else "complete")
    if interrupted:
        raise KeyboardInterrupt
    return results, left


def cleanup_hosts(hosts: dict) -> tuple[int, str]:
    """End a killed multi-host run's nodes through each host's runner (``repro cleanup`` on its folder).

    Args:
        hosts: the ``hosts`` of its ``processes.json`` (:meth:`MultiHostSession.save_processes`).
    Returns:
        (exit code: 0 every host's session is gone, 1 a host could not be reached or still runs something; one line
        per host saying what was done). A host whose recorded root pid now belongs to another process (other start
        ticks) is left alone; a host not reachable is said so: run ``repro cleanup`` again once its link is back.
    """
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
                r.signal_group(root, "KILL")
                time.sleep(0.5)
                left = r.session_procs(root)
                if left:
                    rc = 1
                lines.append(f"{name}: stopped session {root} ({len(live)} processes)" +
                             (f"; still running: {[p for p, _ in left]}" if left else ""))
            r.run(f"rm -rf {shlex.quote(rec['workdir'])}", check=False)
        except HostError as e:
            rc = 1
            lines.append(f"{name} ({spec.reach}) not reachable: {e}; run `repro cleanup` again once it answers")
    return rc, "; ".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """CLI: ``python -m repro.remote_run SCENARIO --hosts HOSTS.json [--variant V ...] [--evidence-dir D] [--expect E]``.

    One ``--variant``: prints the verdict line and the evidence folder, then one JSON line; exit code as ``repro
    run`` (2 on bad input). Several ``--variant``: they run in turn on one server (:func:`run_multihost_many`); one
    verdict line, folder and JSON line (with ``variant``) per variant, then a JSON line ``{"session": …,
    "left_running": …}``; exit code 0 when every variant's is 0, else the first non-zero one (1 when a node was
    left running).
    """
    from repro.runner import RunError

    ap = argparse.ArgumentParser(prog="python -m repro.remote_run", description="repro run across several hosts")
    ap.add_argument("scenario", type=Path)
    ap.add_argument("--hosts", type=Path, required=True, help="JSON list of hosts (repro.hosts.HostSpec fields)")
    ap.add_argument("--variant", action="append",
                    help="variant to run; give it several times to run them in turn on one server")
    ap.add_argument("--evidence-dir", type=Path, default=ev.DEFAULT_EVIDENCE_DIR)
    ap.add_argument("--expect")
    ap.add_argument("--requests", type=int)
    a = ap.parse_args(argv)
    try:
        hosts = hosts_from_json(json.loads(a.hosts.read_text()))
    except (OSError, ValueError) as e:
        print(f"error: {a.hosts}: {e}", file=sys.stderr)
        return 2
    variants = a.variant or []
    opts = RunOptions(scenario_path=a.scenario, variant=variants[0] if variants else None, evidence_root=a.evidence_dir,
                      expect=a.expect, requests=a.requests,
                      command_line=" ".join(["python -m repro.remote_run", *map(shlex.quote, argv or sys.argv[1:])]))

    def observe(e: str, d: Any) -> None:
        if e != "burst":
            print(f"[{time.strftime('%H:%M:%S')}] {e} {json.dumps(d, default=str)[:300]}", file=sys.stderr, flush=True)

    def show(res: RunResult, variant: Optional[str] = None) -> None:
        print(f"{res.verdict.verdict}: {res.verdict.reason}")
        print(f"evidence: {res.evidence}")
        print(json.dumps({**({"variant": variant} if variant else {}), "verdict": res.verdict.verdict,
                          "reason": res.verdict.reason, "evidence": str(res.evidence), "exit_code": res.exit_code}),
              flush=True)

    try:
        if len(variants) <= 1:
            res = run_multihost(opts, hosts, observe=observe)
            show(res)
            return res.exit_code
        shown = iter(variants)
        results, left = run_multihost_many(opts, variants, hosts, observe=observe,
                                           on_result=lambda r: show(r, next(shown)))
    except RunError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    session = json.loads(Path(results[0].evidence, ev.Layout.SESSION.name).read_text())["session"] if results else ""
    print(json.dumps({"session": session, "left_running": left}), flush=True)
    codes = [r.exit_code for r in results if r.exit_code]
    return codes[0] if codes else (1 if any(left.values()) else 0)


if __name__ == "__main__":
    sys.exit(main())
