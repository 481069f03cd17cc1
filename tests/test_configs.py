"""Every shipped Serve config YAML is valid for `serve run` / `serve deploy` and its args build an app."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from ray.serve.schema import ServeDeploySchema

from serve_app import build_app

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.yaml"))


def test_configs_exist():
    assert {p.name for p in CONFIGS} >= {"cpu.yaml", "gpu.yaml", "autoscaling.yaml"}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_config_validates_and_builds(path):
    schema = ServeDeploySchema.model_validate(yaml.safe_load(path.read_text()))
    for app in schema.applications:
        assert app.import_path == "serve_app:build_app"
        assert build_app(app.args) is not None


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_no_config_listens_beyond_loopback_without_an_api_key(path):
    """Shipped configs bind 127.0.0.1 unless they set a key: an unauthenticated API never leaves the machine."""
    config = yaml.safe_load(path.read_text())
    host = (config.get("http_options") or {}).get("host", "127.0.0.1")
    keyed = all(app.get("args", {}).get("api_key") for app in config["applications"])
    assert host in ("127.0.0.1", "localhost") or keyed, f"{path.name} binds {host} without an api_key"
