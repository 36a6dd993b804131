"""Finding a watched server's rank processes on this host: under ``pid_root``, by title ``match``, under the process
listening on the URL's port, or behind a router (:func:`discover_ranks`)."""

from __future__ import annotations

import psutil
import socket
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Optional
from urllib.parse import urlsplit

from repro import evidence as ev
from repro import procs as _procs
from repro.procs import ProcInfo
from repro.watch.options import DiscoveryError


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
            ``repro.hosts.HostRanks`` for ``--hosts``).
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
    workers = adapter.router_workers(url)
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
