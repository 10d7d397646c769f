"""A request's prompt as token ids: the chat template applied and tokenized once, where it is cheapest.

The ingress does it for every request (routers then hash exactly the tokens the engine will cache,
and the replica's cores only run the engine); the replica does it only for callers that reach it
without the ingress. Same tokenizer, same template, same ids as the offline engine.
"""
from __future__ import annotations

import uuid
from typing import List, Optional, Union

import pydantic

from deployments.errors import APIError, engine_error
from deployments.limits import RequestLimits
from deployments.protocol import GenerateRequest


def chat_text(tokenizer, request: GenerateRequest) -> str:
    messages = [{"role": m.role, "content": m.text()} for m in request.messages]
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def prompt_token_ids(tokenizer, request: GenerateRequest) -> List[int]:
    if request.prompt_token_ids is not None:
        return request.prompt_token_ids
    if request.messages is not None:
        return tokenizer(chat_text(tokenizer, request))["input_ids"]
    if isinstance(request.prompt, str):
        return tokenizer(request.prompt)["input_ids"] if request.prompt else []
    return list(request.prompt)


def prepare(tokenizer, request: Union[GenerateRequest, dict], limits: Optional[RequestLimits] = None
            ) -> GenerateRequest:
    """Validates a request, gives it an id and its prompt token ids. Errors are 400 APIErrors.
    With `limits` (the ingress), sizes are checked before tokenizing and the tokens after, also
    for a request that arrives prepared: a caller's own prompt_token_ids are not trusted."""
    try:
        # Only a GenerateRequest object can come prepared (by the ingress); a dict is always tokenized.
        prepared = isinstance(request, GenerateRequest) and request.request_id and request.prompt_token_ids is not None
        if not isinstance(request, GenerateRequest):
            request = GenerateRequest.model_validate(request)
        if limits is not None:
            limits.check_request(request)
        if not prepared:
            request = request.model_copy(update={
                "request_id": request.request_id or uuid.uuid4().hex,
                "prompt_token_ids": prompt_token_ids(tokenizer, request),
            })
        if limits is not None:
            limits.check_tokens(request)
        return request
    except pydantic.ValidationError as e:
        raise engine_error(e) from None
    except APIError:
        raise
    except Exception as e:  # e.g. a chat template that refuses the message roles
        raise APIError(400, f"invalid request: {e}") from None
