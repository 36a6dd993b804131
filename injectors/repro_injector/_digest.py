"""The per-tick lockstep state digest: named probes on the tick function's receiver, written into the ledger.

Enabled by the plan's ``ledger.digest`` (``{"enabled": bool, "package": "sglang", "releases": {version: [{"name",
"path", "kind"}]}, "ring": int}``, compiled by the harness from the engine's per-release data files,
``repro/targets/<engine>/releases/<V>.toml`` ``[state]``; the list of the release installed here is used, none when
it has none). Evaluated by the ticking thread at the start of every scheduler tick (``_ledger.Ledger``'s tick
wrapper), before the tick runs; no collective, no lock the engine holds, never raises into the engine.

Path syntax (parsed here, never ``eval``'d): ``a.b.c`` attribute chains, ``m()`` zero-argument method calls,
``len(path)``, ``path[*].x.y``: the set of ``x.y`` of the members of a list (or of a dict's keys; ``d.values()[*].x``
for its values), recorded as ``[size, blake2b-64 hex of the sorted ids joined by U+001F]`` (never Python's salted
``hash()``), and ``sum(path[*].x.y)``: the sum of those numbers (an int; 0 for no member). A probe reads attributes
and calls only the zero-argument methods its path names: it takes no lock (``len(q.queue)`` of a ``queue.Queue``,
never ``q.qsize()``, which takes the queue's mutex) and calls nothing a nemesis patches (tests/test_state_digest.py
checks the release files against the natural catalogue).

Ledger lines (``ledger-<pid>.jsonl``, beside the collective records):

- ``{"e": "state", "tick", "full": true|absent, "kinds", "v": {name: value}}``: the probes whose value changed
  since this process's previous tick (``full``: every probe, at the first tick and as the first state line of every
  file part; a full line's ``kinds`` names the probes that are not ``lockstep``: ``transient`` / ``local`` /
  ``info``; its ``tol``: probe → the plan's ``tolerance``, where one is set: transient numbers that close count equal).
  A value is an int / float / str / bool, ``[size, hash]`` for a set, or null for *absent* (the path does not exist
  on this server: an attribute is missing or None on the way, e.g. HiCache off).
- ``{"e": "state_error", "tick", "probe", "err"}``: the probe raised something other than a missing attribute;
  written once, the probe is not evaluated again in this process (the harness skips it on every rank).

``digest-<pid>.jsonl`` (a bounded ring: ``ring`` lines per part, the previous part kept as ``digest-<pid>.1.jsonl``):
``{"tick", "probe", "members": [...]}`` each time a set probe of at most ``MAX_RING_MEMBERS`` (256) members changed,
for the diagnosis' "members only one rank holds".
"""

from __future__ import annotations

import hashlib
import json
import operator
import os
import re
from typing import Any, Dict, List, Optional, Tuple

from . import files as _files

_SEG = r"[A-Za-z_][A-Za-z0-9_]*(?:\(\))?"
PATH_RE = re.compile(rf"^(?:(?P<fn>len|sum)\()?(?P<head>{_SEG}(?:\.{_SEG})*)(?:\[\*\](?P<each>(?:\.[A-Za-z_][A-Za-z0-9_]*)+))?(?(fn)\))$")
KINDS = ("lockstep", "transient", "local", "info")
SEP = "\x1f"
MAX_RING_MEMBERS = 256  # a larger set's members are not kept in the ring (its size and hash are still recorded)


def probes_for_release(spec: Dict[str, Any]) -> Tuple[Optional[List[Dict[str, Any]]], str]:
    """The probe list for the engine release installed in this process.

    ``spec["probes"]`` when given (tests); else ``spec["releases"][<version of spec["package"]>]`` (the version from
    ``importlib.metadata``, without importing the engine). Returns ``(probes, "")`` or ``(None, why not)``.
    """
    if spec.get("probes"):
        return list(spec["probes"]), ""
    releases = spec.get("releases") or {}
    pkg = str(spec.get("package") or "")
    try:
        from importlib import metadata

        version = metadata.version(pkg)
    except Exception as e:
        return None, f"version of {pkg!r} unknown ({type(e).__name__}); no state digest"
    probes = releases.get(version) or releases.get(version.split("+")[0])
    if not probes:
        return None, f"no state probes for {pkg} {version} (have: {', '.join(sorted(releases)) or 'none'})"
    return list(probes), ""


