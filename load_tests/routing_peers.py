"""Outside routers compared in `load_tests.routing`, run from their own code (not re-implemented).

Ray Serve LLM's PrefixCacheAffinityRouter matches prompt *text* by character prefixes, read from
`prompt` strings or message dicts; replicas here receive a PreparedRequest (token ids, chat template
applied). This thin adapter hands it the prompt's token ids spelled one character per token, so its
prefix tree matches exactly the token prefixes the engines cache (its match ratio is then in
tokens, not characters). Requests with no prompt (stats probes) get None, which makes it fall back
to its power-of-two choice, as it does for anything it cannot match.
"""

from __future__ import annotations

from typing import Optional

from ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router import PrefixCacheAffinityRouter

_FIRST_CHAR = 0x10000  # past the BMP's surrogates: every id up to ~1M tokens is a valid character


def token_text(token_ids) -> str:
    return "".join(chr(_FIRST_CHAR + t) for t in token_ids)


class PrefixCacheAffinityAdapter(PrefixCacheAffinityRouter):
    def _extract_text_from_request(self, pending_request) -> Optional[str]:
        request = next(iter(pending_request.args), None)
        ids = getattr(request, "prompt_token_ids", None)
        return token_text(ids) if ids else None
