"""Dashboard provisioning with grafana-client, against a recording stand-in for Grafana's HTTP API.

No Grafana server can be installed on these machines (Debian does not package it and the other
registries carry only placeholders), so a small loopback HTTP server answers the four Grafana API calls
provisioning makes (GET, POST and PUT on datasources, POST /api/dashboards/db) the way Grafana
documents them, keeps what was written, checks the bearer token, and records every request.
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import yaml
from ray.dashboard.modules.metrics.templates import DASHBOARD_PROVISIONING_TEMPLATE

from dashboards import grafana, provision
from serve_cluster import free_port

TOKEN = "glsa_test_token"


class FakeGrafana(ThreadingHTTPServer):
    def __init__(self):
        super().__init__(("127.0.0.1", 0), _Handler)
        self.requests: list[tuple[str, str, str | None, dict | None]] = []  # method, path, auth, body
        self.datasources: dict[str, dict] = {}
        self.dashboards: dict[str, dict] = {}

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def writes(self) -> list[tuple[str, str]]:
        return [(method, path) for method, path, _, _ in self.requests if method != "GET"]


class _Handler(BaseHTTPRequestHandler):
    server: FakeGrafana

    def log_message(self, *args):  # keep pytest output clean
        pass

    def do_GET(self):
        self._handle("GET")

    def do_POST(self):
        self._handle("POST")

    def do_PUT(self):
        self._handle("PUT")

    def _handle(self, method: str) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        body = json.loads(self.rfile.read(length)) if length else None
        auth = self.headers.get("Authorization")
        self.server.requests.append((method, self.path, auth, body))
        if auth != f"Bearer {TOKEN}":
            return self._reply(401, {"message": "invalid API key"})
        self._reply(*self._route(method, body))

    def _route(self, method: str, body) -> tuple[int, dict]:
        srv, path = self.server, self.path
        if path.startswith("/api/datasources/uid/"):
            uid = path.rsplit("/", 1)[1]
            if uid not in srv.datasources:
                return 404, {"message": "Data source not found"}
            if method == "PUT":
                srv.datasources[uid] = body
                return 200, {"message": "Datasource updated", "datasource": body}
            return 200, srv.datasources[uid]
        if path == "/api/datasources" and method == "POST":
            if any(d["name"] == body["name"] for d in srv.datasources.values()):
                return 409, {"message": "data source with the same name already exists"}
            srv.datasources[body["uid"]] = body
            return 200, {"message": "Datasource added", "id": len(srv.datasources), "datasource": body}
        if path == "/api/dashboards/db" and method == "POST":
            uid = body["dashboard"]["uid"]
            if uid in srv.dashboards and not body.get("overwrite"):
                return 412, {"message": "The dashboard has been changed by someone else", "status": "version-mismatch"}
            srv.dashboards[uid] = body["dashboard"]
            return 200, {"status": "success", "uid": uid, "url": f"/d/{uid}/tandem", "version": 1}
        return 404, {"message": "Not found"}

    def _reply(self, status: int, payload: dict) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


@pytest.fixture
def fake_grafana():
    server = FakeGrafana()
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


PROM = "http://127.0.0.1:9090"


def test_first_run_creates_the_datasource_and_the_dashboard(fake_grafana):
    result = provision.provision(fake_grafana.url, TOKEN, PROM)
    assert result.datasource == "created"
    assert result.dashboard_url == f"{fake_grafana.url}/d/{grafana.DASHBOARD_UID}/tandem"
    assert [(m, p) for m, p, _, _ in fake_grafana.requests] == [
        ("GET", f"/api/datasources/uid/{provision.DATASOURCE_UID}"), ("POST", "/api/datasources"),
        ("POST", "/api/dashboards/db")]
    assert all(auth == f"Bearer {TOKEN}" for _, _, auth, _ in fake_grafana.requests)

    ds = fake_grafana.requests[1][3]
    assert (ds["type"], ds["url"], ds["access"], ds["uid"]) == ("prometheus", PROM, "proxy", provision.DATASOURCE_UID)
    body = fake_grafana.requests[2][3]
    shipped = json.loads(grafana.DASHBOARD_PATH.read_text())
    assert body["overwrite"] is True and body["dashboard"]["id"] is None
    assert body["dashboard"]["uid"] == shipped["uid"] and body["dashboard"]["panels"] == shipped["panels"]
    [var] = [v for v in body["dashboard"]["templating"]["list"] if v["name"] == "datasource"]
    assert var["current"]["value"] == provision.DATASOURCE_UID  # panels default to the datasource just made


def test_second_run_updates_in_place(fake_grafana):
    provision.provision(fake_grafana.url, TOKEN, PROM)
    first_writes = len(fake_grafana.writes())
    result = provision.provision(fake_grafana.url, TOKEN, "http://prom.internal:9090")
    assert result.datasource == "updated"
    assert fake_grafana.writes()[first_writes:] == [
        ("PUT", f"/api/datasources/uid/{provision.DATASOURCE_UID}"), ("POST", "/api/dashboards/db")]
    assert list(fake_grafana.datasources) == [provision.DATASOURCE_UID]
    assert fake_grafana.datasources[provision.DATASOURCE_UID]["url"] == "http://prom.internal:9090"
    assert list(fake_grafana.dashboards) == [grafana.DASHBOARD_UID]
    dash_bodies = [b for m, p, _, b in fake_grafana.requests if p == "/api/dashboards/db"]
    assert dash_bodies[0] == dash_bodies[1]


def test_bad_token_is_a_clear_error_and_writes_nothing(fake_grafana):
    with pytest.raises(provision.ProvisioningError, match="rejected the token.*401"):
        provision.provision(fake_grafana.url, "wrong", PROM)
    assert fake_grafana.writes() == []
    assert provision.main(["--grafana-url", fake_grafana.url, "--token", "wrong"]) == 2


@pytest.mark.parametrize("url, match", [
    ("grafana.example:3000", "--grafana-url must be an http"),
    ("ftp://127.0.0.1:3000", "--grafana-url must be an http"),
])
def test_malformed_url_is_rejected_before_any_request(url, match):
    with pytest.raises(provision.ProvisioningError, match=match):
        provision.provision(url, TOKEN, PROM)


def test_unreachable_grafana_is_a_clear_error():
    url = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    with pytest.raises(provision.ProvisioningError, match=f"cannot reach Grafana at {url}"):
        provision.provision(url, TOKEN, PROM, timeout=5)


def test_missing_token_and_bad_prometheus_url(fake_grafana):
    with pytest.raises(provision.ProvisioningError, match="token is required"):
        provision.provision(fake_grafana.url, "", PROM)
    with pytest.raises(provision.ProvisioningError, match="--prometheus-url"):
        provision.provision(fake_grafana.url, TOKEN, "localhost:9090")
    assert fake_grafana.requests == []


def test_cli_provisions_and_reports(fake_grafana, capsys):
    assert provision.main(["--grafana-url", fake_grafana.url, "--token", TOKEN]) == 0
    assert "datasource tandem-prometheus created" in capsys.readouterr().out


def test_ray_session_drop_follows_rays_provisioning_config(tmp_path):
    """The session layout is written with Ray's own template; the real one is covered in test_metrics_e2e."""
    target_dir = tmp_path / "grafana_dashboards"
    config = tmp_path / provision.RAY_PROVISIONING
    config.parent.mkdir(parents=True)
    config.write_text(DASHBOARD_PROVISIONING_TEMPLATE.format(dashboard_output_folder=target_dir))
    written = provision.write_to_ray_session(tmp_path)
    assert written.parent == target_dir
    assert json.loads(written.read_text()) == json.loads(grafana.DASHBOARD_PATH.read_text())
    assert yaml.safe_load(config.read_text())["providers"][0]["options"]["path"] == str(target_dir)


def test_ray_session_drop_without_a_session_is_a_clear_error(tmp_path):
    with pytest.raises(provision.ProvisioningError, match="Ray session directory"):
        provision.write_to_ray_session(tmp_path / "nope")
