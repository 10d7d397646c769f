"""The HTTP ingress: OpenAI-compatible FastAPI app in front of the LLM replicas.

It forwards every request through a DeploymentHandle, so the configured request router picks the
replica for HTTP traffic as for Python callers. It also serves typed `generate` / `stream` calls
to other Ray jobs (`serve.get_app_handle(app_name)`).
"""

import asyncio
import json
import time
from typing import AsyncIterator, Optional, Union

from fastapi import FastAPI, Response
from fastapi.responses import StreamingResponse
from ray import serve
from ray.exceptions import RayActorError, RayTaskError
from ray.serve.exceptions import BackPressureError, DeploymentUnavailableError, RequestCancelledError
from ray.serve.handle import DeploymentHandle
from starlette.middleware.cors import CORSMiddleware

from deployments import lora_routes, metrics, request_log
from deployments.adapters import AdapterRegistry
from deployments.auth import APIKeyAuth, load_api_keys
from deployments.chat_output import ChatOutput, chat_events, sse
from deployments.config import IngressConfig
from deployments.errors import APIError, engine_error, overload_error
from deployments.http_errors import install_error_handlers
from deployments.limits import BodySizeLimit, RequestLimits
from deployments.lora_api import LoadLoRAAdapterRequest, LoRAAdapterResponse, UnloadLoRAAdapterRequest
from deployments.openai_protocol import (
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    ModelList,
    StreamUsage,
    TextCompletion,
    Usage,
    new_id,
)
from deployments.prompts import PromptPreparer
from deployments.protocol import GenerateChunk, GenerateRequest, GenerateResponse, ModelInfo, PreparedRequest
from router import feedback

REPLICA_HEADER = "X-Iterserve-Replica"  # which LLM replica served the request (routing is observable)
TIMING_HEADER = "Server-Timing"  # where the first token's time went (request_log.RequestLogEntry.server_timing)
api = FastAPI(title="iterserve", description="OpenAI-compatible LLM serving on Ray Serve")
install_error_handlers(api)


def _cancel(response) -> None:
    """Best-effort cancel of a handle call (Serve's cancel() re-raises the call's own error)."""
    try:
        response.cancel()
    except Exception:
        pass


