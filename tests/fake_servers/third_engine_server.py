"""The third engine's server (tests/third_engine/adapter.py): not SGLang, not vLLM, an engine of its own.

``python third_engine_server.py --port P --tp N``: starts N rank processes (``--rank K thirdeng::rank_TP<K>`` on their
command line, which is their title) that import the ``thirdeng`` package and call ``thirdeng.core:Engine.step`` every
20 ms, then serves ``GET /health`` (200 once every rank ticked) and ``POST /gen`` (``{"ids", "n", "stream"}`` →
``{"n_out": n, "finish": "length"}``, or server-sent events ``data: {"n_out": k}`` per token then the final chunk and
``data: [DONE]``). The ranks are children in the server's process group (the launcher stops the whole group).
"""

import argparse
import json
import os
import subprocess
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ap = argparse.ArgumentParser()
ap.add_argument("--port", type=int)
ap.add_argument("--tp", type=int, default=2)
ap.add_argument("--rank", type=int)
ap.add_argument("--ready-fd", type=int)
a, rest = ap.parse_known_args()

if a.rank is not None:  # one rank: tick forever; one byte on the ready pipe after the first tick
    from thirdeng.core import Engine

    eng = Engine(a.rank)
    while True:
        eng.step()
        if eng.ticks == 1:
            os.write(a.ready_fd, b"1")
            os.close(a.ready_fd)
        time.sleep(0.02)

ranks, pipes, ready = [], [], set()
for k in range(a.tp):
    r, w = os.pipe()
    ranks.append(subprocess.Popen([sys.executable, __file__, "--rank", str(k), "--ready-fd", str(w),
                                   f"thirdeng::rank_TP{k}"], pass_fds=(w,)))
    os.close(w)
    os.set_blocking(r, False)
    pipes.append(r)
print(f"thirdeng: {a.tp} ranks started", flush=True)


def all_ready() -> bool:
    for k, r in enumerate(pipes):
        if k not in ready:
            try:
                if os.read(r, 1):
                    ready.add(k)
            except BlockingIOError:
                pass
    return len(ready) == a.tp and all(p.poll() is None for p in ranks)


class H(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def log_message(self, *args):
        pass

    def _send(self, code, body):
        data = json.dumps(body).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self):
        if self.path == "/health":
            return self._send(200 if all_ready() else 503, {})
        self._send(404, {"error": "not found"})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if self.path != "/gen":
            return self._send(404, {"error": "not found"})
        n = int(body.get("n", 1))
        if not body.get("stream"):
            return self._send(200, {"n_out": n, "finish": "length"})
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Transfer-Encoding", "chunked")
        self.end_headers()
        lines = [json.dumps({"n_out": k}) for k in range(1, n)] + [json.dumps({"n_out": n, "finish": "length"}), "[DONE]"]
        for ln in lines:
            data = f"data: {ln}\n\n".encode()
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()
            time.sleep(0.01)
        self.wfile.write(b"0\r\n\r\n")


ThreadingHTTPServer(("127.0.0.1", a.port), H).serve_forever()
