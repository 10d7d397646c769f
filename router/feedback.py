"""Answers flowing back to the routers of this process, so a conversation follows its cache.

Serve tells a router only that a request completed, not what it produced. The caller that holds
the answer (the ingress) reports it here, and every LLMRouter in the process that routed that
request counts the answer's blocks as cached on its replica: turn n+1 of a chat then matches the
blocks turn n computed there, not only turn n's prompt.
"""
from __future__ import annotations

import weakref
from typing import Sequence

_routers: "weakref.WeakSet" = weakref.WeakSet()


def register(router) -> None:
    _routers.add(router)


def record_answer(request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
    """A request routed by this process finished with `output_token_ids` after `prompt_token_ids`."""
    for router in list(_routers):
        router.record_answer(request_id, prompt_token_ids, output_token_ids)
