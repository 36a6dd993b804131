"""The driver (Jepsen's client): send a burst of concurrent generate requests and record their history.

Every token a streaming response delivers counts as progress, so a slow-but-moving server never looks stalled.
The history is appended to ``requests.jsonl`` as it happens (one JSON object per event), so a run that is killed
keeps what was sent and answered. The driver never judges: ``verdict`` reads its records.
"""

from __future__ import annotations

import http.client
import json
import random
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional, Protocol

import requests

# Token ids are drawn from this range: below 1000 so any vocabulary (the testbed's tiny model has 1024) fits, and
# above the usual special-token ids.
TOKEN_ID_RANGE = (10, 1000)
NORMAL_FINISH_REASONS = frozenset({"length", "stop"})


class GenerateAdapter(Protocol):
    """The part of an engine adapter the driver needs (``repro.targets.base.Adapter``)."""

    generate_path: str

    def generate_body(self, input_ids: list[int], max_new_tokens: int, stream: bool) -> dict: ...

    def parse_stream_line(self, line: Any) -> Any: ...

    def parse_response(self, payload: Any) -> Any: ...

    def with_sampling(self, body: dict, params: dict) -> dict: ...


def make_prompts(count: int, input_len: int, seed: int) -> list[list[int]]:
    """Distinct token-id prompts, reproducible from ``seed``.

    Returns:
        ``count`` lists of ``input_len`` ints in ``TOKEN_ID_RANGE``; no two lists are equal (each starts with a
        different prefix as long as ``count`` ≤ range size ** 2).
    """
    rng = random.Random(seed)
    lo, hi = TOKEN_ID_RANGE
    seen: set[tuple[int, ...]] = set()
    prompts: list[list[int]] = []
    while len(prompts) < count:
        p = [rng.randrange(lo, hi) for _ in range(input_len)]
        key = tuple(p)
        if key in seen:
            continue
        seen.add(key)
        prompts.append(p)
    return prompts


@dataclass
class RequestRecord:
    """One request's history. Times are ``time.time()`` seconds; ``None`` until the event happened.

    ``status``: ``pending`` (not sent), ``outstanding`` (sent, no final answer), ``ok``, ``error``, ``timeout``,
    ``aborted`` (its client disconnected on purpose: the driver's mass abort, :class:`AbortPlan`).
    """

    index: int
    input_len: int
    max_new_tokens: int
    status: str = "pending"
    sent_t: Optional[float] = None
    first_token_t: Optional[float] = None
    last_progress_t: Optional[float] = None
    done_t: Optional[float] = None
    output_len: int = 0
    finish_reason: Optional[str] = None
    http_status: Optional[int] = None
    error: Optional[str] = None

    @property
    def succeeded(self) -> bool:
        """HTTP 200, exactly the requested number of output ids, and a normal finish reason."""
        return (
            self.status == "ok"
            and self.http_status == 200
            and self.output_len == self.max_new_tokens
            and (self.finish_reason in NORMAL_FINISH_REASONS)
        )


@dataclass(frozen=True)
class AbortPlan:
    """The mass-abort action: once ``when_in_flight`` requests are in flight at once (their request written to the
    connection, so the server has them, and with ``before_first_token`` no output id yet), the clients of ``count`` of them (the lowest indices) disconnect at the
    same instant. ``timeout_s``: seconds after the burst's start to stop waiting for that many in flight (then
    nothing is aborted and the history says so). ``delay_s``: seconds between seeing them in flight and the
    disconnect (the chosen ones are those still in flight, before their first token if asked, after the delay).
    Built from a scenario's ``[burst.abort]`` (:meth:`from_spec`)."""

    count: int
    when_in_flight: int
    before_first_token: bool = True
    timeout_s: float = 60.0
    delay_s: float = 0.0

    @classmethod
    def from_spec(cls, spec: Any) -> Optional["AbortPlan"]:
        """From ``repro.nemeses.MassAbort`` (None → None)."""
        if spec is None:
            return None
        return cls(int(spec.count), int(spec.when_in_flight), bool(spec.before_first_token), float(spec.timeout_s),
                   float(getattr(spec, "delay_s", 0.0) or 0.0))


