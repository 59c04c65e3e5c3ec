"""Errors raised by the actor runtime itself (domain errors come from schemas.errors).

Each takes the message as its only positional argument so that it pickles (the `ray`
runtime raises them in a host process and re-raises them in the caller).
"""

from __future__ import annotations

from eventstore.errors import StoreUnavailable
from schemas.errors import (
    UPSTREAM_REQUEST_PROBLEMS,
    Conflict,
    InvalidInput,
    NotFound,
    SvcError,
    Unavailable,
    UpstreamError,
    UpstreamTimeout,
)


class RuntimeStopping(Unavailable):
    """The runtime is shutting down: the command was not started (or was interrupted at the
    stop deadline). Safe to retry against another instance with the same command id."""

    default_code = "runtime_stopping"

    def __init__(self, message: str | None = None) -> None:
        super().__init__(
            message
            or "the actor runtime is stopping and did not run this command; retry shortly "
            "with the same Idempotency-Key"
        )


class CommandInterrupted(RuntimeStopping):
    """The runtime stopped while this command ran and cancelled it at the stop deadline.
    Whether it took effect is not known to the caller: by default it is told to send it again
    with the same Idempotency-Key, which returns the result if it was recorded and runs it
    otherwise (a new key could run twice what did take effect: an agent created twice). A
    chat turn says otherwise (`TURN_INTERRUPTED_MESSAGE`): it is recorded as failed."""

    default_code = "interrupted"

    def __init__(self, message: str | None = None) -> None:
        super().__init__(
            message
            or "the service stopped while this request ran and cut it short; it may have "
            "taken effect: send it again with the same Idempotency-Key, to another instance "
            "or after the restart (it returns the result if there is one, else runs it); "
            "without a key, check whether it took effect before sending it again"
        )


TURN_INTERRUPTED_MESSAGE = (
    "the service stopped while this chat turn ran and interrupted it (the turn is recorded as "
    "failed); send it again, to another instance or after the restart, with a new "
    "Idempotency-Key (the same key returns the recorded failure)"
)


class AnswerAbandoned(RuntimeStopping):
    """This process stopped waiting for a command that goes on in an actor host it does not
    stop (a shared Ray cluster): the command is recorded there, so the same command id (the
    same Idempotency-Key) returns its result, from any instance. Its own code: unlike a
    `runtime_stopping`, the command did start."""

    default_code = "answer_abandoned"

    def __init__(self, message: str | None = None) -> None:
        super().__init__(
            message
            or "this instance stopped before the answer came; the request goes on in the "
            "actor cluster and is recorded there: send it again, to another instance or after "
            "the restart, with the same Idempotency-Key to get its answer (without one it runs "
            "again as a new request)"
        )


class RuntimeNotStarted(Unavailable):
    default_code = "runtime_not_started"

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or "the actor runtime is not started yet; call start() first")


class UnknownActorKind(InvalidInput):
    default_code = "unknown_actor_kind"

    @classmethod
    def of(cls, kind: str, known: list[str]) -> UnknownActorKind:
        return cls(f"no actor kind {kind!r} is registered; known kinds: {known}")


class MailboxFull(Unavailable):
    """An actor's mailbox holds its limit of queued commands (a hot conversation whose store
    is slow, its clients retrying): more are refused at once instead of queued without end.
    Nothing was run; a retry with the same Idempotency-Key is safe."""

    default_code = "actor_busy"
    retry_after_s = 1.0

    @classmethod
    def of_text(cls, where: str) -> MailboxFull:
        return cls(
            f"the requests already waiting for {where} hold as much text as it queues; "
            f"nothing was done: retry shortly (with the same Idempotency-Key), or send "
            f"shorter messages"
        )

    @classmethod
    def of(cls, kind: str, limit: int) -> MailboxFull:
        return cls(
            f"{limit} requests are already waiting for this {kind}; nothing was done: retry "
            "shortly (with the same Idempotency-Key)"
        )


class AskTimeout(SvcError):
    """The caller stopped waiting; the command itself still runs to completion in the actor."""

    http_status = 504
    error_type = "server_error"
    default_code = "actor_timeout"


class ConflictRetriesExhausted(Conflict):
    """Other writers kept moving the stream between reload and append."""

    default_code = "concurrency_conflict"


