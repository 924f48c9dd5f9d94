"""Fake HTTP servers for the tests of jobs that talk to OpenAI-compatible servers (regen --endpoint,
bench --endpoint): a quiet handler base that reads and answers JSON, and a server on a free port."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class JsonHandler(BaseHTTPRequestHandler):
    """No access log; `read_json()` the request body; `_send(code, obj)` answers `obj` as JSON (a
    client that gave up first, as a timeout test's does, is not an error here)."""

    def log_message(self, *a):
        pass

    def read_json(self):
        return json.loads(self.rfile.read(int(self.headers.get("content-length", 0))))

    def _send(self, code: int, obj) -> None:
        body = json.dumps(obj).encode()
        try:
            self.send_response(code)
            self.send_header("content-type", "application/json")
            self.send_header("content-length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):
            pass


def serve(handler) -> tuple[ThreadingHTTPServer, str]:
    """`handler` served on 127.0.0.1 at a free port, in a daemon thread: (server, base URL).
    The caller shuts it down (server.shutdown(); server.server_close())."""
    srv = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    return srv, f"http://127.0.0.1:{srv.server_address[1]}"
