"""Structured logs: one JSON object per line on stderr.

Every record has ``ts`` (UTC, ISO 8601), ``level``, ``logger`` and ``message``; structured
fields travel in ``extra={"fields": {...}}`` and are merged in (``event`` names what happened:
``request``, ``retry``, ``breaker_open``, ``replica_unhealthy``...). API keys and salts are
never logged.
"""

from __future__ import annotations

import json
import logging
import logging.config
from datetime import datetime, timezone


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"ts": datetime.fromtimestamp(record.created, timezone.utc).isoformat(
                   timespec="milliseconds"),
               "level": record.levelname.lower(), "logger": record.name,
               "message": record.getMessage()}
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update(fields)
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str)


def setup_json_logging(level: str = "info") -> dict:
    """Send the gateway's, uvicorn's and the gRPC server's logs through
    :class:`JsonFormatter`; returns the ``log_config`` dict for uvicorn."""
    config = {
        "version": 1,
        "disable_existing_loggers": False,
        "formatters": {"json": {"()": JsonFormatter}},
        "handlers": {"stderr": {"class": "logging.StreamHandler", "formatter": "json",
                                "stream": "ext://sys.stderr"}},
        "loggers": {
            "prefixroute": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
            "uvicorn": {"handlers": ["stderr"], "level": level.upper(), "propagate": False},
            "uvicorn.error": {"level": level.upper()},
            "uvicorn.access": {"handlers": [], "level": "WARNING", "propagate": False},
        },
    }
    logging.config.dictConfig(config)
    return config

