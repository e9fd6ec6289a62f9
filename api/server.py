"""The HTTP server's own limits: how many connections it holds, and how long a connection may take.

``server_options(settings)`` are the keyword arguments of ``uvicorn.run`` / ``uvicorn.Config`` that
``prefixcache serve`` passes (and a test or an embedding server may pass the same):

- ``limit_concurrency``: beyond that many connections (or requests in progress) uvicorn answers 503 at once;
- ``timeout_keep_alive``: an idle keep-alive connection is closed;
- ``timeout_graceful_shutdown``: at shutdown, connections still open after the longest a request may take
  (body, queue wait and generation, plus a margin) are closed;
- ``http``: uvicorn's h11 protocol with two deadlines it lacks (``GuardedH11``). A request's line and
  headers must arrive within ``header_timeout_seconds`` (uvicorn has no such limit: a connection that
  sends nothing, or its headers a byte at a time, is otherwise held forever). And once an answer has gone
  out before its request's body arrived in full (a refusal before the body is read, a 408), the rest of
  the body is read and dropped but no longer keeps the connection open: it closes on the keep-alive
  timeout, which uvicorn otherwise restarts with every byte received.

The body itself has a deadline too (``body_timeout_seconds``), kept by the app (``limits.read_body``),
which answers 408 and gives the request's place back.
"""
from __future__ import annotations

import asyncio
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

from .settings import Settings

#: Seconds past the longest request (its body, then its queue wait and generation) a shutdown waits for connections.
SHUTDOWN_MARGIN_SECONDS = 5.0


def server_options(settings: Settings) -> dict[str, Any]:
    """uvicorn's keyword arguments for these settings' connection limits. A shutdown waits for connections as
    long as a request may take, then closes them (a client that stops reading a stream would otherwise hold
    the process, and the tiers' persist, until it is killed)."""
    return {"limit_concurrency": settings.limit_concurrency, "timeout_keep_alive": settings.keep_alive_timeout_seconds,
            "http": guarded_h11(settings.header_timeout_seconds),
            "timeout_graceful_shutdown": settings.body_timeout_seconds + settings.request_timeout_seconds
            + SHUTDOWN_MARGIN_SECONDS}


def guarded_h11(header_timeout: float) -> type[H11Protocol]:
    """``GuardedH11`` with this header deadline (uvicorn builds protocols from a class)."""
    return type("GuardedH11", (GuardedH11,), {"header_timeout": header_timeout})


class GuardedH11(H11Protocol):
    """uvicorn's h11 protocol, with a deadline on each request's head and none renewed by a dropped body."""

    #: Seconds a request's line and headers may take, from the connection's opening or, after a keep-alive
    #: pause, from the first byte of the next request.
    header_timeout: float = 10.0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._head_timer: asyncio.TimerHandle | None = None
        super().connection_made(transport)
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm_head_timer()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self.conn.our_state is h11.DONE and self.conn.their_state is h11.SEND_BODY:
            # Answered before the body came in: what follows is dropped, and does not restart the keep-alive
            # timeout (uvicorn's own ``data_received`` would), so a client dribbling bytes cannot hold on.
            self.conn.receive_data(data)
            self.handle_events()
            return
        if self._head_timer is None and self._awaiting_head():
            self._arm_head_timer()
        super().data_received(data)
        if not self._awaiting_head():
            self._disarm_head_timer()

    def _awaiting_head(self) -> bool:
        return self.conn.their_state is h11.IDLE

    def _arm_head_timer(self) -> None:
        self._head_timer = self.loop.call_later(self.header_timeout, self._head_timed_out)

    def _disarm_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._awaiting_head() and not self.transport.is_closing():
            self.transport.close()
