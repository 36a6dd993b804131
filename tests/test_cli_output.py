"""Output that survives a log, and a JSON form for every verb that prints a result (no sglang; small processes).

Without a terminal (a pipe, a file, a CI log) rich used to lay tables out for 80 columns and wrap inside
identifiers; the CLI's consoles are as wide as their content there (``COLUMNS`` still wins). `repro cleanup
--json` prints one object per run folder; `repro demo --json` / `repro serve --json` are covered end to end in
tests/test_package.py (demo from the installed wheel) and by their option parsing here. Scenario arguments accept
a bundled name from any folder.
"""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from rich.table import Table
from typer.testing import CliRunner

from repro import cli, resources
from repro.cli import app
from repro.procs import launch_mark, proc_info, save_procs

from repro.procs import LAUNCH_TOKEN_ENV  # noqa: E402

# the launch token a tree repro.launcher started carries (repro.cleanup signals only processes that have it)
TOKEN = "test-launch-token"
TOKEN_ENV = {**os.environ, LAUNCH_TOKEN_ENV: TOKEN}

runner = CliRunner()
LONG = "sglang.srt.mem_cache.unified_radix_cache:UnifiedRadixCache.check_prefetch_progress"


def _table() -> Table:
    t = Table(title="sites")
    for col in ("variant", "injection", "site alternative", "status", "nearest names / detail"):
        t.add_column(col, overflow="fold")
    t.add_row("extra_collective", "extra_allreduce_in_prefetch_check", LONG, "resolved (used)",
              ", ".join([LONG.replace("unified", f"other{k}") for k in range(4)]))
    return t


def test_without_a_terminal_a_table_row_is_one_line_with_every_identifier_whole(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    buf = io.StringIO()  # not a tty, as a pipe into `cat` or a CI log
    monkeypatch.setattr(sys, "stdout", buf)
    c = cli._make_console(stderr=False)
    assert not c.is_terminal and c.width == cli.NO_TERMINAL_WIDTH
    c.print(_table())
    lines = buf.getvalue().splitlines()
    row = [ln for ln in lines if "extra_allreduce_in_prefetch_check" in ln]
    assert len(row) == 1 and LONG in row[0] and "other3" in row[0], buf.getvalue()
    assert max(len(ln) for ln in lines) < 1000  # as wide as the content, not the console


def test_without_a_terminal_columns_still_sets_the_width(monkeypatch):
    monkeypatch.setenv("COLUMNS", "60")
    monkeypatch.setattr(sys, "stdout", io.StringIO())
    assert cli._make_console(stderr=False).width == 60


def test_a_rule_without_a_terminal_is_one_short_line(monkeypatch):
    monkeypatch.delenv("COLUMNS", raising=False)
    buf = io.StringIO()
    monkeypatch.setattr(sys, "stdout", buf)
    cli._rule(cli._make_console(stderr=False), "demo summary")
    assert buf.getvalue().strip() == "──── demo summary ────"


@pytest.fixture
def sleeper():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"], start_new_session=True, env=TOKEN_ENV)
    try:
        yield p
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
        p.wait(10)


def test_cleanup_json_reports_each_run_folder(tmp_path: Path, sleeper):
    run_dir = tmp_path / "evidence" / "smoke" / "20261201T000001Z-extra"
    run_dir.mkdir(parents=True)
    info = proc_info(sleeper.pid)
    save_procs(run_dir / "processes.json", [info], launch=launch_mark(info, tokens=[TOKEN]))
    (run_dir / "run.json").write_text(json.dumps({"status": "running", "pid": 999999999}))
    r = runner.invoke(app, ["cleanup", str(tmp_path / "evidence"), "--json"])
    assert r.exit_code == 0, r.output
    data = json.loads(r.stdout)
    assert data["exit_code"] == 0 and len(data["results"]) == 1, data
    res = data["results"][0]
    assert res["folder"] == str(run_dir) and res["stopped"] == [sleeper.pid] and not res["refused"], res
    assert sleeper.wait(10) is not None
    # the folder names no engine (no env.json, no scenario.toml): cleanup says what it assumed
    assert res["engine"] == "any of: sglang, vllm" and res["engine_from"].startswith("assumed (no env.json"), res


def test_cleanup_says_the_run_folders_engine(tmp_path: Path):
    from repro.cleanup import run_engine

    (tmp_path / "scenario.toml").write_text('name = "s"\n[server]\nadapter = "vllm"\n')
    assert run_engine(tmp_path) == ("vllm", "scenario.toml")
    (tmp_path / "env.json").write_text(json.dumps({"engine": "sglang", "engine_version": "0.5.23"}))
    assert run_engine(tmp_path) == ("sglang", "env.json")


@pytest.mark.parametrize("verb", ["run", "demo", "serve", "compare", "sites", "analyze", "hunt", "cleanup", "arm", "disarm"])
def test_every_verb_that_prints_a_result_has_json(verb):
    r = runner.invoke(app, [verb, "--help"], env={"COLUMNS": "200"})
    assert r.exit_code == 0 and "--json" in r.output, r.output


def test_a_bundled_scenario_is_found_by_name_from_any_folder(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = resources.find_scenario("smoke_extra_allreduce")
    assert p.is_file() and p == resources.scenarios_dir() / "sglang" / "smoke_extra_allreduce.toml"
    assert resources.find_scenario("scenarios/sglang/hicache_prefetch_30760.toml").is_file()
    assert resources.find_data_file("scenarios/sglang/patches/sglang-0.5.23-30760-bulk-prefetch.patch").is_file()
    assert resources.find_scenario("no_such_scenario") == Path("no_such_scenario")
    assert "hunt_catalogue" not in resources.scenario_names() and "smoke_extra_allreduce" in resources.scenario_names()


def test_an_unknown_scenario_name_is_exit_2_naming_the_bundled_ones(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    r = runner.invoke(app, ["sites", "no_such_scenario"])
    assert r.exit_code == 2, r.output
    assert "no_such_scenario: scenario file not found" in r.output and "smoke_extra_allreduce" in r.output
