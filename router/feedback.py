"""Answers reported back to the router that routed them, so a conversation follows its cache.

Serve tells a request router that a request completed, not what it produced. The caller that holds
the answer reports it through the handle it sent the request with:

    feedback.record_answer(self.llm, request.request_id, request.prompt_token_ids, output_token_ids)

and that handle's LLMRouter counts the answer's blocks as cached on the replica that computed it:
turn n+1 of a chat then matches the blocks turn n computed there, not only turn n's prompt. Only
that router hears of it (no registry of every router in the process), and a handle routed by
another router class reports nothing.

The router is told by its `record_answer` method, not found by `isinstance(router, LLMRouter)`:
Serve ships a deployment's router class to every process that routes to it by value, so outside the
process that deployed the app (in every ingress replica) the router's class is a copy, not
router.llm_router.LLMRouter, and an isinstance check there was always False: no answer reached a
router in a deployed app until 2026-11-27 (tests/test_router_serve.py now records one from another
process).
"""

from __future__ import annotations

from typing import Optional, Sequence

from ray.serve.handle import DeploymentHandle
from ray.serve.request_router import RequestRouter


def request_router_of(handle: DeploymentHandle) -> Optional[RequestRouter]:
    """The RequestRouter routing `handle`'s calls (shared by its `.options()` and method copies);
    None until the handle's first routing has built it.

    Ray Serve (2.60) has no public accessor: a DeploymentHandle routes only through `.remote()` (its
    private `_choose_replica` yields a replica, not the router). The narrowest path, all private:
    `DeploymentHandle._router` (its Router wrapper, None until the handle is initialized) ->
    `._asyncio_router` (the AsyncioRouter inside SingletonThreadRouter and CurrentLoopRouter alike) ->
    `._request_router` (the RequestRouter it built on its own loop; the `request_router` property
    would build one here instead, on the caller's thread). tests/test_router_serve.py checks that
    it finds the router of a real deployment's handle."""
    wrapper = getattr(handle, "_router", None)
    return getattr(getattr(wrapper, "_asyncio_router", None), "_request_router", None)


def record_answer(
    handle: DeploymentHandle, request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]
) -> bool:
    """Request `request_id`, sent through `handle`, finished with `output_token_ids` after
    `prompt_token_ids`. False if no LLMRouter routes `handle` (nothing to tell)."""
    record = getattr(request_router_of(handle), "record_answer", None)
    if not callable(record):
        return False
    record(request_id, prompt_token_ids, output_token_ids)
    return True
