"""The promotion dashboard: server-rendered pages of the registry, its evidence and the fleet, with
approve, reject and roll back for admins.

Pages are Jinja2 templates rendered by the gateway itself (`templates/`), plots are SVG drawn on the
server (`svg.py`), and the one small script and the stylesheet are served by the app (`static/`): no
build step, no CDN, works offline. `views.py` turns the registry's reads into what the pages show,
`auth.py` signs browsers in with an API key (session cookie, CSRF), `routes.py` holds the routes;
its actions call the admin API's own route functions (`api.routes.admin`). docs/dashboard.md
describes the pages. `install(app, settings)` mounts it on the gateway (`api.main.create_app`).
"""

from __future__ import annotations

from fastapi import FastAPI
from fastapi.staticfiles import StaticFiles

from api.dashboard.auth import HERE, PATH, DashboardState
from api.dashboard.routes import router
from core.settings import Settings

__all__ = ["install", "router"]


def install(app: FastAPI, settings: Settings) -> None:
    """The dashboard's routes and static files on `app`; its session secret is resolved now, so a
    gateway without one (outside local mode) or with an unreadable one fails at start-up."""
    app.state.dashboard = DashboardState(settings)
    app.include_router(router)
    app.mount(PATH + "/static", StaticFiles(directory=HERE / "static"), name="dashboard-static")
