"""Conversation reads of the admin API, from the read models of the acting workspace:
the list, one conversation's messages, turns, and its export as Markdown or JSON."""

from __future__ import annotations

import logging
import re
from datetime import UTC, datetime

import orjson
from aiohttp import web
from pydantic import TypeAdapter

from gateway.admin_common import (
    CONVERSATION_LIST_MODELS,
    CONVERSATION_TURN_MODELS,
    MESSAGE_MODELS,
    READ,
    TURN_MODELS,
    acting,
    ok,
    read_your_writes,
)
from gateway.control_chars import one_line, visible_controls
from gateway.errors import abort_connection, client_gone, read_query
from gateway.http_server import watching_stalls
from gateway.state import DATABASE
from projections import queries
from schemas.admin import (
    MAX_MESSAGES_PAGE,
    ConversationExport,
    ConversationList,
    ConversationListQuery,
    ConversationMessage,
    ConversationMessages,
    ConversationSummary,
    ExportQuery,
    MessagesQuery,
    TurnError,
    TurnList,
    TurnRecord,
    TurnsQuery,
    conversation_position,
)
from schemas.errors import InvalidInput, NotFound, quoted

log = logging.getLogger(__name__)

_TIMESTAMP = TypeAdapter(datetime)


def _stamp(at: datetime) -> str:
    """A time as every JSON answer writes it (`...Z`), the Markdown export included."""
    return str(_TIMESTAMP.dump_python(at, mode="json"))


MESSAGE_PAGE_BYTES = 8 * 1024 * 1024
"""The text a page of messages holds at most (unless its first message alone is larger):
what one read holds in memory, for the messages endpoint and for each step of an export."""

_UNSAFE_FILENAME = re.compile(r"[^A-Za-z0-9._-]+")
_PUNCTUATION = re.compile(r"[!-/:-@\[-`{-~]")
_BACKTICKS = re.compile(r"`+")


