"""The live cluster page at ``/``: static HTML and JavaScript, no build step.

``index.html`` and ``app.js`` ship as package data. The page polls
``/v1/cluster`` once (hosts, ranks, links, placement) and ``/metrics.json``
every second (tok/s, queue, each rank's busy fraction), and its chat box
streams through ``/v1/chat/completions`` like any client. With ``--api-key``
the page itself is open and asks for the key, which it keeps in the browser's
local storage.
"""

from __future__ import annotations

from importlib.resources import files

#: the page's files and their media types
FILES = {"index.html": "text/html; charset=utf-8", "app.js": "text/javascript; charset=utf-8"}


def read(name: str) -> bytes:
    return files(__name__).joinpath(name).read_bytes()


def routes() -> list:
    from starlette.responses import Response
    from starlette.routing import Route

    async def page(_):
        return Response(read("index.html"), media_type=FILES["index.html"],
                        headers={"Cache-Control": "no-cache"})

    async def static(request):
        name = request.path_params["name"]
        if name not in FILES or name == "index.html":
            return Response(status_code=404)
        return Response(read(name), media_type=FILES[name],
                        headers={"Cache-Control": "no-cache"})

    return [Route("/", page, methods=["GET"]),
            Route("/static/{name}", static, methods=["GET"])]
