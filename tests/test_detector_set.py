"""One detector set for every topology: a single server, a PD stack (each engine server scoped) and a server spanning
hosts get the same detectors — rank death, ledger proof, stall rule — in that polling order, each the same class
(or a subclass of it that reads the ranks where they run). Built on fake sessions: nothing is started."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

from repro import evidence as ev
from repro.checker import RankDeathDetector
from repro.detect import ScopedDetector
from repro.detectors import StallDetector, detector_set
from repro.proof import LedgerProofDetector

PLAN = {"ledger": {"enabled": True}, "faulthandler_signal": "SIGUSR2"}
ORDER = ["rank-death", "ledger-proof", "stall"]


def _base(d) -> type:
    return type(d.inner) if isinstance(d, ScopedDetector) else type(d)


def _kinds(dets) -> list:
    return [d.name for d in dets]


def test_single_server_pd_stack_and_hosts_get_the_same_detector_set(tmp_path: Path):
    from repro import pd
    from repro.host_ledgers import HostLedgerMirror
    from repro.multihost import HostsStallDetector, MultiHostSession

    single = detector_set(PLAN)
    assert _kinds(single) == ORDER
    assert [type(d) for d in single] == [RankDeathDetector, LedgerProofDetector, StallDetector]

    # a PD stack: prefill (TP2) + decode (TP1) + router; every engine server gets rank death and the proof, scoped
    S = pd.make_session_class()
    s = S.__new__(S)
    s.detectors = None

    def role(name, kind, tp):
        (tmp_path / "servers" / name).mkdir(parents=True)
        folder = ev.EvidenceDir.open(tmp_path / "servers" / name)
        return pd.RoleRun(SimpleNamespace(name=name, kind=kind), None, SimpleNamespace(tp_size=tp), folder,
                          PLAN if kind == "engine" else None)

    s.roles = [role("prefill", "engine", 2), role("decode", "engine", 1), role("router", "router", 1)]
    s.role_pids = {"prefill": {0: 11, 1: 12}, "decode": {0: 21}}
    got = s.make_detectors()
    assert sorted(set(_kinds(got)), key=ORDER.index) == ORDER and _kinds(got)[-1] == "stall"
    assert [(d.server, d.name) for d in got if isinstance(d, ScopedDetector)] == [
        ("prefill", "rank-death"), ("decode", "rank-death"), ("prefill", "ledger-proof"), ("decode", "ledger-proof")]
    assert {d.server: d.rank_pids for d in got if isinstance(d, ScopedDetector)} == s.role_pids
    assert [_base(d) for d in got[:4:2]] == [RankDeathDetector, LedgerProofDetector]

    # a server spanning two hosts: the same two, reading the hosts' /proc and ledgers, then the stall rule that
    # captures on the hosts (with the data-link checks)
    h = MultiHostSession.__new__(MultiHostSession)
    h.p, h.ranks = SimpleNamespace(plan=PLAN), {}
    hosts = h.make_detectors(HostLedgerMirror({}, tmp_path / "mirror"))
    assert _kinds(hosts) == ORDER
    assert isinstance(hosts[0], RankDeathDetector) and isinstance(hosts[1], LedgerProofDetector)
    assert isinstance(hosts[2], HostsStallDetector)

    # the same classes everywhere (the topology's own subclass where the ranks are read elsewhere)
    for kinds in (got, hosts):
        for d in kinds:
            if d.name != "stall":
                base = next(type(x) for x in single if x.name == d.name)
                assert issubclass(_base(d), base), (d.name, _base(d), base)
