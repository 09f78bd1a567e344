"""A real `mlflow server` without auth, started as a user starts it (`infra/mlflow/start-server.sh DIR PORT`): a
recipe pointed at it passes the checks before a run (the server has no auth API to ask about permissions), and a
tracking server that does not answer is a problem of the recipe before the run, not minutes of MLflow's retries. The
demo recording through a server is tests/test_mlflow_auth.py's (the same server script, with basic auth)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from support import start_service, stop_service

from alignpipe.launch import free_port
from alignpipe.recipe import RecipeError, parse_recipe, tracking_server

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """`infra/mlflow/start-server.sh DIR PORT` from the repository, as the README says; its URL and folder."""
    root = tmp_path_factory.mktemp("mlflow-server")
    port = free_port()
    env = {**os.environ, "VENV": str(REPO / ".venv")} if (REPO / ".venv").is_dir() else dict(os.environ)
    proc = start_service(
        ["bash", "infra/mlflow/start-server.sh", str(root), str(port)],
        root / "server.log",
        f"http://127.0.0.1:{port}/health",
        env=env,
        cwd=REPO,
        timeout_s=180,
    )
    yield f"http://127.0.0.1:{port}", root
    stop_service(proc)


def test_a_tracking_server_that_does_not_answer_is_refused_before_the_run(demo_text, mlflow_server):
    url, _ = mlflow_server
    tracking_server._health.cache_clear()
    parse_recipe(demo_text, [f"tracking.uri={url}"], to_run=True)  # it answers
    client = MlflowClient(url)  # and has no auth API: the experiment and model it holds need no permission
    client.create_experiment("tiny-demo")
    client.create_registered_model("tiny-demo-sft")
    assert tracking_server._current_user(url) is None
    parse_recipe(demo_text, [f"tracking.uri={url}/"], to_run=True)
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(RecipeError) as e:
        parse_recipe(demo_text, [f"tracking.uri={dead}"], to_run=True)
    (problem,) = e.value.problems
    assert problem.path == ("tracking", "uri") and "does not answer (ConnectionError" in problem.message, problem
    assert "remove `tracking.uri`" in problem.hint
    with pytest.raises(RecipeError) as e:  # credentials belong in the environment: the recipe is logged
        parse_recipe(demo_text, [f"tracking.uri=http://user:hunter2@{dead[len('http://') :]}"])
    (problem,) = e.value.problems
    assert "holds credentials" in problem.message and "MLFLOW_TRACKING_PASSWORD" in problem.message
    assert "hunter2" not in str(e.value), "the refused value is not repeated"
    parse_recipe(demo_text, [f"tracking.uri={dead}"])  # `show` does not ask
    parse_recipe(demo_text, ["tracking.uri=databricks"], to_run=True)  # not HTTP: not asked


@pytest.fixture
def https_server(tmp_path):
    """A loopback HTTPS server answering `/health`, with a self-signed certificate for 127.0.0.1 (a private CA's, as
    far as a client can tell): its URL and certificate file."""
    import http.server
    import ssl
    import subprocess
    import threading

    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )

    class Health(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            self.send_response(200 if self.path == "/health" else 404)
            self.end_headers()
            self.wfile.write(b"OK")

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Health)
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"https://127.0.0.1:{server.server_address[1]}", cert
    server.shutdown()


def test_a_tls_server_is_asked_with_the_certificates_mlflows_client_uses(demo_text, https_server, monkeypatch):
    """A server whose certificate this machine does not trust is a TLS problem with the variables that fix it, and
    each of those variables (MLflow's own, and requests' CA bundle, which MLflow's client reads) makes it answer."""
    url, cert = https_server
    for var in (
        "MLFLOW_TRACKING_SERVER_CERT_PATH",
        "REQUESTS_CA_BUNDLE",
        "CURL_CA_BUNDLE",
        "MLFLOW_TRACKING_INSECURE_TLS",
    ):
        monkeypatch.delenv(var, raising=False)
    tracking_server._health.cache_clear()
    with pytest.raises(RecipeError) as e:
        parse_recipe(demo_text, [f"tracking.uri={url}"], to_run=True)
    (problem,) = e.value.problems
    assert (
        problem.path == ("tracking", "uri")
        and "could not be reached over TLS (SSLError: [SSL: CERTIFICATE_VERIFY_FAILED]" in problem.message
    )
    assert problem.message.endswith("self-signed certificate)") and "MLFLOW_TRACKING_SERVER_CERT_PATH" in problem.hint
    for var, value in (
        ("MLFLOW_TRACKING_SERVER_CERT_PATH", str(cert)),
        ("REQUESTS_CA_BUNDLE", str(cert)),
        ("MLFLOW_TRACKING_INSECURE_TLS", "true"),
    ):
        with monkeypatch.context() as m:
            m.setenv(var, value)
            tracking_server._health.cache_clear()
            parse_recipe(demo_text, [f"tracking.uri={url}"], to_run=True)  # it answers; no auth API behind it
