"""Quiet logging of requests that are not valid HTTP.

aiohttp answers a request it cannot parse (a NUL byte in a header, a broken request line, a bad
chunked body) with a plain-text 400 itself, before any handler runs, and logs each one at ERROR
with a full traceback on the ``aiohttp.server`` logger. Any client can send those, so a client
could flood the log. :class:`MalformedHttpLogFilter` turns them into one WARNING line, at most
one per ``interval_s`` seconds, saying how many were folded into it. Other ``aiohttp.server``
records (a handler's real failure) pass untouched.

The filter is attached while the gateway app runs (``app.py``'s start-up) and removed at
cleanup, so nothing is configured at import time and in-process test servers do not leak it.
"""

from __future__ import annotations

import logging
import threading
import time

from aiohttp.http_exceptions import HttpProcessingError

AIOHTTP_SERVER_LOGGER = "aiohttp.server"
DEFAULT_INTERVAL_S = 10.0


class MalformedHttpLogFilter(logging.Filter):
    """Rewrites "Error handling request" records caused by unparsable requests (see module)."""

    def __init__(self, interval_s: float = DEFAULT_INTERVAL_S) -> None:
        super().__init__()
        self.interval_s = interval_s
        self._lock = threading.Lock()
        self._last = float("-inf")
        self._folded = 0

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        if not isinstance(exc, HttpProcessingError):
            return True
        now = time.monotonic()
        with self._lock:
            if now - self._last < self.interval_s:
                self._folded += 1
                return False
            folded, self._folded, self._last = self._folded, 0, now
        remote = record.args[0] if isinstance(record.args, tuple) and record.args else "?"
        reason = str(exc.message or type(exc).__name__).splitlines()[0][:200]
        more = f" ({folded} more since the last report)" if folded else ""
        record.msg = "malformed HTTP request from %s answered 400: %s%s"
        record.args = (remote, reason, more)
        record.levelno, record.levelname = logging.WARNING, "WARNING"
        record.exc_info = record.exc_text = None
        return True


def attach(filter_: MalformedHttpLogFilter) -> None:
    logging.getLogger(AIOHTTP_SERVER_LOGGER).addFilter(filter_)


def detach(filter_: MalformedHttpLogFilter) -> None:
    logging.getLogger(AIOHTTP_SERVER_LOGGER).removeFilter(filter_)
