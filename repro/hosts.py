"""Hosts a server spans, and how the harness reaches each one: OpenSSH by default, or a command template.

A *host* is where some of a server's ranks run (one SGLang node: ``--node-rank k``). The harness never assumes a
host's processes are visible to it: everything on a host goes through that host's :class:`Runner` — starting the
node's tree, reading its process list, copying the plan and the arm file there, running py-spy on its ranks and
copying stacks, injector records and the server log back. A rank is known as ``(host, pid)``, the pid as that host
sees it (hosts in other PID namespaces or machines reuse pid numbers).

Two ways to reach a host, both using tools operators already run (no agent of our own):

- ``ssh``: ``ssh [options] TARGET -- <command line>`` (BatchMode, a connect timeout; exit status 255 means ssh itself
  failed: the host is unreachable or refused the key);
- ``template``: an argv prefix that runs a program on the host, e.g. ``kubectl exec POD --`` or
  ``srun --jobid 1234 -w node3 --overlap``; the harness appends ``sh -c <command line>``;
- ``local``: ``sh -c <command line>`` here (unit tests; one machine).

Files go through the same channel (``cat > f`` with the bytes on stdin, ``cat f`` / ``tar -cf -`` back), so a
template needs nothing beyond running a command with stdin and stdout: no ``scp``, ``kubectl cp`` or shared disk.
A remote host needs ``sh``, ``cat``, ``tar``, ``ps``, ``kill``, ``python3`` (the capture helper) and, for py-spy
stacks, ``py-spy`` with ptrace (else the injector's faulthandler fallback is used, and said so).
"""

from __future__ import annotations

import io
import json
import shlex
import subprocess
import tarfile
import time
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Optional, Sequence

from repro import capture_helper, shm_files
from repro import evidence as ev
from repro.evidence import Layout

SSH_UNREACHABLE_RC = 255  # what ssh exits with when it could not run the command at all
DEFAULT_CONNECT_TIMEOUT_S = 5
DEFAULT_WORKDIR = "/tmp/repro-remote"


class HostError(Exception):
    """A command could not be run on a host (unreachable, refused, timed out, failed).

    Attributes:
        host: the host's name; command: the command line; rc: exit status (None on a timeout); detail: stderr tail.
    """

    def __init__(self, host: str, command: str, rc: Optional[int], detail: str) -> None:
        self.host, self.command, self.rc, self.detail = host, command, rc, detail
        what = "timed out" if rc is None else ("unreachable" if rc == SSH_UNREACHABLE_RC else f"exit status {rc}")
        super().__init__(f"host {host}: {what}: {detail.strip()[-400:] or command[:200]}")

    @property
    def unreachable(self) -> bool:
        """True when the channel itself failed (ssh exit 255, or a timeout), not the command."""
        return self.rc is None or self.rc == SSH_UNREACHABLE_RC


@dataclass(frozen=True)
class HostSpec:
    """One host of a multi-host server (a scenario's ``[[server.hosts]]`` entry, or ``--hosts``).

    Attributes:
        name: label used in evidence file names and messages (``h0``, ``node-a``).
        node_rank: the engine's node rank on this host (sglang ``--node-rank``); node 0 serves HTTP.
        ssh: ssh target (``user@addr`` or an ssh_config alias); exclusive with ``template``.
        ssh_options: extra ssh arguments (``-i KEY``, ``-o UserKnownHostsFile=…``, ``-p PORT``).
        template: argv prefix that runs a command on the host (``kubectl exec POD --``), as one shell-quoted string.
        address: the host's data address (gloo and the rendezvous use it: sglang ``--dist-init-addr`` on node 0,
            ``SGLANG_HOST_IP``); also where node 0's HTTP port is reached unless ``http_address`` is set.
        http_address: where the harness reaches this host's HTTP port (default ``address``).
        ifname: network interface of the data address (``GLOO_SOCKET_IFNAME``), None to let gloo pick.
        workdir: a folder on the host for the plan, arm file, injector records and logs (private per run below it).
        py_spy: py-spy on the host (a name on its PATH or a path).
        python: a python3 on the host for the capture helper (stdlib only).
    """

    name: str
    node_rank: int
    ssh: Optional[str] = None
    ssh_options: tuple[str, ...] = ()
    template: Optional[str] = None
    address: str = ""
    http_address: Optional[str] = None
    ifname: Optional[str] = None
    workdir: str = DEFAULT_WORKDIR
    py_spy: str = "py-spy"
    python: str = "python3"

    def __post_init__(self) -> None:
        if self.ssh and self.template:
            raise ValueError(f"host {self.name}: give either ssh or template, not both")
        if self.node_rank < 0:
            raise ValueError(f"host {self.name}: node_rank must be >= 0, got {self.node_rank}")

    @property
    def reach(self) -> str:
        """How the host is reached, in words (``ssh root@10.0.0.2``, ``kubectl exec pod-1 --``, ``local``)."""
        if self.ssh:
            return f"ssh {self.ssh}"
        return self.template or "local"


