"""The web UI: a chat playground at / and a live engine dashboard at /dashboard."""

from __future__ import annotations

from kvserve.entrypoints.web.routes import build_web_ui_router, mount_web_ui, register_web_ui

__all__ = ["build_web_ui_router", "mount_web_ui", "register_web_ui"]
