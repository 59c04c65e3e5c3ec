"""The actor runtime contract and the conversation-turn suite (tests/actors) against `ray`.

The same test functions, with this folder's fixtures: one host per runtime, because the
table options (`max_active`, ...) are per host and the contract counts them per runtime.
Multi-host routing, moves and failures are tested in test_cluster.py.
"""

from test_conversation_turns import *  # noqa: F403
from test_runtime_contract import *  # noqa: F403
