"""The chat page at `/`: static files shipped in the package, no build step, nothing
fetched from elsewhere. The page calls the server's own API (`/v1/chat/completions`,
streamed) and marks each piece of a reply by where it came from (the chunks' `dflash`
`sources`), so speculation shows as it runs. The files need no API key; the API does.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse

STATIC = Path(__file__).parent / "static"
# Each page path and the file it serves, with its type.
FILES = {
    "/": ("index.html", "text/html; charset=utf-8"),
    "/page.js": ("page.js", "text/javascript; charset=utf-8"),
    "/page.css": ("page.css", "text/css; charset=utf-8"),
}


def add_page(app: FastAPI) -> None:
    """Serve the page's files on `app`."""
    for path, (name, media_type) in FILES.items():
        app.get(path, include_in_schema=False)(file_route(STATIC / name, media_type))


def file_route(file: Path, media_type: str):
    """A route answering with `file` (a closure: a handler's arguments would be the
    request's query parameters)."""

    async def serve() -> FileResponse:
        return FileResponse(file, media_type=media_type)

    return serve
