"""Put the Tandem dashboard in front of people: into a Grafana through its HTTP API, or into the Grafana
provisioning folder of a Ray session.

    python -m dashboards.provision --grafana-url http://127.0.0.1:3000 --token $GRAFANA_TOKEN \\
        --prometheus-url http://127.0.0.1:9090
    python -m dashboards.provision --ray-session-dir /tmp/ray/session_latest

The first upserts (creates, or updates in place) a Prometheus datasource and the dashboard, so running it
again changes nothing. The second copies the dashboard JSON into the folder that Ray's generated Grafana
provisioning config (<session>/metrics/grafana/provisioning/dashboards/default.yml) loads, so a Grafana
started with Ray's grafana.ini shows it in the "Ray" folder beside Ray's own dashboards.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlparse

import yaml
from grafana_client import GrafanaApi
from grafana_client.client import GrafanaClientError, GrafanaException

from dashboards.grafana import build_dashboard

DATASOURCE_UID = "tandem-prometheus"
DATASOURCE_NAME = "Tandem Prometheus"
DASHBOARD_FILE = "tandem_grafana_dashboard.json"
RAY_PROVISIONING = Path("metrics", "grafana", "provisioning", "dashboards", "default.yml")


class ProvisioningError(RuntimeError):
    """Provisioning failed; the message says what to fix."""


@dataclass(frozen=True)
class Result:
    datasource: str  # "created" | "updated"
    dashboard_url: str


def datasource_payload(prometheus_url: str) -> dict:
    _check_url("--prometheus-url", prometheus_url)
    return {"uid": DATASOURCE_UID, "name": DATASOURCE_NAME, "type": "prometheus", "access": "proxy",
            "url": prometheus_url, "isDefault": False, "jsonData": {"httpMethod": "POST", "timeInterval": "10s"}}


def dashboard_payload(datasource_uid: str = DATASOURCE_UID, folder_uid: str | None = None) -> dict:
    """The /api/dashboards/db body: the dashboard with its datasource variable preset to ours."""
    dashboard = copy.deepcopy(build_dashboard())
    dashboard["id"] = None  # matched by uid: overwrite the existing one instead of adding a copy
    for var in dashboard["templating"]["list"]:
        if var["name"] == "datasource":
            var["current"] = {"selected": True, "text": DATASOURCE_NAME, "value": datasource_uid}
    payload = {"dashboard": dashboard, "overwrite": True, "message": "provisioned by dashboards.provision"}
    if folder_uid:
        payload["folderUid"] = folder_uid
    return payload


def provision(grafana_url: str, token: str, prometheus_url: str, folder_uid: str | None = None,
              timeout: float = 10.0) -> Result:
    """Upsert the datasource and the dashboard. Raises ProvisioningError with the reason."""
    _check_url("--grafana-url", grafana_url)
    if not token:
        raise ProvisioningError("a Grafana API token is required (--token or GRAFANA_TOKEN)")
    datasource = datasource_payload(prometheus_url)
    api = GrafanaApi.from_url(grafana_url, credential=token, timeout=timeout)
    with _explained(grafana_url):
        state = _upsert_datasource(api, datasource)
        answer = api.dashboard.update_dashboard(dashboard_payload(folder_uid=folder_uid))
    return Result(state, grafana_url.rstrip("/") + str(answer.get("url", "")))


def _upsert_datasource(api: GrafanaApi, payload: dict) -> str:
    try:
        api.datasource.get_datasource_by_uid(payload["uid"])
    except GrafanaClientError as exc:
        if exc.status_code != 404:
            raise
        api.datasource.create_datasource(payload)
        return "created"
    api.datasource.update_datasource_by_uid(payload["uid"], payload)
    return "updated"


class _explained:
    """Turns grafana-client and connection errors into one ProvisioningError saying what to fix."""

    def __init__(self, url: str):
        self.url = url

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc is None or isinstance(exc, ProvisioningError):
            return False
        status = getattr(exc, "status_code", None)
        if status == 401:
            msg = (f"Grafana at {self.url} rejected the token (401 Unauthorized): pass a valid service "
                   f"account token (--token or GRAFANA_TOKEN)")
        elif status == 403:
            msg = (f"Grafana at {self.url} refused the request (403 Forbidden): the token needs the Editor "
                   f"or Admin role to write datasources and dashboards")
        elif isinstance(exc, GrafanaException) and status:
            msg = f"Grafana at {self.url} answered {status}: {exc.message}"
        elif isinstance(exc, (GrafanaException, OSError, ValueError)):
            msg = f"cannot reach Grafana at {self.url}: {type(exc).__name__}: {exc}"
        else:
            return False
        raise ProvisioningError(msg) from exc


def write_to_ray_session(session_dir: str | Path) -> Path:
    """Copy the dashboard into the folder Ray's Grafana provisioning loads; returns the file written."""
    config = Path(session_dir) / RAY_PROVISIONING
    if not config.is_file():
        raise ProvisioningError(f"{config} not found: is {session_dir} a Ray session directory of a cluster "
                                f"started with the dashboard (it writes the Grafana config)?")
    providers = (yaml.safe_load(config.read_text()) or {}).get("providers") or []
    folders = [p.get("options", {}).get("path") for p in providers if p.get("type") == "file"]
    if not folders or not folders[0]:
        raise ProvisioningError(f"{config} names no dashboard folder")
    target = Path(folders[0]) / DASHBOARD_FILE
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(json.dumps(build_dashboard(), indent=2) + "\n")
    return target


def _check_url(option: str, url: str) -> None:
    parsed = urlparse(url or "")
    if parsed.scheme not in ("http", "https") or not parsed.hostname:
        raise ProvisioningError(f"{option} must be an http(s) URL such as http://127.0.0.1:3000, got {url!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m dashboards.provision", description=__doc__.split("\n")[0])
    parser.add_argument("--grafana-url", default=os.environ.get("GRAFANA_URL"))
    parser.add_argument("--token", default=os.environ.get("GRAFANA_TOKEN"), help="default: $GRAFANA_TOKEN")
    parser.add_argument("--prometheus-url", default="http://127.0.0.1:9090",
                        help="as Grafana's server reaches it (default %(default)s)")
    parser.add_argument("--folder-uid", help="Grafana folder for the dashboard (default: General)")
    parser.add_argument("--ray-session-dir", help="also drop the JSON into this Ray session's Grafana "
                        "provisioning folder (e.g. /tmp/ray/session_latest)")
    args = parser.parse_args(argv)
    if not args.grafana_url and not args.ray_session_dir:
        parser.error("give --grafana-url (or GRAFANA_URL) and/or --ray-session-dir")
    try:
        if args.ray_session_dir:
            print(f"wrote {write_to_ray_session(args.ray_session_dir)}")
        if args.grafana_url:
            result = provision(args.grafana_url, args.token, args.prometheus_url, args.folder_uid)
            print(f"datasource {DATASOURCE_UID} {result.datasource}; dashboard at {result.dashboard_url}")
    except ProvisioningError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
