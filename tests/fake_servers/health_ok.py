"""The health endpoint of the tests' stand-in servers (not SGLang): ``serve(port)`` answers every GET with 200 "ok"
on 127.0.0.1:PORT until the process ends. A stand-in script puts this folder on ``sys.path`` and imports it."""

import http.server


class _Ok(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.end_headers()
        self.wfile.write(b"ok")

    def log_message(self, *a):
        pass


def serve(port: int) -> None:
    http.server.HTTPServer(("127.0.0.1", port), _Ok).serve_forever()
