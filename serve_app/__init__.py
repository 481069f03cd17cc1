"""The Serve application: OpenAI-compatible HTTP ingress, app config and builder.

`serve run serve_app:app` serves the embedded default model with the default config.
"""

from serve_app.builder import AppConfig, build_app

app = build_app({})

__all__ = ["AppConfig", "app", "build_app"]
