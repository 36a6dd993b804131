"""`repro hunt` on a multi-server stack (PD: prefill + decode + router): the baseline's call places are read from
every engine server's own injector folder (``servers/<role>/injector``) and each row keeps its server, so a trial
fires on one rank of one server (its injection names ``server``); a point's ``servers`` keeps only those servers'
rows; a server row is tried only on the ranks that server showed (its TP size may differ from the base's); the
trial's fire counts and effect come from its server's records, not the first server's."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

from repro import evidence as ev
from repro.catalogue import load_catalogue
from repro.hunt.plan import Row, plan_trials, read_seen, rows_from_seen, server_injector_dirs

REPO = Path(__file__).resolve().parent.parent
NATURAL = REPO / "scenarios/sglang/natural_nemeses.toml"
SENDER_POLL = "sglang.srt.disaggregation.common.conn:CommonKVSender.poll"


def _seen(folder: Path, pid: int, rank: int, probe: str, caller: str, stack: list[str]) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    line = {"event": "seen", "id": probe, "rank": rank, "pid": pid, "caller": caller, "stack": stack, "loops": []}
    with (folder / ev.Layout.fire_log(pid)).open("a") as f:
        f.write(json.dumps(line) + "\n")


def _pd_baseline(run: Path) -> None:
    """A PD baseline folder: the prefill server's ranks 0, 1 and the decode server's rank 0 (TP=1) each saw the
    sender poll, the receiver poll and the prefill tick (a decode server never calls the prefill tick: written here
    to show the point's ``servers`` drops it)."""
    chain = ["sglang.srt.disaggregation.utils:_poll_with_failure_injection",
             "sglang.srt.disaggregation.utils:poll_and_all_reduce"]
    for role, ranks in (("prefill", (0, 1)), ("decode", (0,))):
        inj = ev.Layout.server_dir(run, role) / ev.Layout.INJECTOR.name
        for rank in ranks:
            pid = 100 * (1 + (role == "decode")) + rank
            for probe in ("probe-pd_sender_poll", "probe-pd_receiver_poll", "probe-pd_prefill_tick"):
                _seen(inj, pid, rank, probe, chain[0], chain)
    # the run folder's own injector/ holds a copy of one server's records (repro.pd): never read twice
    _seen(run / ev.Layout.INJECTOR.name, 101, 1, "probe-pd_sender_poll", chain[0], chain)


def _probes(cat) -> dict[str, str]:
    return {f"probe-{p.name}": p.name for p in cat.points}


def test_a_pd_baseline_gives_rows_per_server_and_points_keep_their_servers(tmp_path: Path) -> None:
    cat = load_catalogue(NATURAL)
    run = tmp_path / "baseline"
    _pd_baseline(run)
    servers = server_injector_dirs(run)
    assert sorted(servers) == ["decode", "prefill"]
    seen = read_seen(run / ev.Layout.INJECTOR.name, servers)
    assert {e["server"] for e in seen} == {"prefill", "decode"} and len(seen) == 9  # the run folder's copy not read
    rows = rows_from_seen(cat, seen, _probes(cat))
    got = sorted((r.point, r.server, r.ranks) for r in rows)
    assert got == [("pd_prefill_tick", "prefill", (0, 1)),       # decode's sighting dropped: servers = ["prefill"]
                   ("pd_receiver_poll", "decode", (0,)),           # prefill's dropped: servers = ["decode"]
                   ("pd_sender_poll", "prefill", (0, 1))]
    assert all(r.where.startswith(f"{r.server}: ") for r in rows)


def test_a_server_row_fires_on_one_rank_of_that_server_only(tmp_path: Path) -> None:
    cat = load_catalogue(NATURAL)
    run = tmp_path / "baseline"
    _pd_baseline(run)
    rows = rows_from_seen(cat, read_seen(run / ev.Layout.INJECTOR.name, server_injector_dirs(run)), _probes(cat))
    trials = plan_trials(cat, rows, [0, 1])
    names = [t.name for t in trials]
    # decode has TP=1 here: its row gets rank 0 only; the prefill rows both ranks
    assert [n for n in names if "pd_receiver_poll" in n] == ["t003-pd_receiver_poll-pending_transferring-decode-r0"]
    assert sum("pd_sender_poll" in n for n in names) == 2
    recv = next(t for t in trials if t.row.point == "pd_receiver_poll")
    inj = recv.injection(cat.point("pd_receiver_poll").sites)
    assert inj["server"] == "decode" and inj["gate"]["ranks"] == [0]
    assert "server" not in trials[0].injection(["m:f"]) or trials[0].row.server  # only a server row names one


def test_a_single_server_row_has_no_server_and_every_rank() -> None:
    cat = load_catalogue(NATURAL)
    row = Row("pd_sender_poll", "m:Caller.f", None, None, ranks=(0,))
    trials = plan_trials(cat, [row], [0, 1])
    assert [t.rank for t in trials] == [0, 1]
    assert "server" not in trials[0].injection([SENDER_POLL]) and trials[0].name.endswith("-r0")


def test_a_pd_trials_counts_and_effect_come_from_its_own_server(tmp_path: Path) -> None:
    """The PD session's run folder reports one server's records (the first engine server's unless another
    diverged): a decode trial read from there counted the prefill server's ranks (fired 0 on its target)."""
    from repro.hunt import loop
    from repro.hunt.plan import Trial
    from repro.verdict import InjectionCheck

    cat = load_catalogue(NATURAL)
    row = Row("pd_receiver_poll", "m:Caller.f", None, None, ranks=(0, 1), server="decode")
    t = Trial(1, row, cat.perturbations["pending_transferring"], 1)
    asked: list = []

    class Runs:
        def injection_checks(self, records, variant, rank_pids):
            asked.append((records, variant, rank_pids))
            fired = {0: 0, 1: 3} if rank_pids == {0: 20, 1: 21} else {0: 0, 1: 0}
            return [0, 1], [0, 1], [InjectionCheck(t.name, "s", {0: 5, 1: 5}, fired, fired)], None

    (tmp_path / "session").mkdir()
    session_folder = ev.EvidenceDir.open(tmp_path / "session")
    p = SimpleNamespace(evidence=session_folder)
    outcome = SimpleNamespace(
        verdict=SimpleNamespace(verdict="ALL REQUESTS SUCCEEDED", reason="ok", notes=()), timings={"burst_s": 1.0},
        analysis=None, injector="prefill-records",
        pd={"roles": {"prefill": {"injector": "prefill-records", "variant": "v-prefill", "pids": {0: 10, 1: 11}},
                      "decode": {"injector": "decode-records", "variant": "v-decode", "pids": {0: 20, 1: 21}}}})
    base = SimpleNamespace(server=SimpleNamespace(tp_size=2))
    tr = loop._trial_result(Runs(), p, base, cat, t, "v-all", outcome, tmp_path / "run", {0: 10, 1: 11},
                            tmp_path, SimpleNamespace())
    assert asked == [("decode-records", "v-decode", {0: 20, 1: 21})]
    assert tr.fired == {0: 0, 1: 3} and tr.fired_on_target == 3


def test_generated_hunt_scenarios_keep_a_pd_base_stack_and_the_injections_server(tmp_path: Path) -> None:
    """Measured: the hunt's baseline.toml / trials.toml of natural_hunt_pd.toml lost `topology = "pd"` and the
    `[server.roles.decode]` table, so the whole "PD" hunt ran on one plain TP=2 server (every PD row not reached)."""
    from repro.scenario import load_scenario
    from repro.scenario_toml import scenario_toml

    base = load_scenario(REPO / "scenarios/sglang/natural_hunt_pd.toml")
    text = scenario_toml(base, base.name, "d", [("v", "success", "d", [
        {"id": "t1", "site": [SENDER_POLL], "action": {"kind": "none"}, "server": "prefill", "gate": {"ranks": [1]}}])])
    f = tmp_path / "s.toml"
    f.write_text(text)
    s = load_scenario(f)
    assert s.server.topology == "pd" and s.server.roles["decode"].tp_size == 2
    assert s.variants[0].injections[0].server == "prefill"
