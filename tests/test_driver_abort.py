"""The driver's mass-abort action against a local SSE endpoint (not SGLang: the driver's bookkeeping only; the PD
end-to-end file runs it on a real stack): N of M in-flight requests disconnect at one instant, the server sees the
disconnects, the rest still succeed, and the completion rule does not count an abort as a failure."""

from __future__ import annotations

import json
import select
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from repro.driver import AbortPlan, BurstDriver, make_prompts
from repro.verdict import SUCCEEDED, judge_completion
from test_driver_evidence import PlainAdapter


def _server(first_token_after_s: float, token_gap_s: float, headers_late: bool = False, read_body_after_s: float = 0.0):
    """A local SSE endpoint. Its "prefill" (``first_token_after_s``) watches the socket, so a client that leaves is
    recorded at the instant the server can see it (as is one whose body never came, or whose stream writes fail).
    ``headers_late``: the headers come only with the first token (as a PD router's do). ``read_body_after_s``: the
    handler reads the request body only that long after its headers (the server's side of a slow upload). The
    server's ``bodies_read`` / ``bodies_lost`` list when bodies were read whole / cut."""
    disconnects: list[float] = []
    bodies_read: list[float] = []
    bodies_lost: list[float] = []

    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def _client_left_within(self, seconds: float) -> bool:
            end = time.time() + seconds
            while time.time() < end:
                r, _, _ = select.select([self.connection], [], [], 0.02)
                if r:
                    try:
                        if self.connection.recv(1, socket.MSG_PEEK) == b"":
                            return True
                    except OSError:  # reset
                        return True
            return False

        def do_POST(self):
            time.sleep(read_body_after_s)
            try:
                raw = self.rfile.read(int(self.headers["Content-Length"]))
                body = json.loads(raw)
            except (OSError, ValueError):  # the client left before its body was read
                disconnects.append(time.time())
                bodies_lost.append(time.time())
                return
            bodies_read.append(time.time())
            if headers_late and self._client_left_within(first_token_after_s):  # no headers yet
                disconnects.append(time.time())
                return
            try:
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                if not headers_late and self._client_left_within(first_token_after_s):  # "prefill + KV transfer"
                    disconnects.append(time.time())
                    return
                for i in range(1, body["n"] + 1):
                    fin = "length" if i == body["n"] else None
                    self._chunk(f"data: {json.dumps({'n': i, 'finish': fin})}\n\n".encode())
                    time.sleep(token_gap_s)
                self._chunk(b"data: [DONE]\n\n")
                self._chunk(b"")
            except (BrokenPipeError, ConnectionResetError):
                disconnects.append(time.time())

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    srv.bodies_read, srv.bodies_lost = bodies_read, bodies_lost
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, disconnects


def _run(srv, disconnects, adapter, n: int, max_new: int, concurrency: int, plan: AbortPlan, hist,
         want_disconnects: int, timeout_s: float = 20):
    """Drive ``n`` requests of ``max_new`` tokens with ``plan`` until the burst finished (bounded), then wait (boundedly: on a loaded box a
    handler thread can start late) until the server saw ``want_disconnects`` clients leave, and 0.3 s more (a wrong
    extra disconnect would show up there). Returns the driver's final state; the server is shut down."""
    try:
        d = BurstDriver(adapter, f"http://127.0.0.1:{srv.server_port}", make_prompts(n, 3, 1), max_new, concurrency,
                        hist, timeout_s, abort=plan)
        d.start()
        deadline = time.time() + timeout_s + 10
        while not d.state().finished and time.time() < deadline:
            time.sleep(0.02)
        st = d.state()
        d.close()
        seen_by = time.time() + 10
        while len(disconnects) < want_disconnects and time.time() < seen_by:
            time.sleep(0.05)
        time.sleep(0.3)
    finally:
        srv.shutdown()
    return st


def test_mass_abort_disconnects_n_of_m_in_flight_at_once_and_the_rest_succeed(tmp_path):
    srv, disconnects = _server(first_token_after_s=1.0, token_gap_s=0.1)  # its handlers watch their sockets
    st = _run(srv, disconnects, PlainAdapter(), 6, 4, 6, AbortPlan(count=3, when_in_flight=6), tmp_path / "r.jsonl", 3, 10)
    assert st.finished and st.aborted == 3 and st.ok == 3 and st.failed == 0
    aborted = sorted(r.index for r in st.requests if r.status == "aborted")
    assert aborted == [0, 1, 2]
    assert all(r.first_token_t is None for r in st.requests if r.status == "aborted")  # before the first token
    events = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    cut = [e for e in events if e["event"] == "abort"]
    assert len(cut) == 1 and cut[0]["requests"] == [0, 1, 2] and cut[0]["in_flight"] == 6
    # the server saw the clients go away: exactly the aborted streams, at about one instant
    assert len(disconnects) == 3 and max(disconnects) - min(disconnects) < 1.0
    assert judge_completion(st.requests, [0], [0], [0], []).verdict == SUCCEEDED


