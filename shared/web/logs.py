"""Log set-up shared by both services: text or JSON lines, and the access log.

`--log-format json` writes one JSON object per line: `time` (UTC, ISO 8601, milliseconds),
`level`, `logger`, `message`, `exception` (the traceback text, when there is one), and the
fields a record carries in `extra={"fields": {...}}` (the access log's method, path, ...).
"""

from __future__ import annotations

import logging
from datetime import datetime, timezone
from typing import Any, Final

import orjson
from starlette.types import Scope

LOG_FORMATS: Final = ("text", "json")
TEXT_FORMAT: Final = "%(asctime)s %(levelname)s %(name)s: %(message)s"
DEFAULT_TRACE_ID_HEADER: Final = "x-trace-id"

access_logger = logging.getLogger("dynamo_lite.access")


class JsonFormatter(logging.Formatter):
    """One JSON object per record, on one line."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds")
            .replace("+00:00", "Z"),
            "level": record.levelname,
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)
        if fields:
            entry.update(fields)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        elif record.exc_text:
            entry["exception"] = record.exc_text
        if record.stack_info:
            entry["stack"] = self.formatStack(record.stack_info)
        return orjson.dumps(entry, default=str).decode()


def configure_logging(level: str, log_format: str = "text") -> None:
    """Configure the root logger (every library's loggers propagate to it) once per process."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=level.upper(), handlers=[handler])


class AccessLog:
    """One line per answered request: client, method, path, status, duration, trace id.

    The trace id is the value of a request header (`x-trace-id` unless configured), so a
    gateway's id for an LLM request can be followed through the services' logs.
    """

    def __init__(self, trace_id_header: str = DEFAULT_TRACE_ID_HEADER) -> None:
        self.trace_id_header = trace_id_header.lower().encode("latin-1")

    def from_scope(self, scope: Scope, status: int, seconds: float) -> None:
        trace_id = None
        for key, value in scope["headers"]:
            if key == self.trace_id_header:
                trace_id = value
                break
        client = scope.get("client")
        self(f"{client[0]}:{client[1]}" if client else None, scope["method"], scope["path"], status, seconds,
             trace_id)

    def __call__(
        self, client: str | None, method: str, path: str, status: int, seconds: float, trace_id: bytes | None
    ) -> None:
        trace_text = trace_id.decode("latin-1") if trace_id is not None else None
        duration_ms = round(seconds * 1000, 3)
        fields = {
            "method": method,
            "path": path,
            "status": status,
            "duration_ms": duration_ms,
            "client": client,
            "trace_id": trace_text,
        }
        access_logger.info(
            '%s "%s %s" %d %.3fms trace_id=%s',
            client or "-", method, path, status, duration_ms, trace_text or "-",
            extra={"fields": fields},
        )


__all__ = ["DEFAULT_TRACE_ID_HEADER", "LOG_FORMATS", "AccessLog", "JsonFormatter", "configure_logging"]