def check_hosts(hosts: Sequence[HostSpec]) -> None:
    """Raise ValueError unless node ranks are exactly 0..n-1 and names are unique (message names the fix)."""
    ranks = sorted(h.node_rank for h in hosts)
    if ranks != list(range(len(hosts))):
        raise ValueError(f"host node ranks must be 0..{len(hosts) - 1}, one per host; got {ranks}")
    names = [h.name for h in hosts]
    if len(set(names)) != len(names):
        raise ValueError(f"host names must be unique; got {names}")


@dataclass
class Result:
    """A finished command on a host: exit status, stdout (bytes), stderr (text), seconds it took."""

    rc: int
    stdout: bytes
    stderr: str
    duration_s: float

    @property
    def text(self) -> str:
        return self.stdout.decode("utf-8", errors="replace")


class Runner:
    """Runs shell command lines on one host and moves files there and back (see the module docstring).

    Args:
        host: the host (its ``ssh`` / ``template`` / neither = local decides the channel).
        connect_timeout_s: ssh ``ConnectTimeout``.
    """

    def __init__(self, host: HostSpec, connect_timeout_s: int = DEFAULT_CONNECT_TIMEOUT_S) -> None:
        self.host = host
        self.connect_timeout_s = connect_timeout_s

    @property
    def name(self) -> str:
        return self.host.name

    def argv(self, command: str) -> list[str]:
        """The local argv that runs the shell command line ``command`` on the host."""
        h = self.host
        if h.ssh:
            return ["ssh", "-o", "BatchMode=yes", "-o", f"ConnectTimeout={self.connect_timeout_s}",
                    "-o", "ServerAliveInterval=5", "-o", "ServerAliveCountMax=2",
                    *h.ssh_options, h.ssh, "--", command]
        if h.template:
            return [*shlex.split(h.template), "sh", "-c", command]
        return ["sh", "-c", command]

    def run(self, command: str, *, input: Optional[bytes] = None, timeout_s: float = 30.0,
            check: bool = True) -> Result:
        """Run ``command`` on the host and wait for it.

        Raises:
            HostError: the channel failed (exit 255 over ssh), the command timed out, or (``check``) it exited non-zero.
        """
        t0 = time.monotonic()
        try:
            p = subprocess.run(self.argv(command), input=input if input is not None else b"",
                               capture_output=True, timeout=max(0.1, timeout_s))
        except subprocess.TimeoutExpired:
            raise HostError(self.name, command, None, f"no answer within {timeout_s:.1f} s") from None
        except OSError as e:
            raise HostError(self.name, command, SSH_UNREACHABLE_RC, f"cannot run {self.argv(command)[0]}: {e}") from None
        err = p.stderr.decode("utf-8", errors="replace")
        res = Result(p.returncode, p.stdout, err, time.monotonic() - t0)
        if self.host.ssh and p.returncode == SSH_UNREACHABLE_RC:
            raise HostError(self.name, command, p.returncode, err)
        if check and p.returncode != 0:
            raise HostError(self.name, command, p.returncode, err)
        return res

    def reachable(self, timeout_s: float = 10.0) -> tuple[bool, str]:
        """(True, "") when ``true`` runs on the host, else (False, why)."""
        try:
            self.run("true", timeout_s=timeout_s)
            return True, ""
        except HostError as e:
            return False, str(e)

    # ---- files -------------------------------------------------------------------------------------------------
    def put(self, data: bytes, remote_path: str, timeout_s: float = 30.0) -> None:
        """Write ``data`` to ``remote_path`` on the host atomically (a temporary name, then ``mv``); makes the folder."""
        q = shlex.quote(remote_path)
        tmp = shlex.quote(remote_path + ".part")
        parent = shlex.quote(str(Path(remote_path).parent))
        self.run(f"mkdir -p {parent} && cat > {tmp} && mv -f {tmp} {q}", input=data, timeout_s=timeout_s)

    def get(self, remote_path: str, timeout_s: float = 30.0) -> Optional[bytes]:
        """The bytes of ``remote_path`` on the host, or None when it does not exist."""
        q = shlex.quote(remote_path)
        res = self.run(f"if [ -f {q} ]; then cat {q}; else exit 3; fi", timeout_s=timeout_s, check=False)
        if res.rc == 3:
            return None
        if res.rc != 0:
            raise HostError(self.name, f"cat {remote_path}", res.rc, res.stderr)
        return res.stdout

    def put_tree(self, local_dir: Path, remote_dir: str, timeout_s: float = 60.0) -> None:
        """Copy the folder ``local_dir`` to ``remote_dir`` on the host (tar over the channel; ``__pycache__`` skipped)."""
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w") as tf:
            tf.add(str(local_dir), arcname=".", filter=lambda ti: None if "__pycache__" in ti.name else ti)
        q = shlex.quote(remote_dir)
        self.run(f"mkdir -p {q} && tar -C {q} -xf -", input=buf.getvalue(), timeout_s=timeout_s)

    def get_tree(self, remote_dir: str, local_dir: Path, timeout_s: float = 60.0) -> list[str]:
        """Copy the folder ``remote_dir`` from the host into ``local_dir``; returns the file names copied (empty
        when the folder does not exist). Only regular files and folders are extracted."""
        q = shlex.quote(remote_dir)
        res = self.run(f"if [ -d {q} ]; then tar -C {q} -cf - .; else exit 3; fi", timeout_s=timeout_s, check=False)
        if res.rc == 3:
            return []
        if res.rc != 0:
            raise HostError(self.name, f"tar {remote_dir}", res.rc, res.stderr)
        local_dir.mkdir(parents=True, exist_ok=True)
        names = []
        with tarfile.open(fileobj=io.BytesIO(res.stdout), mode="r") as tf:
            for m in tf.getmembers():
                if not (m.isfile() or m.isdir()) or m.name.startswith("/") or ".." in Path(m.name).parts:
                    continue
                if _has_tar_filter():
                    tf.extract(m, str(local_dir), filter="data")
                else:
                    tf.extract(m, str(local_dir))
                if m.isfile():
                    names.append(m.name[2:] if m.name.startswith("./") else m.name)
        return names

    # ---- processes ---------------------------------------------------------------------------------------------
    def start(self, argv: Sequence[str], env: Mapping[str, str], log_path: str, cwd: str) -> int:
        """Start ``argv`` on the host in a new session (``setsid``), detached, stdout+stderr to ``log_path``.

        Returns:
            The pid as the host sees it; it is also the session and process-group id of the node's tree.
        Raises:
            HostError: the command could not be started.
        """
        envs = " ".join(shlex.quote(f"{k}={v}") for k, v in env.items())
        cmd = " ".join(shlex.quote(a) for a in argv)
        line = (f"mkdir -p {shlex.quote(cwd)} && cd {shlex.quote(cwd)} && "
                f"(env {envs} setsid {cmd} > {shlex.quote(log_path)} 2>&1 < /dev/null & echo $!)")
        res = self.run(line, timeout_s=30.0)
        try:
            return int(res.text.strip().splitlines()[-1])
        except (ValueError, IndexError):
            raise HostError(self.name, line, res.rc, f"no pid printed: {res.text[:200]!r} {res.stderr[-200:]}") from None

    def session_procs(self, sid: int, timeout_s: float = 15.0) -> list[tuple[int, str]]:
        """(pid, command line or title) of every live process in session ``sid`` on the host (``ps -s``; zombies,
        which hold no resources and wait for their parent, are left out)."""
        res = self.run(f"ps -o pid=,stat=,args= -s {int(sid)}", timeout_s=timeout_s, check=False)
        out = []
        for line in res.text.splitlines():
            parts = line.strip().split(None, 2)
            if len(parts) >= 2 and parts[0].isdigit() and not parts[1].startswith("Z"):
                out.append((int(parts[0]), parts[2] if len(parts) > 2 else ""))
        return out

    def alive(self, pid: int, timeout_s: float = 10.0) -> bool:
        """Whether ``pid`` exists on the host (``kill -0``)."""
        return self.run(f"kill -0 {int(pid)} 2>/dev/null", timeout_s=timeout_s, check=False).rc == 0

    def shm_files(self, sid: int, timeout_s: float = 15.0) -> tuple[Optional[float], set[str]]:
        """The /dev/shm files the processes of session ``sid`` on the host map or hold open now, and when the session's
        leader started (seconds since the epoch on the host's clock; None when it is gone): ``repro/shm_files.py``
        run there. Raises HostError when the host cannot be reached or the helper fails."""
        res = self.run(f"{shlex.quote(self.host.python)} - list {int(sid)}", input=SHM_HELPER.encode(), timeout_s=timeout_s)
        try:
            js = json.loads(res.text)
            return js.get("since"), set(js.get("files") or [])
        except (ValueError, AttributeError) as e:
            raise HostError(self.name, "shm_files list", res.rc, f"no JSON printed: {res.text[:200]!r}") from e

    def remove_shm(self, since: float, mp_names_glob: str, files: Iterable[str], timeout_s: float = 15.0) -> list[str]:
        """Unlink on the host each of ``files`` and each file the matching ``mpnames-*.txt`` records name, whose status
        changed at or after ``since`` (host clock; ``repro.shm_files.remove``). Call once the session is empty.
        Returns the paths removed. Raises HostError as :meth:`run`."""
        cmd = " ".join(shlex.quote(a) for a in (self.host.python, "-", "remove", repr(float(since)), mp_names_glob,
                                                *sorted(files)))
        res = self.run(cmd, input=SHM_HELPER.encode(), timeout_s=timeout_s)
        try:
            return list(json.loads(res.text).get("removed") or [])
        except (ValueError, AttributeError) as e:
            raise HostError(self.name, "shm_files remove", res.rc, f"no JSON printed: {res.text[:200]!r}") from e

    def signal_group(self, pgid: int, sig: str = "TERM", timeout_s: float = 10.0) -> None:
        """Send ``sig`` to the process group ``pgid`` on the host (no error when it is already gone)."""
        # POSIX sh (dash) has no ``kill -- -PGID``: the negative pid goes right after the signal
        self.run(f"kill -{sig} -{int(pgid)} 2>/dev/null; true", timeout_s=timeout_s, check=False)