@serve.deployment(name="OpenAIIngress")
@serve.ingress(api)
class OpenAIIngress:
    def __init__(
        self, llm: DeploymentHandle, model_name: str, engine_model: str, ingress_config: Optional[dict] = None
    ):
        from batcher.model_files import load_tokenizer

        self.config = IngressConfig.model_validate(ingress_config or {})
        self.api_keys = load_api_keys(self.config.api_keys_env, self.config.api_key_file)  # fails the deploy

        # Chat template and tokenization happen here, once per request, off the event loop
        # (deployments/prompts.py).
        self.tokenizer = load_tokenizer(engine_model)
        self._preparer = PromptPreparer(self.tokenizer)
        self.llm = llm
        self.llm_stream = llm.options(stream=True)
        self.model_name = model_name
        self.overload = (self.config.overload_status_code, self.config.retry_after_s)
        self._info: Optional[ModelInfo] = None
        self._limits: Optional[RequestLimits] = None
        self._adapters: Optional[AdapterRegistry] = None  # from the replicas' engine config, on first need

    def __serve_build_asgi_app__(self):
        """Serve calls this once per replica after __init__: the app with this replica's guards,
        outermost first: CORS (so refusals carry its headers too), API keys, body size."""
        app = self._asgi_app
        app.add_middleware(BodySizeLimit, max_bytes=self._max_body_bytes)
        if self.api_keys is not None:
            app.add_middleware(APIKeyAuth, keys=self.api_keys)
        if self.config.cors_allow_origins:
            app.add_middleware(
                CORSMiddleware,
                allow_origins=self.config.cors_allow_origins,
                allow_methods=["*"],
                allow_headers=["*"],
                expose_headers=[REPLICA_HEADER, TIMING_HEADER, "Retry-After"],
            )
        return app

    # ---- typed Python API (other Ray jobs) -------------------------------------------------------

    async def generate(self, request: Union[GenerateRequest, dict]) -> GenerateResponse:
        return await self._generate(await self._prepare(request))

    async def stream(self, request: Union[GenerateRequest, dict]) -> AsyncIterator[GenerateChunk]:
        request = await self._prepare(request)
        gen = self._llm(request, stream=True).stream.remote(request)
        finished, output = False, []
        try:
            async for chunk in gen:
                if chunk.index == 0:  # the router learns one answer: choice 0's
                    output += chunk.token_ids
                yield chunk
            finished = True
        except Exception as e:
            raise self._api_error(e) from None
        finally:
            if not finished:
                _cancel(gen)  # the caller went away (or it failed): abort the engine request
        feedback.record_answer(self.llm, request.request_id, request.prompt_token_ids, output)

    async def _generate(self, request: PreparedRequest) -> GenerateResponse:
        response = self._llm(request).generate.remote(request)
        try:
            out = await response
        except asyncio.CancelledError:
            _cancel(response)
            raise
        except Exception as e:
            raise self._api_error(e) from None
        feedback.record_answer(self.llm, request.request_id, request.prompt_token_ids, out.token_ids)
        return out

    # ---- HTTP ------------------------------------------------------------------------------------

    @api.get("/health")
    async def health(self):
        try:  # a round trip to an LLM replica (not cached: health must reflect now)
            await asyncio.wait_for(self._fetch_model_info(), timeout=10)
        except Exception as e:
            raise APIError(503, f"no healthy LLM replica: {e}", type="service_unavailable_error") from None
        return {"status": "ok"}

    @api.get("/v1/models")
    async def models(self) -> ModelList:
        return await lora_routes.model_list(self.llm, await self._registry(), await self._model_info())

    @api.post("/v1/load_lora_adapter")
    async def load_lora_adapter(self, body: LoadLoRAAdapterRequest) -> LoRAAdapterResponse:
        return await lora_routes.load(self.llm, await self._registry(), body, self._api_error)

    @api.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(self, body: UnloadLoRAAdapterRequest) -> LoRAAdapterResponse:
        return await lora_routes.unload(self.llm, await self._registry(), body, self._api_error)

    @api.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatCompletionRequest, response: Response):
        rid, created = new_id("chatcmpl"), int(time.time())
        log = request_log.begin(rid, bool(body.stream))
        request = await self._from_body(body, rid)
        log.prepared()
        if body.stream:
            return await self._stream_response(request, self._chat_events(body, rid, created), log)
        out = await self._generate(request)
        log.write(200, out)
        response.headers[REPLICA_HEADER] = out.replica_id
        response.headers[TIMING_HEADER] = log.server_timing()
        output = ChatOutput(body, self.config.tool_call_parser)
        return ChatCompletion(
            id=rid,
            created=created,
            model=body.model or self.model_name,
            choices=[output.choice_of(c) for c in out.choices or [out]],
            usage=Usage.of(out),
        )

    @api.post("/v1/completions")
    async def completions(self, body: CompletionRequest, response: Response):
        rid, created = new_id("cmpl"), int(time.time())
        log = request_log.begin(rid, bool(body.stream))
        request = await self._from_body(body, rid)
        log.prepared()
        if body.stream:
            return await self._stream_response(request, self._completion_events(body, rid, created), log)
        out = await self._generate(request)
        log.write(200, out)
        response.headers[REPLICA_HEADER] = out.replica_id
        response.headers[TIMING_HEADER] = log.server_timing()
        return TextCompletion(
            id=rid,
            created=created,
            model=body.model or self.model_name,
            choices=[
                CompletionChoice(
                    index=c.index,
                    text=c.text,
                    finish_reason=c.finish_reason,
                    logprobs=CompletionLogprobs.of(c.logprobs) if c.logprobs is not None else None,
                )
                for c in out.choices or [out]
            ],
            usage=Usage.of(out),
        )

    # ---- helpers ---------------------------------------------------------------------------------

    async def _from_body(self, body, rid: str) -> PreparedRequest:
        (await self._request_limits()).check_user(body.user)
        try:
            request = body.to_generate(rid)
        except ValueError as e:  # pydantic.ValidationError is a ValueError
            raise engine_error(e) from None
        return await self._prepare(request)

    async def _prepare(self, request: Union[GenerateRequest, dict]) -> PreparedRequest:
        """The one request path: every request, HTTP or handle, becomes a PreparedRequest here."""
        return await self._preparer(request, await self._request_limits(), (await self._registry()).resolve)

    def _llm(self, request: PreparedRequest, stream: bool = False) -> DeploymentHandle:
        """With its adapter as Serve's multiplexed model id: routers prefer the replicas holding it."""
        return lora_routes.for_adapter(self.llm_stream if stream else self.llm, request.lora_name)

    async def _stream_response(
        self, request: PreparedRequest, events, log: request_log.RequestLogEntry
    ) -> StreamingResponse:
        """Waits for the first chunk before answering, so errors keep their status code."""
        gen = self._llm(request, stream=True).stream.remote(request)
        try:
            first = await gen.__anext__()
        except asyncio.CancelledError:
            _cancel(gen)
            raise
        except Exception as e:
            raise self._api_error(e) from None
        log.first_token(first.replica_ttft_s, first.replica_sent_at)
        return StreamingResponse(
            self._relay(request, gen, first, events, log),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", REPLICA_HEADER: first.replica_id, TIMING_HEADER: log.server_timing()},
        )

    async def _relay(
        self, request: PreparedRequest, gen, first: GenerateChunk, events, log: request_log.RequestLogEntry
    ) -> AsyncIterator[str]:
        """Chunks -> SSE text. A client disconnect cancels this generator, which cancels `gen`
        (the replica then aborts the request and frees its KV blocks)."""
        finished, output, last, generated = False, [], first, {}

        def event(chunk: GenerateChunk) -> str:
            nonlocal last
            if chunk.index == 0:  # the router learns one answer: choice 0's
                output.extend(chunk.token_ids)
            last, generated[chunk.index] = chunk, chunk.completion_tokens
            return events(chunk)

        try:
            yield event(first)
            async for chunk in gen:
                yield event(chunk)
            finished = True
            feedback.record_answer(self.llm, request.request_id, request.prompt_token_ids, output)
            log.write(200, last.model_copy(update={"completion_tokens": sum(generated.values())}))
            yield "data: [DONE]\n\n"
        except Exception as e:  # mid-stream failure: the status is already sent; report in-band
            err = self._api_error(e)
            metrics.count_error(err.status_code, err.type)
            log.write(err.status_code, last, error_type=err.type)
            yield f"data: {json.dumps(err.body())}\n\ndata: [DONE]\n\n"
        finally:
            if not finished:
                _cancel(gen)
                log.write(200, last, finish_reason="abort")  # the client went away

    def _chat_events(self, body: ChatCompletionRequest, rid: str, created: int):
        def make(choices, usage=None) -> ChatCompletionChunk:
            return ChatCompletionChunk(
                id=rid, created=created, model=body.model or self.model_name, choices=choices, usage=usage
            )

        return chat_events(body, ChatOutput(body, self.config.tool_call_parser), make)

    def _completion_events(self, body: CompletionRequest, rid: str, created: int):
        usage, offsets = StreamUsage(body.n), {}

        def events(chunk: GenerateChunk) -> str:
            offset = offsets.get(chunk.index, 0)
            lps = CompletionLogprobs.of(chunk.logprobs, offset) if chunk.logprobs else None
            offsets[chunk.index] = offset + len(chunk.text)
            out = sse(
                TextCompletion(
                    id=rid,
                    created=created,
                    model=body.model or self.model_name,
                    choices=[
                        CompletionChoice(
                            index=chunk.index, text=chunk.text, logprobs=lps, finish_reason=chunk.finish_reason
                        )
                    ],
                )
            )
            total = usage.add(chunk)
            if total is not None and body.include_usage:
                out += sse(
                    TextCompletion(
                        id=rid, created=created, model=body.model or self.model_name, choices=[], usage=total
                    )
                )
            return out

        return events

    async def _fetch_model_info(self) -> ModelInfo:
        self._info = await self.llm.model_info.remote()
        return self._info

    async def _model_info(self) -> ModelInfo:
        return self._info or await self._fetch_model_info()

    async def _replica_info(self) -> ModelInfo:
        """The replicas' model info (asked once); failing, the client's APIError."""
        try:
            return await self._model_info()
        except Exception as e:
            raise self._api_error(e) from None

    async def _registry(self) -> AdapterRegistry:
        """The adapter names, from the replicas' engine config (asked once, on first need)."""
        if self._adapters is None:
            self._adapters = AdapterRegistry(self.model_name, (await self._replica_info()).lora_config)
        return self._adapters

    async def _request_limits(self) -> RequestLimits:
        """The limits, sized from the replicas' context window (asked once, on first need)."""
        if self._limits is None:
            info = await self._replica_info()
            self._limits = RequestLimits(self.config.limits, info.max_model_len, len(self.tokenizer))
        return self._limits

    async def _max_body_bytes(self) -> int:
        if self.config.limits.max_body_bytes is not None:  # known without asking a replica
            return self.config.limits.max_body_bytes
        return (await self._request_limits()).max_body_bytes

    def _api_error(self, e: Exception) -> APIError:
        """Whatever a handle call raised -> the error the client sees."""
        if isinstance(e, BackPressureError):  # behind FastAPI this would otherwise be a 500
            return overload_error(*self.overload)
        cause = e.cause if isinstance(e, RayTaskError) and getattr(e, "cause", None) is not None else e
        if isinstance(cause, APIError):
            return APIError(*cause.args)
        if isinstance(cause, (RayActorError, DeploymentUnavailableError, RequestCancelledError)):
            return APIError(
                503,
                f"LLM replica unavailable: {type(cause).__name__}",
                retry_after_s=self.overload[1],
                type="service_unavailable_error",
                code="replica_unavailable",
            )
        return engine_error(cause)
