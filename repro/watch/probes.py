"""The watch's probes: one bounded generate probe, one /health probe in its own thread, the wrong-API check, and what
/health said meanwhile (:func:`classify_health`)."""

from __future__ import annotations

import requests
import threading
import time
from dataclasses import asdict, dataclass, replace
from typing import Any, Callable, Optional, Sequence


PROBE_INPUT_IDS = (1, 2, 3, 4)  # token ids of the generate probe (valid in any vocabulary of >= 5 tokens)


# A server that never answered a generate probe successfully and answers one of these statuses (or closes the
# connection) within WRONG_API_FAST_S is "not this engine's API / misconfigured URL", not hung: a hang is a probe
# that does not answer in time. After a success, fast errors count toward a hang again (a router answers fast 5xx
# when its workers hang).
WRONG_API_STATUSES = (404, 405, 501)


WRONG_API_FAST_S = 1.0


# generate-probe outcomes
OK, TIMEOUT, REFUSED, HTTP_ERROR, BAD_ANSWER, SKIPPED, ERROR, INTERRUPTED = (
    "ok", "timeout", "refused", "http_error", "bad_answer", "skipped", "error", "interrupted")


# hang kinds, by what /health said while the generate probes failed
SILENT, HEALTH_ERROR, HEALTH_TIMEOUT, HEALTH_UNREACHABLE, HEALTH_UNKNOWN = (
    "silent", "health-error", "health-timeout", "health-unreachable", "health-unknown")


@dataclass(frozen=True)
class ProbeResult:
    """One HTTP probe.

    Attributes:
        kind: ``generate`` or ``health``.
        outcome: ``ok``, ``timeout`` (no answer within the timeout: abandoned), ``refused`` (could not connect:
            refused, DNS failure, connect timeout), ``http_error`` (a non-200 status), ``bad_answer`` (200 but the
            body is not a 1-token answer), ``skipped`` (the previous probe of this kind was still running) or
            ``error`` (anything else), ``interrupted`` (a stop was requested while it was in flight: not counted).
        status: HTTP status, when an answer came.
        latency_s: seconds from sending to the answer (or to giving up).
        started: start time, seconds since the epoch.
        error: short description when not ok.
        round: probe round that started it (0 before it is assigned).
    """

    kind: str
    outcome: str
    status: Optional[int] = None
    latency_s: float = 0.0
    started: float = 0.0
    error: str = ""
    round: int = 0

    @property
    def ok(self) -> bool:
        return self.outcome == OK

    @property
    def reached(self) -> bool:
        """The server was reached (not refused / unresolvable)."""
        return self.outcome != REFUSED

    def to_json(self) -> dict[str, Any]:
        d = {"outcome": self.outcome, "status": self.status, "latency_s": round(self.latency_s, 3),
             "round": self.round}
        if self.error:
            d["error"] = self.error
        return d


def _http(method: str, url: str, timeout_s: float, body: Optional[dict] = None) -> tuple[str, Optional[int], Any, str, float]:
    """(outcome, status, response or None, error, latency_s) of one request; never raises."""
    t0 = time.monotonic()
    try:
        r = requests.request(method, url, json=body, timeout=(min(timeout_s, 3.0), timeout_s))
        return OK, r.status_code, r, "", time.monotonic() - t0
    except requests.exceptions.ConnectTimeout:
        return REFUSED, None, None, f"connect timed out after {min(timeout_s, 3.0):.1f} s", time.monotonic() - t0
    except requests.exceptions.ConnectionError as e:
        # A read timeout on a kept connection can surface as ConnectionError(ReadTimeoutError).
        text = str(e)
        if "Read timed out" in text:
            return TIMEOUT, None, None, f"no answer within {timeout_s:.1f} s", time.monotonic() - t0
        if "RemoteDisconnected" in text or "Connection aborted" in text:
            return ERROR, None, None, "the server closed the connection without answering", time.monotonic() - t0
        return REFUSED, None, None, _short_conn_error(text), time.monotonic() - t0
    except requests.exceptions.Timeout:
        return TIMEOUT, None, None, f"no answer within {timeout_s:.1f} s", time.monotonic() - t0
    except requests.RequestException as e:
        return ERROR, None, None, f"{type(e).__name__}: {str(e)[:200]}", time.monotonic() - t0


