"""Conversation reads of the admin API, from the read models of the acting workspace:
the list, one conversation's messages, turns, and its export as Markdown or JSON."""

from __future__ import annotations

import re
from datetime import UTC, datetime

from aiohttp import web

from gateway.admin_common import CONVERSATION_MODELS, READ, acting, ok, read_your_writes
from gateway.control_chars import visible_controls
from gateway.errors import read_query
from gateway.state import DATABASE
from projections import queries
from schemas.admin import (
    ConversationExport,
    ConversationList,
    ConversationMessage,
    ConversationMessages,
    ConversationSummary,
    ExportQuery,
    MessagesQuery,
    PageQuery,
    TurnError,
    TurnList,
    TurnRecord,
    TurnsQuery,
)
from schemas.errors import NotFound

_UNSAFE_FILENAME = re.compile(r"[^A-Za-z0-9._-]+")
_PUNCTUATION = re.compile(r"[!-/:-@\[-`{-~]")
_BACKTICKS = re.compile(r"`+")


def summary(c: queries.Conversation) -> ConversationSummary:
    return ConversationSummary(
        id=c.id,
        title=c.title,
        workspace_id=c.workspace_id,
        project_id=c.project_id,
        folder=c.folder,
        tags=list(c.tags),
        agent=c.agent,
        model=c.model,
        message_count=c.message_count,
        deleted=c.deleted,
        created_at=c.created_at,
        updated_at=c.updated_at,
    )


def message(m: queries.Message) -> ConversationMessage:
    return ConversationMessage.model_validate(
        {
            "role": m.role,
            "content": m.content,
            "name": m.name,
            "turn_id": m.turn_id,
            "created_at": m.created_at,
        }
    )


def turn(t: queries.Turn) -> TurnRecord:
    failed = t.error_code is not None or t.error_message is not None
    return TurnRecord.model_validate(
        {
            "turn_id": t.turn_id,
            "conversation_id": t.conversation_id,
            "status": t.status,
            "model": t.model,
            "prompt_tokens": t.prompt_tokens,
            "completion_tokens": t.completion_tokens,
            "tokens": t.total_tokens,
            "duration_ms": t.duration_ms,
            "error": TurnError(code=t.error_code, message=t.error_message) if failed else None,
            "started_at": t.started_at,
            "finished_at": t.finished_at,
        }
    )


async def _conversation(request: web.Request, workspace_id: str, cid: str) -> queries.Conversation:
    found = await queries.get_conversation(request.app[DATABASE], workspace_id, cid)
    if found is None:
        raise _not_found(cid)
    return found


def _not_found(cid: str) -> NotFound:
    return NotFound(f"conversation {cid!r} not found", code="conversation_not_found")


async def list_conversations(request: web.Request) -> web.Response:
    principal = await acting(request, READ)
    page = read_query(request, PageQuery)
    await read_your_writes(request, CONVERSATION_MODELS)
    rows, total = await queries.list_conversations(
        request.app[DATABASE], principal.workspace_id, limit=page.limit, offset=page.offset
    )
    return ok(
        ConversationList(
            conversations=[summary(c) for c in rows],
            total=total,
            limit=page.limit,
            offset=page.offset,
        )
    )


async def conversation_messages(request: web.Request) -> web.Response:
    principal = await acting(request, READ)
    params = read_query(request, MessagesQuery)
    await read_your_writes(request, CONVERSATION_MODELS)
    await _conversation(request, principal.workspace_id, params.id)
    rows = await queries.get_messages(request.app[DATABASE], principal.workspace_id, params.id)
    return ok(ConversationMessages(conversation_id=params.id, messages=[message(m) for m in rows]))


async def conversation_turns(request: web.Request) -> web.Response:
    principal = await acting(request, READ)
    params = read_query(request, TurnsQuery)
    await read_your_writes(request, CONVERSATION_MODELS)
    if params.conversation_id is not None:
        await _conversation(request, principal.workspace_id, params.conversation_id)
    rows = await queries.list_turns(
        request.app[DATABASE],
        principal.workspace_id,
        params.conversation_id,
        limit=params.limit,
    )
    return ok(TurnList(conversation_id=params.conversation_id, turns=[turn(t) for t in rows]))


def to_markdown(export: ConversationExport) -> str:
    """Headings and list items hold single lines; each message's text sits in a code fence
    longer than any run of backticks in it, so no content (a line `## assistant · ...`, say)
    can pass for a section of its own."""
    c = export.conversation
    lines = [f"# {_line(c.title or 'Conversation ' + c.id)}", ""]
    lines.append(f"- id: `{c.id}`")
    lines.append(f"- created: {c.created_at.isoformat()}")
    lines.append(f"- updated: {c.updated_at.isoformat()}")
    if c.folder:
        lines.append(f"- folder: {_line(c.folder)}")
    if c.tags:
        lines.append(f"- tags: {_line(', '.join(c.tags))}")
    lines.append(f"- exported: {export.exported_at.isoformat()}")
    for m in export.messages:
        author = f"{m.role} ({_line(m.name)})" if m.name else m.role
        fence = "`" * max(3, _longest_backtick_run(m.content) + 1)
        lines += ["", f"## {author} · {m.created_at.isoformat()}", "", f"{fence}text"]
        # Terminal controls would act when the downloaded file is shown with `cat`; the JSON
        # export keeps every character as sent.
        lines += [visible_controls(m.content), fence]
    return "\n".join(lines) + "\n"


def _line(text: str) -> str:
    """One line of literal text: whitespace collapsed, and every ASCII punctuation character
    backslash-escaped (CommonMark allows it for all of them), so a title or a name reads as
    itself, never as emphasis, a link, an entity or inline HTML."""
    return _PUNCTUATION.sub(r"\\\g<0>", visible_controls(" ".join(text.split())))


def _longest_backtick_run(text: str) -> int:
    return max((len(run) for run in _BACKTICKS.findall(text)), default=0)


async def export_conversation(request: web.Request) -> web.Response:
    principal = await acting(request, READ)
    params = read_query(request, ExportQuery)
    await read_your_writes(request, CONVERSATION_MODELS)
    cid = params.conversation_id
    both = await queries.get_conversation_and_messages(
        request.app[DATABASE], principal.workspace_id, cid
    )
    if both is None:
        raise _not_found(cid)
    found, rows = both
    export = ConversationExport(
        conversation=summary(found),
        messages=[message(m) for m in rows],
        exported_at=datetime.now(UTC),
    )
    stem = _UNSAFE_FILENAME.sub("_", found.id)[:100] or "conversation"
    if params.format == "md":
        body, content_type = to_markdown(export), "text/markdown"
    else:
        body, content_type = export.model_dump_json(indent=2), "application/json"
    return web.Response(
        text=body,
        content_type=content_type,
        charset="utf-8",
        headers={
            "Content-Disposition": f'attachment; filename="conversation-{stem}.{params.format}"'
        },
    )
