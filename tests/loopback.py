"""Tiny HTTP servers on 127.0.0.1 for tests: an OpenAI-style completions endpoint and a reward scorer."""

from __future__ import annotations

import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@contextmanager
def serve(handler_fn):
    """Run `handler_fn(method, path, body) -> (status, dict)` on a free loopback port; yields the base URL.
    Every request is recorded in `.requests` of the yielded object."""
    requests: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, method):
            length = int(self.headers.get("Content-Length") or 0)
            body = json.loads(self.rfile.read(length)) if length else None
            requests.append({"method": method, "path": self.path, "body": body})
            status, payload = handler_fn(method, self.path, body)
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self):
            self._reply("GET")

        def do_POST(self):
            self._reply("POST")

        def log_message(self, *args):
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()

    class Endpoint(str):
        pass

    url = Endpoint(f"http://127.0.0.1:{server.server_address[1]}")
    url.requests = requests
    try:
        yield url
    finally:
        server.shutdown()
        server.server_close()


def completions_handler(method, path, body):
    """OpenAI-compatible: /v1/models and /v1/completions answering " good film" (stop) or "x y z" (length)."""
    if path == "/v1/models":
        return 200, {"data": [{"id": "served-policy"}]}
    if path == "/v1/completions":
        prompts, n = body["prompt"], body.get("n", 1)
        choices = []
        for i, _ in enumerate(prompts):
            for j in range(n):
                stop = (i + j) % 2 == 0
                choices.append({"index": i * n + j, "text": " good film" if stop else " x y z",
                                "finish_reason": "stop" if stop else "length"})
        return 200, {"choices": choices[::-1]}  # out of order on purpose: the engine sorts by index
    return 404, {"error": "not found"}
