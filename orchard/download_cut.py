"""A streamed download cut after its response started, said in one log line.

Once a response's headers are out, the only way left to tell the client that its body is
incomplete is to close the connection, which an ASGI app does by raising; uvicorn then logs
the whole stack as "Exception in ASGI application". A cut download is an expected event (a
sandbox deleted under its diff's download: hundreds in an RL run), so the stream logs it in
one line and raises ``DownloadCut``, and ``QuietDownloadCuts`` drops uvicorn's record for it.
Both the agent and the server install the filter.
"""

from __future__ import annotations

import logging


class DownloadCut(Exception):
    """Ends a download whose bytes stopped coming after its response started."""


class QuietDownloadCuts(logging.Filter):
    """Drops a log record whose exception is, or was raised from, a ``DownloadCut``."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        seen: set[int] = set()
        while exc is not None and id(exc) not in seen:
            if isinstance(exc, DownloadCut):
                return False
            seen.add(id(exc))
            exc = exc.__cause__ or exc.__context__
        return True


def quiet_download_cuts() -> None:
    """Install the filter on uvicorn's error logger (after uvicorn configured its logging)."""
    logging.getLogger("uvicorn.error").addFilter(QuietDownloadCuts())
