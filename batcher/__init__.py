"""batcher: the per-replica continuous-batching engine.

Public API (other packages depend on these names):
- EngineConfig, SamplingParams: pydantic settings.
- EngineInput(prompt, params, request_id=..., cache_salt=..., lora_name=..., lora_path=...): one request
  as the engine takes it.
- LLMEngine(config).generate(prompts, params) -> list[Completion]: blocking, offline;
  make_request(EngineInput) -> EngineRequest, add(request), step(); add_request(EngineInput) -> request id.
- AsyncLLMEngine(config): the step loop runs in its own thread;
  `async for delta in engine.stream(EngineInput(prompt, params, ...))` yields StreamDelta;
  `await engine.generate(EngineInput(prompt, params))` -> Completion (generate_choices: all n);
  engine.abort(request_id);
  engine.snapshot() / engine.stats(): the state the loop thread published after its last round.
- block_hash: the prefix cache's SHA-256 block hashes (request routers hash with it too).
"""

from batcher.config import EngineConfig
from batcher.engine_input import EngineInput
from batcher.errors import EngineDeadError, EngineError, InvalidRequestError, RequestTooLongError
from batcher.outputs import Completion, EngineStats, StreamDelta, TokenLogprob
from batcher.sampling_params import SamplingParams

__all__ = [
    "AsyncLLMEngine",
    "Completion",
    "EngineConfig",
    "EngineDeadError",
    "EngineError",
    "EngineInput",
    "EngineStats",
    "InvalidRequestError",
    "LLMEngine",
    "RequestTooLongError",
    "SamplingParams",
    "StreamDelta",
    "TokenLogprob",
]


def __getattr__(name):  # the engines pull in torch and transformers: import them on first use
    if name == "LLMEngine":
        from batcher.llm_engine import LLMEngine

        return LLMEngine
    if name == "AsyncLLMEngine":
        from batcher.async_engine import AsyncLLMEngine

        return AsyncLLMEngine
    raise AttributeError(name)