def _has_tar_filter() -> bool:
    return hasattr(tarfile, "data_filter")


def in_parallel(calls: Mapping[Any, Callable[[float], Any]], deadline_s: float) -> dict[Any, tuple[bool, Any]]:
    """Run each call at once, all sharing one deadline.

    Args:
        calls: key -> function taking the seconds left until the shared deadline (pass it on as its timeout).
        deadline_s: seconds from now by which every call must be done.
    Returns:
        key -> (True, result) or (False, the exception, or a TimeoutError when the call was still running at the
        deadline: it is abandoned, its thread left to finish on its own timeout).
    """
    end = time.monotonic() + deadline_s
    out: dict[Any, tuple[bool, Any]] = {}
    ex = ThreadPoolExecutor(max_workers=max(1, len(calls)))
    try:
        futs = {k: ex.submit(fn, max(0.1, end - time.monotonic())) for k, fn in calls.items()}
        for k, f in futs.items():
            try:
                out[k] = (True, f.result(timeout=max(0.0, end - time.monotonic()) + 1.0))
            except FutureTimeout:
                out[k] = (False, TimeoutError(f"still running at the shared deadline of {deadline_s:.1f} s"))
            except Exception as e:  # noqa: BLE001 - reported per key
                out[k] = (False, e)
    finally:
        ex.shutdown(wait=False)
    return out