def summary(c: queries.Conversation) -> ConversationSummary:
    return ConversationSummary(
        id=c.id,
        title=c.title or "",  # the spec's Conversation.title is a string, never null
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
            "seq": m.seq,
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
    return NotFound(f"conversation {quoted(cid)} not found", code="conversation_not_found")


async def list_conversations(request: web.Request) -> web.Response:
    principal = await acting(request, READ)
    page = read_query(request, ConversationListQuery)
    await read_your_writes(request, CONVERSATION_LIST_MODELS)
    rows, total = await queries.list_conversations(
        request.app[DATABASE],
        principal.workspace_id,
        limit=page.limit + 1,  # one more than the page: whether there is a next one
        offset=page.offset,
        after=page.after,
    )
    shown = rows[: page.limit]
    last = shown[-1] if len(rows) > page.limit else None
    return ok(
        ConversationList(
            conversations=[summary(c) for c in shown],
            total=total,
            limit=page.limit,
            offset=page.offset,
            next_after=None if last is None else conversation_position(last.updated_at, last.id),
        )
    )


async def conversation_messages(request: web.Request) -> web.Response:
    principal = await acting(request, READ)
    params = read_query(request, MessagesQuery)
    await read_your_writes(request, MESSAGE_MODELS)
    await _conversation(request, principal.workspace_id, params.id)
    page = await queries.get_message_page(
        request.app[DATABASE],
        principal.workspace_id,
        params.id,
        after=params.after,
        limit=params.limit,
        max_bytes=MESSAGE_PAGE_BYTES,
    )
    return ok(
        ConversationMessages(
            conversation_id=params.id,
            messages=[message(m) for m in page.messages],
            next_after=page.next_after,
        )
    )


async def conversation_turns(request: web.Request) -> web.Response:
    principal = await acting(request, READ)
    params = read_query(request, TurnsQuery)
    if params.conversation_id is None and "conversation_id" in request.query:
        # Empty (a script's unset variable): not every conversation's turns instead.
        raise InvalidInput(
            "conversation_id: give a conversation's id, or leave the parameter out for the "
            "workspace's turns"
        )
    # The conversation row only for the existence check of the one asked for.
    models = CONVERSATION_TURN_MODELS if params.conversation_id else TURN_MODELS
    await read_your_writes(request, models)
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
    parts = [_markdown_head(export.conversation, export.exported_at)]
    parts += [_markdown_message(m) for m in export.messages]
    return "".join(parts)


def _markdown_head(c: ConversationSummary, exported_at: datetime) -> str:
    lines = [f"# {_line(c.title or 'Conversation ' + c.id)}", ""]
    lines.append(f"- id: `{c.id}`")
    lines.append(f"- created: {_stamp(c.created_at)}")
    lines.append(f"- updated: {_stamp(c.updated_at)}")
    if c.folder:
        lines.append(f"- folder: {_line(c.folder)}")
    if c.tags:
        lines.append(f"- tags: {_line(', '.join(c.tags))}")
    lines.append(f"- exported: {_stamp(exported_at)}")
    return "\n".join(lines) + "\n"


def _markdown_message(m: ConversationMessage) -> str:
    author = f"{m.role} ({_line(m.name)})" if m.name else m.role
    fence = "`" * max(3, _longest_backtick_run(m.content) + 1)
    # Terminal controls would act when the downloaded file is shown with `cat`; the JSON
    # export keeps every character as sent.
    lines = ["", f"## {author} · {_stamp(m.created_at)}", "", f"{fence}text"]
    lines += [visible_controls(m.content), fence]
    return "\n".join(lines) + "\n"


def _line(text: str) -> str:
    """One line of literal text: whitespace collapsed, and every ASCII punctuation character
    backslash-escaped (CommonMark allows it for all of them), so a title or a name reads as
    itself, never as emphasis, a link, an entity or inline HTML. Overrides of the text's
    direction and characters that show as nothing are escapes too: an override in a
    message's name would show the rest of its heading, the time included, reversed."""
    return _PUNCTUATION.sub(r"\\\g<0>", one_line(" ".join(text.split())))


def _longest_backtick_run(text: str) -> int:
    return max((len(run) for run in _BACKTICKS.findall(text)), default=0)


async def export_conversation(request: web.Request) -> web.StreamResponse:
    """The download is written a page of messages at a time (MESSAGE_PAGE_BYTES of text at
    most in memory, however long the conversation), up to the last message there was when
    the header was read. The first page is read before the response starts, so a failure
    there is an ordinary error answer; one after that aborts the connection: over HTTP/1.1
    (chunked) a client sees a transfer cut short, never a file that looks complete."""
    principal = await acting(request, READ)
    params = read_query(request, ExportQuery)
    await read_your_writes(request, MESSAGE_MODELS)
    db, ws, cid = request.app[DATABASE], principal.workspace_id, params.conversation_id
    found = await queries.get_conversation_and_last_seq(db, ws, cid)
    if found is None:
        raise _not_found(cid)
    conversation, through = found
    if request.method == "HEAD":
        # The download's headers only. Written, the body would follow them all the same
        # (aiohttp's writer does not know the request was HEAD), and the client would read
        # it as the start of its next response on the connection.
        return _download(conversation.id, params.format)

    async def page_after(after: int) -> queries.MessagePage:
        return await queries.get_message_page(
            db,
            ws,
            cid,
            after=after,
            limit=MAX_MESSAGES_PAGE,
            max_bytes=MESSAGE_PAGE_BYTES,
            through=through,
        )

    page = await page_after(0)
    writer = _MarkdownExport() if params.format == "md" else _JsonExport()
    resp = _download(conversation.id, params.format)
    exported_at = datetime.now(UTC)
    await resp.prepare(request)
    try:
        # A client that stops taking the download without leaving is cut off.
        with watching_stalls(request):
            await resp.write(writer.head(summary(conversation), exported_at))
            while True:
                await resp.write(writer.messages([message(m) for m in page.messages]))
                if page.next_after is None:
                    break
                page = await page_after(page.next_after)
            await resp.write(writer.tail(exported_at))
            await resp.write_eof()
    except ConnectionError:
        client_gone(request)  # the download was cancelled: nothing left to write to
    except Exception:
        # Not answered as an error: the status line went out with the first bytes, and a
        # second response written into this body would corrupt the transfer.
        log.exception("export of conversation %s cut short", cid)
        abort_connection(request)
    return resp


def _download(conversation_id: str, format: str) -> web.StreamResponse:
    stem = _UNSAFE_FILENAME.sub("_", conversation_id)[:100] or "conversation"
    resp = web.StreamResponse(
        headers={"Content-Disposition": f'attachment; filename="conversation-{stem}.{format}"'}
    )
    resp.content_type = "text/markdown" if format == "md" else "application/json"
    resp.charset = "utf-8"
    return resp


class _MarkdownExport:
    def head(self, conversation: ConversationSummary, exported_at: datetime) -> bytes:
        return _markdown_head(conversation, exported_at).encode()

    def messages(self, messages: list[ConversationMessage]) -> bytes:
        return "".join(_markdown_message(m) for m in messages).encode()

    def tail(self, exported_at: datetime) -> bytes:
        return b""


class _JsonExport:
    """`ConversationExport` as JSON, indented by two, written as it is read."""

    def __init__(self) -> None:
        self._first = True

    def head(self, conversation: ConversationSummary, exported_at: datetime) -> bytes:
        return b'{\n  "conversation": ' + _indented(conversation, 2) + b',\n  "messages": ['

    def messages(self, messages: list[ConversationMessage]) -> bytes:
        parts = []
        for m in messages:
            parts.append(b"\n    " if self._first else b",\n    ")
            parts.append(_indented(m, 4))
            self._first = False
        return b"".join(parts)

    def tail(self, exported_at: datetime) -> bytes:
        close = b"]" if self._first else b"\n  ]"
        stamp = _TIMESTAMP.dump_json(exported_at)  # as pydantic writes the other times
        return close + b',\n  "exported_at": ' + stamp + b"\n}\n"


def _indented(model: ConversationSummary | ConversationMessage, depth: int) -> bytes:
    # JSON strings hold no raw line break (orjson escapes them), so every line break of the
    # indented text is between tokens, where the deeper indent goes.
    text = orjson.dumps(model.model_dump(mode="json"), option=orjson.OPT_INDENT_2)
    return text.replace(b"\n", b"\n" + b" " * depth)