class TurnInProgress(Conflict):
    """A RunTurn whose command id names a turn recorded as running: a client's retry under
    its Idempotency-Key while the first attempt runs, or the runtime's own retry after the
    host running the turn was lost (the `ray` runtime), whose run died with that host. The
    log cannot tell the two apart before the turn's expiry (actors/conversation.py), when a
    turn still running is recorded as abandoned; `expires_at` is that time (ISO 8601), None
    for a turn recorded before turns carried it; `never_expires` when calls had no limit."""

    default_code = "turn_in_progress"
    conversation_id: str = ""
    workspace_id: str = ""
    expires_at: str | None = None
    never_expires: bool = False

    @classmethod
    def of(
        cls,
        turn_id: str,
        conversation_id: str,
        workspace_id: str,
        expires_at: str | None,
        *,
        never_expires: bool = False,
    ) -> TurnInProgress:
        given_up = _given_up(conversation_id, workspace_id, expires_at, never_expires)
        error = cls(
            f"turn {turn_id} of conversation {conversation_id} is still in progress; "
            f"{given_up}; retry with the same Idempotency-Key to get its answer or its failure"
        )
        error.conversation_id, error.workspace_id = conversation_id, workspace_id
        error.expires_at, error.never_expires = expires_at, never_expires
        return error

    def unkeyed(self) -> str:
        """The message for a request that sent no Idempotency-Key, which cannot ask for the
        turn again: what became of it is read in the conversation."""
        given_up = _given_up(
            self.conversation_id, self.workspace_id, self.expires_at, self.never_expires
        )
        return (
            "the actor host running this request's turn stopped answering, and the turn is "
            f"still recorded as running in conversation {self.conversation_id}; its outcome "
            f"is recorded there when it finishes; {given_up}. Read the "
            "conversation's messages, or continue it with X-SVC-Conversation-Id; sending this "
            "request again runs a new turn (send an Idempotency-Key with a chat request to be "
            "able to ask for its answer again)"
        )


def _given_up(
    conversation_id: str, workspace_id: str, expires_at: str | None, never_expires: bool
) -> str:
    """When a turn still running, if it never finishes, is recorded as failed, and by what."""
    if never_expires:
        return (
            "it is never given up by itself, model calls having no time limit with "
            "SVC_LLM_CALL_TIMEOUT_S 0: if the process running it has stopped, an operator "
            "records it as failed with `svc conversations abandon --workspace "
            f"{workspace_id} {conversation_id}`"
        )
    # A turn recorded before turns carried their expiry expires as any other would.
    by = expires_at or "SVC_LLM_CALL_TIMEOUT_S plus a minute after its start"
    return (
        f"if it has not finished by {by} (the process running it may have stopped), it is "
        "recorded as failed with turn_abandoned"
    )


class StoreRequired(Unavailable):
    default_code = "store_required"

    @classmethod
    def of(cls, stream_id: str) -> StoreRequired:
        return cls(f"actor {stream_id} tried to record events but its table has no event store")


# A recorded failure answers a retry with the status its first attempt got; the codes that
# are not an upstream's 502 (conversation._failure_facts records the raising error's code).
_RECORDED_STATUS: dict[str, tuple[int, str]] = {
    UpstreamTimeout.default_code: (UpstreamTimeout.http_status, UpstreamTimeout.error_type),
    "interrupted": (Unavailable.http_status, Unavailable.error_type),
    RuntimeStopping.default_code: (Unavailable.http_status, Unavailable.error_type),
    # The store failed the turn's completion (StatementAborted shares the code).
    StoreUnavailable.default_code: (StoreUnavailable.http_status, StoreUnavailable.error_type),
    "internal_error": (SvcError.http_status, SvcError.error_type),
    "concurrency_conflict": (Conflict.http_status, Conflict.error_type),
    "model_not_found": (NotFound.http_status, NotFound.error_type),
    **{
        code: (InvalidInput.http_status, InvalidInput.error_type)
        for code in UPSTREAM_REQUEST_PROBLEMS
    },
}


class TurnCrashed(SvcError):
    """An unexpected exception (a defect, not an upstream's or the client's doing) ended a
    chat turn whose failure is recorded: a 500 that names nothing of its cause (chained as
    `__cause__`, for the log's traceback) and carries the record's cursor, as any recorded
    failure does, for read-your-writes. Its message, which names the cause for the log (the
    `ray` runtime carries no `__cause__` across processes), never reaches a client: the
    gateway answers every 500 with an error id only."""

    @classmethod
    def of(cls, cause: Exception, cursor: str) -> TurnCrashed:
        crashed = cls(f"the turn failed on an unexpected {type(cause).__name__}: {cause}")
        crashed.recorded_cursor = cursor
        return crashed


INTERNAL_FAILURE_MESSAGE = "internal error while running the turn"
"""What a turn failed by an internal error records and answers again: never its detail."""


class RecordedTurnFailure(UpstreamError):
    """A retried RunTurn whose first attempt failed: the recorded failure is returned again
    (idempotency), with the first attempt's status; send a new Idempotency-Key to try the
    turn again. An internal failure's (500) answer is the generic message whatever the
    record says: records made before they were written generic hold the failed query's
    detail."""

    final = True

    def __init__(self, message: str, *, code: str | None = None) -> None:
        super().__init__(message, code=code)
        status = _RECORDED_STATUS.get(self.code)
        if status is not None:
            self.http_status, self.error_type = status
        if self.http_status == 500:
            # The detail stays in the log; what to do does not.
            self.message = (
                f"{INTERNAL_FAILURE_MESSAGE} (recorded result of the first attempt; send a "
                "new Idempotency-Key to try again)"
            )
