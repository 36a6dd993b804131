"""The topology seam (issue 28): the run folder is written by the session that drove it (``repro.runner.RunEvidence``),
never by a switch on the topology's type, and a watched hang is captured and judged by one stall check over the
topology's TP groups (``repro.checker.check_groups`` on ``Discovery.stall_groups``). Built on fake sessions and
discoveries: nothing is started, nothing is captured."""

from __future__ import annotations

from pathlib import Path

from repro import pd, runner
from repro.checker import LocalRanks
from repro.multihost import MultiHostSession
from repro.hosts import HostRanks
from repro.verdict import INCONCLUSIVE, Verdict
from repro.watch import Discovery


def test_finish_evidence_asks_the_topology_that_drove_the_run_to_write_its_folder(tmp_path: Path):
    calls = []

    class Topology(runner.RunEvidence):
        def write_evidence(self, p, opts, variant, evd, outcome, rank_pids, interrupted):
            calls.append((p, variant, evd, rank_pids, interrupted))

    out = runner.Outcome(Verdict(INCONCLUSIVE, "x"), topology=Topology())
    runner.finish_evidence("P", "O", "V", "E", out, {0: 1}, False)
    assert calls == [("P", "V", "E", {0: 1}, False)]
    # every session is a topology that writes its folder: one server, a PD stack, a server spanning hosts
    assert issubclass(runner.Session, runner.RunEvidence) and issubclass(MultiHostSession, runner.RunEvidence)
    assert issubclass(pd.make_session_class(), runner.RunEvidence)
    assert runner.SINGLE_SERVER.command_prefix() == "repro run"
    assert MultiHostSession.command_prefix(None) == "python -m repro.remote_run"


def test_a_watched_hang_is_judged_by_groups_whatever_the_topology(tmp_path: Path):
    stacks = tmp_path / "stacks"
    single = Discovery({0: 11, 1: 12}, "match").stall_groups(tmp_path, stacks)
    assert [(g.name, type(g.where), g.stacks_dir, list(g.expected_ranks)) for g in single] == [
        (None, LocalRanks, stacks, [0, 1])]
    assert single[0].where.rank_pids == {0: 11, 1: 12}

    stack = Discovery({0: 11}, "router-workers", servers={"prefill": {0: 11, 1: 12}, "decode": {0: 21}})
    groups = stack.stall_groups(tmp_path, stacks)
    assert [(g.name, g.stacks_dir, list(g.expected_ranks)) for g in groups] == [
        ("prefill", tmp_path / "servers" / "prefill" / "stacks", [0, 1]),
        ("decode", tmp_path / "servers" / "decode" / "stacks", [0])]
    assert [g.where.rank_pids for g in groups] == [{0: 11, 1: 12}, {0: 21}]

    where = HostRanks({})
    hosts = Discovery({0: 5, 1: 5}, "hosts", where=where).stall_groups(tmp_path, stacks)  # pids repeat across hosts
    assert [(g.name, g.where, g.stacks_dir) for g in hosts] == [(None, where, stacks)]
