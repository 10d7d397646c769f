"""Outside routers compared in `load_tests.routing`, run from their own code (not re-implemented).

Ray Serve LLM's PrefixCacheAffinityRouter reads prompt text from `prompt` strings or message *dicts*;
handed GenerateRequest's pydantic messages it extracts "" and fails dividing by the text's length
(so Serve retries forever). This thin adapter hands it what it would read from an OpenAI body: the
messages' contents joined, no chat template. Requests with no text (stats probes) get None, which
makes it fall back to its power-of-two choice, as it does for anything it cannot match.
"""
from __future__ import annotations

from typing import Optional

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter

from deployments.protocol import GenerateRequest


class PrefixCacheAffinityAdapter(PrefixCacheAffinityRouter):
    def _extract_text_from_request(self, pending_request) -> Optional[str]:
        request = next(iter(pending_request.args), None)
        if not isinstance(request, GenerateRequest):
            return None
        if request.messages is not None:
            text = "".join(m.text() for m in request.messages)
        else:
            text = request.prompt if isinstance(request.prompt, str) else ""
        return text or None
