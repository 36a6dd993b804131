"""Shard split of a trial plan: every trial in exactly one shard; merge of shards == unsharded plan; bad K/N."""
from types import SimpleNamespace

import pytest

from repro.shard import ShardError, parse_shard, shard_trials, trial_key


def _plan():
    out = []
    for p in ("a", "b", "c", "get_num_allocatable_reqs"):
        for pert in ("zero_once", "raise_once"):
            for rank in (0, 1):
                out.append(SimpleNamespace(n=len(out) + 1, row=SimpleNamespace(point=p),
                                           perturbation=SimpleNamespace(name=pert), rank=rank, workload=""))
    return out


@pytest.mark.parametrize("n", [1, 2, 3, 5])
def test_shards_partition_and_merge_equal_unsharded(n):
    plan = _plan()
    shards = [shard_trials(plan, k, n) for k in range(1, n + 1)]
    merged = sorted((t for s in shards for t in s), key=lambda t: t.n)
    assert [t.n for t in merged] == [t.n for t in plan]
    assert [trial_key(t) for t in merged] == [trial_key(t) for t in plan]
    assert [[trial_key(t) for t in s] for s in shards] == [[trial_key(t) for t in shard_trials(_plan(), k, n)] for k in range(1, n + 1)]


@pytest.mark.parametrize("bad", ["0/2", "3/2", "x/2", "1", "1/0", "1/2/3"])
def test_bad_shard_is_one_line_error(bad):
    with pytest.raises(ShardError) as e:
        parse_shard(bad)
    assert "\n" not in str(e.value) and "--shard" in str(e.value)


def test_parse_shard_ok():
    assert parse_shard("2/4") == (2, 4)


# ---------------------------------------------------------------- the hunt with --shard, on a stand-in runner
import json  # noqa: E402
from pathlib import Path  # noqa: E402

