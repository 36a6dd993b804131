"""The host runner (repro.hosts) without namespaces: local and template channels, files both ways, a detached
process tree found by session and ended by group, py-spy through the runner, one shared deadline, and ssh's
"unreachable" exit status. The namespaced rig (tests/test_multihost_rig.py) runs the same code over real sshd."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from repro.hosts import HostError, HostSpec, RemoteRank, Runner, capture_remote, check_hosts, hosts_from_json, in_parallel


def local(name="h0", **kw) -> Runner:
    return Runner(HostSpec(name=name, node_rank=0, **kw))


def test_ssh_argv_puts_the_command_line_after_the_target():
    r = Runner(HostSpec(name="a", node_rank=1, ssh="root@10.0.0.2", ssh_options=("-i", "/k")))
    argv = r.argv("echo hi")
    assert argv[0] == "ssh" and "BatchMode=yes" in argv
    assert argv[-3:] == ["root@10.0.0.2", "--", "echo hi"] and argv[argv.index("-i") + 1] == "/k"


def test_template_prefix_runs_the_command_through_sh():
    r = Runner(HostSpec(name="pod", node_rank=0, template="env REPRO_VIA_TEMPLATE=yes"))
    assert r.argv("x")[:2] == ["env", "REPRO_VIA_TEMPLATE=yes"]
    assert r.run("echo $REPRO_VIA_TEMPLATE").text.strip() == "yes"


def test_failed_command_raises_naming_the_host():
    with pytest.raises(HostError) as e:
        local("hx").run("echo boom >&2; exit 7")
    assert "hx" in str(e.value) and "exit status 7" in str(e.value) and "boom" in str(e.value)
    assert not e.value.unreachable


def test_ssh_to_a_closed_port_is_unreachable_not_a_command_failure():
    if shutil.which("ssh") is None:
        pytest.skip("no ssh client")  # the rig test installs openssh; this one only needs the client
    r = Runner(HostSpec(name="gone", node_rank=1, ssh="root@127.0.0.1", ssh_options=("-p", "1")))
    ok, why = r.reachable(timeout_s=10)
    assert not ok and "gone" in why and "unreachable" in why


def test_files_and_folders_round_trip(tmp_path):
    r = local()
    remote = tmp_path / "remote"
    r.put(b"abc\x00def", str(remote / "sub" / "f.bin"))
    assert (remote / "sub" / "f.bin").read_bytes() == b"abc\x00def"
    assert r.get(str(remote / "sub" / "f.bin")) == b"abc\x00def"
    assert r.get(str(remote / "missing")) is None
    src = tmp_path / "src"
    (src / "pkg" / "__pycache__").mkdir(parents=True)
    (src / "pkg" / "m.py").write_text("x = 1\n")
    (src / "pkg" / "__pycache__" / "m.pyc").write_bytes(b"junk")
    r.put_tree(src, str(remote / "tree"))
    assert (remote / "tree" / "pkg" / "m.py").read_text() == "x = 1\n"
    assert not (remote / "tree" / "pkg" / "__pycache__").exists()
    back = tmp_path / "back"
    names = r.get_tree(str(remote / "tree"), back)
    assert "pkg/m.py" in names and (back / "pkg" / "m.py").read_text() == "x = 1\n"
    assert r.get_tree(str(remote / "nope"), back) == []


def test_started_tree_is_found_by_session_and_ended_by_group(tmp_path):
    r = local()
    prog = "import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(600)']); time.sleep(600)"
    pid = r.start([sys.executable, "-c", prog], {"REPRO_T": "1"}, str(tmp_path / "log"), str(tmp_path))
    try:
        deadline = time.time() + 10
        procs = []
        while time.time() < deadline and len(procs) < 2:
            procs = r.session_procs(pid)
            time.sleep(0.1)
        assert len(procs) == 2 and pid in [p for p, _ in procs]
        assert os.getsid(pid) == pid and os.getpgid(pid) == pid
    finally:
        r.signal_group(pid, "KILL")
    deadline = time.time() + 10
    while time.time() < deadline and r.session_procs(pid):
        time.sleep(0.1)
    assert r.session_procs(pid) == []


def test_in_parallel_shares_one_deadline():
    t0 = time.monotonic()
    res = in_parallel({"fast": lambda left: left > 0, "slow": lambda left: time.sleep(5)}, deadline_s=0.5)
    assert res["fast"] == (True, True)
    assert res["slow"][0] is False and "deadline" in str(res["slow"][1])
    assert time.monotonic() - t0 < 3.0


def _capture_one_child(tmp_path: Path, body: str):
    """Start ``python -c`` running ``body`` (a function that prints ``ready`` once past start-up), dump it through a
    local runner as host h1's rank 1, end it by pid; skips only where py-spy is absent or ptrace is refused."""
    py_spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    if not os.path.exists(py_spy):
        pytest.skip("py-spy is not installed")
    p = subprocess.Popen([sys.executable, "-c", body], stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout.readline().strip() == "ready"  # past start-up: from here on only the function runs
        r = Runner(HostSpec(name="h1", node_rank=1, py_spy=py_spy, python=sys.executable))
        (c,) = capture_remote([RemoteRank(1, r, p.pid)], tmp_path, tag="-1", deadline_s=20)
    finally:
        p.kill()
        p.wait()
    if not c.ok and "ptrace" in c.error.lower():
        pytest.skip(f"ptrace refused here: {c.error}")
    assert c.ok, c.error
    return c


def test_capture_through_the_runner_reads_a_real_process(tmp_path):
    c = _capture_one_child(tmp_path, "import time\ndef waiting_here():\n    print('ready', flush=True)\n"
                                     "    time.sleep(600)\nwaiting_here()\n")
    names = [f.function for t in c.threads for f in t.frames]
    assert "waiting_here" in names
    text = (tmp_path / "rank1-1.txt").read_text()
    assert text.startswith("# host h1 (pid") and "waiting_here" in text
    assert '"host": "h1"' in (tmp_path / "capture-1.json").read_text()
    assert c.cpu_percent is not None and c.cpu_percent < 20
    assert c.duration_s >= 0.2  # the helper's least CPU window (one 10 ms tick is 5 %, not 50 %)


def test_remote_capture_reads_a_spinning_rank_as_busy(tmp_path):
    c = _capture_one_child(tmp_path, "def spinning_here():\n    print('ready', flush=True)\n    while True:\n"
                                     "        pass\nspinning_here()\n")
    assert "spinning_here" in [f.function for t in c.threads for f in t.frames]
    assert c.cpu_percent is not None and c.cpu_percent > 20, c.cpu_percent


def test_a_sessions_shm_files_are_listed_and_removed_on_its_host_when_made_since_it_started(tmp_path):
    """Runner.shm_files / remove_shm run repro/shm_files.py on the host (here through the local channel): the file a
    session's process maps, and the one an ``mpnames-*.txt`` record names, are removed once the session is gone;
    nothing outside /dev/shm and nothing older than the session is."""
    name = f"repro-test-{uuid.uuid4().hex[:10]}"
    mapped, registered = Path("/dev/shm") / name, Path("/dev/shm") / f"sem.mp-{name}"
    prog = ("import mmap, os, sys, time\nfd = os.open(sys.argv[1], os.O_CREAT | os.O_RDWR, 0o600)\n"
            "os.ftruncate(fd, 4096)\nm = mmap.mmap(fd, 4096)\nos.close(fd)\nprint('ready', flush=True)\ntime.sleep(600)\n")
    r = local(python=sys.executable)
    t_start = time.time()
    p = subprocess.Popen([sys.executable, "-c", prog, str(mapped)], stdout=subprocess.PIPE, text=True,
                         start_new_session=True)
    try:
        assert p.stdout.readline().strip() == "ready"
        since, files = r.shm_files(p.pid)
    finally:
        os.killpg(p.pid, signal.SIGKILL)
        p.wait()
    try:
        assert str(mapped) in files, files
        assert since is not None and abs(since - t_start) < 2.0, (since, t_start)  # the leader's start, host clock
        registered.write_bytes(b"\0" * 32)
        (tmp_path / "mpnames-4242.txt").write_text(f"semaphore /mp-{name}\nsemaphore ../etc\nnoise\n")
        outside = tmp_path / "not-in-shm"
        outside.write_text("x")
        glob_ = str(tmp_path / "mpnames-*.txt")
        assert r.remove_shm(time.time() + 3600, glob_, [*files, str(outside)]) == []  # all older than that "start"
        assert mapped.exists() and registered.exists()
        removed = r.remove_shm(since, glob_, [*files, str(outside)])
        assert sorted(removed) == sorted([str(mapped), str(registered)])
        assert not mapped.exists() and not registered.exists() and outside.exists()
    finally:
        mapped.unlink(missing_ok=True)
        registered.unlink(missing_ok=True)


def test_host_lists_are_checked():
    hosts = hosts_from_json([{"name": "a", "node_rank": 0, "ssh": "root@x"}, {"name": "b", "node_rank": 1,
                                                                              "template": "kubectl exec p --"}])
    assert hosts[1].reach == "kubectl exec p --"
    with pytest.raises(ValueError, match="node ranks must be 0..1"):
        check_hosts([HostSpec("a", 0), HostSpec("b", 2)])
    with pytest.raises(ValueError, match="unknown field"):
        hosts_from_json([{"name": "a", "node_rank": 0, "shh": "x"}])
    with pytest.raises(ValueError, match="either ssh or template"):
        HostSpec("a", 0, ssh="x", template="y")


def test_every_node_is_launched_with_the_harness_fork_ranks_opt_in(tmp_path: Path, monkeypatch):
    """REPRO_FORK_RANKS=1 set for the harness is in each node's launch environment: a node started over ssh (or a
    command template) gets only the environment MultiHostSession hands it, not this process's, so without it there
    the nodes' ranks were spawned while the run claimed the opt-in (the multihost stage of scripts/test.sh sets it)."""
    from repro import evidence as ev
    from repro import resources
    from repro.multihost import MultiHostSession
    from repro.targets.base import LaunchSpec
    from repro.targets.sglang import SGLangAdapter

    class _Started(Exception):
        pass

    class P:  # the members MultiHostSession.start reads before the nodes are up
        evidence = ev.EvidenceDir(tmp_path / "evidence", "mh", "fork")
        plan = {"injections": []}
        arm_file = tmp_path / "ARM"
        adapter = SGLangAdapter()
        spec = LaunchSpec(python=sys.executable, model="/m", tp_size=2, args=["--device", "cpu"], env={"A": "1"},
                          pythonpath_prepend=[str(resources.injectors_dir())])

    hosts = [HostSpec(name=f"h{k}", node_rank=k, python=sys.executable, address="127.0.0.1",
                      workdir=str(tmp_path / f"wd{k}")) for k in (0, 1)]
    envs: dict[str, dict] = {}

    def start_node(self, n, argv, env, log_path):
        envs[n.name] = dict(env)
        if len(envs) == len(hosts):
            raise _Started
        return 0

    monkeypatch.setattr(MultiHostSession, "start_node", start_node)
    for value in ("1", None):
        if value is None:
            monkeypatch.delenv("REPRO_FORK_RANKS", raising=False)
        else:
            monkeypatch.setenv("REPRO_FORK_RANKS", value)
        envs.clear()
        with pytest.raises(_Started):
            MultiHostSession(P(), hosts).start()
        assert set(envs) == {"h0", "h1"}
        for name, env in envs.items():
            assert env.get("REPRO_FORK_RANKS") == value and env["A"] == "1", (name, env)
            assert "PATH" not in env  # nothing else of this process's environment is handed over



@pytest.mark.parametrize("text, names", [
    ("[1]", ["hosts[0]", "host object"]),
    ("null", ["JSON list of host objects", "null"]),
    ('{"name": "h0", "node_rank": 0}', ["JSON list of host objects", "an object"]),
    ('[{"name": "h0", "node_rank": "zero"}]', ["hosts[0].node_rank", "integer >= 0", '"zero"']),
    ('[{"name": "h0", "node_rank": -1}]', ["hosts[0].node_rank", "integer >= 0"]),
    ('[{"name": "h0", "node_rank": 0, "ssh_options": 5}]', ["hosts[0].ssh_options", "list of strings"]),
    ('[{"name": "h0", "node_rank": 0', ["--hosts", "Expecting"]),
])
def test_run_refuses_a_hosts_file_of_the_wrong_shape_in_one_exit_2_line(tmp_path: Path, text: str, names: list):
    """A --hosts JSON of the wrong shape (a tester's [1], null, node_rank "zero", ssh_options 5) is one error line
    naming the file, the entry and field and what was expected, exit 2, before anything starts (was a TypeError
    traceback, exit 1, or a top-level object read as field names 'a', 'e', 'm', 'n')."""
    from typer.testing import CliRunner

    from repro.cli import app

    f = tmp_path / "hosts.json"
    f.write_text(text)
    scen = Path(__file__).resolve().parent.parent / "scenarios" / "sglang" / "smoke_extra_allreduce.toml"
    r = CliRunner().invoke(app, ["run", str(scen), "--hosts", str(f), "--evidence-dir", str(tmp_path / "ev")])
    assert r.exit_code == 2, r.output
    assert r.exception is None or isinstance(r.exception, SystemExit), r.exception
    flat = r.output.replace("\n", "")
    assert "Traceback" not in r.output and str(f) in flat, r.output
    for n in names:
        assert n in flat, (n, r.output)
    assert "unknown field(s) ['a'" not in r.output and not (tmp_path / "ev").exists()


@pytest.mark.parametrize("items, match", [
    ([], "empty"),
    ([{"name": "h0", "node_rank": True}], r"hosts\[0\]\.node_rank: expected an integer >= 0"),
    ([{"name": "h0", "node_rank": 0, "ssh_options": [1]}], r"hosts\[0\]\.ssh_options: expected a list of strings"),
    ([{"name": 7, "node_rank": 0}], r"hosts\[0\]\.name: expected a string"),
    ([{"name": "..", "node_rank": 0}], r"hosts\[0\]\.name: .*folder name"),
    ([{"name": "a/b", "node_rank": 0}], r"hosts\[0\]\.name: .*folder name"),
    ([{"name": "h0", "node_rank": 0, "ssh": ["x"]}], r"hosts\[0\]\.ssh: expected a string or null"),
])
def test_host_entries_of_the_wrong_type_are_refused_naming_index_and_field(items: list, match: str):
    """Values the old reader passed on (a host named '..' made its evidence folder hosts/../, the run folder itself;
    ssh_options [1] or name 7 reached the launch): refused before anything starts."""
    with pytest.raises(ValueError, match=match):
        hosts_from_json(items)
