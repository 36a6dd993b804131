"""A tiny stand-in for one server of a PD stack (engine or router), for tests of repro.pd.Stack's life-cycle.

Not SGLang: it only answers the HTTP endpoints the stack's start-up and teardown look at, and forks one child so
the tree has more than one process. ``python pd_fake.py --port P [--router] [--prefill URL B] [--decode URL]
[--workers-after-s S] [--die-after-s S] [--health-after-s S] [--lose-port-once FILE] [--shm PATH --die-file FILE]``: ``/health`` 200 at once
(503 until ``--health-after-s``); it prints ``fake: loading`` at start; a router's ``GET /workers`` lists its
workers (healthy only after ``--workers-after-s``), like sglang-router 0.3.2 does. With ``--lose-port-once FILE``
the first start (FILE absent: it is created) prints uvicorn's bind error and stays alive without serving, as
sglang 0.5.23's HTTP server did when another process took its port first; later starts serve. With ``--shm PATH``
the child creates and maps PATH (as each sglang scheduler maps its ``sglang_loads_*.shm``) before the server answers,
and exits without unlinking it once ``--die-file`` exists (a rank that dies while its server runs).
"""

import argparse
import json
import os
import sys
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

ap = argparse.ArgumentParser()
ap.add_argument("--host", default="127.0.0.1")
ap.add_argument("--port", type=int, required=True)
ap.add_argument("--pd-disaggregation", action="store_true")
ap.add_argument("--prefill", nargs=2)
ap.add_argument("--decode")
ap.add_argument("--workers-after-s", type=float, default=0.0)
ap.add_argument("--die-after-s", type=float, default=0.0)
ap.add_argument("--health-after-s", type=float, default=0.0)  # /health answers 503 until then, like a loading server
ap.add_argument("--lose-port-once")
ap.add_argument("--shm")
ap.add_argument("--die-file")
a, _ = ap.parse_known_args()
t0 = time.monotonic()
print("fake: loading", flush=True)
if a.lose_port_once and not os.path.exists(a.lose_port_once):
    open(a.lose_port_once, "w").close()
    print(f"ERROR:    [Errno 98] error while attempting to bind on address ('{a.host}', {a.port}): address already in use",
          flush=True)
    while True:  # alive, never serving
        time.sleep(1)
child = os.fork()
if child == 0:  # a child in the same process group, like a scheduler process
    if a.shm:
        import mmap

        fd = os.open(a.shm, os.O_CREAT | os.O_RDWR, 0o600)
        os.ftruncate(fd, 4096)
        m = mmap.mmap(fd, 4096)
        open(a.shm + ".mapped", "w").close()
    while True:
        if a.die_file and os.path.exists(a.die_file):
            os._exit(1)
        time.sleep(0.05 if a.die_file else 1)
if a.shm:
    while not os.path.exists(a.shm + ".mapped"):
        time.sleep(0.02)
    os.unlink(a.shm + ".mapped")


class H(BaseHTTPRequestHandler):
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
            if time.monotonic() - t0 < a.health_after_s:
                return self._send(503, {"error": "loading"})
            return self._send(200, {})
        if self.path == "/workers" and a.pd_disaggregation:
            ready = time.monotonic() - t0 >= a.workers_after_s
            ws = [{"url": a.prefill[0], "worker_type": "prefill", "is_healthy": ready, "bootstrap_port": int(a.prefill[1])},
                  {"url": a.decode, "worker_type": "decode", "is_healthy": ready}] if ready else []
            return self._send(200, {"workers": ws, "total": len(ws)})
        self._send(404, {"error": "not found"})


srv = ThreadingHTTPServer((a.host, a.port), H)
if a.die_after_s:
    import threading

    threading.Timer(a.die_after_s, lambda: os._exit(3)).start()
srv.serve_forever()
