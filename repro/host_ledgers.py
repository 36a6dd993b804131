"""The ranks' collective ledgers of a server spanning several hosts, followed live from here (``--hosts`` runs).

Each rank's injector writes ``ledger-<pid>.jsonl`` on its own host (``repro.ledger_follow`` describes the format and
the injector's rotation). :class:`HostLedgerMirror` copies what each host's ledgers gained into one local folder,
at most one remote call per host per second (all hosts at once, :data:`FETCH_EVERY_S`), appending only the new
bytes: the local file ``ledger-<rank>.jsonl`` is a growing prefix of rank ``rank``'s ledger on its host (pids may
repeat across hosts, ranks do not), so :class:`repro.ledger_follow.LedgerFollower` tails it exactly as it tails a
local server's. A rotation on the host (``.jsonl`` renamed ``.1``, a new part opened) is copied seamlessly: the rest
of the old part, then the new one (its header says ``part`` + 1).

:class:`HostsLedgerProofDetector` is ``repro.proof.LedgerProofDetector`` on that mirror: a rank is alive while its
node is (the host's pids are not this machine's), and the proof's stacks are taken on the ranks' hosts.
"""

from __future__ import annotations

import base64
import json
import shlex
import threading
import time
from pathlib import Path
from typing import Any, Mapping, Optional

from repro.evidence import Layout
from repro.proof import LedgerProofDetector

FETCH_EVERY_S = 1.0  # at most one remote call per host per this many seconds
FETCH_MAX_BYTES = 4 << 20  # per rank per call (a mirror that fell behind catches up over several calls)

# On a host: argv = injector_dir, max_bytes, the current and the previous part's file name with ``{pid}`` in them
# (``repro.evidence.Layout.ledger_file``), then pid:offset:inode per rank. Prints one JSON object: pid → {data
# (base64 of the bytes from offset on), ino, off (the offset to ask next time)}. A file whose inode changed was
# rotated: the rest of the previous part from offset, then the new part from 0.
_TAIL_PY = r'''
import base64, json, os, sys
d, cap, cur, prev, out = sys.argv[1], int(sys.argv[2]), sys.argv[3], sys.argv[4], {}
for arg in sys.argv[5:]:
    pid, off, ino = (int(x) for x in arg.split(":"))
    path = os.path.join(d, cur.format(pid=pid))
    data = b""
    try:
        st = os.stat(path)
    except OSError:
        out[pid] = {"data": "", "ino": ino, "off": off}
        continue
    if ino and st.st_ino != ino:
        try:
            with open(os.path.join(d, prev.format(pid=pid)), "rb") as f:
                f.seek(off); data = f.read(cap)
        except OSError:
            pass
        off = 0
    with open(path, "rb") as f:
        f.seek(off); new = f.read(max(0, cap - len(data)))
    out[pid] = {"data": base64.b64encode(data + new).decode(), "ino": st.st_ino, "off": off + len(new)}
for arg in sys.argv[5:]:  # alive: /proc/PID exists and is not a zombie
    pid = int(arg.split(":")[0])
    try:
        alive = open("/proc/%d/stat" % pid).read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        alive = False
    out.setdefault(pid, {"data": "", "ino": 0, "off": 0})["alive"] = alive
print(json.dumps(out))
'''


