"""What ``repro watch`` is asked (:class:`WatchOptions`), its exit codes and the errors it raises before it starts."""

from __future__ import annotations

import tempfile
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Optional
from urllib.parse import urlsplit

from repro import procs as _procs
from repro.option_checks import non_negative_number_problem, positive_number_problem
from repro.verdict import DEADLOCKED, EXIT_CODES, INCONCLUSIVE


EVIDENCE_ENV = "REPRO_EVIDENCE_DIR"


FALLBACK_EVIDENCE_ROOT = Path(tempfile.gettempdir()) / "repro-watch-evidence"


LEDGER_POLL_S = 0.2  # how often the ledgers are followed while a probe is in flight (watch --ledger-dir)


HISTORY_ROUNDS = 200  # probe rounds kept in memory and written to probes.jsonl on a hang


ON_HANG_OUTPUT_TAIL_CHARS = 2000


EXIT_HEALTHY = 0


EXIT_HUNG_DEADLOCK = EXIT_CODES[DEADLOCKED]  # 3


EXIT_HUNG_NO_EVIDENCE = EXIT_CODES[INCONCLUSIVE]  # 4


EXIT_UNREACHABLE = 6


EXIT_MISCONFIGURED = 8  # the URL answers, but not as this engine's generate API: never a hang


LogSink = Callable[[dict], None]


class WatchConfigError(ValueError):
    """Bad watch options; the message names the option (``--interval`` …) and what was expected."""


class DiscoveryError(RuntimeError):
    """The rank processes could not be found or told apart; the message says which flag fixes it."""


@dataclass(frozen=True)
class WatchOptions:
    """What to watch and how.

    Attributes:
        url: base URL of the server (``http://host:port``).
        interval_s: seconds from one probe round's start to the next (a slow round delays the next, never overlaps).
        probe_timeout_s: seconds a generate probe may take before it counts as failed (and is abandoned).
        health_timeout_s: seconds a /health probe may take (default 25 s: above sglang's 20 s, so its 503 is seen).
        failures: consecutive failed generate probes that declare a hang (``--once`` declares on the first).
        pid_root: look for rank processes under this pid (the server's launcher), else None.
        match: rank processes are those whose title contains this text (e.g. ``sglang::scheduler``), else None.
            With neither, the tree of the process listening on the URL's port is used, then the default title.
        evidence_root: evidence root; a hang's folder is ``<root>/watch-<host>-<port>/<UTC>-hang``.
        on_hang: shell command run after the evidence is on disk, with ``REPRO_EVIDENCE_DIR`` set; None for none.
        on_hang_timeout_s: seconds the command may run before its process group is ended.
        once: one probe round, then exit (see :meth:`Watcher.run` for the exit codes).
        max_rounds: stop after this many probe rounds (None: until stopped).
        confirm_gap_s: seconds between the first capture and the confirming one.
        capture_timeout_s: per-process py-spy bound in seconds.
        native: ask py-spy for native frames too.
        metrics_path: Prometheus endpoint kept raw in the evidence (sglang serves it with ``--enable-metrics``).
        ledger_dir: the injector folder holding the ranks' collective ledgers (``<serve evidence>/injector``, or
            the ``out_dir`` of a plan loaded into a production launch); None: probes only. With it the ranks'
            ledgers are followed between and after probe rounds (every 0.2 s) and a ledger proof of a deadlock
            (``repro.proof``) declares the hang at once, without waiting for ``failures`` failed probes; a desync
            the ledgers show is logged (``desync`` event).
        hosts: the hosts a multi-node server spans (``repro.hosts.HostSpec``; ``--hosts``): its ranks are listed
            and dumped on each host through that host's runner (``repro/watch/hosts.py``); empty: this host.
    """

    url: str
    interval_s: float = 10.0
    probe_timeout_s: float = 5.0
    health_timeout_s: float = 25.0
    failures: int = 3
    pid_root: Optional[int] = None
    match: Optional[str] = None
    evidence_root: Path = Path("evidence")
    on_hang: Optional[str] = None
    on_hang_timeout_s: float = 600.0
    once: bool = False
    max_rounds: Optional[int] = None
    confirm_gap_s: float = 1.0
    capture_timeout_s: float = 10.0
    native: bool = False
    metrics_path: str = "/metrics"
    ledger_dir: Optional[Path] = None  # the injector folder with the ranks' ledger-<pid>.jsonl (repro.proof reads it)
    hosts: tuple = ()  # repro.hosts.HostSpec of each host the server spans: ranks found and captured there (repro/watch/hosts.py)

    def validate(self) -> "WatchOptions":
        """Check every field; returns self with the URL normalised (no trailing slash).

        Raises:
            WatchConfigError: a value is out of range; the message names the flag and what was expected.
        """
        try:
            parts = urlsplit(self.url)
            parts.port  # noqa: B018 - raises ValueError for a port outside 0..65535
        except ValueError as e:
            raise WatchConfigError(f"--url must look like http://HOST:PORT (got {self.url!r}: {e})") from None
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise WatchConfigError(f"--url must look like http://HOST:PORT (got {self.url!r})")
        for name, flag in (("interval_s", "--interval"), ("probe_timeout_s", "--probe-timeout"),
                           ("health_timeout_s", "--health-timeout"), ("on_hang_timeout_s", "--on-hang-timeout"),
                           ("capture_timeout_s", "--capture-timeout")):
            bad = positive_number_problem(flag, getattr(self, name), "seconds")  # nan and inf too
            if bad:
                raise WatchConfigError(bad)
        bad = non_negative_number_problem("confirm gap", self.confirm_gap_s, "seconds")
        if bad:
            raise WatchConfigError(bad)
        if self.failures < 1:
            raise WatchConfigError(f"--failures must be >= 1 consecutive failed probes (got {self.failures})")
        if self.max_rounds is not None and self.max_rounds < 1:
            raise WatchConfigError(f"--count must be >= 1 probe rounds (got {self.max_rounds})")
        if self.pid_root is not None and (isinstance(self.pid_root, bool) or not isinstance(self.pid_root, int)
                                          or self.pid_root < 1):
            raise WatchConfigError(f"--pid-root must be a process id >= 1, the pid of the server's launcher (got "
                                   f"{self.pid_root})")
        if self.pid_root is not None and _procs.proc_info(self.pid_root) is None:
            raise WatchConfigError(f"--pid-root {self.pid_root}: no such process; pass the pid of the server's "
                                   "launcher (the process that started the rank processes)")
        if self.match is not None and not self.match.strip():
            raise WatchConfigError("--match must be a non-empty piece of the rank processes' titles (what `ps -o args` "
                                   "shows for them)")
        return replace(self, url=self.url.rstrip("/"))
