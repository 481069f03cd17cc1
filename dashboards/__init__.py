"""Grafana dashboards and provisioning (the observability issue fills this in)."""