def _short_conn_error(text: str) -> str:
    for needle, short in (("Connection refused", "connection refused"), ("Name or service not known", "host not found"),
                          ("No route to host", "no route to host"), ("Network is unreachable", "network unreachable")):
        if needle in text:
            return short
    return text[:200]


def probe_generate(adapter: Any, url: str, timeout_s: float) -> ProbeResult:
    """POST a 1-token greedy generate (``adapter.generate_body(PROBE_INPUT_IDS, 1, stream=False)``).

    Ok iff HTTP 200 and ``adapter.parse_response`` reports no error and at least one output id.

    Args:
        adapter: engine adapter (``generate_path``, ``generate_body``, ``parse_response``).
        url: base URL.
        timeout_s: seconds to wait for the answer; past it the request is abandoned (connection closed).
    """
    started = time.time()
    outcome, status, resp, err, lat = _http("POST", url + adapter.generate_path, timeout_s,
                                            adapter.generate_body(list(PROBE_INPUT_IDS), 1, stream=False))
    if outcome != OK:
        return ProbeResult("generate", outcome, status, lat, started, err)
    if status != 200:
        return ProbeResult("generate", HTTP_ERROR, status, lat, started, f"HTTP {status}: {resp.text[:200]}")
    try:
        upd = adapter.parse_response(resp.json())
    except ValueError:
        return ProbeResult("generate", BAD_ANSWER, status, lat, started, f"not JSON: {resp.text[:200]}")
    if upd.error:
        return ProbeResult("generate", BAD_ANSWER, status, lat, started, f"engine error: {upd.error[:200]}")
    if not upd.output_ids:
        return ProbeResult("generate", BAD_ANSWER, status, lat, started, "answered with no output id")
    return ProbeResult("generate", OK, status, lat, started)


def probe_health(adapter: Any, url: str, timeout_s: float) -> ProbeResult:
    """GET ``adapter.health_path``; ok iff HTTP 200 within ``timeout_s`` seconds."""
    started = time.time()
    outcome, status, resp, err, lat = _http("GET", url + adapter.health_path, timeout_s)
    if outcome != OK:
        return ProbeResult("health", outcome, status, lat, started, err)
    if status != 200:
        return ProbeResult("health", HTTP_ERROR, status, lat, started, f"HTTP {status}")
    return ProbeResult("health", OK, status, lat, started)


def wrong_api(gen: ProbeResult) -> Optional[str]:
    """Why a failed generate probe looks like "not this engine's API / misconfigured URL", else None.

    That is an answer within ``WRONG_API_FAST_S`` (1 s) that is HTTP 404 / 405 / 501 (no such route or method), or
    a connection the server closed without answering. Only meaningful before any generate probe succeeded: the
    caller (:meth:`Watcher._account`) checks that. A refused connection is *unreachable*, a slow answer a failure.
    """
    if gen.latency_s >= WRONG_API_FAST_S:
        return None
    if gen.outcome == HTTP_ERROR and gen.status in WRONG_API_STATUSES:
        return f"HTTP {gen.status} within {gen.latency_s * 1000:.0f} ms"
    if gen.outcome == ERROR and "closed the connection" in gen.error:
        return f"the connection was closed without an answer within {gen.latency_s * 1000:.0f} ms"
    return None


