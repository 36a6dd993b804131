"""``repro watch --hosts``: the rank processes of a watched server found, and captured, on each of its hosts.

A server spanning hosts (multi-node TP) that someone else runs has its ranks on other machines: the watch probes
its URL from here as usual, but finds the ranks by listing each host's processes through that host's runner
(``repro.hosts.Runner``: ssh or a command template) and reading their titles with the adapter's one title parser
(sglang 0.5.23: ``sglang::scheduler_TP{k}``, see ``repro/targets/sglang/adapter.py``), and on a hang dumps every rank on
its own host (:class:`HostRanks` for ``repro.checker.check_stall``, the one stall check: ``repro.hosts.capture_remote``,
py-spy there, all hosts at once, one deadline; the injector's faulthandler fallback when py-spy is unusable and the
injector folder on that host is known). Evidence: ``stacks/rank<k>*.txt`` start with ``# host
…``; ``hosts.json`` maps each rank to its host and pid as that host sees it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional, Sequence

from repro import evidence as ev
from repro.hosts import HostError, HostSpec, RemoteRank, Runner, capture_remote, in_parallel

LIST_DEADLINE_S = 20.0

# CPU seconds (utime + stime, /proc/PID/stat) of the pids given, and the host's monotonic clock: one JSON object.
_CPU_PY = r'''
import json, os, sys, time
out = {}
for p in sys.argv[1:]:
    try:
        f = open("/proc/%s/stat" % p).read().rsplit(")", 1)[1].split()
        out[p] = (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except Exception:
        pass
print(json.dumps({"t": time.monotonic(), "cpu": out}))
'''


def _cpu_seconds(ranks: dict[int, RemoteRank]) -> dict[int, tuple[float, float]]:
    """rank -> (host monotonic time, cpu seconds) read on each rank's host (one runner call per host, in parallel);
    a rank whose host did not answer or whose process is gone is left out."""
    import json
    import shlex

    by_host: dict[str, list[RemoteRank]] = {}
    for r in ranks.values():
        by_host.setdefault(r.host, []).append(r)

    def one(rs: list[RemoteRank]):
        cmd = " ".join(shlex.quote(a) for a in (rs[0].runner.host.python, "-", *(str(r.pid) for r in rs)))
        return lambda left: json.loads(rs[0].runner.run(cmd, input=_CPU_PY.encode(), timeout_s=left).text)

    res = in_parallel({h: one(rs) for h, rs in by_host.items()}, 15.0)
    out = {}
    for h, rs in by_host.items():
        ok, v = res[h]
        if ok:
            out.update({r.rank: (v["t"], v["cpu"][str(r.pid)]) for r in rs if str(r.pid) in v["cpu"]})
    return out


def discover_on_hosts(adapter: Any, hosts: Sequence[HostSpec], match: Optional[str] = None,
                      injector_dir: Optional[str] = None) -> tuple[Any, dict[int, RemoteRank]]:
    """Find the rank processes on every host (``ps -eo pid=,args=`` through its runner, all hosts at once).

    Args:
        adapter: the engine adapter (its ``parse_title`` decides what a rank process is).
        hosts: the hosts the server spans.
        match: only processes whose title contains this text (``--match``), else every rank title.
        injector_dir: the injector folder on the hosts (for the faulthandler fallback), when known.
    Returns:
        (a ``repro.watch.Discovery`` with method ``hosts``: rank -> pid as its host sees it, and a ``note`` naming
        any host not reached or any rank found on two hosts; rank -> RemoteRank). A rank found twice is left out.
    """
    from repro.watch import Discovery

    runners = [Runner(h) for h in hosts]
    listed = in_parallel({r.name: (lambda left, r=r: r.run("ps -eo pid=,args=", timeout_s=left).text) for r in runners},
                         LIST_DEADLINE_S)
    ranks: dict[int, RemoteRank] = {}
    seen: dict[int, list[str]] = {}
    notes = []
    for r in runners:
        ok, out = listed[r.name]
        if not ok:
            notes.append(f"host {r.name} ({r.host.reach}) not reached to list its processes: {out}")
            continue
        for line in out.splitlines():
            parts = line.strip().split(None, 1)
            if len(parts) < 2 or not parts[0].isdigit() or (match is not None and match not in parts[1]):
                continue
            rt = adapter.parse_title(parts[1])
            if rt is None:
                continue
            seen.setdefault(rt.tp, []).append(f"{r.name}:{parts[0]}")
            ranks[rt.tp] = RemoteRank(rt.tp, r, int(parts[0]), injector_dir)
    for k, where in sorted(seen.items()):
        if len(where) > 1:
            notes.append(f"rank {k} found more than once ({', '.join(where)}): left out; pass --match TITLE")
            ranks.pop(k, None)
    if not ranks and not notes:
        notes.append(f"no rank process on hosts {', '.join(r.name for r in runners)}"
                     + (f" titled *{match}*" if match else ""))
    disc = Discovery({k: r.pid for k, r in sorted(ranks.items())}, "hosts", [], "; ".join(notes), where=HostRanks(ranks))
    return disc, ranks


class HostRanks:
    """Where a server's ranks run, for ``repro.checker.check_stall``: on other hosts, each read through its host's
    runner — CPU from the host's /proc (one call per host, all at once), stacks by :func:`repro.hosts.capture_remote`
    (py-spy there, all hosts at once, one deadline; the injector's faulthandler fallback).

    Args:
        ranks: rank -> RemoteRank.
        fallback_signal: the injector's faulthandler signal (the capture's fallback) when the caller names none.
    """

    def __init__(self, ranks: dict[int, RemoteRank], fallback_signal: str = "SIGUSR2") -> None:
        self.ranks = dict(ranks)
        self.fallback_signal = fallback_signal

    @property
    def rank_pids(self) -> dict[int, int]:
        """rank -> pid as its host sees it."""
        return {k: r.pid for k, r in self.ranks.items()}

    def cpu_seconds(self) -> dict[int, tuple[float, float]]:
        """rank -> (its host's monotonic clock, CPU seconds); a rank whose host did not answer is left out."""
        return _cpu_seconds(self.ranks)

    def capture(self, stacks_dir: Path, tag: str, *, timeout_s: float = 10.0, native: bool = False,
                fallback_signal: Optional[str] = None, injector_dir: Any = None) -> list:
        """One capture of every rank on its host. ``timeout_s``: per-rank py-spy bound; the capture's shared
        deadline is twice that, at least 20 s. ``native`` is not supported on remote hosts (ignored);
        ``injector_dir`` is each rank's own (its RemoteRank's)."""
        return capture_remote([self.ranks[k] for k in sorted(self.ranks)], stacks_dir, tag=tag,
                              deadline_s=max(20.0, 2 * timeout_s), fallback_signal=fallback_signal or self.fallback_signal)

    def capture_cpu(self, first: Sequence[Any], second: Sequence[Any]) -> dict[int, float]:
        """Where a host did not answer the CPU reading: the higher of the two captures' own readings."""
        return {c.rank: max(c.cpu_percent or 0.0, c2.cpu_percent or 0.0) for c, c2 in zip(first, second)}

    def write_record(self, evd: ev.EvidenceDir) -> None:
        """``hosts.json``: each rank's host (:func:`write_hosts_record`)."""
        write_hosts_record(evd, self.ranks)


def write_hosts_record(evd: ev.EvidenceDir, ranks: dict[int, RemoteRank]) -> None:
    """``hosts.json`` of a watch hang: each rank's host, how it is reached and its pid as that host sees it."""
    evd.hosts_json.write({
        "ranks": {str(k): {"host": r.host, "pid": r.pid, "reach": r.runner.host.reach} for k, r in sorted(ranks.items())},
        "note": "pids are as each host sees them (its own PID namespace or machine)"})


__all__ = ["HostError", "HostRanks", "discover_on_hosts", "write_hosts_record"]
