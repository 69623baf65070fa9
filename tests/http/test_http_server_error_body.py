"""The server's own errors come from the ``error_body`` its owner gives it; the HTTP layer
knows nothing of the application above it."""

from __future__ import annotations

import ast
import asyncio
from pathlib import Path

from httpkit import connect, read_response, read_to_eof, request_bytes

import epd_proxy.http
from epd_proxy.http.server import HttpServer
from epd_proxy.http.server_limits import ServerLimits


def tagged(status: int, message: str, path: str = "") -> bytes:
    return b'{"status":%d,"said":"%s","path":"%s"}' % (status, message.encode(), path.encode())


async def test_the_servers_own_answers_use_its_error_body():
    release = asyncio.Event()

    async def handler(req, w):
        if req.path == "/boom":
            raise RuntimeError("boom")
        await release.wait()
        w.send(200, b"ok")

    srv = await HttpServer(handler, error_body=tagged,
                           limits=ServerLimits(max_body_bytes=10, max_connections=2)).start("127.0.0.1", 0)
    try:
        r, w = await connect(srv.port)
        w.write(request_bytes("POST", "/", body=b"x" * 11))
        resp = await asyncio.wait_for(read_response(r), 2)
        assert resp.status == 413 and resp.body == tagged(413, "request body larger than 10 bytes", "/")
        w.close()

        r, w = await connect(srv.port)
        w.write(request_bytes("GET", "/boom"))
        resp = await asyncio.wait_for(read_response(r), 2)
        assert resp.status == 500 and resp.body == tagged(500, "internal proxy error", "/boom")
        w.close()

        held = []
        for _ in range(2):
            r, w = await connect(srv.port)
            w.write(request_bytes("GET", "/wait"))
            held.append(w)
        while not (len(srv.connections) == 2 and all(c._task for c in srv.connections)):
            await asyncio.sleep(0.01)
        r, w = await connect(srv.port)
        raw = await asyncio.wait_for(read_to_eof(r), 2)
        assert raw.startswith(b"HTTP/1.1 503 ")
        assert raw.partition(b"\r\n\r\n")[2] == tagged(503, "the proxy has too many client connections; "
                                                            "retry shortly")
        w.close()
        release.set()
        for hw in held:
            hw.close()
    finally:
        await srv.close()


def test_the_http_package_imports_nothing_from_the_application():
    root = Path(epd_proxy.http.__file__).parent
    for path in root.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                outside = (node.level >= 2 or (node.level == 0 and (node.module or "").startswith("epd_proxy")
                                               and not (node.module or "").startswith("epd_proxy.http")))
                assert not outside, f"{path.name} imports {'.' * node.level}{node.module}"
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    assert not alias.name.startswith("epd_proxy") or alias.name.startswith("epd_proxy.http"), \
                        f"{path.name} imports {alias.name}"