class ProbeSyntaxError(ValueError):
    """A probe path outside the restricted syntax (the module docstring)."""


def parse_path(path: str) -> Tuple[bool, List[Tuple[str, bool]], Optional[List[str]]]:
    """Parse one probe path.

    Returns:
        ``(fn, steps, each)``: ``fn`` ``"len"``, ``"sum"`` or ``""``; ``steps`` a list of ``(attribute, call)`` from
        the receiver; ``each`` the attribute chain taken on every member (a set or sum probe), or None.
    Raises:
        ProbeSyntaxError: the path is not in the restricted syntax (``len(...)`` and ``[*]`` do not combine;
            ``sum(...)`` needs ``[*]``).
    """
    m = PATH_RE.match(path.replace(" ", ""))
    fn = m.group("fn") if m else None
    if not m or (fn == "len" and m.group("each")) or (fn == "sum" and not m.group("each")):
        raise ProbeSyntaxError(f"probe path {path!r}: expected attribute chains, zero-argument calls 'name()', "
                               "'len(path)', 'path[*].attr' or 'sum(path[*].attr)'")
    steps = [(s[:-2], True) if s.endswith("()") else (s, False) for s in m.group("head").split(".")]
    each = m.group("each")
    return fn or "", steps, (each[1:].split(".") if each else None)


class Absent(Exception):
    """The probe's path does not exist on this server (an attribute missing or None on the way)."""


def set_hash(ids: List[str]) -> str:
    """blake2b-64 (hex) of the sorted ids joined by U+001F: the same on every rank for the same set."""
    return hashlib.blake2b(SEP.join(sorted(ids)).encode("utf-8", "replace"), digest_size=8).hexdigest()


class Probe:
    """One compiled probe; :meth:`read` gives its value on a receiver (raises Absent or the probe's own error)."""

    __slots__ = ("name", "path", "kind", "tol", "fn", "steps", "each", "getter", "last_ids", "last_val")

    def __init__(self, name: str, path: str, kind: str = "lockstep", tol: float = 0.0) -> None:
        self.name, self.path, self.kind, self.tol = name, path, kind, float(tol or 0.0)
        self.fn, self.steps, self.each = parse_path(path)
        self.getter = operator.attrgetter(".".join(self.each)) if self.each else None
        self.last_ids: Any = None  # a set probe's previous member list (hash only when it changed)
        self.last_val: Any = None

    def read(self, obj: Any) -> Tuple[Any, Optional[List[str]]]:
        """``(value, members)``: members only for a set probe whose member list changed since the last read."""
        for attr, call in self.steps:
            if obj is None:
                raise Absent()
            try:
                obj = getattr(obj, attr)
            except AttributeError:
                raise Absent() from None
            if call:
                obj = obj()
        if obj is None:
            raise Absent()
        if self.fn == "len":
            return len(obj), None
        if self.each is None:
            return obj, None
        raw = list(map(self.getter, obj))
        if self.fn == "sum":
            return sum(x for x in raw if x is not None), None
        if raw == self.last_ids:
            return self.last_val, None
        ids = sorted(raw) if not raw or isinstance(raw[0], str) else sorted(str(i) for i in raw)
        val = [len(ids), hashlib.blake2b(SEP.join(ids).encode("utf-8", "replace"), digest_size=8).hexdigest()]
        self.last_ids, self.last_val = raw, val
        return val, (ids if len(ids) <= MAX_RING_MEMBERS else None)