class _Slot:
    """At most one probe of a kind in flight, in a daemon thread; its result is taken by the watch loop."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._thread: Optional[threading.Thread] = None
        self._done = threading.Event()
        self._result: Optional[ProbeResult] = None
        self.started_mono = 0.0
        self.round = 0

    def busy(self) -> bool:
        t = self._thread
        return t is not None and t.is_alive()

    def start(self, fn: Callable[[], ProbeResult], round_no: int) -> None:
        done = threading.Event()

        def target() -> None:
            try:
                r = fn()
            except Exception as e:  # noqa: BLE001 - a probe must never kill the watch
                r = ProbeResult(self.name, ERROR, None, 0.0, time.time(), f"{type(e).__name__}: {e}")
            with self._lock:
                self._result = replace(r, round=round_no)
            done.set()

        self._done = done
        self.started_mono = time.monotonic()
        self.round = round_no
        self._thread = threading.Thread(target=target, name=f"repro-watch-{self.name}", daemon=True)
        self._thread.start()

    def wait(self, timeout_s: float, stop: threading.Event) -> bool:
        """Wait up to ``timeout_s`` seconds for the probe in flight; False if still running (or stop was asked)."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if self._done.wait(min(0.1, max(0.0, left))):
                return True
            if left <= 0 or stop.is_set():
                return False

    def take(self) -> Optional[ProbeResult]:
        with self._lock:
            r, self._result = self._result, None
        return r


@dataclass(frozen=True)
class HealthView:
    """What /health said while the generate probes failed.

    Attributes:
        kind: ``silent`` (answered 200), ``health-error`` (answered another status), ``health-timeout`` (did not
            answer within its timeout, or still in flight), ``health-unreachable`` or ``health-unknown``.
        detail: one sentence for people.
        status: the HTTP status of the answer used, if any.
        in_flight_s: seconds the health probe in flight has been waiting, when it decided the kind.
    """

    kind: str
    detail: str
    status: Optional[int] = None
    in_flight_s: Optional[float] = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def classify_health(answers: Sequence[ProbeResult], since_round: int, in_flight: Optional[tuple[int, float]],
                    probe_timeout_s: float) -> HealthView:
    """Classify a hang by what /health said since the first failed generate probe.

    Args:
        answers: completed /health probes (``round`` = the probe round that started each).
        since_round: probe round of the first failed generate probe; answers of earlier rounds do not count.
        in_flight: (round, seconds waiting) of the /health probe still in flight, or None.
        probe_timeout_s: a probe in flight at least this long (seconds) counts as not answering.
    Returns:
        The newest answer's kind (``silent`` for 200, ``health-error``, ``health-timeout``, ``health-unreachable``);
        ``health-timeout`` when the newest probe is still in flight past ``probe_timeout_s``; else
        ``health-unknown``.
    """
    recent = [a for a in answers if a.round >= since_round]
    last = max(recent, key=lambda a: a.round) if recent else None
    if in_flight is not None and in_flight[0] >= since_round and in_flight[1] >= probe_timeout_s \
            and (last is None or last.round < in_flight[0]):
        return HealthView(HEALTH_TIMEOUT, f"/health has not answered for {in_flight[1]:.1f} s while generate probes "
                                          "fail", None, round(in_flight[1], 3))
    if last is None:
        return HealthView(HEALTH_UNKNOWN, "no /health answer since the generate probes started failing")
    if last.outcome == OK:
        return HealthView(SILENT, "silent hang: /health still answers 200 while generate probes fail "
                                  "(a liveness check or load balancer would not notice)", last.status)
    if last.outcome == HTTP_ERROR:
        return HealthView(HEALTH_ERROR, f"/health answers HTTP {last.status} while generate probes fail", last.status)
    if last.outcome == TIMEOUT:
        return HealthView(HEALTH_TIMEOUT, f"/health did not answer within {last.latency_s:.1f} s either")
    if last.outcome == REFUSED:
        return HealthView(HEALTH_UNREACHABLE, f"/health is unreachable ({last.error})")
    return HealthView(HEALTH_ERROR, f"/health failed: {last.error}", last.status)
