"""The namespaced rig (scripts/multihost/rig.py) with real sshd: the harness, in a namespace of its own, reaches
each host only through ssh — it starts a process there, finds it by session, dumps it with py-spy on that host,
copies files both ways and ends it — and the rig leaves nothing behind."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.multihost_fixtures import RIG_DIR, hosts_file, rig2, rig_or_skip  # noqa: F401 (rig2 is a fixture)

pytestmark = pytest.mark.multihost


def test_harness_reaches_host_processes_only_through_ssh(rig2, tmp_path):
    hosts = hosts_file(rig2, tmp_path / "hosts.json")
    p = subprocess.run(rig2.harness_argv([sys.executable, str(RIG_DIR / "harness_probe.py"), str(hosts)]),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    assert len(out["harness_pids"]) < 10  # its own PID namespace: only the probe and its parents
    for name, h in out["hosts"].items():
        assert h["hostname"].endswith(name)
        assert h["session"] == [h["pid"]]
        assert h["capture_ok"], h["capture_error"]
        assert "probe_waits_here" in h["functions"]
        assert not h["visible_here"]  # that pid is not the host's process in the harness's namespace
        assert h["file_back"]
        assert "repro-remote" in h["tmp"]  # the workdir lives in the host's private /tmp
        assert h["left_after_kill"] == []
    assert not (Path("/tmp") / "repro-remote" / "probe.py").exists()  # not on the machine's /tmp
    assert {"rank0-1.json", "rank1-1.json", "capture-1.json"} <= set(out["capture_files"])


def test_host_without_py_spy_falls_back_to_the_faulthandler_dump_and_says_so(rig2, tmp_path):
    """py-spy missing on every host: each rank's stacks come from the faulthandler dump its process registered
    (SIGUSR2, the injector's way), taken on its own host through ssh, and the capture says py-spy was unusable."""
    hosts = hosts_file(rig2, tmp_path / "hosts.json")
    p = subprocess.run(rig2.harness_argv([sys.executable, str(RIG_DIR / "harness_probe.py"), str(hosts), "--no-py-spy"]),
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    for name, h in out["hosts"].items():
        assert h["capture_ok"], h["capture_error"]
        assert h["method"] == "faulthandler"
        assert "py-spy unusable" in h["notice"] and "not found" in h["notice"] and f"host {name}" in h["notice"]
        assert "probe_waits_here" in h["functions"]
        assert h["left_after_kill"] == []
    assert {"rank0-1.txt", "rank1-1.txt", "capture-1.json"} <= set(out["capture_files"])


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_rig_teardown_leaves_nothing():
    rig = rig_or_skip(2)
    with rig:
        st = rig.state
        pids = [h.init_pid for h in st.hosts] + [h.unshare_pid for h in st.hosts]
        names = [h.netns for h in st.hosts] + [st.harness_netns]
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert not any(n in netns for n in names)
    assert st.prefix not in links
    assert not [p for p in pids if _running(p)]
    assert not Path(st.dir).exists()


def test_host_unreachable_at_start_is_inconclusive_naming_it_and_starts_nothing(rig2, tmp_path):
    from repro import testbed
    from tests.multihost_fixtures import REPO, run_in_rig

    if not testbed.is_set_up():
        pytest.skip("CPU testbed not set up")
    rig2.set_data_link("h1", up=True)
    # h1's sshd stops listening: the host is unreachable over ssh before anything starts
    subprocess.run(["kill", "-STOP", str(rig2.host("h1").init_pid)], check=True)
    try:
        rc, res, err = run_in_rig(rig2, [REPO / "scenarios/sglang/smoke_extra_allreduce.toml", "--variant", "control"],
                                  tmp_path, timeout_s=120)
    finally:
        subprocess.run(["kill", "-CONT", str(rig2.host("h1").init_pid)], check=True)
    assert rc == 4 and res["verdict"] == "INCONCLUSIVE", err[-2000:]
    assert "host unreachable at start" in res["reason"] and "h1 (ssh root@" in res["reason"]
    assert "h0 (" not in res["reason"]
    assert rig2.host_procs("h0") == []  # nothing was started on the reachable host


LINK_CHECK = r"""
import json, sys, time
from pathlib import Path
from repro import evidence as ev
from repro.hosts import hosts_from_json
from repro.multihost import MultiHostSession

hosts = hosts_from_json(json.loads(Path(sys.argv[1]).read_text()))
evd = ev.EvidenceDir(Path(sys.argv[2]), "links", "check")

class P:  # the members link_faults uses
    evidence = evd

s = MultiHostSession(P(), hosts)
listener = ("import socket, time; s = socket.socket(); s.bind(('0.0.0.0', 0)); s.listen(); "
            "print(s.getsockname()[1], flush=True); time.sleep(600)")
procs = []
try:
    for n in s.nodes:  # a listener on each host stands in for its node's HTTP port
        procs.append((n, n.runner.start(["/usr/bin/python3", "-c", listener], {}, n.workdir + "/listen.log", n.workdir)))
        got = ""
        for _ in range(100):
            got = (n.runner.get(n.workdir + "/listen.log") or b"").decode().strip()
            if got:
                break
            time.sleep(0.1)
        n.http_port = int(got)
    print(json.dumps(s.link_faults()), flush=True)
    sys.stdin.readline()  # the test cuts h1's data link now
    print(json.dumps(s.link_faults()), flush=True)
finally:
    for n, pid in procs:
        n.runner.signal_group(pid, "KILL")
"""


def test_lost_data_link_is_named_by_host(rig2, tmp_path):
    """The data-link check of repro.remote_run, run as the harness over real ssh: with every link up it names no
    host; with h1's data0 down it names h1, and only h1."""
    from tests.multihost_fixtures import REPO, hosts_file

    hosts = hosts_file(rig2, tmp_path / "hosts.json")
    (tmp_path / "check.py").write_text(LINK_CHECK)
    p = subprocess.Popen(rig2.harness_argv([sys.executable, str(tmp_path / "check.py"), str(hosts), str(tmp_path / "ev")]),
                         cwd=REPO, env={**__import__("os").environ, "PYTHONPATH": str(REPO)},
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        before = json.loads(p.stdout.readline() or "null")
        rig2.set_data_link("h1", up=False)
        p.stdin.write("go\n")
        p.stdin.flush()
        after = json.loads(p.stdout.readline() or "null")
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        rig2.set_data_link("h1", up=True)
    assert before == [], p.stderr.read()[-2000:]
    assert after is not None and len(after) == 1, after
    assert "host h1's data link is lost" in after[0] and "data0 is down" in after[0]
    assert rig2.host_procs("h0") == [] and rig2.host_procs("h1") == []


KILLED_RUN = r"""
import json, sys
from pathlib import Path
from repro import evidence as ev
from repro.hosts import hosts_from_json
from repro.multihost import MultiHostSession

hosts = hosts_from_json(json.loads(Path(sys.argv[1]).read_text()))
evd = ev.EvidenceDir(Path(sys.argv[2]), "cleanup", "killed")

class P:  # the members save_processes uses
    evidence = evd

s = MultiHostSession(P(), hosts)
# a node's tree (root + child) that maps a /dev/shm file and names a registered semaphore in an mpnames record, as a
# rank's scheduler and the injector do
tree = ("import mmap, os, subprocess, time\n"
        "os.makedirs('injector', exist_ok=True)\n"
        "open('injector/mpnames-%d.txt' % os.getpid(), 'w').write('semaphore /mp-killed\\n')\n"
        "open('/dev/shm/sem.mp-killed', 'wb').write(bytes(32))\n"
        "fd = os.open('/dev/shm/sglang_loads_killed.shm', os.O_CREAT | os.O_RDWR, 0o600); os.ftruncate(fd, 4096)\n"
        "m = mmap.mmap(fd, 4096); os.close(fd)\n"
        "subprocess.Popen(['sleep', '600']); time.sleep(600)")
for n in s.nodes:  # a node's tree on each host; then this harness ends without stopping them
    n.root_pid = s.start_node(n, ["/usr/bin/python3", "-c", tree], {}, n.workdir + "/node.log")  # as start() does
s.save_processes()
print(evd.path)
"""


def test_cleanup_over_ssh_ends_a_killed_multihost_runs_nodes(rig2, tmp_path):
    """A harness that ended without stopping its nodes left a tree on each host; ``repro cleanup FOLDER`` (run as
    the harness: it reaches the hosts only over ssh) ends each host's session from processes.json and removes the
    run folder there; a second cleanup finds nothing."""
    from tests.multihost_fixtures import REPO

    hosts = hosts_file(rig2, tmp_path / "hosts.json")
    (tmp_path / "killed.py").write_text(KILLED_RUN)
    env = {**__import__("os").environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run(rig2.harness_argv([sys.executable, str(tmp_path / "killed.py"), str(hosts), str(tmp_path / "ev")]),
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr[-2000:]
    folder = p.stdout.strip().splitlines()[-1]
    rec = json.loads((Path(folder) / "processes.json").read_text())
    assert set(rec["hosts"]) == {"h0", "h1"} and rec["processes"] == []
    for h in ("h0", "h1"):
        assert len(rig2.host_procs(h)) == 2, rig2.host_procs(h)  # root + child, left running
        assert len(rec["hosts"][h]["processes"]) == 2 and rec["hosts"][h]["root_start_ticks"]
        deadline = time.time() + 30  # the tree's python is still starting on its host
        while time.time() < deadline and len(rig2.host_shm(h)) < 2:
            time.sleep(0.2)
        assert rig2.host_shm(h) == ["sem.mp-killed", "sglang_loads_killed.shm"], rig2.host_shm(h)
    c = subprocess.run(rig2.harness_argv([sys.executable, "-m", "repro", "cleanup", folder]), cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=120)
    assert c.returncode == 0, c.stdout[-2000:] + c.stderr[-2000:]
    assert "h0: stopped session" in c.stdout and "h1: stopped session" in c.stdout, c.stdout
    assert rig2.host_procs("h0") == [] and rig2.host_procs("h1") == []
    assert rig2.host_shm("h0") == [] and rig2.host_shm("h1") == [], c.stdout  # the files the tree made: removed
    assert "h0: stopped session" in c.stdout and "removed 2 /dev/shm file(s)" in c.stdout, c.stdout
    for h in ("h0", "h1"):
        ls = subprocess.run(rig2.host_argv(h, ["ls", rec["hosts"][h]["workdir"]]), capture_output=True, text=True)
        assert ls.returncode != 0  # the run folder on the host is gone
    again = subprocess.run(rig2.harness_argv([sys.executable, "-m", "repro", "cleanup", folder]), cwd=REPO, env=env,
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0 and "nothing to clean" in again.stdout, again.stdout + again.stderr


# A stand-in front of a server whose ranks hang: /health answers, /generate never does (the ranks behind it are
# the real hung gloo job below; the watch judges them, not this front).
STUCK_FRONT = r"""
import http.server, sys, time
class H(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200 if self.path == "/health" else 404); self.end_headers()
    def do_POST(self):
        time.sleep(600)
    def log_message(self, *a):
        pass
http.server.ThreadingHTTPServer(("0.0.0.0", int(sys.argv[1])), H).serve_forever()
"""


def test_watch_hosts_finds_and_captures_hung_ranks_on_each_host(rig2, tmp_path):
    """``repro watch --url … --hosts …``, run as the harness: a real gloo job hung across the two hosts (rank 1 in
    an extra all_reduce, rank 0 in the next broadcast; ranks titled like SGLang's schedulers, gloo on the data
    link) is found by listing each host's processes over ssh, dumped with py-spy on its own host, and judged
    DEADLOCKED; the evidence labels each rank's host and its pid as that host sees it."""
    import os
    import signal

    from repro import testbed
    from tests.multihost_fixtures import REPO

    py = testbed.testbed_python()
    if py is None:
        pytest.fail(f"the gloo job needs the testbed's torch: run `{testbed.setup_command()}`")
    desync = REPO / "tests" / "gloo_programs" / "desync.py"
    h0 = rig2.host("h0")
    procs = []
    try:
        for k, name in enumerate(("h0", "h1")):
            job = (f"mkdir -p /tmp/desync && exec env GLOO_SOCKET_IFNAME=data0 {py} {desync} {k} 2 29611 /tmp/desync "
                   f"--master-addr {h0.data_addr} --title sglang::scheduler_TP{k} --extra-rank 1 --lifetime-s 150")
            procs.append(subprocess.Popen(rig2.host_argv(name, ["sh", "-c", job]), stdout=subprocess.DEVNULL,
                                          stderr=subprocess.DEVNULL, start_new_session=True))
        procs.append(subprocess.Popen(rig2.host_argv("h0", ["/usr/bin/python3", "-c", STUCK_FRONT, "30777"]),
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True))
        for _ in range(600):  # both ranks reached their hang point (desync.py writes ready-<rank>)
            ready = [subprocess.run(rig2.host_argv(n, ["ls", "/tmp/desync"]), capture_output=True, text=True).stdout
                     for n in ("h0", "h1")]
            if "ready-0" in ready[0] and "ready-1" in ready[1]:
                break
            time.sleep(0.2)
        assert "ready-0" in ready[0] and "ready-1" in ready[1], ready
        time.sleep(1.0)
        hosts = hosts_file(rig2, tmp_path / "hosts.json")
        w = subprocess.run(rig2.harness_argv([
            sys.executable, "-m", "repro", "watch", "--url", f"http://{h0.mgmt_addr}:30777", "--hosts", str(hosts),
            "--once", "--probe-timeout", "3", "--health-timeout", "3", "--evidence-dir", str(tmp_path / "ev")]),
            cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)}, capture_output=True, text=True, timeout=180)
    finally:
        for p in procs:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            p.wait(timeout=30)
    assert w.returncode == 3, w.stdout[-3000:] + w.stderr[-2000:]
    (verdict_file,) = [v for v in (tmp_path / "ev").glob("watch-*/*/verdict.json") if v.parent.name != "latest"]
    evd = verdict_file.parent
    assert json.loads(verdict_file.read_text())["verdict"] == "DEADLOCKED"
    ranks = json.loads((evd / "hosts.json").read_text())["ranks"]
    assert {k: v["host"] for k, v in ranks.items()} == {"0": "h0", "1": "h1"}
    cap = json.loads((evd / "stacks" / "capture.json").read_text())
    by_rank = {c["rank"]: c for c in cap["processes"]}
    assert by_rank[0]["host"] == "h0" and by_rank[1]["host"] == "h1"
    assert all(c["ok"] and c["method"] == "py-spy" for c in cap["processes"])
    assert by_rank[1]["pid"] == ranks["1"]["pid"]
    assert (evd / "stacks" / "rank1.txt").read_text().startswith("# host h1 (pid")
    assert "check_prefetch_progress" in (evd / "stacks" / "rank1.txt").read_text()
    assert "all_reduce" in (evd / "analysis.json").read_text()
    for _ in range(100):  # the SIGKILLed job's processes are gone within moments (not a watch leftover: it starts none)
        left = rig2.host_procs("h0") + rig2.host_procs("h1")
        if not left:
            break
        time.sleep(0.1)
    assert left == []
