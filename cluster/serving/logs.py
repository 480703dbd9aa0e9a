"""A replica's logs: plain text for a terminal (the default) or one JSON object per line, every line
about a request carrying its request id and trace id, and an access line per request.

The ids come from the request being served where the line is logged (a context variable set by
ReplicaFrontend.stream for the request's task), so a warning deep in the engine's front end carries
them too. The access line (logger "warpspec.access", INFO) says how the request ended and what it
cost: status, prompt and completion tokens, TTFT, TPOT, acceptance length and finish reason.

Nothing from the client's request is logged but its id and these counts: never the prompt or the
output text, never the API key (replicas hold only its digest).
"""

from __future__ import annotations

import contextvars
import logging
from collections.abc import Mapping

from pythonjsonlogger.json import JsonFormatter

LOG_FORMATS = ("text", "json")
ACCESS = logging.getLogger("warpspec.access")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s%(request_tag)s: %(message)s"
JSON_FIELDS = ("asctime", "levelname", "name", "message", "request_id", "trace_id")

# (request id, trace id or "") of the request this task is serving.
_current_request: contextvars.ContextVar[tuple[str, str] | None] = contextvars.ContextVar("warpspec_request",
                                                                                            default=None)


class RequestIds(logging.Filter):
    """Puts the current request's ids on every record (request_id, trace_id: None outside a request;
    request_tag: " [id]" for the text format)."""

    def filter(self, record: logging.LogRecord) -> bool:
        current = _current_request.get()
        if not hasattr(record, "request_id"):
            record.request_id = current[0] if current else None
        if not hasattr(record, "trace_id"):
            record.trace_id = (current[1] or None) if current else None
        record.request_tag = f" [{record.request_id}]" if record.request_id else ""
        return True


def configure_logging(log_format: str = "text", level: int = logging.INFO) -> logging.Handler:
    """One stderr handler on the "warpspec" logger in this process, in log_format; called again, it
    replaces the handler it made before. Returns the handler."""
    if log_format not in LOG_FORMATS:
        raise ValueError(f"log_format must be one of {', '.join(LOG_FORMATS)}, got {log_format!r}")
    root = logging.getLogger("warpspec")
    for handler in list(root.handlers):
        if getattr(handler, "warpspec_logs", False):
            root.removeHandler(handler)
    handler = logging.StreamHandler()
    handler.warpspec_logs = True
    handler.addFilter(RequestIds())
    handler.setFormatter(JsonFormatter(list(JSON_FIELDS), rename_fields={"levelname": "level", "asctime": "time"})
                         if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    root.addHandler(handler)
    root.setLevel(level)
    return handler


def serving_request(request_id: str | None, trace_id: str | None = None) -> None:
    """Lines logged from now on in this task (and the tasks it starts) carry the request's ids; None:
    no request's. Set, not entered: a streaming request's task runs other code between its messages."""
    _current_request.set((request_id, trace_id or "") if request_id is not None else None)


def log_access(request_id: str, trace_id: str | None, status: str, finish_reason: str | None,
               metrics: Mapping[str, float]) -> None:
    """The request's access line: how it ended (status: "ok", "cancelled" or the gRPC status name of
    its error) and its counts and times, as a message and as fields."""
    fields = {"request_id": request_id, "trace_id": trace_id, "status": status, "finish_reason": finish_reason,
              "prompt_tokens": int(metrics.get("prompt_tokens", 0)),
              "completion_tokens": int(metrics.get("completion_tokens", 0))}
    for name in ("time_to_first_token_s", "time_per_output_token_s", "acceptance_length"):
        if name in metrics:
            fields[name] = round(float(metrics[name]), 6)
    times = ", ".join(f"{label} {fields[name] * 1e3:.1f} ms" for label, name in
                      (("TTFT", "time_to_first_token_s"), ("TPOT", "time_per_output_token_s")) if name in fields)
    acceptance = f", acceptance {fields['acceptance_length']:.2f}" if "acceptance_length" in fields else ""
    ACCESS.info("%s: %d prompt + %d completion tokens%s%s%s, finish %s", status, fields["prompt_tokens"],
                fields["completion_tokens"], ", " if times else "", times, acceptance, finish_reason or "none",
                extra=fields)