from repro import hunt as H  # noqa: E402
from repro.hunt import loop as HL  # noqa: E402
from repro.hunt.merge import MergeError, merge_shards  # noqa: E402
from test_hunt import FakeRunner, _lines, _opts  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(autouse=True)
def _no_settle(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(HL, "SETTLE_S", 0.0)


def _ids(results) -> list:
    return [(r.trial.n, r.trial.name, trial_key(r.trial)) for r in results]


def test_two_shards_merged_are_the_unsharded_plan(tmp_path: Path) -> None:
    full = H.hunt(_opts(tmp_path / "full"), runs=FakeRunner({}))
    assert len(full.results) == 8
    shards, runners = [], []
    for k in (1, 2):
        fr = FakeRunner({})
        runners.append(fr)
        shards.append(H.hunt(_opts(tmp_path / f"s{k}", shard=(k, 2)), runs=fr))
    # each shard ran only its own trials (the baseline first), together exactly the plan, none twice
    assert all(fr.driven[0] == "baseline" for fr in runners)
    assert sorted(_ids(shards[0].results) + _ids(shards[1].results)) == _ids(full.results)
    assert not {r.trial.n for r in shards[0].results} & {r.trial.n for r in shards[1].results}
    # the split was written before the baseline (the shard event precedes the baseline event)
    events = [x["event"] for x in _lines(shards[0].folder)]
    assert events.index("shard") < events.index("baseline")
    from typer.testing import CliRunner

    from repro.cli import app

    r = CliRunner().invoke(app, ["hunt-merge", str(shards[1].folder), str(shards[0].folder), "--out", str(tmp_path / "merged"), "--json"])
    assert r.exit_code == 0, r.output
    assert json.loads(r.stdout)["missing"] == []
    merged = tmp_path / "merged"
    trials = [x for x in _lines(merged) if x["event"] == "trial"]
    assert [(t["n"], t["trial"], (t["point"], t["perturbation"], t["rank"], t["workload"])) for t in trials] == _ids(full.results)
    md = (merged / "HUNT.md").read_text()
    assert "status**: complete; 8 trial(s) run of 8" in md and "merged 2 of 2 shard(s)" in md
    # a missing shard is named, not silently dropped; the same shard twice is an error
    part = merge_shards([shards[0].folder], tmp_path / "part")
    assert "MISSING shard(s) 2/2" in (part / "HUNT.md").read_text()
    with pytest.raises(MergeError, match="twice"):
        merge_shards([shards[0].folder, shards[0].folder], tmp_path / "dup")
    with pytest.raises(MergeError, match="not a shard"):
        merge_shards([full.folder], tmp_path / "nos")


def test_a_shard_with_no_trial_starts_no_server(tmp_path: Path) -> None:
    # 1 point x 2 perturbations x 2 ranks = 4 keys over 64 shards: most shards hold none
    from repro.shard import shard_plan_keys

    point = H.load_catalogue(H.catalogue_for("sglang")).point("get_num_allocatable_reqs")
    k = next(k for k in range(1, 65) if not shard_plan_keys([point], [0, 1], ("zero_once", "delay_once"), k, 64))
    fr = FakeRunner({})
    res = H.hunt(_opts(tmp_path, shard=(k, 64)), runs=fr)
    assert res.results == [] and fr.driven == [] and fr.sessions == []


@pytest.mark.parametrize("bad", ["0/2", "x/2", "2"])
def test_cli_bad_shard_is_exit_2_one_line(bad: str, tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from repro.cli import app

    r = CliRunner().invoke(app, ["hunt", str(REPO / "scenarios/sglang/hicache_prefetch_30760.toml"), "--shard", bad,
                                 "--evidence-dir", str(tmp_path)])
    assert r.exit_code == 2, r.output
    lines = [x for x in r.output.splitlines() if x.strip()]
    assert len(lines) == 1 and ("expected K/N" in lines[0] or "need 1 <= K <= N" in lines[0]), lines
    assert not any(tmp_path.iterdir())  # no folder, no server


def test_cli_hunt_merge_of_no_shard_is_exit_2(tmp_path: Path) -> None:
    from typer.testing import CliRunner

    from repro.cli import app

    r = CliRunner().invoke(app, ["hunt-merge", str(tmp_path)])
    assert r.exit_code == 2 and "hunt.jsonl" in r.output, r.output


def test_a_merged_row_keeps_its_server_nature_and_effect() -> None:
    """hunt-merge rebuilds each trial from its hunt.jsonl line: a PD row's server, a control row's nature and a
    natural row's effect must survive it (HUNT.md ranks by nature and prints the effect column)."""
    from repro.catalogue import Perturbation
    from repro.hunt.merge import _result, _row
    from repro.hunt.plan import Row, Trial
    from repro.hunt.results import TrialResult

    rows = [Row("pd_sender_poll", "m:poll_and_all_reduce", None, None, server=s) for s in ("prefill", "decode")]
    leak = Perturbation("control_leak_one_slot", {"kind": "state", "pool": "req_to_token_pool", "take": 1}, "", control=True)
    held = Perturbation("pending_transferring", {"kind": "pending", "polls": 5, "value": 3, "only_done": True, "done": 4}, "")
    res = [TrialResult(Trial(1, rows[1], held, 1), "ALL REQUESTS SUCCEEDED", "", effect="inputs: …", effect_status="input reconciled"),
           TrialResult(Trial(2, rows[0], leak, 0), "INCONCLUSIVE", "", effect="first divergent state", effect_status="diverged")]
    back_rows = [_row({**r.__dict__}) for r in rows]
    assert [r.key for r in back_rows] == [r.key for r in rows]
    for r in res:
        b = _result(r.to_json(), back_rows)
        assert (b.trial.row.server, b.nature, b.effect, b.effect_status) == (
            r.trial.row.server, r.nature, r.effect, r.effect_status)


def _corrupt(folder: Path, event: str, edit) -> None:
    """Rewrite the first ``event`` line of ``folder``'s hunt.jsonl with ``edit`` (dict -> JSON value)."""
    p = folder / "hunt.jsonl"
    lines = p.read_text().splitlines()
    i = next(i for i, x in enumerate(lines) if json.loads(x)["event"] == event)
    lines[i] = json.dumps(edit(json.loads(lines[i])))
    p.write_text("\n".join(lines) + "\n")


def _set(key, value):
    return lambda d: {**d, key: value}


def _drop(key):
    return lambda d: {k: v for k, v in d.items() if k != key}


@pytest.mark.parametrize("event,edit,says", [
    ("rows", lambda d: None, "is null, not a JSON object"),
    ("rows", lambda d: [1, 2], "is a list ([1, 2]), not a JSON object"),
    ("shard", _set("k", None), "('shard' event): field 'k' is null; expected an integer"),
    ("shard", _set("k", "1"), "field 'k' is a string"),
    ("shard", _set("k", True), "field 'k' is true/false"),
    ("shard", _set("k", 5), "shard 5/2 is not one of 1..N"),
    ("shard", _set("k", -1), "shard -1/2 is not one of 1..N"),
    ("shard", _set("header", [1]), "field 'header' is a list"),
    ("plan", _set("trials", None), "('plan' event): field 'trials' is null; expected a list"),
    ("plan", _set("trials", "x"), "field 'trials' is a string"),
    ("plan", _set("trials", [[1]]), "field 'trials' holds [1]; expected [number, name] pairs"),
    ("trial", _set("n", None), "('trial' event): field 'n' is null; expected an integer"),
    ("trial", _set("n", "x"), "field 'n' is a string"),
    ("trial", _drop("n"), "field 'n' is missing"),
    ("trial", _set("diagnosis", {"family": "no such family"}), "('trial' event): ValueError"),
])
def test_a_corrupt_shard_line_is_refused_exit_2_naming_file_line_and_field(tmp_path: Path, event, edit, says) -> None:
    """A shard's hunt.jsonl edited by hand or damaged on disk: one line naming the file, the line and the field,
    exit 2, no traceback; nothing merged (a shard claiming K outside 1..N was merged as 5/2 before)."""
    from typer.testing import CliRunner

    from repro.cli import app

    shards = [H.hunt(_opts(tmp_path / f"s{k}", shard=(k, 2)), runs=FakeRunner({})).folder for k in (1, 2)]
    bad = next(s for s in shards if any(x["event"] == event for x in _lines(s)))
    _corrupt(bad, event, edit)
    r = CliRunner().invoke(app, ["hunt-merge", str(shards[0]), str(shards[1]), "--out", str(tmp_path / "m")])
    assert r.exit_code == 2, r.output
    text = " ".join(r.output.split())
    assert f"{bad / 'hunt.jsonl'}: line " in text and says in text and "Traceback" not in text, text
    assert not (tmp_path / "m" / "HUNT.md").exists()


def test_a_shard_torn_mid_write_still_merges_as_running(tmp_path: Path) -> None:
    """A shard killed mid-write leaves a torn last line: that line is skipped and the shard reads as running."""
    shards = [H.hunt(_opts(tmp_path / f"s{k}", shard=(k, 2)), runs=FakeRunner({})).folder for k in (1, 2)]
    p = shards[1] / "hunt.jsonl"
    text = p.read_text()
    p.write_text(text[:text.rindex('{"event": "end"') + 20])
    md = (merge_shards(shards, tmp_path / "m") / "HUNT.md").read_text()
    assert "2/2 running (no end line)" in md
