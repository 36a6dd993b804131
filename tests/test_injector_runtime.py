"""The injector in real subprocesses: inert without a plan, entry files (venv, shadowed sitecustomize), lazy
patching, arming / disarming / re-arming a running process, module:function sites with aliases, records."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from repro.injection_records import read_injector_dir

REPO = Path(__file__).resolve().parent.parent
INJECTORS = REPO / "injectors"
WAIT_S = 60.0  # generous bound for a subprocess to reach a state (not a speed assertion)

TARGET_MODULE = """
import time

class Worker:
    def __init__(self):
        self.calls = 0

    def step(self, i):
        self.calls += 1
        return i

def tick(w, i):
    return w.step(i)

def loop_forever(out_path):
    w = Worker()
    i = 0
    with open(out_path, "a") as out:
        while True:
            out.write(f"{i} {tick(w, i)}\\n")
            out.flush()
            i += 1
            time.sleep(0.01)

def now():
    return "real"
"""


def _plan(tmp: Path, injections: list[dict], **extra) -> Path:
    plan = {
        "version": 1,
        "scenario": "t",
        "variant": "v",
        "out_dir": str(tmp / "out"),
        "arm_file": str(tmp / "arm"),
        "arm_poll_s": 0.1,
        "injections": injections,
        "faulthandler_signal": "SIGUSR2",
    }
    plan.update(extra)
    p = tmp / "plan.json"
    p.write_text(json.dumps(plan))
    return p


def _inj(iid: str, site, action: dict, **gate) -> dict:
    g = {"called_from": [], "not_called_from": [], "max_depth": 16, "inside_loop": None, "ranks": [], "rank_group": None,
         "occurrence": {"mode": "every", "nth": 1, "max_fires": 0}}
    g.update(gate)
    sites = [site] if isinstance(site, str) else list(site)
    return {"id": iid, "site": {"alternatives": sites, "aliases": gate.pop("aliases", []) if "aliases" in gate else []},
            "gate": g, "action": action}


def _env(tmp: Path, plan: Path | None, extra_path: list[Path] = ()) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("REPRO_PLAN", "PYTHONPATH")}
    env["PYTHONPATH"] = os.pathsep.join([str(INJECTORS), *map(str, extra_path), str(tmp)])
    if plan is not None:
        env["REPRO_PLAN"] = str(plan)
    return env


def _run(python: str, code: str, env: dict, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([python, "-c", textwrap.dedent(code)], env=env, cwd=cwd, capture_output=True, text=True, timeout=120)


def _wait(pred, what: str, timeout_s: float = WAIT_S):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


@pytest.fixture()
def target(tmp_path: Path) -> Path:
    (tmp_path / "tmod.py").write_text(TARGET_MODULE)
    return tmp_path


def test_inert_without_plan_env(target: Path):
    out = target / "out"
    out.mkdir()
    code = """
        import sys, json, tmod
        finders = [type(f).__name__ for f in sys.meta_path]
        print(json.dumps({"finders": finders, "loaded": "repro_injector" in sys.modules,
                          "site": sys.modules["sitecustomize"].__file__,
                          "patched": getattr(tmod.Worker.step, "__repro_injection__", None),
                          "threads": __import__("threading").active_count()}))
    """
    r = _run(sys.executable, code, _env(target, None), target)
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["site"].startswith(str(INJECTORS))  # our entry file ran ...
    assert not got["loaded"] and "_HookFinder" not in got["finders"]  # ... and did nothing else
    assert got["patched"] is None and got["threads"] == 1
    assert r.stderr == ""
    assert list(out.iterdir()) == []


def test_patches_lazily_and_records_loaded_marker(target: Path):
    plan = _plan(target, [_inj("ret", ["nosuch.module:X.y", "tmod:Worker.step"], {"kind": "return_value", "value": 42, "call_original": True},
                               called_from=["tmod:tick"])])
    (target / "arm").write_text("ret\n")
    code = """
        import sys, time
        before = "tmod" in sys.modules
        import tmod
        w = tmod.Worker()
        print(before, tmod.tick(w, 1), w.step(2), w.calls)
        time.sleep(0.5)
    """
    r = _run(sys.executable, code, _env(target, plan), target)
    assert r.returncode == 0, r.stderr
    # module imported after activation, patched at import; gate matches via tick only; original still called
    assert r.stdout.split() == ["False", "42", "2", "2"]
    rep = read_injector_dir(target / "out")
    (m,) = rep.markers
    assert m.sites["ret"].patched and m.sites["ret"].resolved == "tmod:Worker.step"
    assert m.python == sys.version.split()[0]
    (lg,) = rep.logs
    assert lg.arm_seq == 1 and lg.armed_ids == ("ret",)
    c = lg.counts["ret"]
    assert (c.entered, c.matched, c.fired) == (2, 1, 1)
    (f,) = rep.fires("ret")
    assert f.caller == "tmod:tick" and f.completed is True


def test_create_time_matches_psutil(target: Path):
    plan = _plan(target, [])
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], env=_env(target, plan), cwd=target)
    try:
        marker = _wait(lambda: list((target / "out").glob(f"loaded-{p.pid}.json")), "loaded marker")[0]
        d = json.loads(marker.read_text())
        assert abs(d["create_time"] - psutil.Process(p.pid).create_time()) < 0.05
        assert d["proctitle"].startswith(sys.executable)
    finally:
        p.kill()
        p.wait()


def test_faulthandler_signal_dumps_all_threads(target: Path):
    plan = _plan(target, [])
    p = subprocess.Popen([sys.executable, "-c", "import time\ndef parked():\n    time.sleep(60)\nparked()"],
                         env=_env(target, plan), cwd=target)
    try:
        _wait(lambda: list((target / "out").glob(f"loaded-{p.pid}.json")), "loaded marker")
        dump = target / "out" / f"faulthandler-{p.pid}.txt"

        def dumped() -> str:
            os.kill(p.pid, signal.SIGUSR2)  # again until the program has reached parked() (start-up may be slow)
            time.sleep(0.2)
            return dump.read_text() if dump.exists() and "parked" in dump.read_text() else ""

        text = _wait(dumped, "faulthandler dump")
        assert "Thread" in text and "parked" in text
        assert p.poll() is None  # not chained to SIG_DFL: the process lives on
    finally:
        p.kill()
        p.wait()


def test_arm_disarm_rearm_a_running_process(target: Path):
    plan = _plan(target, [
        _inj("ret7", "tmod:Worker.step", {"kind": "return_value", "value": 7, "call_original": True}, called_from=["tmod:tick"]),
        _inj("skip", "tmod:Worker.step", {"kind": "skip", "value": -1}, called_from=["tmod:tick"],
             occurrence={"mode": "nth", "nth": 3, "max_fires": 0}),
    ])
    # two injections on the same method: the second one's alternative resolves to the already-wrapped attribute
    results = target / "results.txt"
    p = subprocess.Popen([sys.executable, "-c", f"import tmod; tmod.loop_forever({str(results)!r})"],
                         env=_env(target, plan), cwd=target, stderr=subprocess.PIPE, text=True)
    arm = target / "arm"

    def values() -> list[tuple[int, int]]:
        if not results.exists():
            return []
        rows = [ln.split() for ln in results.read_text().splitlines()]
        return [(int(a), int(b)) for a, b in rows if a and b]

    try:
        _wait(lambda: len(values()) > 20, "unarmed progress")
        assert all(i == v for i, v in values())  # never fires before arming
        arm.write_text("ret7\n")
        _wait(lambda: any(v == 7 and i != 7 for i, v in values()), "armed ret7 to take effect")
        arm.write_text("")  # disarm
        _wait(lambda: read_injector_dir(target / "out").logs and read_injector_dir(target / "out").logs[0].disarmed, "disarmed event")
        n = len(values())
        _wait(lambda: len(values()) > n + 20, "progress after disarm")
        assert all(i == v for i, v in values()[n + 5:])  # disarmed: original results again
        tmp = target / "arm.tmp"
        tmp.write_text("skip\n")
        os.replace(tmp, arm)  # re-arm with the other injection (atomic write, as the launcher does)
        _wait(lambda: any(v == -1 for _, v in values()), "re-armed skip to fire")
        _wait(lambda: len(values()) > n + 60, "progress after skip")
        rep = read_injector_dir(target / "out")
        (lg,) = rep.logs
        assert lg.arm_seq == 2 and lg.armed_ids == ("skip",)
        skipped = [i for i, v in values() if v == -1]
        assert len(skipped) == 1  # nth=3 counted from the re-arm: exactly one fire
        c = lg.counts["skip"]
        assert c.fired == 1 and c.matched >= 3 and lg.counts["ret7"].fired == 0
    finally:
        p.kill()
        _, err = p.communicate()
    assert "Traceback" not in err, err


def test_module_function_site_and_alias(target: Path):
    (target / "user.py").write_text("from tmod import now\n\ndef call():\n    return now()\n")
    inj = _inj("fn", "tmod:now", {"kind": "return_value", "value": "fake", "call_original": False})
    inj["site"]["aliases"] = ["user:now"]
    plan = _plan(target, [inj])
    (target / "arm").write_text("fn\n")
    r = _run(sys.executable, "import tmod, user\nprint(tmod.now(), user.call())\n", _env(target, plan), target)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["fake", "fake"]


def test_bad_plan_is_one_stderr_line_and_the_program_runs(target: Path):
    bad = target / "plan.json"
    bad.write_text(json.dumps({"version": 99}))
    r = _run(sys.executable, "print('alive')", _env(target, bad), target)
    assert r.returncode == 0 and r.stdout.strip() == "alive"
    assert "plan version 99 not supported" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_unknown_id_in_arm_file_is_an_error_record(target: Path):
    plan = _plan(target, [_inj("a", "tmod:Worker.step", {"kind": "none"})])
    (target / "arm").write_text("nope\n")
    r = _run(sys.executable, "import time; time.sleep(0.3)", _env(target, plan), target)
    assert r.returncode == 0
    assert "unknown injection id(s) ['nope']" in (target / "out" / "errors.log").read_text()
    assert "unknown injection id" in r.stderr


def test_sitecustomize_in_venv_without_user_site_runs_shadowed_one(tmp_path: Path, target: Path):
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    py = str(venv / "bin" / "python")
    shadow = tmp_path / "distro"
    shadow.mkdir()
    (shadow / "sitecustomize.py").write_text("import builtins\nbuiltins.SHADOWED_SITECUSTOMIZE_RAN = True\n")
    plan = _plan(target, [_inj("ret", "tmod:Worker.step", {"kind": "return_value", "value": 5, "call_original": True})])
    (target / "arm").write_text("ret\n")
    code = """
        import site, sys, builtins, tmod
        print(site.ENABLE_USER_SITE, getattr(builtins, "SHADOWED_SITECUSTOMIZE_RAN", False), tmod.Worker().step(1))
    """
    r = _run(py, code, _env(target, plan, [shadow]), target)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["False", "True", "5"]  # user site off in a venv; both sitecustomizes ran
    assert list((target / "out").glob("loaded-*.json"))


def test_calls_between_arm_write_and_poll_count_as_entered(tmp_path: Path):
    # Ranks notice the arm file up to arm_poll_s apart; a rank that passes the site after the write but before its
    # poll must still show the site as entered (not matched, not fired) for this arming.
    sys.path.insert(0, str(INJECTORS))
    from repro_injector._runtime import Runtime

    plan = json.loads(_plan(tmp_path, [_inj("a", "tmod:Worker.step", {"kind": "skip"})]).read_text())
    (tmp_path / "out").mkdir()
    rt = Runtime(plan, str(tmp_path / "plan.json"))
    site = rt.sites[0]
    site.recent.append(time.time() - 60)  # long before the arm file existed: not counted
    (tmp_path / "arm").write_text("a\n")
    written = (tmp_path / "arm").stat().st_mtime
    site.recent.extend([written + 0.001, written + 0.002])
    rt.poll_arm(force=True)
    c = site.counts
    assert (c.entered, c.entered_before_poll, c.matched, c.fired) == (2, 2, 0, 0)
    rep = read_injector_dir(tmp_path / "out")
    (lg,) = rep.logs
    assert lg.counts["a"].entered == 2 and lg.counts["a"].entered_before_poll == 2


def test_delay_runs_the_original_after_sleeping_and_max_fires_caps(target: Path):
    plan = _plan(target, [_inj("slow", "tmod:Worker.step", {"kind": "delay", "delay_s": 0.3},
                               occurrence={"mode": "every", "nth": 1, "max_fires": 2})])
    (target / "arm").write_text("slow\n")
    r = _run(sys.executable, "import tmod\nw = tmod.Worker()\nprint([w.step(i) for i in range(4)], w.calls)\n",
             _env(target, plan), target)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("]")[0] == "[0, 1, 2, 3" and r.stdout.split()[-1] == "4"
    rep = read_injector_dir(target / "out")
    (lg,) = rep.logs
    c = lg.counts["slow"]
    assert (c.entered, c.matched, c.fired) == (4, 4, 2)  # max_fires caps the fires, not the matches
    assert len(rep.fires("slow")) == 2


def test_wait_armed_returns_once_every_process_has_read_the_new_arm_file(target: Path):
    from repro.injection_records import read_injector_dir as read_dir
    from repro.runner import fire_log_offsets, wait_armed, write_arm_file

    plan = _plan(target, [_inj("ret7", "tmod:Worker.step", {"kind": "return_value", "value": 7, "call_original": True})],
                 arm_poll_s=0.5)  # slow polling: the two processes notice the arm file at different moments
    procs = [subprocess.Popen([sys.executable, "-c", f"import tmod; tmod.loop_forever({str(target / f'r{i}.txt')!r})"],
                              env=_env(target, plan), cwd=target, stderr=subprocess.PIPE, text=True) for i in range(2)]
    try:
        out = target / "out"
        _wait(lambda: all((target / f"r{i}.txt").exists() for i in range(2)), "both processes running")
        pids = [p.pid for p in procs]
        offsets = fire_log_offsets(out, pids)
        write_arm_file(target / "arm", ["ret7"])
        t0 = time.time()
        assert wait_armed(out, offsets, target / "arm", timeout_s=20) == []
        acked = time.time()
        logs = {lg.pid: lg for lg in read_dir(out).logs}
        assert set(logs) == set(pids) and all(lg.armed_ids == ("ret7",) for lg in logs.values())
        armed_at = [e["time"] for pid in pids for e in map(json.loads, (out / f"fires-{pid}.jsonl").read_text().splitlines())
                    if e["event"] == "armed"]
        assert len(armed_at) == 2 and max(armed_at) <= acked + 0.01 and min(armed_at) >= t0 - 0.01
        # an arm file nobody reads again (same file, old events already consumed) is reported per pid on timeout
        offsets = fire_log_offsets(out, pids + [999999])
        assert wait_armed(out, offsets, target / "arm", timeout_s=0.3) == sorted(pids + [999999])
    finally:
        for p in procs:
            p.kill()
            p.communicate()


def test_every_resolving_alternative_is_patched_and_an_inherited_one_is_not_wrapped_twice(target: Path):
    # sglang 0.5.18 imports unified_radix_cache before hiradix_cache and builds HiRadixCache for HiCache: a site
    # listing both must count the calls of the class the release runs, whichever module came first.
    (target / "tmod_a.py").write_text("class A:\n    def check(self, i):\n        return i\n\nclass Sub(A):\n    pass\n")
    (target / "tmod_b.py").write_text("class B:\n    def check(self, i):\n        return i + 100\n")
    plan = _plan(target, [_inj("cnt", ["tmod_a:A.check", "tmod_b:B.check", "tmod_a:Sub.check"], {"kind": "none"})])
    (target / "arm").write_text("cnt\n")
    code = """
        import time
        import tmod_a
        import tmod_b  # imported after the first alternative was patched
        print(tmod_a.A().check(1), tmod_b.B().check(1), tmod_a.Sub().check(2))
        time.sleep(0.5)
    """
    r = _run(sys.executable, code, _env(target, plan), target)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split() == ["1", "101", "2"]
    rep = read_injector_dir(target / "out")
    (m,) = rep.markers
    assert [t["status"] for t in m.sites["cnt"].alternatives_tried] == ["patched", "patched", "patched"]
    assert rep.resolved_site("cnt") == "tmod_a:A.check + tmod_b:B.check + tmod_a:Sub.check"
    (lg,) = rep.logs
    assert lg.counts["cnt"].entered == 3  # one per call: B's counted, Sub's through A's wrapper only
