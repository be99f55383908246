"""The listening page: ``GET /listen`` (one static HTML page, its scripts and style from ``static/``, no build step,
nothing from another origin), ``GET /`` redirects to it. The page calls the gateway's own routes (same origin, the
live sessions' WebSockets included), so it is served with a Content-Security-Policy that allows nothing else:
scripts, styles and requests from 'self' only, audio from 'self' and the page's own blob: URLs. The page is public;
the API routes it calls keep their key check."""

from __future__ import annotations

from importlib import resources

from fastapi import APIRouter
from starlette.responses import RedirectResponse, Response

from .errors import GatewayError

PAGE_PATH = "/listen"
CSP = ("default-src 'none'; script-src 'self'; style-src 'self'; connect-src 'self'; media-src 'self' blob:; "
       "img-src 'self' data:; base-uri 'none'; form-action 'none'; frame-ancestors 'none'")
_FILES = {"listen.html": "text/html; charset=utf-8", "listen.js": "text/javascript; charset=utf-8",
          "live.js": "text/javascript; charset=utf-8", "listen.css": "text/css; charset=utf-8"}
_HEADERS = {"content-security-policy": CSP, "x-content-type-options": "nosniff", "referrer-policy": "no-referrer",
            "cache-control": "no-cache"}

router = APIRouter()


def _static(name: str) -> Response:
    if name not in _FILES:
        raise GatewayError(404, f"{PAGE_PATH}/{name}: no such file", code="not_found")
    data = resources.files(__package__).joinpath("static", name).read_bytes()
    return Response(data, media_type=_FILES[name], headers=_HEADERS)


@router.get("/", include_in_schema=False)
async def root():
    return RedirectResponse(PAGE_PATH, status_code=307)


@router.get(PAGE_PATH, include_in_schema=False)
async def page():
    return _static("listen.html")


@router.get(PAGE_PATH + "/{name}", include_in_schema=False)
async def page_file(name: str):
    return _static(name)