@dataclass(frozen=True)
class DriverState:
    """A consistent snapshot of the burst. ``last_progress_t`` is the newest progress event of any request."""

    total: int
    pending: int
    outstanding: int
    ok: int
    failed: int
    last_progress_t: Optional[float]
    finished: bool
    requests: tuple[RequestRecord, ...] = field(default=())
    aborted: int = 0
    admin: tuple[dict, ...] = field(default=())  # the workload's admin calls so far (repro.nemeses.AdminCall)
    admin_live: int = 0  # admin calls started and not yet answered (they keep the burst from finishing)

    def waiting_for(self) -> str:
        """What keeps the burst from finishing, as a sentence for a budget time-out: outstanding requests, or once
        every request ended, the admin calls still waiting for their answers."""
        if self.outstanding or self.pending or not self.admin_live:
            return "requests still outstanding"
        return f"every request ended; {self.admin_live} admin call(s) still waiting for an answer"

    def tally(self, now: float) -> str:
        """The burst's requests as a clause for a budget time-out, e.g. ``4 of 8 requests answered, 4 outstanding with
        no progress for 171 s`` (``now``: epoch seconds); a stall with live ranks reads plainly from it."""
        parts = [f"{self.ok} of {self.total} requests answered"]
        if self.failed:
            parts.append(f"{self.failed} failed")
        if self.outstanding:
            quiet = self.stalled_for(now)
            parts.append(f"{self.outstanding} outstanding" + (f" with no progress for {quiet:.0f} s" if quiet >= 1 else ""))
        if self.pending:
            parts.append(f"{self.pending} not sent yet")
        return ", ".join(parts)

    def stalled_for(self, now: float) -> float:
        """Seconds since the last progress event while some request is outstanding (0.0 when none is)."""
        if self.outstanding == 0 or self.last_progress_t is None:
            return 0.0
        return max(0.0, now - self.last_progress_t)


