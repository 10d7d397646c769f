"""GenerateRequest -> PreparedRequest: the one place a request is validated, templated and tokenized.

The ingress does it once per request, where it is cheapest: routers then hash exactly the tokens
the engine will cache, and the replicas' cores only run the engine. Same tokenizer, same template,
same ids as the offline engine.
"""

from __future__ import annotations

import asyncio
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, List, Optional, Union

import pydantic

from deployments.adapters import BASE, ResolvedModel
from deployments.errors import APIError, engine_error
from deployments.limits import RequestLimits
from deployments.piece_tokenizer import PieceTokenizer
from deployments.protocol import GenerateRequest, PreparedRequest
from deployments.tool_calls import render_chat


def chat_text(tokenizer, request: GenerateRequest) -> str:
    """The chat template applied: tool calls and results of earlier turns included, and the tools
    themselves unless tool_choice is "none" (then the model is not told of them)."""
    messages = [{**m.model_dump(exclude_none=True), "content": m.text()} for m in request.messages]
    tools = request.tools if request.tool_choice != "none" else None
    return render_chat(tokenizer, messages, tools)


def prompt_token_ids(
    tokenizer, request: GenerateRequest, encode: Optional[Callable[[str], List[int]]] = None
) -> List[int]:
    """`encode`: text -> ids, the tokenizer's own call unless given (a PieceTokenizer's: the same ids)."""
    encode = encode or (lambda text: tokenizer(text)["input_ids"])
    if request.messages is not None:
        return encode(chat_text(tokenizer, request))
    if isinstance(request.prompt, str):
        return encode(request.prompt) if request.prompt else []
    return list(request.prompt)


def prepare(
    tokenizer,
    request: Union[GenerateRequest, dict],
    limits: RequestLimits,
    resolve: Optional[Callable[[Optional[str]], ResolvedModel]] = None,
    encode: Optional[Callable[[str], List[int]]] = None,
) -> PreparedRequest:
    """Validates a request (sizes before tokenizing, token ids after), gives it an id, its prompt's
    token ids and max_tokens (None: the rest of the context window), and its `model` resolved to a
    LoRA adapter by `resolve` (AdapterRegistry.resolve; None: only the base); text tokenized by
    `encode` (prompt_token_ids). Errors are APIErrors:
    400, or 404 for a model that is not served."""
    try:
        if not isinstance(request, GenerateRequest):
            request = GenerateRequest.model_validate(request)
        lora = resolve(request.model) if resolve is not None else BASE
        limits.check_request(request)
        ids = prompt_token_ids(tokenizer, request, encode)
        limits.check_tokens(request.prompt_param, ids)
        max_tokens = request.max_tokens or max(1, limits.max_model_len - len(ids))
        return PreparedRequest(
            request_id=request.request_id or uuid.uuid4().hex,
            prompt_token_ids=ids,
            params=request.sampling_params(max_tokens),
            cache_salt=request.cache_salt,
            prompt_param=request.prompt_param,
            lora_name=lora.lora_name,
            lora_path=lora.lora_path,
        )
    except pydantic.ValidationError as e:
        raise engine_error(e) from None
    except APIError:
        raise
    except Exception as e:  # e.g. a chat template that refuses the message roles
        raise APIError(400, f"invalid request: {e}") from None


class PromptPreparer:
    """`prepare` off the event loop. A long chat's template and tokenization take milliseconds; on the
    ingress's event loop they would hold up every stream it relays and every routing decision made
    there, and a wave of chats would queue behind each other's (docs/routing.md). The tokenizer lets
    the loop run while it works. One thread: a tokenizer is not guaranteed safe to share between
    threads, nor is the PieceTokenizer that remembers the conversations' pieces (a chat's history is
    tokenized once, not every turn)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.pieces = PieceTokenizer(tokenizer)
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="prepare")

    async def __call__(
        self,
        request: Union[GenerateRequest, dict],
        limits: RequestLimits,
        resolve: Optional[Callable[[Optional[str]], ResolvedModel]] = None,
    ) -> PreparedRequest:
        return await asyncio.get_running_loop().run_in_executor(
            self._thread, prepare, self.tokenizer, request, limits, resolve, self.pieces.encode
        )