class Digest:
    """The probes of one process and their previous values (see the module docstring).

    Args:
        spec: the plan's ``ledger.digest``; ``out_dir`` / ``pid`` for ``digest-<pid>.jsonl``.
    """

    def __init__(self, spec: Dict[str, Any], out_dir: str, pid: int) -> None:
        self.probes: List[Probe] = []
        self.errors: List[Tuple[str, str]] = []  # probes that did not compile (written at the first tick)
        self.failed: List[Tuple[str, str]] = []  # probes dropped after an error (repeated in every ledger part)
        for p in spec.get("probes") or []:
            try:
                self.probes.append(Probe(str(p["name"]), str(p["path"]), str(p.get("kind") or "lockstep"),
                                         float(p.get("tolerance") or 0.0)))
            except (KeyError, ProbeSyntaxError) as e:
                self.errors.append((str(p.get("name", "?")), f"{type(e).__name__}: {e}"))
        self.ring = max(2, int(spec.get("ring") or 2000))
        self.prev: Dict[str, Any] = {}
        self.full = True
        self.out_dir, self.pid = out_dir, pid
        self.fh: Any = None
        self.in_part = 0
        self.eval_s = 0.0  # benchmarks: thread time spent in tick(), all ticks

    def tick(self, tick: int, receiver: Any) -> List[str]:
        """Evaluate every probe on ``receiver``; returns the ledger lines to write (none when nothing changed)."""
        out: List[str] = []
        changed: Dict[str, Any] = {}
        full = self.full
        prev = self.prev
        members: List[Tuple[str, List[str]]] = []
        for p in list(self.probes):
            try:
                v, m = p.read(receiver)
            except Absent:
                v, m = None, None
            except Exception as e:  # never into the engine: record once, drop the probe in this process
                self.probes.remove(p)
                self.failed.append((p.name, f"{type(e).__name__}: {e}"[:300]))
                out.append(self._error_line(tick, *self.failed[-1]))
                continue
            if not isinstance(v, (int, float, str, bool, list)) and v is not None:
                v = repr(v)[:100]
            if full or p.name not in prev or prev[p.name] != v:
                changed[p.name] = v
                prev[p.name] = v
            if m is not None:
                members.append((p.name, m))
        if full and self.errors:
            for name, err in self.errors:
                out.append(self._error_line(tick, name, err))
            self.failed += self.errors
            self.errors = []
        if changed:
            rec: Dict[str, Any] = {"e": "state", "tick": tick}
            if full:
                rec["full"] = True
                self._kinds(rec)
            rec["v"] = changed
            out.append(json.dumps(rec, default=repr, separators=(",", ":")))
        self.full = False
        if members:
            self._ring(tick, members)
        return out

    def _kinds(self, rec: Dict[str, Any]) -> None:
        kinds = {p.name: p.kind for p in self.probes if p.kind != "lockstep"}
        if kinds:
            rec["kinds"] = kinds
        tol = {p.name: p.tol for p in self.probes if p.tol}
        if tol:
            rec["tol"] = tol

    @staticmethod
    def _error_line(tick: int, name: str, err: str) -> str:
        return json.dumps({"e": "state_error", "tick": tick, "probe": name, "err": err}, separators=(",", ":"))

    def full_lines(self, tick: int) -> List[str]:
        """The first state lines of a new ledger part: the failed probes again, then every probe's last value."""
        if not self.prev:
            return []
        return [self._error_line(tick, n, e) for n, e in self.failed] + [self.full_line(tick)]

    def full_line(self, tick: int) -> str:
        """Every probe's last value as one ``full`` state line."""
        rec: Dict[str, Any] = {"e": "state", "tick": tick, "full": True}
        self._kinds(rec)
        rec["v"] = dict(self.prev)
        return json.dumps(rec, default=repr, separators=(",", ":"))

    def _path(self, part: int) -> str:
        return os.path.join(self.out_dir, _files.digest_file(self.pid, part))

    def _ring(self, tick: int, members: List[Tuple[str, List[str]]]) -> None:
        if self.fh is None:
            self.fh = open(self._path(0), "a", encoding="utf-8")
        for name, m in members:
            if self.in_part >= self.ring:
                self.fh.close()
                os.replace(self._path(0), self._path(1))
                self.fh = open(self._path(0), "a", encoding="utf-8")
                self.in_part = 0
            self.fh.write(json.dumps({"tick": tick, "probe": name, "members": m}, separators=(",", ":")) + "\n")
            self.in_part += 1
        self.fh.flush()

    def after_fork(self, pid: int) -> None:
        self.pid, self.fh, self.in_part, self.full = pid, None, 0, True
