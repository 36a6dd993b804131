#!/usr/bin/env python3
"""A test rig of "hosts" on one Linux machine (root only): each host a network + PID + mount + UTS namespace
running OpenSSH's sshd, and the harness in a namespace of its own.

Layout (``Rig(n_hosts)``, names all start with the rig's prefix ``rmh<id>``, so teardown touches nothing else):

- a bridge ``<prefix>br`` in the root network namespace (no address on it: the root namespace is not on the net);
- per host ``h<i>``: network namespace ``<prefix>-h<i>`` with two veths on the bridge, ``mgmt0`` (management
  address ``10.<net>.0.<10+i>``, where sshd and HTTP are reached) and ``data0`` (data address ``10.<net>.1.<10+i>``,
  gloo and the rendezvous), no default route; inside it ``unshare --pid --mount --uts --fork --mount-proc``
  mounts a private tmpfs on ``/tmp`` and ``/dev/shm`` and execs ``sshd -D`` (PID 1 there, so killing it ends every
  process of that host);
- the harness: network namespace ``<prefix>-hx`` (management address ``10.<net>.0.2``), and every harness command
  runs in a new PID + mount namespace (``/proc`` remounted): it cannot see the hosts' processes;
- keys: a client key, a host key per host and a ``known_hosts`` made by the rig under ``/var/tmp/<prefix>/``
  (outside ``/tmp``, which the hosts replace); ``/run/sshd`` (sshd's privilege-separation folder, checked on every
  connection by every rig's sshd) is created when missing, with a mark, and removed by the teardown of the last rig
  (no other ``/var/tmp/rmh*`` folder left) when the mark is there: one rig going never breaks another's ssh.

Needs: ``ip``/``ss`` (iproute2), ``unshare``/``nsenter`` (util-linux), ``sysctl``/``ps`` (procps), ``tar``,
``ssh-keygen``/``ssh`` (openssh-client) and ``/usr/sbin/sshd`` (Debian ``openssh-server``): :func:`ensure_tools`
installs the packages of the missing ones with apt-get (on a stock Debian image only openssh-server).

Teardown (:meth:`Rig.down`, also on failure and Ctrl-C through the context manager, and ``rig.py down --all`` for
leftovers of a killed run) kills each host's PID 1 by its pid, deletes the namespaces and the bridge by the names
the rig created, and removes its folder. CLI::

    python3 scripts/multihost/rig.py up --hosts 2 --state /var/tmp/rig.json   # prints the state (JSON)
    python3 scripts/multihost/rig.py down --state /var/tmp/rig.json
    python3 scripts/multihost/rig.py down --all                                # every rmh* namespace/bridge/folder
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional, Sequence

PREFIX = "rmh"
STATE_ROOT = Path("/var/tmp")


def _paths_kept_visible() -> list[Path]:
    """Folders the hosts must see at their own path although each host mounts a private /tmp: this checkout (the
    rig's own scripts, the tests' gloo programs, the CPU testbed's files) and the testbed cache when
    ``REPRO_TESTBED_DIR`` points under /tmp."""
    out = [Path(__file__).resolve().parents[2]]
    tb = os.environ.get("REPRO_TESTBED_DIR")
    if tb:
        out.append(Path(tb).expanduser().resolve())
    return out
SSHD = "/usr/sbin/sshd"
PRIVSEP_DIR = Path("/run/sshd")
PRIVSEP_MARK = PRIVSEP_DIR / ".made-by-multihost-rig"
SSHD_START_TIMEOUT_S = 15.0


class RigError(RuntimeError):
    """The rig could not be built (the message names the command that failed and its output)."""


def sh(*argv: str, check: bool = True, input: Optional[bytes] = None, timeout_s: float = 60.0) -> subprocess.CompletedProcess:
    p = subprocess.run(list(argv), capture_output=True, input=input, timeout=timeout_s)
    if check and p.returncode != 0:
        raise RigError(f"{' '.join(argv)} -> exit {p.returncode}: {p.stderr.decode(errors='replace').strip()[-500:]}")
    return p


# what the rig and the hosts run -> the Debian package that has it (all but openssh-server are in a stock image)
TOOLS = {"ip": "iproute2", "ss": "iproute2", "unshare": "util-linux", "nsenter": "util-linux", "sysctl": "procps",
         "ps": "procps", "tar": "tar", "ssh": "openssh-client", "ssh-keygen": "openssh-client", SSHD: "openssh-server"}


def missing_tools() -> dict[str, str]:
    """tool -> Debian package, for each tool of :data:`TOOLS` not found here."""
    return {t: pkg for t, pkg in TOOLS.items() if not (os.path.exists(t) if t.startswith("/") else shutil.which(t))}


def ensure_tools() -> None:
    """Install the Debian packages of any missing tool (:data:`TOOLS`; on a fresh machine usually only
    ``openssh-server``) with apt-get (``apt-get update`` and a retry when the first install fails).

    Raises:
        RigError: not root, apt-get missing, or the install failed (its output tail and the tools still missing).
    """
    missing = missing_tools()
    if not missing:
        return
    pkgs = sorted(set(missing.values()))
    if os.geteuid() != 0:
        raise RigError(f"missing {sorted(missing)}; installing {pkgs} needs root")
    if shutil.which("apt-get") is None:
        raise RigError(f"missing {sorted(missing)} and no apt-get to install {pkgs}: install them first")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    cmd = ["apt-get", "install", "-y", "--no-install-recommends", *pkgs]
    p = subprocess.run(cmd, capture_output=True, env=env)
    if p.returncode != 0:
        subprocess.run(["apt-get", "update"], capture_output=True, env=env)
        p = subprocess.run(cmd, capture_output=True, env=env)
    still = missing_tools()
    if p.returncode != 0 or still:
        raise RigError(f"{' '.join(cmd)} -> exit {p.returncode}; still missing {sorted(still)}: "
                       f"{p.stderr.decode(errors='replace')[-500:]}")


def ensure_sshd() -> str:
    """``/usr/sbin/sshd``, installing what the rig needs first (:func:`ensure_tools`).

    Raises:
        RigError: not root, or the install failed (its output tail).
    """
    ensure_tools()
    return SSHD


@dataclass
class RigHost:
    """One namespaced host: names, addresses, and the root-namespace pids of its ``unshare`` and its PID 1 (sshd)."""

    name: str
    netns: str
    mgmt_addr: str
    data_addr: str
    unshare_pid: int = 0
    init_pid: int = 0
    veths: list = field(default_factory=list)


@dataclass
class RigState:
    prefix: str
    dir: str
    bridge: str
    hosts: list
    harness_netns: str
    harness_addr: str
    client_key: str
    known_hosts: str
    made_privsep_dir: bool = False


def _children(pid: int) -> list[int]:
    out = []
    try:
        for t in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{t}/children") as f:
                out += [int(x) for x in f.read().split()]
    except OSError:
        pass
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class Rig:
    """Build (``up``) and remove (``down``) the rig; a context manager that always tears down.

    Args:
        n_hosts: number of hosts (``h0`` … ``h<n-1>``).
        net: second octet of the 10.x.0.0/24 management and 10.x.1.0/24 data subnets.
        prefix: name prefix (default ``rmh<pid>``); everything the rig creates carries it.
    """

    def __init__(self, n_hosts: int = 2, net: int = 231, prefix: Optional[str] = None) -> None:
        self.n_hosts = n_hosts
        self.net = net
        self.prefix = prefix or f"{PREFIX}{os.getpid()}"
        self.dir = STATE_ROOT / self.prefix
        self.state: Optional[RigState] = None
        self.procs: list[subprocess.Popen] = []

    # ---- building ----------------------------------------------------------------------------------------------
    def up(self) -> RigState:
        if os.geteuid() != 0:
            raise RigError("the multihost rig needs root (network namespaces, sshd)")
        ensure_sshd()
        d = self.dir
        d.mkdir(parents=True, exist_ok=False)
        made_privsep = False
        if not PRIVSEP_DIR.exists():
            PRIVSEP_DIR.mkdir(mode=0o755)
            PRIVSEP_MARK.touch()  # a rig made it: the last rig to go removes it (another may still need it)
            made_privsep = True
        key = d / "id_ed25519"
        sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", f"{self.prefix}-client", "-f", str(key))
        (d / "authorized_keys").write_text((d / "id_ed25519.pub").read_text())
        os.chmod(d / "authorized_keys", 0o600)
        br = f"{self.prefix}br"
        self.state = st = RigState(prefix=self.prefix, dir=str(d), bridge=br, hosts=[],
                                   harness_netns=f"{self.prefix}-hx", harness_addr=f"10.{self.net}.0.2",
                                   client_key=str(key), known_hosts=str(d / "known_hosts"), made_privsep_dir=made_privsep)
        self._save()
        sh("ip", "link", "add", br, "type", "bridge")
        sh("ip", "link", "set", br, "up")
        known = []
        # the harness: management link only
        self._netns_with_veths(st.harness_netns, [("x", "mgmt0", f"{st.harness_addr}/24")])
        for i in range(self.n_hosts):
            h = RigHost(name=f"h{i}", netns=f"{self.prefix}-h{i}", mgmt_addr=f"10.{self.net}.0.{10 + i}",
                        data_addr=f"10.{self.net}.1.{10 + i}")
            st.hosts.append(h)
            self._save()
            h.veths = self._netns_with_veths(h.netns, [(f"{i}m", "mgmt0", f"{h.mgmt_addr}/24"),
                                                       (f"{i}d", "data0", f"{h.data_addr}/24")])
            hk = d / h.name / "ssh_host_ed25519_key"
            hk.parent.mkdir()
            sh("ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", h.name, "-f", str(hk))
            known.append(f"{h.mgmt_addr} {(d / h.name / 'ssh_host_ed25519_key.pub').read_text().split(' ')[0]} "
                         f"{(d / h.name / 'ssh_host_ed25519_key.pub').read_text().split(' ')[1]}")
            cfg = d / h.name / "sshd_config"
            cfg.write_text("\n".join([
                "Port 22", f"ListenAddress {h.mgmt_addr}", f"HostKey {hk}", f"AuthorizedKeysFile {d}/authorized_keys",
                "PermitRootLogin prohibit-password", "PasswordAuthentication no", "KbdInteractiveAuthentication no",
                "UsePAM no", "StrictModes no", "PidFile none", "PrintMotd no", "UseDNS no", "LogLevel ERROR",
                "MaxStartups 100:30:200", "MaxSessions 100", f"SetEnv REPRO_RIG_HOST={h.name}", "",
            ]))
            # the hosts get a private /tmp; a checkout (or testbed) under /tmp — a CI clone — stays visible at its
            # path: bound aside under the rig folder first, then back onto the new tmpfs
            keep = [str(x) for x in _paths_kept_visible() if str(x).startswith("/tmp/")]
            aside = [d / h.name / f"keep{k}" for k in range(len(keep))]
            for a in aside:
                a.mkdir()
            pre = "".join(f"mount --bind {shlex.quote(k)} {a} && " for k, a in zip(keep, aside))
            back = "".join(f"mkdir -p {shlex.quote(k)} && mount --bind {a} {shlex.quote(k)} && " for k, a in zip(keep, aside))
            inner = (f"hostname {self.prefix}-{h.name} && {pre}mount -t tmpfs -o mode=1777 tmpfs /tmp && {back}"
                     f"mount -t tmpfs -o mode=1777 tmpfs /dev/shm && exec {SSHD} -D -e -f {cfg}")
            log = open(d / h.name / "sshd.log", "wb")
            p = subprocess.Popen(["ip", "netns", "exec", h.netns, "unshare", "--pid", "--mount", "--uts", "--fork",
                                  "--mount-proc", "--propagation", "private", "--kill-child", "sh", "-c", inner],
                                 stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
            log.close()
            self.procs.append(p)
            h.unshare_pid = p.pid
            self._save()
        Path(st.known_hosts).write_text("\n".join(known) + "\n")
        for h in st.hosts:
            self._wait_sshd(h)
        self._save()
        return st

    def _netns_with_veths(self, ns: str, links: Sequence[tuple[str, str, str]]) -> list[str]:
        sh("ip", "netns", "add", ns)
        sh("ip", "-n", ns, "link", "set", "lo", "up")
        # both veths share one bridge (one L2 segment): without these Linux answers ARP for the management address
        # on the data veth too ("ARP flux"), and cutting the data link would cut ssh with it
        for key, val in (("arp_ignore", "1"), ("arp_announce", "2")):
            for scope in ("all", "default"):
                sh("ip", "netns", "exec", ns, "sysctl", "-q", "-w", f"net.ipv4.conf.{scope}.{key}={val}")
        outer_names = []
        for tag, inner, cidr in links:
            outer = f"{self.prefix}{tag}"[:15]
            sh("ip", "link", "add", outer, "type", "veth", "peer", "name", inner, "netns", ns)
            sh("ip", "link", "set", outer, "master", self.state.bridge)
            sh("ip", "link", "set", outer, "up")
            sh("ip", "-n", ns, "addr", "add", cidr, "dev", inner)
            sh("ip", "-n", ns, "link", "set", inner, "up")
            outer_names.append(outer)
        return outer_names

    def _wait_sshd(self, h: RigHost) -> None:
        deadline = time.monotonic() + SSHD_START_TIMEOUT_S
        while time.monotonic() < deadline:
            kids = _children(h.unshare_pid)
            if kids:
                h.init_pid = kids[0]
            if h.init_pid:
                p = sh("ip", "netns", "exec", h.netns, "ss", "-ltnH", f"sport = :22", check=False)
                if p.stdout.strip():
                    return
            if not _alive(h.unshare_pid):
                break
            time.sleep(0.1)
        log = (self.dir / h.name / "sshd.log").read_text(errors="replace")[-800:]
        raise RigError(f"sshd of {h.name} did not listen on {h.mgmt_addr}:22 within {SSHD_START_TIMEOUT_S:.0f} s: {log}")

    def _save(self) -> None:
        if self.state is not None:
            (self.dir / "state.json").write_text(json.dumps(asdict(self.state), indent=2))

    # ---- using ---------------------------------------------------------------------------------------------------
    def ssh_options(self) -> tuple[str, ...]:
        """ssh arguments that log in with the rig's key and check the hosts' keys against its known_hosts."""
        st = self.state
        return ("-i", st.client_key, "-o", f"UserKnownHostsFile={st.known_hosts}", "-o", "StrictHostKeyChecking=yes",
                "-o", "IdentitiesOnly=yes", "-o", "LogLevel=ERROR")

    def harness_argv(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run as the harness: in the harness's network namespace and a fresh PID + mount namespace."""
        return ["ip", "netns", "exec", self.state.harness_netns, "unshare", "--pid", "--fork", "--mount-proc",
                "--kill-child", *argv]

    def host_argv(self, host: str, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside host ``host``'s namespaces from the root namespace (nsenter by its PID 1)."""
        h = self.host(host)
        return ["nsenter", "-t", str(h.init_pid), "-n", "-p", "-m", "-u", "--", *argv]

    def kubectl_pods(self) -> Path:
        """Write the pod map of the stand-in ``scripts/multihost/kubectl`` (pod = host name) and return its path:
        point ``$REPRO_FAKE_KUBECTL_PODS`` at it."""
        f = self.dir / "kubectl-pods.json"
        f.write_text(json.dumps({h.name: {"addr": h.mgmt_addr, "ssh_options": list(self.ssh_options())}
                                 for h in self.state.hosts}))
        return f

    def host(self, name: str) -> RigHost:
        for h in self.state.hosts:
            if h.name == name:
                return h
        raise KeyError(name)

    def set_data_link(self, host: str, up: bool) -> None:
        """Cut (``up=False``) or restore host ``host``'s data link (its ``data0`` veth, from the root namespace)."""
        h = self.host(host)
        sh("ip", "-n", h.netns, "link", "set", "data0", "up" if up else "down")
        if not up:  # forget the peers' data-address neighbours learnt before the cut (no stale answers)
            sh("ip", "-n", h.netns, "neigh", "flush", "dev", "data0", check=False)

    def host_procs(self, host: str) -> list[tuple[int, str]]:
        """(root-namespace pid, command line) of every process in host ``host``'s PID namespace other than its
        PID 1 (sshd): empty when nothing runs there. Read from the root namespace's /proc (no probe inside)."""
        h = self.host(host)
        try:
            want = os.readlink(f"/proc/{h.init_pid}/ns/pid")
        except OSError:
            return []
        out = []
        for d in os.listdir("/proc"):
            if not d.isdigit() or int(d) == h.init_pid:
                continue
            try:
                if os.readlink(f"/proc/{d}/ns/pid") == want and _alive(int(d)):
                    out.append((int(d), open(f"/proc/{d}/cmdline", "rb").read().replace(b"\0", b" ").decode(errors="replace")))
            except OSError:
                continue
        return out

    def host_shm(self, host: str) -> list[str]:
        """The names in host ``host``'s private ``/dev/shm`` (its tmpfs, read through its PID 1's root from the root
        namespace): empty when no run left a shared-memory file there."""
        try:
            return sorted(os.listdir(f"/proc/{self.host(host).init_pid}/root/dev/shm"))
        except OSError:
            return []

    # ---- teardown ------------------------------------------------------------------------------------------------
    def down(self) -> list[str]:
        """Remove everything the rig created; returns what could not be removed (empty when clean)."""
        if self.state is None and (self.dir / "state.json").exists():
            self.state = RigState(**json.loads((self.dir / "state.json").read_text()))
            self.state.hosts = [RigHost(**h) if isinstance(h, dict) else h for h in self.state.hosts]
        return teardown(self.state, self.procs, self.dir, self.prefix)

    def __enter__(self) -> "Rig":
        try:
            self.up()
        except BaseException:
            self.down()
            raise
        return self

    def __exit__(self, *exc) -> None:
        left = self.down()
        if left:
            print(f"rig: left behind: {left}", file=sys.stderr)


def teardown(state: Optional[RigState], procs: Sequence[subprocess.Popen], d: Path, prefix: str) -> list[str]:
    """Kill each host's PID 1 (ending its whole PID namespace) and the ``unshare`` parents by pid, delete the
    namespaces, veths and bridge by the names the rig created, remove the rig folder (and ``/run/sshd`` when a rig
    made it and no other rig is left). Idempotent. Returns what is still there afterwards."""
    left: list[str] = []
    hosts = [RigHost(**h) if isinstance(h, dict) else h for h in (state.hosts if state else [])]
    for h in hosts:
        # PID 1 of the host's namespace first: the kernel then kills every process in it; its unshare parent reaps
        # it and exits on its own (killing unshare first would leave PID 1 to be reaped by someone else)
        for pid in {h.init_pid, *(_children(h.unshare_pid) if h.unshare_pid else [])}:
            if pid and _alive(pid):
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
    for h in hosts:
        deadline = time.monotonic() + 5.0
        while h.unshare_pid and _alive(h.unshare_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        if h.unshare_pid and _alive(h.unshare_pid):
            try:
                os.kill(h.unshare_pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(timeout=5)
    for h in hosts:
        if h.unshare_pid and _alive(h.unshare_pid):
            left.append(f"process {h.unshare_pid} (unshare of {h.name})")
    names = [h.netns for h in hosts] + ([state.harness_netns] if state else [])
    existing = sh("ip", "netns", "list", check=False).stdout.decode().split()
    for ns in names:
        if ns in existing:
            sh("ip", "netns", "del", ns, check=False)
    if state:
        sh("ip", "link", "del", state.bridge, check=False)
    time.sleep(0.2)
    existing = sh("ip", "netns", "list", check=False).stdout.decode().split()
    left += [f"netns {ns}" for ns in names if ns in existing]
    links = sh("ip", "-o", "link", "show", check=False).stdout.decode()
    left += [f"link {w.split('@')[0]}" for line in links.splitlines() for w in line.split()[1:2]
             if w.startswith(prefix)]
    # /run/sshd is shared by every rig's sshd (each connection checks it): removed by the last rig to go, when a rig
    # made it (its mark is there), never while another rig's folder is still there
    others = [o for o in STATE_ROOT.glob(f"{PREFIX}*") if o.is_dir() and o.name != d.name]
    if PRIVSEP_MARK.exists() and not others:
        try:
            PRIVSEP_MARK.unlink()
            PRIVSEP_DIR.rmdir()
        except OSError:
            pass
    if d.exists() and d.name.startswith(PREFIX):
        shutil.rmtree(d, ignore_errors=True)
    return left


def down_all() -> list[str]:
    """Teardown of every rig folder ``/var/tmp/rmh*`` (a killed run's leftovers), then any ``rmh*`` namespace or
    link still there (by name)."""
    left: list[str] = []
    for d in sorted(STATE_ROOT.glob(f"{PREFIX}*")):
        st = None
        if (d / "state.json").exists():
            raw = json.loads((d / "state.json").read_text())
            st = RigState(**raw)
        left += teardown(st, [], d, d.name)
    for ns in sh("ip", "netns", "list", check=False).stdout.decode().split():
        if ns.startswith(PREFIX):
            sh("ip", "netns", "del", ns, check=False)
    for line in sh("ip", "-o", "link", "show", check=False).stdout.decode().splitlines():
        name = line.split()[1].rstrip(":").split("@")[0]
        if name.startswith(PREFIX):
            sh("ip", "link", "del", name, check=False)
    return left


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    u = sub.add_parser("up")
    u.add_argument("--hosts", type=int, default=2)
    u.add_argument("--state", type=Path, required=True)
    dn = sub.add_parser("down")
    dn.add_argument("--state", type=Path)
    dn.add_argument("--all", action="store_true")
    a = ap.parse_args(argv)
    if a.cmd == "up":
        rig = Rig(a.hosts)
        try:
            st = rig.up()
        except BaseException:
            rig.down()
            raise
        a.state.write_text(json.dumps({"rig_dir": str(rig.dir), **asdict(st)}, indent=2))
        print(a.state.read_text())
        return 0
    if a.all:
        left = down_all()
    elif a.state:
        raw = json.loads(a.state.read_text())
        rig = Rig(prefix=raw["prefix"])
        left = rig.down()
    else:
        ap.error("down needs --state FILE or --all")
    print(json.dumps({"left": left}))
    return 1 if left else 0


if __name__ == "__main__":
    sys.exit(main())