# ---- capture on the rank's host ----------------------------------------------------------------------------------

# The capture that runs on the rank's host: repro/capture_helper.py itself (stdlib only), its source sent on stdin
# to the host's python3 (argv: pid py-spy faulthandler-file signal timeout); it prints one JSON object (title, CPU
# seconds before and after, monotonic times, py-spy's JSON and text dumps or the faulthandler dump). The same code
# as the local capture's (repro.capture imports it): the tracer-held retry and the SigCgt check included.
def _source_of(module: Any) -> str:
    return Path(module.__file__).read_text(encoding="utf-8")


CAPTURE_HELPER = _source_of(capture_helper)
SHM_HELPER = _source_of(shm_files)  # repro/shm_files.py, run on a host (Runner.shm_files / remove_shm)


@dataclass(frozen=True)
class RemoteRank:
    """A rank process as its host sees it: the host's runner, the pid there, and the injector folder there."""

    rank: int
    runner: Runner
    pid: int
    injector_dir: Optional[str] = None

    @property
    def host(self) -> str:
        return self.runner.name


def capture_remote(ranks: Sequence[RemoteRank], out_dir: Path, *, tag: str = "", deadline_s: float = 15.0,
                   fallback_signal: str = "SIGUSR2") -> list[Any]:
    """Dump every rank's Python stacks on its own host, all hosts at once with one shared deadline.

    Args:
        ranks: the ranks to dump (each through its host's runner).
        out_dir: evidence ``stacks/`` folder; writes ``rank<k><tag>.txt`` / ``.json`` (py-spy) and ``capture<tag>.json``
            (per rank: host, pid as the host sees it, method, ok, error, cpu_percent, duration_s).
        tag: file-name suffix (``-1``, ``-1b``).
        deadline_s: seconds for the whole capture; a host that has not answered by then is reported, not waited for.
        fallback_signal: the signal the injector registered faulthandler on (its file is
            ``<injector_dir>/faulthandler-<pid>.txt`` on the host).
    Returns:
        One ``repro.stacks.RankCapture`` per rank, in rank order; ``ok=False`` with the host and cause on failure,
        ``notice`` when the faulthandler fallback was used.
    """
    from repro.stacks import RankCapture, parse_faulthandler, parse_pyspy_json

    out_dir.mkdir(parents=True, exist_ok=True)
    order = sorted(ranks, key=lambda r: r.rank)
    per_call_s = max(1.0, deadline_s / 3)

    def one(r: RemoteRank) -> Callable[[float], Any]:
        fh = f"{r.injector_dir}/{Layout.faulthandler_file(r.pid)}" if r.injector_dir else "-"
        cmd = " ".join(shlex.quote(a) for a in (r.runner.host.python, "-", str(r.pid), r.runner.host.py_spy, fh,
                                                fallback_signal, f"{per_call_s:.1f}"))
        return lambda left: json.loads(r.runner.run(cmd, input=CAPTURE_HELPER.encode(), timeout_s=left).text)

    results = in_parallel({r.rank: one(r) for r in order}, deadline_s)
    caps, meta = [], []
    for r in order:
        ok, res = results[r.rank]
        label = Layout.stack_label(r.rank)
        where = f"host {r.host} pid {r.pid}"
        if not ok:
            cap = RankCapture(rank=r.rank, pid=r.pid, label=label, ok=False, method="py-spy",
                              error=f"{where}: capture failed: {res}", text="", threads=[], title="")
        else:
            cpu = None
            if res.get("cpu0") is not None and res.get("cpu1") is not None and res["t1"] > res["t0"]:
                cpu = round(100.0 * (res["cpu1"] - res["cpu0"]) / (res["t1"] - res["t0"]), 2)
            common = dict(rank=r.rank, pid=r.pid, label=label, title=res.get("title", ""), cpu_percent=cpu,
                          duration_s=round(res["t1"] - res["t0"], 4))
            if res.get("json"):
                dumps = parse_pyspy_json(res["json"])
                (out_dir / Layout.stack_name(r.rank, tag, "json")).write_text(res["json"])
                text = res.get("text") or ""
                cap = RankCapture(ok=bool(dumps and dumps[0].threads), method="py-spy",
                                  error="" if dumps and dumps[0].threads else f"{where}: py-spy returned no threads",
                                  text=text, threads=dumps[0].threads if dumps else [],
                                  tool_version=res.get("tool_version", ""), **common)
            elif res.get("faulthandler"):
                dumps = parse_faulthandler(res["faulthandler"], pid=r.pid, title=common["title"])
                notice = f"{where}: py-spy unusable ({res.get('error', '')[:200]}); fell back to the injector's faulthandler dump"
                text = f"Process {r.pid}: {common['title']}\n# faulthandler dump ({fallback_signal}); {notice}\n" + res["faulthandler"]
                cap = RankCapture(ok=bool(dumps[0].threads), method="faulthandler", error="", notice=notice, text=text,
                                  threads=dumps[0].threads, tool_version="faulthandler (CPython)", **common)
            else:
                cap = RankCapture(ok=False, method="py-spy", error=f"{where}: {res.get('error', 'no dump')}", text="",
                                  threads=[], **common)
        if cap.text:
            (out_dir / Layout.stack_name(r.rank, tag)).write_text(f"# host {r.host} (pid {r.pid} as that host sees it)\n" + cap.text)
        caps.append(cap)
        meta.append({**cap.model_dump(exclude={"text", "threads"}), "host": r.host})
    (out_dir / Layout.capture_meta(tag)).write_text(json.dumps({"tag": tag, "deadline_s": deadline_s, "processes": meta},
                                                           indent=2))
    return caps


