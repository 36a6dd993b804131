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

from typing import Any, Optional, Sequence

from repro.hosts import HostRanks, HostSpec, RemoteRank, Runner, in_parallel
from repro.watch.discovery import Discovery

LIST_DEADLINE_S = 20.0


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
