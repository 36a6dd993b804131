"""Issue 29 item 3: a site that cannot exist is refused before any server or evidence folder (repro/site_precheck.py).

The source check runs against real installations: this interpreter's stdlib, and the CPU testbed's sglang 0.5.23
(set up by scripts/cpu_testbed/setup.sh, as the fast stage's discover tests also need).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

from typer.testing import CliRunner

from repro import testbed
from repro.cli import app
from repro.site_precheck import missing_sites, site_absent

REPO = Path(__file__).resolve().parent.parent
SMOKE = REPO / "scenarios" / "sglang" / "smoke_extra_allreduce.toml"
PY = sys.executable


def _testbed_python() -> str:
    py = testbed.testbed_python()
    assert py is not None, "the CPU testbed is not set up: bash scripts/cpu_testbed/setup.sh"
    return str(py)


def test_stdlib_sites_absent_present_and_undecided():
    assert site_absent(PY, "json.decoder:JSONDecoder.decode") is None
    why = site_absent(PY, "json.decoder:JSONDecodr.decode")
    assert why and "JSONDecodr" in why and "JSONDecoder" in why  # the nearest name comes with it
    assert "does not exist" in (site_absent(PY, "json.decoderzz:JSONDecoder.decode") or "")
    assert "defines no 'decodezz'" in (site_absent(PY, "json.decoder:JSONDecoder.decodezz") or "")
    # inherited from a base this check cannot follow (a builtin): never refused, the launch-time check decides
    assert site_absent(PY, "collections:OrderedDict.nonexistent_but_maybe_inherited") is None


def test_an_injection_is_refused_only_when_every_alternative_is_absent():
    ok = missing_sites(PY, [("v", "a", ["json.decoder:JSONDecodr.decode", "json.decoder:JSONDecoder.decode"])])
    assert ok == []
    bad = missing_sites(PY, [("v", "a", ["json.decoder:JSONDecodr.decode", "json.decoderzz:X.y"])])
    assert len(bad) == 1 and bad[0].startswith("variants.v.injections.a.site:")


def test_every_shipped_sglang_scenario_passes_on_the_testbed():
    from repro.scenario import load_scenario

    py = _testbed_python()
    files = [f for f in sorted((REPO / "scenarios" / "sglang").glob("*.toml")) if "[[variants]]" in f.read_text()
             or "[variants." in f.read_text()]  # scenarios, not the discover rules / hunt catalogue beside them
    assert len(files) >= 5, files
    for f in files:
        sc = load_scenario(f)
        assert missing_sites(py, [(v.name, i.id, list(i.site)) for v in sc.variants for i in v.injections]) == [], f


def test_run_with_a_typo_in_a_site_refuses_before_launching(tmp_path):
    py = _testbed_python()
    scen = tmp_path / "s.toml"
    scen.write_text(SMOKE.read_text().replace("Scheduler.run_batch\"", "Scheduler.run_batchzz\"", 1))
    assert "run_batchzz" in scen.read_text()
    ev = tmp_path / "evidence"
    t0 = time.monotonic()
    r = CliRunner().invoke(app, ["run", str(scen), "--variant", "extra_collective", "--python", py,
                                 "--evidence-dir", str(ev)])
    assert r.exit_code == 2, r.output
    out = " ".join(r.output.split())
    assert "run_batchzz" in out and "Scheduler.run_batch" in out and "nothing was launched" in out, out
    assert not ev.exists() or not any(ev.rglob("verdict.json")), "an evidence folder was written for a refused run"
    assert time.monotonic() - t0 < 60  # not the ~70 s of a server start (the check itself takes about a second)