_HOST_STR_FIELDS = ("name", "ssh", "template", "address", "http_address", "ifname", "workdir", "py_spy", "python")


def hosts_from_json(items: Any) -> list[HostSpec]:
    """HostSpecs from a list of mappings (a scenario's ``[[server.hosts]]`` or a ``--hosts`` JSON file).

    Raises:
        ValueError: ``items`` is not a list of objects, a field is missing, unknown or of the wrong type (the message
            names the host index, the field, what was expected and what it got).
    """
    if not isinstance(items, (list, tuple)):
        raise ValueError(f"expected a JSON list of host objects at the top level, got {_json_kind(items)}")
    if not items:
        raise ValueError("the list of hosts is empty; expected one host object per node (node_rank 0..n-1)")
    known = set(HostSpec.__dataclass_fields__)
    out = []
    for i, item in enumerate(items):
        if not isinstance(item, Mapping):
            raise ValueError(f"hosts[{i}]: expected a host object like {{\"name\": \"h{i}\", \"node_rank\": {i}}}, "
                             f"got {_json_kind(item)}")
        extra = set(item) - known
        if extra:
            raise ValueError(f"hosts[{i}]: unknown field(s) {sorted(extra)}; expected some of {sorted(known)}")
        for need in ("name", "node_rank"):
            if need not in item:
                raise ValueError(f"hosts[{i}]: field {need!r} is missing (e.g. name = \"h{i}\", node_rank = {i})")
        d = dict(item)
        nr = d["node_rank"]
        if isinstance(nr, bool) or not isinstance(nr, int) or nr < 0:
            raise ValueError(f"hosts[{i}].node_rank: expected an integer >= 0, got {_json_kind(nr)}")
        for f in _HOST_STR_FIELDS:
            optional = f in ("ssh", "template", "http_address", "ifname")
            if f in d and not (isinstance(d[f], str) or (optional and d[f] is None)):
                raise ValueError(f"hosts[{i}].{f}: expected a string{' or null' if optional else ''}, got {_json_kind(d[f])}")
        name = d["name"]
        if not name or not name.strip(".") or any(c in name for c in "/\\\0"):
            raise ValueError(f"hosts[{i}].name: expected a non-empty label usable as a folder name (no '/', not '.' "
                             f"or '..': evidence goes to hosts/<name>/), got {name!r}")
        if "ssh_options" in d:
            opts = d["ssh_options"]
            if not isinstance(opts, (list, tuple)) or not all(isinstance(o, str) for o in opts):
                raise ValueError(f"hosts[{i}].ssh_options: expected a list of strings like [\"-p\", \"2222\"], "
                                 f"got {_json_kind(opts)}")
            d["ssh_options"] = tuple(opts)
        out.append(HostSpec(**d))
    check_hosts(out)
    return out


