"""The actor system: logical actors hosted by an activation table behind a runtime.

Wiring (the composition root does this once)::

    conversations = ConversationBehaviour(providers, call_budget_s=current_call_budget)
    table = ActivationTable(store, [conversations, WorkspaceBehaviour(), AgentBehaviour()],
                            idle_s=settings.actor_idle_sec)
    runtime = LocalRuntime(table)
    await runtime.start()
    result = await runtime.ask(conversation_key(cid), RunTurn(...))   # -> TurnResult
    ...
    await runtime.stop(deadline_s=10)
"""

from actors.agent import AgentBehaviour, AgentState, agent_key
from actors.behaviour import ActorContext, ActorKey, Behaviour, CommandOutcome
from actors.conversation import (
    ConversationBehaviour,
    ConversationState,
    TurnRecord,
    TurnResult,
    conversation_key,
)
from actors.errors import (
    AskTimeout,
    CommandInterrupted,
    ConflictRetriesExhausted,
    MailboxFull,
    RecordedTurnFailure,
    RuntimeNotStarted,
    RuntimeStopping,
    UnknownActorKind,
)
from actors.local import LocalRuntime
from actors.runtime import ActorRuntime
from actors.table import ActivationTable, Reply, TableStats
from actors.workspace import WorkspaceBehaviour, WorkspaceState, workspace_key

__all__ = [
    "ActivationTable",
    "ActorContext",
    "ActorKey",
    "ActorRuntime",
    "AgentBehaviour",
    "AgentState",
    "AskTimeout",
    "Behaviour",
    "CommandInterrupted",
    "CommandOutcome",
    "ConflictRetriesExhausted",
    "ConversationBehaviour",
    "ConversationState",
    "LocalRuntime",
    "MailboxFull",
    "RecordedTurnFailure",
    "Reply",
    "RuntimeNotStarted",
    "RuntimeStopping",
    "TableStats",
    "TurnRecord",
    "TurnResult",
    "UnknownActorKind",
    "WorkspaceBehaviour",
    "WorkspaceState",
    "agent_key",
    "conversation_key",
    "workspace_key",
]
