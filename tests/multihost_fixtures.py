"""The namespaced multi-host rig as a pytest fixture (scripts/multihost/rig.py): root only; everything it made is
removed when the test ends, passes or fails (and on Ctrl-C, through the rig's context manager)."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

RIG_DIR = Path(__file__).resolve().parents[1] / "scripts" / "multihost"
PY_SPY = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")


def load_rig_module():
    sys.path.insert(0, str(RIG_DIR))
    try:
        import rig  # noqa: PLC0415
    finally:
        sys.path.remove(str(RIG_DIR))
    return rig


def rig_or_skip(n_hosts: int = 2):
    """A built Rig (context manager entered by the caller), or a skip when not root / no namespaces here."""
    if os.geteuid() != 0:
        pytest.skip("the multihost rig needs root (network namespaces, sshd)")
    rig = load_rig_module()
    try:
        rig.ensure_tools()  # installs what is missing (openssh-server on a fresh machine)
    except rig.RigError as e:
        pytest.fail(f"the multihost rig's tools: {e}")
    return rig.Rig(n_hosts)


def hosts_file(rig, path: Path, *, via: str = "ssh", workdir: str = "/tmp/repro-remote") -> Path:
    """Write the rig's hosts as a ``--hosts`` JSON file (ssh targets, or the stand-in kubectl template)."""
    real_py_spy = os.path.realpath(PY_SPY)
    items = []
    for i, h in enumerate(rig.state.hosts):
        item = {"name": h.name, "node_rank": i, "address": h.data_addr, "http_address": h.mgmt_addr,
                "ifname": "data0", "workdir": workdir, "py_spy": real_py_spy, "python": "/usr/bin/python3"}
        if via == "ssh":
            item.update(ssh=f"root@{h.mgmt_addr}", ssh_options=list(rig.ssh_options()))
        else:
            item.update(template=f"{RIG_DIR / 'kubectl'} exec {h.name} --")
        items.append(item)
    path.write_text(json.dumps(items, indent=2))
    return path


@pytest.fixture
def rig2():
    """Two namespaced hosts (h0, h1) reached over ssh, and a harness namespace; torn down afterwards."""
    rig = rig_or_skip(2)
    with rig:
        yield rig


@pytest.fixture(scope="module")
def rig2_shared():
    """One two-host rig for a whole test module (the e2e tests share it; each leaves its hosts empty and every
    data link up); torn down after the module's last test."""
    rig = rig_or_skip(2)
    with rig:
        yield rig


REPO = Path(__file__).resolve().parents[1]


def run_in_rig(rig, args, tmp_path: Path, *, via: str = "ssh", on_line=None, timeout_s: float = 420.0,
               all_lines: bool = False):
    """Run ``python -m repro.remote_run ARGS --hosts <the rig's hosts>`` as the harness (its own namespaces).

    Args:
        on_line: called with each progress line the harness prints (stderr), e.g. to cut a link mid-burst.
        all_lines: return every JSON line printed (several ``--variant``: one per variant, then the session's).
    Returns:
        (exit code, the last JSON line printed — or the list of them with ``all_lines`` —, all stderr text).
    """
    import subprocess
    import threading

    hosts = hosts_file(rig, tmp_path / f"hosts-{via}.json", via=via)
    env = dict(os.environ, PYTHONPATH=str(REPO))
    if via == "kubectl":
        env["REPRO_FAKE_KUBECTL_PODS"] = str(rig.kubectl_pods())
    argv = rig.harness_argv([sys.executable, "-m", "repro.remote_run", *map(str, args), "--hosts", str(hosts),
                             "--evidence-dir", str(tmp_path / "evidence")])
    p = subprocess.Popen(argv, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)
    err_lines: list[str] = []
    out_lines: list[str] = []

    def pump_err():
        # the only reader of stderr (communicate() would read it too and take lines from on_line)
        for line in p.stderr:
            err_lines.append(line)
            if on_line is not None:
                on_line(line)

    def pump_out():
        out_lines.extend(p.stdout)

    threads = [threading.Thread(target=pump_err, daemon=True), threading.Thread(target=pump_out, daemon=True)]
    for t in threads:
        t.start()
    try:
        p.wait(timeout=timeout_s)
    except BaseException:
        os.killpg(p.pid, 9)  # the harness's PID namespace ends with it (unshare --kill-child); the rig ends the hosts
        p.wait()
        raise
    for t in threads:
        t.join(timeout=5)
    found = [json.loads(ln) for ln in out_lines if ln.startswith("{")]
    if all_lines:
        return p.returncode, found, "".join(err_lines)
    return p.returncode, (found[-1] if found else None), "".join(err_lines)