def _json_kind(v: Any) -> str:
    """A JSON value in words for an error line: ``null``, ``a list``, ``an object``, else its JSON text (short)."""
    if v is None:
        return "null"
    if isinstance(v, (list, tuple)):
        return f"a list ({json.dumps(v, default=str)[:60]})"
    if isinstance(v, Mapping):
        return f"an object with keys {sorted(map(str, v))[:8]}"
    return json.dumps(v, default=str)[:60]


# CPU seconds (utime + stime, /proc/PID/stat) of the pids given, and the host's monotonic clock: one JSON object.
_CPU_PY = r'''
import json, os, sys, time
out = {}
for p in sys.argv[1:]:
    try:
        f = open("/proc/%s/stat" % p).read().rsplit(")", 1)[1].split()
        out[p] = (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")
    except Exception:
        pass
print(json.dumps({"t": time.monotonic(), "cpu": out}))
'''


def _cpu_seconds(ranks: dict[int, RemoteRank]) -> dict[int, tuple[float, float]]:
    """rank -> (host monotonic time, cpu seconds) read on each rank's host (one runner call per host, in parallel);
    a rank whose host did not answer or whose process is gone is left out."""
    import json
    import shlex

    by_host: dict[str, list[RemoteRank]] = {}
    for r in ranks.values():
        by_host.setdefault(r.host, []).append(r)

    def one(rs: list[RemoteRank]):
        cmd = " ".join(shlex.quote(a) for a in (rs[0].runner.host.python, "-", *(str(r.pid) for r in rs)))
        return lambda left: json.loads(rs[0].runner.run(cmd, input=_CPU_PY.encode(), timeout_s=left).text)

    res = in_parallel({h: one(rs) for h, rs in by_host.items()}, 15.0)
    out = {}
    for h, rs in by_host.items():
        ok, v = res[h]
        if ok:
            out.update({r.rank: (v["t"], v["cpu"][str(r.pid)]) for r in rs if str(r.pid) in v["cpu"]})
    return out


