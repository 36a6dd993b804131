#!/usr/bin/env python3
"""Run as the harness inside the rig (scripts/multihost/rig.py): through repro.hosts' runner only, start a small
Python program on every host, find it by session, dump its stacks with py-spy on its host, copy a file there and
back, end its group and check it is gone. Prints one JSON object (per host: what was seen). Used by
tests/test_multihost_rig.py.

    python3 scripts/multihost/harness_probe.py HOSTS.json [--no-py-spy]

``--no-py-spy``: every host's py-spy is a path that does not exist there; the program registers faulthandler on
SIGUSR2 into ``<workdir>/injector/faulthandler-<pid>.txt`` the way the injector does, so the capture must fall back
to that dump (and say so).
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from repro.hosts import RemoteRank, Runner, capture_remote, hosts_from_json  # noqa: E402

PROGRAM = "import time\ndef probe_waits_here():\n    time.sleep(600)\nprobe_waits_here()\n"
# as the injector does (injectors/): faulthandler on SIGUSR2 into <injector dir>/faulthandler-<pid>.txt
PROGRAM_FH = ("import faulthandler, os, signal, sys, time\n"
              "os.makedirs(sys.argv[1], exist_ok=True)\n"
              "f = open(os.path.join(sys.argv[1], 'faulthandler-%d.txt' % os.getpid()), 'w')\n"
              "faulthandler.register(signal.SIGUSR2, file=f, all_threads=True)\n"
              "def probe_waits_here():\n    time.sleep(600)\nprobe_waits_here()\n")


def main() -> int:
    hosts = hosts_from_json(json.loads(Path(sys.argv[1]).read_text()))
    no_py_spy = "--no-py-spy" in sys.argv[2:]
    if no_py_spy:
        hosts = [dataclasses.replace(h, py_spy="/nonexistent/py-spy") for h in hosts]
    program = PROGRAM_FH if no_py_spy else PROGRAM
    runners = [Runner(h) for h in hosts]
    out: dict = {"harness_pids": sorted(int(p) for p in os.listdir("/proc") if p.isdigit()), "hosts": {}}
    started = {}
    try:
        for r in runners:
            r.put(program.encode(), f"{r.host.workdir}/probe.py")
            started[r.name] = r.start([r.host.python, f"{r.host.workdir}/probe.py", f"{r.host.workdir}/injector"],
                                      {"REPRO_PROBE": r.name}, f"{r.host.workdir}/probe.log", r.host.workdir)
        time.sleep(1.0)
        ranks = [RemoteRank(i, r, started[r.name], f"{r.host.workdir}/injector") for i, r in enumerate(runners)]
        with tempfile.TemporaryDirectory() as d:
            caps = capture_remote(ranks, Path(d), tag="-1", deadline_s=20)
            files = sorted(os.listdir(d))
        for r, c in zip(runners, caps):
            pid = started[r.name]
            out["hosts"][r.name] = {
                "pid": pid, "session": [p for p, _ in r.session_procs(pid)],
                "hostname": r.run("hostname").text.strip(),
                "tmp": r.run("ls /tmp").text.split(),
                "capture_ok": c.ok, "capture_error": c.error, "method": c.method, "notice": c.notice,
                "functions": sorted({f.function for t in c.threads for f in t.frames}),
                "visible_here": os.path.exists(f"/proc/{pid}") and "probe.py" in Path(f"/proc/{pid}/cmdline").read_text(errors="replace"),
                "file_back": (r.get(f"{r.host.workdir}/probe.py") or b"").decode() == program,
            }
        out["capture_files"] = files
    finally:
        for r in runners:
            if r.name in started:
                r.signal_group(started[r.name], "KILL")
    time.sleep(0.5)
    for r in runners:
        out["hosts"][r.name]["left_after_kill"] = [p for p, _ in r.session_procs(started[r.name])]
    print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
