"""Small HTTP servers on 127.0.0.1 for tests: an OpenAI-style completions endpoint and a stand-in Hub."""

from __future__ import annotations

import base64
import hashlib
import json
import threading
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@contextmanager
def serve(handler_fn):
    """Run `handler_fn(method, path, body, headers) -> (status, dict[, response headers])` on a free loopback port;
    yields the base URL, with every request recorded in `.requests` (body = parsed JSON when it is JSON)."""
    requests: list[dict] = []

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, method):
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                body = json.loads(raw) if raw else None
            except ValueError:
                body = raw
            requests.append({"method": method, "path": self.path, "body": body, "headers": dict(self.headers)})
            status, payload, *extra = handler_fn(method, self.path, body, dict(self.headers))
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            for name, value in (extra[0] if extra else {}).items():
                self.send_header(name, value)
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

    url: Any = Endpoint(f"http://127.0.0.1:{server.server_address[1]}")  # its requests attached below
    url.requests = requests
    try:
        yield url
    finally:
        server.shutdown()
        server.server_close()


def completions_handler(method, path, body, headers):
    """OpenAI-compatible: /v1/models and /v1/completions answering " good film" (stop) or " x y z" (length)."""
    if path == "/v1/models":
        return 200, {"data": [{"id": "served-policy"}]}
    if path == "/v1/completions":
        prompts, n = body["prompt"], body.get("n", 1)
        choices = []
        for i, _ in enumerate(prompts):
            for j in range(n):
                stop = (i + j) % 2 == 0
                choices.append(
                    {
                        "index": i * n + j,
                        "text": " good film" if stop else " x y z",
                        "finish_reason": "stop" if stop else "length",
                    }
                )
        return 200, {"choices": choices[::-1]}  # out of order on purpose: the engine sorts by index
    return 404, {"error": "not found"}


def git_hash(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


class FakeHub:
    """The Hub endpoints `HfApi.create_repo`, `create_branch` and `upload_folder` use. Files are kept in
    memory per (repo, branch); every commit is recorded with its message and author token."""

    def __init__(self):
        self.repos: dict[str, dict] = {}
        self.commits: list[dict] = []
        self.validated: list = []
        self.fail_commits = 0  # answer this many commit attempts with 503 first
        self.commit_attempts = 0

    def __call__(self, method, path, body, headers):
        parts = path.split("?")[0].strip("/").split("/")
        base = f"http://{headers.get('Host') or headers.get('host')}"
        if path.startswith("/api/validate-yaml"):
            self.validated.append(body)
            return 200, {"errors": [], "warnings": []}
        if path.startswith("/api/repos/create"):
            repo_id = (
                f"{body.get('organization') or 'user'}/{body['name']}" if "/" not in body["name"] else body["name"]
            )
            private = body.get("private") if "private" in body else body.get("visibility") == "private"
            self.repos.setdefault(repo_id, {"private": private, "branches": {"main": {}}})
            return 200, {"url": f"{base}/{repo_id}", "name": repo_id, "id": repo_id}
        if parts[:2] != ["api", "models"] or len(parts) < 4:
            return 404, {"error": f"unknown path {path}"}
        repo_id, action = f"{parts[2]}/{parts[3]}", parts[4] if len(parts) > 4 else "info"
        repo = self.repos.get(repo_id)
        if repo is None:
            return 404, {"error": "Repository not found"}
        branch = "/".join(parts[5:]) if len(parts) > 5 else "main"
        files = repo["branches"].get(branch)
        if action == "branch":
            repo["branches"].setdefault(branch, dict(repo["branches"]["main"]))
            return 200, {}
        if action == "preupload":
            return 200, {
                "files": [
                    {
                        "path": f["path"],
                        "uploadMode": "regular",
                        "shouldIgnore": False,
                        "oid": git_hash(files[f["path"]]) if files and f["path"] in files else None,
                    }
                    for f in body["files"]
                ]
            }
        if action == "commit":
            self.commit_attempts += 1
            if self.fail_commits > 0:
                self.fail_commits -= 1
                return 503, {"error": "service unavailable"}
            lines = [json.loads(x) for x in body.decode().splitlines() if x.strip()]
            header = next(x["value"] for x in lines if x["key"] == "header")
            added = {x["value"]["path"]: base64.b64decode(x["value"]["content"]) for x in lines if x["key"] == "file"}
            files.update(added)
            oid = hashlib.sha1(f"{len(self.commits)}{sorted(added)}".encode()).hexdigest()
            self.commits.append(
                {
                    "repo": repo_id,
                    "branch": branch,
                    "message": header["summary"],
                    "files": sorted(added),
                    "authorization": headers.get("Authorization") or headers.get("authorization"),
                }
            )
            repo["head"] = oid
            return 200, {"commitUrl": f"{base}/{repo_id}/commit/{oid}", "commitOid": oid, "pullRequestUrl": None}
        if action in ("revision", "info"):
            return 200, {
                "id": repo_id,
                "sha": repo.get("head", "0" * 40),
                "siblings": [{"rfilename": p} for p in (files or {})],
            }
        return 404, {"error": f"unknown action {action}"}


@contextmanager
def stand_in_hub(monkeypatch, handler_fn, *caches):
    """`handler_fn` served as the Hub: huggingface_hub's ENDPOINT points at it, and its offline mode (conftest's
    HF_HUB_OFFLINE=1, as read at import) is off. `caches` (functools caches of what was asked) are cleared before
    and after, so that no test sees another's answers."""
    from huggingface_hub import constants

    for cache in caches:
        cache.cache_clear()
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    try:
        with serve(handler_fn) as url:
            monkeypatch.setattr(constants, "ENDPOINT", url)
            yield url
    finally:
        for cache in caches:
            cache.cache_clear()
