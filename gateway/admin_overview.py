"""Tenant overview (GET /v1/admin/overview) and usage analytics (GET /v1/admin/analytics),
both read from the read models of the acting workspace."""

from __future__ import annotations

from dataclasses import asdict
from datetime import UTC, datetime

from aiohttp import web

from gateway.admin_common import (
    CONVERSATION_MODELS,
    READ,
    TURN_MODELS,
    acting,
    ok,
    read_your_writes,
)
from gateway.errors import read_query
from gateway.state import DATABASE, PROJECTIONS
from projections import queries
from projections.apikeys import ApiKeysProjector
from projections.runner import ProjectionStatus
from projections.workspaces import WorkspacesProjector
from schemas.admin import (
    AdminRead,
    AnalyticsQuery,
    AnalyticsResponse,
    HealthStatus,
    OverviewCounts,
    OverviewResponse,
    ProjectionHealth,
    UsageBucket,
    UsageFigures,
)
from schemas.errors import InvalidInput

LAGGING_S = 5.0


def projection_health(status: ProjectionStatus) -> ProjectionHealth:
    if status.failure is not None:
        state = "failed"
    elif not status.running:
        state = "stopped"
    elif status.lag_seconds > LAGGING_S:
        state = "lagging"
    else:
        state = "ok"
    return ProjectionHealth(name=status.name, status=state, lag_seconds=status.lag_seconds)


OVERVIEW_MODELS = (*CONVERSATION_MODELS, ApiKeysProjector.name, WorkspacesProjector.name)


async def overview(request: web.Request) -> web.Response:
    principal = await acting(request, READ)
    read_query(request, AdminRead)
    await read_your_writes(request, OVERVIEW_MODELS)
    db = request.app[DATABASE]
    counts = await queries.overview(db, principal.workspace_id)
    workspace = await queries.get_workspace(db, principal.workspace_id)
    projections = [projection_health(s) for s in await request.app[PROJECTIONS].status()]
    healthy = all(p.status == "ok" for p in projections)
    return ok(
        OverviewResponse(
            workspace_id=principal.workspace_id,
            workspace_name=workspace.name if workspace else None,
            counts=OverviewCounts(**asdict(counts)),
            health=HealthStatus(
                status="ok" if healthy else "degraded", database="ok", projections=projections
            ),
        )
    )


def _figures(figures: queries.UsageFigures) -> UsageFigures:
    return UsageFigures(**asdict(figures))


async def analytics(request: web.Request) -> web.Response:
    principal = await acting(request, READ)
    params = read_query(request, AnalyticsQuery)
    try:
        since, until = params.window(datetime.now(UTC))
    except ValueError as exc:
        raise InvalidInput(str(exc), code="invalid_window") from None
    await read_your_writes(request, TURN_MODELS)
    result = await queries.analytics(
        request.app[DATABASE],
        principal.workspace_id,
        since=since,
        until=until,
        bucket=params.bucket,
    )
    return ok(
        AnalyticsResponse(
            since=result.since,
            until=result.until,
            bucket=result.bucket,
            totals=_figures(result.totals),
            series=[UsageBucket(start=b.start, **asdict(b.figures)) for b in result.series],
        )
    )