class HostRanks:
    """Where a server's ranks run, for ``repro.checker.check_stall``: on other hosts, each read through its host's
    runner — CPU from the host's /proc (one call per host, all at once), stacks by :func:`repro.hosts.capture_remote`
    (py-spy there, all hosts at once, one deadline; the injector's faulthandler fallback).

    Args:
        ranks: rank -> RemoteRank.
        fallback_signal: the injector's faulthandler signal (the capture's fallback) when the caller names none.
    """

    def __init__(self, ranks: dict[int, RemoteRank], fallback_signal: str = "SIGUSR2") -> None:
        self.ranks = dict(ranks)
        self.fallback_signal = fallback_signal

    @property
    def rank_pids(self) -> dict[int, int]:
        """rank -> pid as its host sees it."""
        return {k: r.pid for k, r in self.ranks.items()}

    def cpu_seconds(self) -> dict[int, tuple[float, float]]:
        """rank -> (its host's monotonic clock, CPU seconds); a rank whose host did not answer is left out."""
        return _cpu_seconds(self.ranks)

    def capture(self, stacks_dir: Path, tag: str, *, timeout_s: float = 10.0, native: bool = False,
                fallback_signal: Optional[str] = None, injector_dir: Any = None) -> list:
        """One capture of every rank on its host. ``timeout_s``: per-rank py-spy bound; the capture's shared
        deadline is twice that, at least 20 s. ``native`` is not supported on remote hosts (ignored);
        ``injector_dir`` is each rank's own (its RemoteRank's)."""
        return capture_remote([self.ranks[k] for k in sorted(self.ranks)], stacks_dir, tag=tag,
                              deadline_s=max(20.0, 2 * timeout_s), fallback_signal=fallback_signal or self.fallback_signal)

    def capture_cpu(self, first: Sequence[Any], second: Sequence[Any]) -> dict[int, float]:
        """Where a host did not answer the CPU reading: the higher of the two captures' own readings."""
        return {c.rank: max(c.cpu_percent or 0.0, c2.cpu_percent or 0.0) for c, c2 in zip(first, second)}

    def write_record(self, evd: ev.EvidenceDir) -> None:
        """``hosts.json``: each rank's host (:func:`write_hosts_record`)."""
        write_hosts_record(evd, self.ranks)


def write_hosts_record(evd: ev.EvidenceDir, ranks: dict[int, RemoteRank]) -> None:
    """``hosts.json`` of a watch hang: each rank's host, how it is reached and its pid as that host sees it."""
    evd.hosts_json.write({
        "ranks": {str(k): {"host": r.host, "pid": r.pid, "reach": r.runner.host.reach} for k, r in sorted(ranks.items())},
        "note": "pids are as each host sees them (its own PID namespace or machine)"})


__all__ = ["HostError", "HostRanks", "HostSpec", "Result", "Runner", "RemoteRank", "capture_remote", "check_hosts",
           "hosts_from_json", "in_parallel"]
