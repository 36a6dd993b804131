"""Driver history/stall accounting against a local streaming HTTP endpoint, and the evidence store's guarantees.

The endpoint here is a plain SSE emitter with a minimal adapter defined in this file: it tests the driver's
bookkeeping, not SGLang (real-SGLang behaviour is covered by the end-to-end tests).
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Optional

import pytest

from repro import evidence as ev
from repro.driver import BurstDriver, make_prompts
from repro.targets.base import AdapterBase


@dataclass
class Upd:
    output_ids: Optional[int]
    finish_reason: Optional[str]
    done: bool
    error: Optional[str] = None


class PlainAdapter(AdapterBase):
    """A driver-only engine: the base adapter's defaults (no sampling parameters) plus its own HTTP shapes."""

    generate_path = "/gen"

    def generate_body(self, input_ids, max_new_tokens, stream):
        return {"ids": input_ids, "n": max_new_tokens}

    def parse_stream_line(self, line):
        line = line.decode() if isinstance(line, bytes) else line
        if line == "data: [DONE]":
            return Upd(None, None, True)
        d = json.loads(line[len("data: "):])
        return Upd(d["n"], d.get("finish"), False)

    def parse_response(self, payload):
        return Upd(payload["n"], "length", True)


def _server(token_gap_s: float, stop_after: Optional[int] = None):
    class H(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # chunked streaming, as SGLang's StreamingResponse sends

        def log_message(self, *a):
            pass

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

        def do_POST(self):
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            for i in range(1, body["n"] + 1):
                if stop_after is not None and i > stop_after:
                    time.sleep(30)  # stalls: the client is abandoned long before
                    return
                time.sleep(token_gap_s)
                fin = "length" if i == body["n"] else None
                self._chunk(f"data: {json.dumps({'n': i, 'finish': fin})}\n\n".encode())
            self._chunk(b"data: [DONE]\n\n")
            self._chunk(b"")

    srv = ThreadingHTTPServer(("127.0.0.1", 0), H)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv


def test_stall_clock_counts_only_while_requests_are_outstanding():
    from repro.driver import DriverState

    busy = DriverState(total=2, pending=0, outstanding=1, ok=1, failed=0, last_progress_t=100.0, finished=False)
    done = DriverState(total=2, pending=0, outstanding=0, ok=2, failed=0, last_progress_t=100.0, finished=True)
    assert busy.stalled_for(112.5) == 12.5 and done.stalled_for(112.5) == 0.0


def test_prompts_are_distinct_and_reproducible():
    a, b = make_prompts(50, 4, seed=7), make_prompts(50, 4, seed=7)
    assert a == b and len({tuple(p) for p in a}) == 50 and make_prompts(50, 4, seed=8) != a


def test_streamed_tokens_count_as_progress_and_all_succeed(tmp_path):
    srv = _server(token_gap_s=0.05)
    try:
        d = BurstDriver(PlainAdapter(), f"http://127.0.0.1:{srv.server_port}", make_prompts(4, 3, 1), 6, 2, tmp_path / "r.jsonl", 10)
        d.start()
        progress_marks = set()
        while not d.state().finished:
            progress_marks.add(d.state().last_progress_t)
            time.sleep(0.02)
        st = d.state()
        d.close()
    finally:
        srv.shutdown()
    assert st.ok == 4 and st.failed == 0
    # every streamed token moved the progress clock: it advanced many times while requests were outstanding
    assert len(progress_marks) >= 4
    events = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    assert [e["event"] for e in events].count("sent") == 4 and [e["event"] for e in events].count("done") == 4
    assert all(e["output_len"] == 6 for e in events if e["event"] == "done")


def test_a_stalled_stream_shows_as_stall_and_is_abandoned(tmp_path):
    srv = _server(token_gap_s=0.01, stop_after=2)
    try:
        d = BurstDriver(PlainAdapter(), f"http://127.0.0.1:{srv.server_port}", make_prompts(2, 3, 1), 5, 2, tmp_path / "r.jsonl", 60)
        d.start()
        time.sleep(1.0)
        st = d.state()
        assert st.outstanding == 2 and st.stalled_for(time.time()) > 0.7
        assert all(r.output_len == 2 and r.first_token_t for r in st.requests)
        d.abandon()
    finally:
        srv.shutdown()


def test_evidence_folder_latest_link_and_atomic_verdict(tmp_path):
    a = ev.EvidenceDir(tmp_path, "scen", "v1")
    b = ev.EvidenceDir(tmp_path, "scen", "v1")  # same second: must not collide
    assert a.path != b.path and (tmp_path / "scen" / "latest").resolve() == b.path.resolve()
    assert ev.read_json(a.file("run.json"))["status"] == "running"
    a.write_json("verdict.json", {"verdict": "DEADLOCKED"})
    assert ev.read_json(a.file("verdict.json")) == {"verdict": "DEADLOCKED"}
    assert not [p for p in a.path.iterdir() if p.name.startswith(".")]  # no temp files left


def test_unwritable_evidence_root_names_the_flag(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with pytest.raises(ev.EvidenceError, match="--evidence-dir"):
        ev.EvidenceDir(blocker, "scen", "v")


def test_torn_jsonl_last_line_is_skipped(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"a": 1}\n{"a": 2')
    assert ev.read_jsonl(p) == [{"a": 1}]
