"""The store: one evidence folder per run, written as the run goes, ``verdict.json`` atomically and last.

Layout (see evidence/README.md): ``evidence/<scenario>/<UTC-time>-<label>/`` with ``evidence/<scenario>/latest``
pointing at the newest run. ``run.json`` says ``running`` from the start and ``complete`` or ``interrupted`` at
the end, so a folder left by a harness that was killed reads as partial, not as a silent success.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

DEFAULT_EVIDENCE_DIR = Path("evidence")


def utc_stamp(t: Optional[float] = None) -> str:
    """``20261130T055501Z`` for ``t`` (seconds since the epoch; default now)."""
    return time.strftime("%Y%m%dT%H%M%SZ", time.gmtime(t))


def write_json_atomic(path: Path, data: Any) -> None:
    """Write JSON to ``path`` via a temporary file in the same folder and ``os.replace`` (never half-written)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=str(path.parent))
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(data, f, indent=2, default=str)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except OSError:
            pass
        raise


def write_text_atomic(path: Path, text: str) -> None:
    """Write text to ``path`` atomically (temporary file + ``os.replace``)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=str(path.parent))
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def _own_create_time() -> Optional[float]:
    try:
        import psutil

        return psutil.Process().create_time()
    except Exception:  # pragma: no cover - psutil is a dependency; be safe in odd sandboxes
        return None


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-") or "run"


class EvidenceDir:
    """One run's evidence folder.

    Args:
        root: the evidence root (default ``./evidence``).
        scenario: scenario name (first path level).
        label: run label (variant name by default), part of the folder name.
    Raises:
        EvidenceError: the folder cannot be created (message names the path and ``--evidence-dir``).
    """

    def __init__(self, root: Path, scenario: str, label: str) -> None:
        self.root = Path(root)
        base = self.root / _slug(scenario)
        name = f"{utc_stamp()}-{_slug(label)}"
        path = base / name
        n = 2
        try:
            base.mkdir(parents=True, exist_ok=True)
            while True:
                try:
                    path.mkdir()
                    break
                except FileExistsError:
                    path = base / f"{name}-{n}"
                    n += 1
        except OSError as e:
            raise EvidenceError(f"cannot create the evidence folder under {base}: {e.strerror}; choose another with --evidence-dir") from None
        self.path = path
        self.scenario_dir = base
        for sub in ("injector", "stacks"):
            (path / sub).mkdir(exist_ok=True)
        self._update_latest()
        self.set_status("running")

    @property
    def injector_dir(self) -> Path:
        return self.path / "injector"

    @property
    def stacks_dir(self) -> Path:
        return self.path / "stacks"

    def file(self, name: str) -> Path:
        return self.path / name

    def _update_latest(self) -> None:
        link = self.scenario_dir / "latest"
        tmp = self.scenario_dir / f".latest.{os.getpid()}"
        try:
            if tmp.is_symlink() or tmp.exists():
                tmp.unlink()
            tmp.symlink_to(self.path.name)
            os.replace(tmp, link)
        except OSError:
            pass  # a filesystem without symlinks: the timestamped folder is still there

    def set_status(self, status: str, **extra: Any) -> None:
        """Record the run's life-cycle in ``run.json`` (``running``, ``complete``, ``interrupted``)."""
        data = {"status": status, "time": time.time(), "pid": os.getpid(), "harness_create_time": _own_create_time()}
        data.update(extra)
        write_json_atomic(self.path / "run.json", data)

    def write_json(self, name: str, data: Any) -> Path:
        p = self.path / name
        write_json_atomic(p, data)
        return p

    def write_text(self, name: str, text: str) -> Path:
        p = self.path / name
        write_text_atomic(p, text)
        return p


class EvidenceError(OSError):
    """The evidence folder cannot be written; the message names the path and the fix."""


def read_json(path: Path) -> Any:
    """Read a JSON file; ``None`` when it is missing."""
    try:
        return json.loads(Path(path).read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None


def read_jsonl(path: Path) -> list[dict]:
    """Read a JSON-lines file, skipping a torn last line (the writer may have been killed mid-line)."""
    out: list[dict] = []
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                line = line.strip()
                if not line:
                    continue
                try:
                    out.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    except FileNotFoundError:
        pass
    return out