class BurstDriver:
    """Send ``count`` requests with at most ``concurrency`` in flight, streaming when the adapter supports it.

    Args:
        adapter: the engine adapter (request body, stream parsing).
        base_url: e.g. ``http://127.0.0.1:30000``.
        prompts: token-id lists, one per request (see ``make_prompts``).
        max_new_tokens: output ids asked of every request.
        concurrency: requests in flight at once.
        history_path: ``requests.jsonl``; one line per event (sent, first_token, done, error, timeout).
        request_timeout_s: socket read timeout per request in seconds (a hang is detected long before).
        stream: use streaming responses (progress per token).
        abort: a mass abort during the burst (:class:`AbortPlan`); the ``abort`` history event lists the requests.
        workload: what else the clients do (``repro.nemeses.Workload``: mixed lengths and sampling, client aborts
            mid-stream, per-request deadlines, admin calls under load, requests after the burst); ``prompts`` then
            holds one prompt per :func:`repro.nemeses.request_plans` entry (burst requests, then ``after`` ones).
    """

    def __init__(
        self,
        adapter: GenerateAdapter,
        base_url: str,
        prompts: list[list[int]],
        max_new_tokens: int,
        concurrency: int,
        history_path: Path,
        request_timeout_s: float = 600.0,
        stream: bool = True,
        abort: Optional[AbortPlan] = None,
        workload: Any = None,
    ) -> None:
        self.adapter = adapter
        self.base_url = base_url.rstrip("/")
        self.prompts = prompts
        self.max_new_tokens = max_new_tokens
        self.concurrency = max(1, concurrency)
        self.history_path = Path(history_path)
        self.request_timeout_s = request_timeout_s
        self.stream = stream
        self._lock = threading.Lock()
        self._records = [RequestRecord(i, len(p), max_new_tokens) for i, p in enumerate(prompts)]
        self._pool: Optional[ThreadPoolExecutor] = None
        self._abandoned = threading.Event()
        self._history = open(self.history_path, "a", encoding="utf-8")
        self._start_t: Optional[float] = None
        self.abort = abort
        self._to_abort: set[int] = set()
        self._responses: dict[int, Any] = {}
        self._socks: dict[int, socket.socket] = {}  # abortable requests' sockets (a mass abort shuts them down)
        self._on_wire: set[int] = set()  # requests the server has (written, or answered with headers): _in_flight
        self.abort_t: Optional[float] = None  # when the mass abort happened (None: not, or not yet)
        self._init_workload(workload)

    # -- history -----------------------------------------------------------------------------------------
    def _event(self, rec: RequestRecord, event: str, **extra: Any) -> None:
        line = {"t": time.time(), "request": rec.index, "event": event, "output_len": rec.output_len}
        line.update({k: v for k, v in extra.items() if v is not None})
        with self._lock:
            if not self._history.closed:
                self._history.write(json.dumps(line) + "\n")
                self._history.flush()

    # -- one request -------------------------------------------------------------------------------------
    def _one(self, rec: RequestRecord) -> None:
        if self._abandoned.is_set():
            return
        body = self._body(rec)
        now = time.time()
        with self._lock:
            rec.status, rec.sent_t, rec.last_progress_t = "outstanding", now, now
        self._event(rec, "sent", input_len=rec.input_len)
        if self.abort is not None:
            self._one_abortable(rec, body)
            return
        if not self.stream:  # its headers come with the whole answer: counted from the send, as no better sign comes
            with self._lock:
                self._on_wire.add(rec.index)
        try:
            resp = requests.post(
                self.base_url + self.adapter.generate_path,
                json=body,
                stream=self.stream,
                timeout=(10.0, self.request_timeout_s),
            )
            rec.http_status = resp.status_code
            with self._lock:
                self._responses[rec.index] = resp
                self._on_wire.add(rec.index)  # the server answered: it has the request (``requests`` says no sooner)
                cut = rec.index in self._to_abort
            if cut:  # the mass abort came while this request waited for its headers
                resp.close()
                self._finish(rec, "aborted")
                return
            if resp.status_code != 200:
                self._finish(rec, "error", error=f"HTTP {resp.status_code}: {resp.text[:300]}")
                return
            if self.stream:
                for raw in resp.iter_lines():
                    if rec.index in self._to_abort:
                        self._finish(rec, "aborted")
                        return
                    if self._abandoned.is_set():
                        resp.close()
                        self._finish(rec, "error", error="abandoned by the harness")
                        return
                    if not raw:
                        continue
                    upd = self.adapter.parse_stream_line(raw)
                    if upd is None:
                        continue
                    self._progress(rec, upd)
                    if self._cut_mid_stream(rec, resp):
                        return
                    if getattr(upd, "done", False):
                        break
            else:
                self._progress(rec, self.adapter.parse_response(resp.json()))
            self._finish(rec, "ok")
        except requests.Timeout as e:
            self._finish(rec, "timeout", error=f"no answer within {self.request_timeout_s:.0f} s ({type(e).__name__})")
        except Exception as e:  # connection reset when the server is torn down, bad JSON, ...
            if rec.index in self._to_abort:  # our own disconnect surfacing as a read error
                self._finish(rec, "aborted")
            else:
                self._finish(rec, "error", error=f"{type(e).__name__}: {e}")

    def _one_abortable(self, rec: RequestRecord, body: dict) -> None:
        """One request of a burst with a mass abort, on its own ``http.client`` connection whose socket the abort
        thread can shut down at any moment, also before the response headers arrive (``requests`` gives no handle
        on its socket while it waits for them; a client that leaves during prefill or the KV transfer has no
        headers yet: measured on a PD stack, the router's headers come with the first token)."""
        from urllib.parse import urlsplit

        u = urlsplit(self.base_url)
        conn = http.client.HTTPConnection(u.hostname or "127.0.0.1", u.port or 80, timeout=10.0)
        try:
            conn.connect()
            conn.sock.settimeout(self.request_timeout_s)
            with self._lock:
                self._socks[rec.index] = conn.sock
                cut = rec.index in self._to_abort
            if cut:  # the mass abort came while this request was connecting
                self._finish(rec, "aborted")
                return
            payload = json.dumps(body).encode()
            conn.request("POST", (u.path.rstrip("/") or "") + self.adapter.generate_path, body=payload,
                         headers={"Content-Type": "application/json", "Accept": "text/event-stream, application/json"})
            with self._lock:  # only now may the mass abort choose it: a request cut before it was written never
                self._on_wire.add(rec.index)  # reached the server, and aborting it would test nothing there
            resp = conn.getresponse()
            rec.http_status = resp.status
            if rec.index in self._to_abort:
                self._finish(rec, "aborted")
                return
            if resp.status != 200:
                self._finish(rec, "error", error=f"HTTP {resp.status}: {resp.read(300).decode('utf-8', 'replace')}")
                return
            if self.stream:
                while True:
                    raw = resp.readline()
                    if rec.index in self._to_abort:
                        self._finish(rec, "aborted")
                        return
                    if self._abandoned.is_set():
                        self._finish(rec, "error", error="abandoned by the harness")
                        return
                    if not raw:
                        break  # end of the response
                    raw = raw.rstrip(b"\r\n")
                    if not raw:
                        continue
                    upd = self.adapter.parse_stream_line(raw)
                    if upd is None:
                        continue
                    self._progress(rec, upd)
                    if getattr(upd, "done", False):
                        break
            else:
                self._progress(rec, self.adapter.parse_response(json.loads(resp.read())))
            self._finish(rec, "ok")
        except (socket.timeout, TimeoutError) as e:
            if rec.index in self._to_abort:
                self._finish(rec, "aborted")
            else:
                self._finish(rec, "timeout", error=f"no answer within {self.request_timeout_s:.0f} s ({type(e).__name__})")
        except Exception as e:  # our own shutdown surfacing as a read error, a reset when the server is torn down, ...
            if rec.index in self._to_abort:
                self._finish(rec, "aborted")
            else:
                self._finish(rec, "error", error=f"{type(e).__name__}: {e}")
        finally:
            with self._lock:
                self._socks.pop(rec.index, None)
            conn.close()

    def _progress(self, rec: RequestRecord, upd: Any) -> None:
        now = time.time()
        first = False
        with self._lock:
            n = getattr(upd, "output_ids", None)
            n = rec.output_len if n is None else int(n)
            if getattr(upd, "error", None):
                rec.error = str(upd.error)
            if n > rec.output_len:
                first = rec.first_token_t is None
                if first:
                    rec.first_token_t = now
                rec.output_len = n
                rec.last_progress_t = now
            reason = getattr(upd, "finish_reason", None)
            if reason:
                rec.finish_reason = reason
        if first:
            self._event(rec, "first_token")

    def _finish(self, rec: RequestRecord, status: str, error: Optional[str] = None) -> None:
        with self._lock:
            if rec.status in ("ok", "error", "timeout", "aborted"):
                return
            if status == "aborted" and error is None:
                error = self._cut_why.get(rec.index)  # the workload's client abort or deadline (None: the mass abort)
            rec.status = status
            rec.done_t = time.time()
            rec.error = error
            if status == "ok" and rec.error:
                rec.status = "error"  # the engine answered 200 but reported an error (e.g. abort) in the body
            elif status == "ok" and not rec.succeeded:
                rec.error = (
                    f"answered with {rec.output_len}/{rec.max_new_tokens} output ids, finish reason {rec.finish_reason!r}"
                )
        self._event(rec, "done" if status == "ok" else status, finish_reason=rec.finish_reason, http_status=rec.http_status, error=rec.error)

    # -- workload actions (repro.nemeses.Workload; the mass abort above is AbortPlan's) ------------------------
    def _init_workload(self, workload: Any) -> None:
        """Per-request plans of a workload: output lengths, sampling, client aborts, deadlines; admin calls; the
        requests sent after the burst (the last ``workload.after`` prompts).

        Raises:
            ValueError: the workload asks for sampling parameters the adapter cannot add (its ``with_sampling``
                refuses them: ``AdapterBase``'s default), or
                fewer prompts than ``workload.after``.
        """
        from repro.nemeses import request_plans

        self.workload = workload
        self._cut_why: dict[int, str] = {}
        self._admin: list[dict] = []
        self._admin_live = 0  # admin calls started and not yet answered (or given up): the burst is not finished
        n = len(self.prompts)
        self._n_burst = n
        self._plans = None
        if workload is None:
            return
        if workload.after > n - 1:
            raise ValueError(f"workload.after ({workload.after}) needs at least one burst request before it ({n} prompts)")
        self._n_burst = n - workload.after
        self._plans = request_plans(self._n_burst, 1, self.max_new_tokens, workload)
        first = next((pl for pl in self._plans if pl.sampling), None)
        if first is not None:  # refused now, before any request, by an adapter that adds no sampling parameters
            self.adapter.with_sampling(self.adapter.generate_body(self.prompts[0], 1, self.stream), first.sampling)
        self._records = [RequestRecord(i, len(p), self._plans[i].max_new_tokens) for i, p in enumerate(self.prompts)]

    def _body(self, rec: RequestRecord) -> dict:
        """The request body: the adapter's, with this request's extra sampling parameters (workload ``mix``)."""
        body = self.adapter.generate_body(self.prompts[rec.index], rec.max_new_tokens, self.stream)
        plan = self._plans[rec.index] if self._plans else None
        if plan is not None and plan.sampling:
            body = self.adapter.with_sampling(body, plan.sampling)
        return body

    def _cut_mid_stream(self, rec: RequestRecord, resp: Any) -> bool:
        """Client abort mid-stream: once this request has ``abort_after_tokens`` ids, its client disconnects."""
        plan = self._plans[rec.index] if self._plans else None
        k = plan.abort_after_tokens if plan is not None else None
        if k is None or rec.output_len < k:
            return False
        with self._lock:
            self._to_abort.add(rec.index)
            self._cut_why[rec.index] = f"client abort after {rec.output_len} output ids (workload client_abort: {k})"
        try:
            resp.close()
        except Exception:
            pass
        self._finish(rec, "aborted")
        return True

    def _start_workload(self) -> None:
        """Start the workload's threads: deadlines, admin calls, the requests after the burst."""
        w = self.workload
        if w is None:
            return
        if any(pl.deadline_s is not None for pl in self._plans or []):
            threading.Thread(target=self._deadlines, name="repro-driver-deadlines", daemon=True).start()
        for k, call in enumerate(w.admin):
            with self._lock:
                self._admin_live += 1
            threading.Thread(target=self._admin_thread, args=(k, call), name=f"repro-driver-admin{k}", daemon=True).start()
        if self._n_burst < len(self._records):
            threading.Thread(target=self._after_burst, name="repro-driver-after", daemon=True).start()

    def _deadlines(self) -> None:
        """Per-request timeouts: a request still outstanding ``deadline_s`` after it was sent has its client give up
        (socket closed; recorded ``aborted`` with the reason). A request whose answer never began stays outstanding
        until its thread sees the cut, so a deadline never hides a hang."""
        plans = self._plans or []
        while not self._abandoned.is_set():
            now = time.time()
            live = False
            with self._lock:
                due = []
                for r in self._records[: self._n_burst]:
                    dl = plans[r.index].deadline_s
                    if dl is None or r.status not in ("pending", "outstanding"):
                        continue
                    live = True
                    if r.status == "outstanding" and r.sent_t is not None and now - r.sent_t >= dl and r.index not in self._to_abort:
                        self._to_abort.add(r.index)
                        self._cut_why[r.index] = f"client deadline of {dl:g} s (workload deadlines)"
                        due.append(self._responses.get(r.index))
            for resp in due:
                if resp is not None:
                    try:
                        resp.close()
                    except Exception:
                        pass
            if not live:
                return
            time.sleep(0.01)

    def _in_flight(self) -> int:
        """Requests the server has and has not finished (an admin call's ``when_in_flight``): outstanding, and
        written to the connection (a mass-abort burst's own connections) or answered with headers (``requests``,
        which gives no sooner sign). One merely marked outstanding may still be connecting: measured, an admin
        call then reached the server before any stream was open."""
        with self._lock:
            return sum(r.status == "outstanding" and r.index in self._on_wire for r in self._records)

    def _burst_ended(self) -> bool:
        """Every request of the workload (burst and ``after``) has ended: no more load will come."""
        with self._lock:
            return not any(r.status in ("pending", "outstanding") for r in self._records)

    def _admin_thread(self, k: int, call: Any) -> None:
        """Run one admin call; while it runs the burst is not :attr:`DriverState.finished`."""
        try:
            self._admin_call(k, call)
        finally:
            with self._lock:
                self._admin_live -= 1

    def _admin_call(self, k: int, call: Any) -> None:
        """One admin call of the workload (``repro.nemeses.AdminCall``): wait for the load, call, record each answer
        (``admin`` history event and :attr:`DriverState.admin`)."""
        deadline = time.time() + call.wait_s
        while call.when_in_flight and self._in_flight() < call.when_in_flight:
            if self._abandoned.is_set():
                return
            ended = self._burst_ended()
            if ended or time.time() > deadline:
                why = "before every request had ended" if ended else f"within {call.wait_s:g} s"
                self._admin_record({"call": k, "method": call.method, "path": call.path, "ok": False, "done": False,
                                    "error": f"never {call.when_in_flight} requests in flight {why}: not called"})
                return
            time.sleep(0.005)
        if call.delay_s:
            time.sleep(call.delay_s)
        body = call.body
        if call.fill_from:
            try:
                info = requests.get(self.base_url + call.fill_from, timeout=(5.0, call.timeout_s)).json()
                body = call.filled_body(info if isinstance(info, dict) else {})
            except Exception as e:  # KeyError: a placeholder the answer lacks; a non-JSON or no answer
                self._admin_record({"call": k, "method": call.method, "path": call.path, "ok": False, "done": False,
                                    "error": f"could not fill the body from {call.fill_from}: {type(e).__name__}: {e}"})
                return
        for n in range(call.repeat):
            if self._abandoned.is_set():
                return
            t0 = time.time()
            rec: dict = {"call": k, "n": n, "method": call.method, "path": call.path, "in_flight": self._in_flight(), "done": True}
            try:
                resp = requests.request(call.method, self.base_url + call.path, params=call.query or None, json=body,
                                        headers=call.headers or None, timeout=(5.0, call.timeout_s))
                rec.update(http_status=resp.status_code, ok=resp.status_code in call.ok_status, answer=resp.text[:300])
            except requests.Timeout:
                rec.update(ok=False, timeout=True, error=f"no answer within {call.timeout_s:g} s")
            except Exception as e:
                rec.update(ok=False, error=f"{type(e).__name__}: {e}")
            rec["elapsed_s"] = round(time.time() - t0, 3)
            self._admin_record(rec)
            if call.interval_s and n + 1 < call.repeat:
                time.sleep(call.interval_s)

    def _admin_record(self, rec: dict) -> None:
        with self._lock:
            self._admin.append(rec)
        self._event_plain("admin", **rec)

    def _warm_flush(self, warm: Any) -> None:
        """Storage-warm workload (``repro.nemeses.WarmStorage``): wait for write-through backups, flush the caches;
        recorded as admin call ``warm_storage`` (its HTTP status; a refused flush leaves the after requests warm in
        the device cache instead, which the record shows)."""
        time.sleep(warm.wait_s)
        t0 = time.time()
        rec: dict = {"call": "warm_storage", "n": 0, "method": "POST", "path": warm.flush_path, "in_flight": self._in_flight(),
                     "done": True}
        try:
            resp = requests.post(self.base_url + warm.flush_path, headers=warm.headers or None, timeout=(5.0, warm.timeout_s))
            rec.update(http_status=resp.status_code, ok=resp.status_code == 200, answer=resp.text[:300])
        except Exception as e:
            rec.update(ok=False, error=f"{type(e).__name__}: {e}")
        rec["elapsed_s"] = round(time.time() - t0, 3)
        self._admin_record(rec)

    def _after_burst(self) -> None:
        """Send the workload's ``after`` requests once every burst request has ended (answered, failed or cut)."""
        while not self._abandoned.is_set():
            with self._lock:
                busy = any(r.status in ("pending", "outstanding") for r in self._records[: self._n_burst])
            if not busy:
                break
            time.sleep(0.01)
        else:
            return
        warm = getattr(self.workload, "warm_storage", None)
        if warm is not None:
            self._warm_flush(warm)
        self._event_plain("after_burst", requests=list(range(self._n_burst, len(self._records))))
        for rec in self._records[self._n_burst:]:
            try:
                assert self._pool is not None
                self._pool.submit(self._one, rec)
            except RuntimeError:  # the pool was shut down (abandoned) meanwhile
                return

    # -- control -----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Submit every request to a thread pool and return at once."""
        self._start_t = time.time()
        self._pool = ThreadPoolExecutor(max_workers=self.concurrency, thread_name_prefix="repro-driver")
        for rec in self._records[: self._n_burst]:
            self._pool.submit(self._one, rec)
        self._start_workload()
        if self.abort is not None:
            threading.Thread(target=self._abort_when_due, name="repro-driver-abort", daemon=True).start()

    def _abort_when_due(self) -> None:
        """Wait until ``abort.when_in_flight`` requests are in flight (before their first token, if asked), then
        disconnect ``abort.count`` of them at once: mark them, close every open response in one pass."""
        plan = self.abort
        assert plan is not None
        deadline = time.time() + plan.timeout_s
        due: Optional[float] = None  # when enough were seen in flight, plus the delay
        while not self._abandoned.is_set() and time.time() < deadline:
            with self._lock:
                flying = [r for r in self._records if r.status == "outstanding" and r.index in self._on_wire
                          and (not plan.before_first_token or r.first_token_t is None)]
                if due is None and len(flying) >= plan.when_in_flight:
                    due = time.time() + plan.delay_s
                if due is not None and time.time() >= due and flying:
                    chosen = sorted(r.index for r in flying)[: plan.count]
                    self._to_abort.update(chosen)
                    resps = [self._responses.get(i) for i in chosen]
                    socks = [self._socks.get(i) for i in chosen]
                    self.abort_t = time.time()
                    break
            time.sleep(0.005)
        else:
            self._event_plain("abort_not_done", in_flight_needed=plan.when_in_flight, waited_s=plan.timeout_s)
            return
        for sock in socks:  # a real disconnect now, headers or not: the peer sees the connection close
            if sock is not None:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        for resp in resps:
            if resp is not None:
                try:
                    resp.close()
                except Exception:
                    pass
        self._event_plain("abort", requests=chosen, in_flight=len(flying), before_first_token=plan.before_first_token)

    def _event_plain(self, event: str, **extra: Any) -> None:
        line = {"t": time.time(), "event": event, **extra}
        with self._lock:
            if not self._history.closed:
                self._history.write(json.dumps(line) + "\n")
                self._history.flush()

    def state(self) -> DriverState:
        """A snapshot of every request (copies), safe to read while the burst runs."""
        with self._lock:
            recs = tuple(RequestRecord(**asdict(r)) for r in self._records)
            admin = tuple(dict(a) for a in self._admin)
            admin_live = self._admin_live
        pending = sum(r.status == "pending" for r in recs)
        outstanding = sum(r.status == "outstanding" for r in recs)
        ok = sum(r.succeeded for r in recs)
        aborted = sum(r.status == "aborted" for r in recs)
        # a workload's admin call still waiting for its answer (bounded by its own timeout_s) is part of the burst:
        # a burst that ended before /flush_cache answered would report the call as never made
        finished = pending == 0 and outstanding == 0 and admin_live == 0
        progress = [t for r in recs for t in (r.last_progress_t, r.done_t) if t is not None]
        return DriverState(
            total=len(recs),
            pending=pending,
            outstanding=outstanding,
            ok=ok,
            failed=len(recs) - pending - outstanding - ok - aborted,
            last_progress_t=max(progress) if progress else self._start_t,
            finished=finished,
            requests=recs,
            aborted=aborted,
            admin=admin,
            admin_live=admin_live,
        )

    def abandon(self) -> None:
        """Stop sending; requests still in flight end when the server is torn down (their sockets close)."""
        self._abandoned.set()
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)

    def close(self, wait_s: float = 5.0) -> None:
        """Abandon what is left, give in-flight threads ``wait_s`` seconds to notice, close the history file."""
        self.abandon()
        deadline = time.time() + wait_s
        while time.time() < deadline and self.state().outstanding:
            time.sleep(0.05)
        with self._lock:
            self._history.close()
