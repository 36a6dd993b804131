"""The collective ledger's file (``ledger-<pid>.jsonl`` and its rotated parts): the writing half of
``_ledger.Ledger``, which inherits it. The format, the rotation and the pinned parts are described in ``_ledger.py``'s
module docstring; the attributes used here (``fh``, ``part``, ``in_part``, ``q``, ``_frags``, …) are set by
``Ledger.__init__`` and reset by ``Ledger.after_fork``. stdlib only, like the rest of the injector."""

from __future__ import annotations

import json
import os
import sys
import time
from typing import Any, Dict, List, Tuple

from . import files as _files

MAX_FRAGMENTS = 4096  # encoded line parts kept (enter_line); cleared when full
PINNED_PARTS = (3, 2)  # ledger-<pid>.3/.2.jsonl: the part current at the latest arming and the next, kept past rotation

_wall = time.time


def _js(x: Any) -> str:
    return json.dumps(x, default=repr, separators=(",", ":"))


class LedgerFile:
    """Writes the queued records of a ``_ledger.Ledger`` (a mixin: ``Ledger`` holds the state)."""

    def path(self, part: int = 0) -> str:
        """``<out_dir>/ledger-<pid>.jsonl`` (current part) or ``ledger-<pid>.1.jsonl`` (previous part)."""
        return os.path.join(self.rt.out_dir, _files.ledger_file(self.rt.pid, part))

    def _open(self) -> None:
        if self.rank is None:  # a state digest line can come before this process's first collective
            dist = sys.modules.get("torch.distributed")
            try:
                if dist is not None and dist.is_initialized():
                    self.rank = int(dist.get_rank())
            except Exception:
                pass
        self.fh = open(self.path(), "a", encoding="utf-8")
        self.in_part = 0
        self._line({"e": "header", "pid": self.rt.pid, "rank": self.rank, "part": self.part, "dropped": self.dropped,
                    "max_records": self.max_records, "time": _wall()})
        for _pg, info in list(self.groups.values()):
            if info.get("g") is not None:
                self._line({"e": "group", **info})
        if self.digest is not None and self.part:  # each part starts with a full digest (part 0: the first tick's)
            for line in self.digest.full_lines(self.tick):
                self.fh.write(line + "\n")

    def _line(self, rec: Dict[str, Any]) -> None:
        self.fh.write(_js(rec) + "\n")

    def enter_line(self, item: tuple) -> str:
        """One queued enter item as its JSON line (the same object as ``json.dumps`` of the record dict, keys in
        the documented order). The parts that repeat from one collective to the next — group, op / API / reduce
        op, shapes and dtypes, call site, injection / thread — are encoded once and kept (``_frags``, bounded):
        a third of ``json.dumps``'s time per record, measured in benchmarks/RESULTS.md."""
        _, key, seq, op, api, red, meta, site, tick, t, inj, thread, bypass, src = item[:14]
        vin = item[14] if len(item) > 14 else None
        if red is not None and not isinstance(red, str):
            red = str(red).rsplit(".", 1)[-1]
        f1, f2, f3 = self._frags
        if len(f1) + len(f2) + len(f3) > MAX_FRAGMENTS:
            f1.clear(), f2.clear(), f3.clear()
        k1 = (key, op, api, red)
        a = f1.get(k1)
        if a is None:
            a = f1[k1] = ('{"e":"enter","g":' + _js(key) + ',"seq":', ',"op":' + _js(op) + ',"api":' + _js(api)
                          + ',"red":' + _js(red) + ',"shapes":')
        k2 = (meta, site)
        b = f2.get(k2)
        if b is None:
            shapes, dtypes = self._tensor_meta(meta)
            b = f2[k2] = _js(shapes) + ',"dtypes":' + _js(dtypes) + ',"site":' + _js(list(site)) + ',"tick":'
        k3 = (inj, thread, bool(bypass), src)
        c = f3.get(k3)
        if c is None:
            c = f3[k3] = (',"inj":' + _js(inj) + ',"thread":' + _js(thread) + (',"bypass":true' if bypass else "")
                          + ("" if src is None else ',"src":' + _js(src)) + "}\n")
        return (a[0] + str(int(seq)) + a[1] + b + str(int(tick)) + ',"t":' + repr(float(t))
                + (c if vin is None else c[:-2] + ',"in":' + _js(vin) + "}\n"))

    def note_armed(self) -> None:
        """A new arming (every rank reads it; a hunt's next trial on the same server): the part current now and the
        next one are kept at rotation (``PINNED_PARTS``), the earlier arming's pinned parts dropped."""
        self.pin_from = self.part

    def _rotate(self) -> None:
        self.fh.close()
        self.fh = None
        i = self.part - 1 - self.pin_from if self.pin_from is not None else -1
        if 0 <= i < len(PINNED_PARTS) and os.path.exists(self.path(1)):
            # the part about to be replaced began within the arming's first two parts: keep it (a long stall ticks
            # on and would rotate the nemesis's own ticks away); every rank pins the same parts (it is the arming's)
            if i == 0:
                self.dropped += self.pinned_records
                self.pinned_records = 0
                for q in PINNED_PARTS:
                    if os.path.exists(self.path(q)):
                        os.remove(self.path(q))
            self.pinned_records += self.prev_part_records
            os.replace(self.path(1), self.path(PINNED_PARTS[i]))
        else:
            self.dropped += self.prev_part_records
        self.prev_part_records = self.in_part
        os.replace(self.path(0), self.path(1))
        self.part += 1
        self._open()

    @staticmethod
    def _tensor_meta(meta: tuple) -> Tuple[List[Any], List[str]]:
        """Shapes and dtypes as written, from :func:`_meta`'s ``(shape, dtype)`` pairs."""
        return [list(m[0]) for m in meta], [str(m[1]).replace("torch.", "") for m in meta]

    def write_now(self) -> None:
        """The calling thread writes the queue (hot path, at a collective's entry): never waits for the writer
        thread (skipped while it is writing) and never raises into the caller."""
        if not self._wlock.acquire(False):
            return
        try:
            self._drain_locked()
        except Exception as e:
            self.last_write = _wall()  # do not retry at every collective
            try:
                self.rt.error("ledger write", e)
            except Exception:
                pass
        finally:
            self._wlock.release()

    def drain_on_error(self) -> None:
        """A collective raised (gloo's size check, a timeout, an abort): write the queue now, blocking, so the record
        of the collective that failed is on disk before the exception ends the process (SGLang's scheduler sends
        its parent SIGQUIT from its ``except`` path; the writer thread would have had up to ``WRITER_PERIOD_S``).
        Never raises into the caller."""
        try:
            self.drain()
        except Exception as e:
            try:
                self.rt.error("ledger write after a failed collective", e)
            except Exception:
                pass

    def drain(self) -> None:
        """Write everything queued so far and flush (writer thread, atexit, tests)."""
        with self._wlock:
            self._drain_locked()

    def _drain_locked(self) -> None:
        self.last_write = _wall()
        if not self.q:
            return
        if self.fh is None:
            self._open()
        q = self.q
        while q:
            item = q.popleft()
            kind = item[0]
            if kind == "x":
                _, key, seq, t, err = item[:5]
                vout = item[5] if len(item) > 5 else None
                self.fh.write('{"e":"exit","g":' + _js(key) + ',"seq":' + str(int(seq)) + ',"t":' + repr(float(t))
                              + ',"err":' + ("null" if err is None else _js(err))
                              + ("" if vout is None else ',"out":' + _js(vout)) + "}\n")
            elif kind == "n":
                line = self.enter_line(item)
                if self.in_part >= self.max_records // 2:
                    self._rotate()
                self.fh.write(line)
                self.in_part += 1
                self.total += 1
            elif kind == "g":
                self._line({"e": "group", **item[1]})
            elif kind == "s":
                self.fh.write(item[1] + "\n")
        self.fh.flush()
