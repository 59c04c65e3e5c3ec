"""Bodies of the system endpoints: health, readiness, ping, time and client-log ingest."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

MAX_CLIENT_LOG_ENTRIES = 50
MAX_CLIENT_LOG_MESSAGE = 2000

ContextValue = str | int | float | bool | None


class Health(BaseModel):
    status: Literal["ok"] = "ok"
    version: str


class Readiness(BaseModel):
    status: Literal["ready"] = "ready"
    database: Literal["ok", "busy"] = "ok"
    """busy: every pooled connection is at work, so the probe could not borrow one in time
    (the database answers the work; the process stays in service)."""


class Pong(BaseModel):
    pong: bool = True


class ServerTime(BaseModel):
    time: datetime = Field(description="server time, RFC 3339 in UTC")
    unix: float = Field(description="seconds since the Unix epoch")
    unix_ms: int


class ClientLogEntry(BaseModel):
    model_config = ConfigDict(extra="forbid")
    level: Literal["debug", "info", "warn", "warning", "error"]
    message: str = Field(min_length=1, max_length=MAX_CLIENT_LOG_MESSAGE)
    source: str | None = Field(default=None, max_length=200, description="component or page")
    at: datetime | None = Field(default=None, description="client time of the event")
    context: dict[str, ContextValue] = Field(default_factory=dict, max_length=32)


class ClientLogBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")
    entries: list[ClientLogEntry] = Field(min_length=1, max_length=MAX_CLIENT_LOG_ENTRIES)


class ClientLogAccepted(BaseModel):
    accepted: int