class HostLedgerMirror:
    """Copy every rank's ledger from its host into ``local_dir`` as it grows (a thread, one call per host per
    :data:`FETCH_EVERY_S`; :meth:`fetch` once more on demand).

    Args:
        ranks: rank → ``repro.hosts.RemoteRank`` (runner, pid on its host, injector folder there).
        local_dir: the mirror folder (``ledger-<rank>.jsonl``); created.
    Attributes:
        errors: host → the latest failed call's message (the follower then sees no new bytes: the stall rule
            decides, as for a missing local ledger).
    """

    def __init__(self, ranks: Mapping[int, Any], local_dir: Path) -> None:
        self.ranks = dict(ranks)
        self.dir = Path(local_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        self.state: dict[int, tuple[int, int]] = {k: (0, 0) for k in self.ranks}  # rank → (offset, inode) on its host
        self.errors: dict[str, str] = {}
        self.dead: dict[int, float] = {}  # rank → time.time() its pid was first seen gone on its host
        self.calls = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None

    @property
    def rank_keys(self) -> dict[int, int]:
        """rank → the key of its mirror file (the rank itself: ``ledger-<rank>.jsonl``), for the follower."""
        return {k: k for k in self.ranks}

    def fetch(self, deadline_s: float = 5.0) -> int:
        """One call per host (all at once): append what every rank's ledger gained. Returns the bytes copied."""
        from repro.hosts import in_parallel

        with self._lock:
            by_host: dict[str, list[int]] = {}
            for k, r in self.ranks.items():
                by_host.setdefault(r.host, []).append(k)

            def one(ks: list) -> Any:
                r0 = self.ranks[ks[0]]
                args = [f"{self.ranks[k].pid}:{self.state[k][0]}:{self.state[k][1]}" for k in ks]
                cmd = " ".join(shlex.quote(str(a)) for a in (r0.runner.host.python, "-", r0.injector_dir,
                                                              FETCH_MAX_BYTES, Layout.ledger_file("{pid}"),
                                                              Layout.ledger_file("{pid}", 1), *args))
                return lambda left: json.loads(r0.runner.run(cmd, input=_TAIL_PY.encode(), timeout_s=left).text)

            res = in_parallel({h: one(ks) for h, ks in by_host.items()}, deadline_s)
            self.calls += 1
            n = 0
            for h, (ok, got) in res.items():
                if not ok:
                    self.errors[h] = str(got)
                    continue
                self.errors.pop(h, None)
                for k in by_host[h]:
                    x = got.get(str(self.ranks[k].pid))
                    if not x:
                        continue
                    if x.get("alive") is False and k not in self.dead:
                        self.dead[k] = time.time()
                    data = base64.b64decode(x["data"])
                    if data:
                        with open(self.dir / Layout.ledger_file(k), "ab") as f:
                            f.write(data)
                        n += len(data)
                    self.state[k] = (int(x["off"]), int(x["ino"]))
            return n

    def start(self) -> None:
        """Follow in a thread until :meth:`stop` (a call per host every :data:`FETCH_EVERY_S` at most)."""
        if self._thread is not None:
            return

        def loop() -> None:
            while not self._stop.is_set():
                t0 = time.monotonic()
                try:
                    self.fetch()
                except Exception as e:  # noqa: BLE001 - a host that fails is reported, the run goes on
                    self.errors["*"] = f"{type(e).__name__}: {e}"
                self._stop.wait(max(0.0, FETCH_EVERY_S - (time.monotonic() - t0)))

        self._thread = threading.Thread(target=loop, name="host-ledger-mirror", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """End the thread (idempotent)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=10)
            self._thread = None


class HostsLedgerProofDetector(LedgerProofDetector):
    """The ledger proof (``repro.proof.LedgerProofDetector``) of a server spanning hosts, on a
    :class:`HostLedgerMirror`'s folder: ``ctx.rank_pids`` maps each rank to its mirror key, every rank counts as
    alive (a node's death ends the burst first: ``repro.multihost``), and the proof's stacks are taken on the
    ranks' own hosts (``repro.checker.check_stall`` on ``repro.hosts.HostRanks``).

    Args:
        ranks: rank → ``repro.hosts.RemoteRank``.
        fallback_signal: the injector's faulthandler signal (the capture's fallback).
    """

    def __init__(self, ranks: Mapping[int, Any] = None, fallback_signal: str = "SIGUSR2") -> None:
        super().__init__()
        self.remote_ranks = dict(ranks or {})
        self.fallback_signal = fallback_signal

    def start(self, ctx: Any) -> None:
        ranks, sig = self.remote_ranks, self.fallback_signal
        super().start(ctx)  # (re-initialises the base's fields)
        self.remote_ranks, self.fallback_signal = ranks, sig

    def _alive(self) -> set[int]:
        return set(self.rank_pids)

    def capture(self, ctx: Any) -> Any:
        from repro.checker import check_stall
        from repro.hosts import HostRanks

        where = HostRanks(self.remote_ranks, self.fallback_signal)
        return check_stall(where.rank_pids, ctx.run_dir.stacks_dir, list(ctx.expected_ranks), tag="-proof",
                           second_tag="-proofb", confirm_gap_s=1.0, timeout_s=10.0, where=where)


class _HostRankWatch:
    """``repro.checker.RankWatch`` for ranks on other hosts: a rank is gone when its host's ``/proc`` says so (the
    mirror's calls report it, no extra remote call); the reason is read from the server log on the dead rank's
    host (``<workdir>/server.log``, fetched once per death)."""

    def __init__(self, mirror: HostLedgerMirror) -> None:
        from repro.checker import RankWatch

        self.mirror = mirror
        self.procs = {k: r for k, r in mirror.ranks.items()}
        self.deaths: dict = {}
        self._texts: dict[str, str] = {}
        self._base = RankWatch({}, None)

    def log_text(self, host: Optional[str] = None) -> str:
        """The server log of ``host`` (default: of the hosts of the dead ranks; "" when none), as ``RankWatch.log_text``."""
        hosts = [host] if host else sorted({self.procs[k].host for k in self.deaths})
        out = []
        for h in hosts:
            r = next(r for r in self.procs.values() if r.host == h)
            try:
                raw = r.runner.get(str(Layout.SERVER_LOG.at(Path(r.injector_dir).parent)), timeout_s=10.0)
            except Exception:  # noqa: BLE001 - an unreachable host: no reason, the death still counts
                raw = None
            if raw is not None:
                self._texts[h] = raw[-256 * 1024:].decode("utf-8", errors="replace")
            out.append(self._texts.get(h, ""))
        return "\n".join(out)

    def poll(self) -> list:
        from repro.checker import RankDeath, death_reason

        gone = [k for k in sorted(self.procs) if k not in self.deaths and k in self.mirror.dead]
        new = []
        for k in gone:
            r = self.procs[k]
            why = death_reason(self.log_text(r.host), k, r.pid)
            new.append(RankDeath(k, r.pid, f"on host {r.host}: {why}", self.mirror.dead[k]))
        for d in new:
            self.deaths[d.rank] = d
        return new

    def refresh_reasons(self) -> None:
        from repro.checker import RankDeath, death_reason

        for k, d in list(self.deaths.items()):
            r = self.procs[k]
            self.deaths[k] = RankDeath(k, d.pid, f"on host {r.host}: {death_reason(self.log_text(r.host), k, r.pid)}",
                                       d.seen_t)

    def verdict_reason(self) -> str:
        """As ``repro.checker.RankWatch.verdict_reason``, the log tail from the dead ranks' hosts."""
        from repro.checker import LOG_TAIL_LINES

        ds = sorted(self.deaths.values(), key=lambda d: (d.seen_t, d.rank))
        alive = sorted(set(self.procs) - set(self.deaths))
        text = "; ".join(d.sentence() for d in ds)
        if alive:
            text += f"; rank(s) {', '.join(map(str, alive))} still running"
        tail = "\n".join(self.log_text().splitlines()[-LOG_TAIL_LINES:])
        return f"{text} during the burst (a crash, not a deadlock); server log tail:\n{tail}"


def hosts_rank_death_detector(mirror: HostLedgerMirror) -> Any:
    """``repro.checker.RankDeathDetector`` for ranks on other hosts: the same detector (its Detection, record,
    ``rank_deaths.json``, final word), watching the ranks through :class:`HostLedgerMirror`'s calls."""
    from repro.checker import RankDeathDetector

    class HostsRankDeathDetector(RankDeathDetector):
        def start(self, ctx: Any) -> None:
            self.watch = _HostRankWatch(mirror)

        def poll(self, ctx: Any) -> Any:
            if self.watch is not None and not [k for k in self.watch.procs if k in mirror.dead]:
                return None  # nothing gone: no sleep, no log read
            return super().poll(ctx)

    return HostsRankDeathDetector()


__all__ = ["HostLedgerMirror", "HostsLedgerProofDetector", "hosts_rank_death_detector", "FETCH_EVERY_S"]