class _BigBodyAdapter(PlainAdapter):
    """Bodies far larger than the loopback socket buffers, so writing one takes as long as the server waits to read."""

    def generate_body(self, input_ids, max_new_tokens, stream):
        return {**super().generate_body(input_ids, max_new_tokens, stream), "pad": "x" * (24 << 20)}


def test_mass_abort_chooses_only_requests_whose_body_the_server_has(tmp_path):
    """A request counts as in flight for the mass abort once it is written to its connection: one still uploading
    never reached the server, and cutting it would test nothing there. Here each body waits 1 s on the server before
    it is read; the abort comes after, and every body reached the server whole."""
    srv, disconnects = _server(first_token_after_s=1.0, token_gap_s=0.05, read_body_after_s=1.0)
    st = _run(srv, disconnects, _BigBodyAdapter(), 2, 3, 2, AbortPlan(count=1, when_in_flight=2), tmp_path / "r.jsonl", 1)
    events = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    cut = [e for e in events if e["event"] == "abort"]
    sent = min(e["t"] for e in events if e.get("event") == "sent")
    assert len(cut) == 1 and cut[0]["t"] - sent >= 0.9  # not at once: the uploads took the server's 1 s
    assert st.finished and st.aborted == 1 and st.ok == 1 and st.failed == 0
    assert len(srv.bodies_read) == 2 and srv.bodies_lost == []  # both bodies reached the server whole
    assert len(disconnects) == 1  # and it saw the aborted client leave during the "prefill"


def test_mass_abort_that_never_sees_enough_in_flight_aborts_nothing_and_says_so(tmp_path):
    srv, _ = _server(first_token_after_s=0.0, token_gap_s=0.01)
    try:
        d = BurstDriver(PlainAdapter(), f"http://127.0.0.1:{srv.server_port}", make_prompts(2, 3, 1), 3, 2,
                        tmp_path / "r.jsonl", 10, abort=AbortPlan(count=2, when_in_flight=5, timeout_s=1.0))
        d.start()
        while not d.state().finished:
            time.sleep(0.02)
        time.sleep(1.2)
        st = d.state()
        d.close()
    finally:
        srv.shutdown()
    assert st.ok == 2 and st.aborted == 0
    events = [json.loads(x)["event"] for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert "abort_not_done" in events and "abort" not in events


def test_mass_abort_disconnects_before_the_response_headers_arrive(tmp_path):
    """A client that leaves during prefill has no headers yet: its socket is closed at the abort instant, not when
    headers would have come (the server sees EOF within a fraction of a second of the abort event)."""
    srv, disconnects = _server(first_token_after_s=3.0, token_gap_s=0.05, headers_late=True)
    try:
        d = BurstDriver(PlainAdapter(), f"http://127.0.0.1:{srv.server_port}", make_prompts(6, 3, 1), 3, 6,
                        tmp_path / "r.jsonl", 10, abort=AbortPlan(count=2, when_in_flight=6, delay_s=0.3))
        d.start()
        deadline = time.time() + 20
        while not d.state().finished and time.time() < deadline:
            time.sleep(0.02)
        st = d.state()
        d.close()
    finally:
        srv.shutdown()
    assert st.finished and st.aborted == 2 and st.ok == 4 and st.failed == 0
    events = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    cut = [e for e in events if e["event"] == "abort"]
    assert len(cut) == 1 and cut[0]["requests"] == [0, 1]
    assert cut[0]["t"] - max(e["t"] for e in events if e.get("event") == "sent") >= 0.3  # delay_s after all 6 flew
    assert len(disconnects) == 2 and all(abs(t - cut[0]["t"]) < 0.5 for t in disconnects)
    aborted_at = [e["t"] for e in events if e.get("event") == "aborted"]
    assert len(aborted_at) == 2 and all(t - cut[0]["t"] < 0.5 for t in aborted_at)  # not 3 s later with the headers
