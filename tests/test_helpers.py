"""tests/helpers.py's uvicorn_server: it holds its port from the moment it is chosen, and a server
that cannot start is reported at once, not after the start deadline."""

from __future__ import annotations

import contextlib
import errno
import socket
import threading
import time

import httpx
import pytest
import uvicorn
from fastapi import FastAPI

from tests.helpers import free_port, uvicorn_server


def _hello() -> FastAPI:
    app = FastAPI()

    @app.get("/hello")
    async def hello() -> dict:
        return {"hello": "world"}

    return app


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")  # the failed bind, expected
def test_a_port_taken_before_uvicorn_binds_it_ends_its_thread_unstarted():
    """The flake this helper removes, on purpose: another process takes the port `free_port()`
    chose before uvicorn binds it; uvicorn's thread ends at once and never starts."""
    port = free_port()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", port))
        taken.listen()
        server = uvicorn.Server(uvicorn.Config(_hello(), host="127.0.0.1", port=port, log_level="critical"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        thread.join(10)
        assert not thread.is_alive() and not server.started


def test_the_server_holds_its_port_from_the_start_and_answers():
    with uvicorn_server(_hello()) as port:
        assert httpx.get(f"http://127.0.0.1:{port}/hello").json() == {"hello": "world"}
        # no other process can take the port (it was bound before uvicorn started)
        with socket.socket() as other, pytest.raises(OSError) as e:
            other.bind(("127.0.0.1", port))
        assert e.value.errno == errno.EADDRINUSE
    with pytest.raises(httpx.TransportError):  # and it is closed after
        httpx.get(f"http://127.0.0.1:{port}/hello", timeout=2)


def test_many_servers_started_side_by_side_each_get_their_own_port():
    with contextlib.ExitStack() as stack:
        ports = [stack.enter_context(uvicorn_server(_hello())) for _ in range(8)]
        assert len(set(ports)) == 8
        assert all(httpx.get(f"http://127.0.0.1:{p}/hello").status_code == 200 for p in ports)


def test_a_server_whose_startup_fails_is_reported_at_once():
    @contextlib.asynccontextmanager
    async def lifespan(app):
        raise RuntimeError("the app cannot start")
        yield

    t0 = time.monotonic()
    server = uvicorn_server(FastAPI(lifespan=lifespan), log_level="critical", start_s=60)
    with pytest.raises(AssertionError, match="ended before the server started"), server:
        pass
    assert time.monotonic() - t0 < 30  # well before the start deadline it would have waited out
