"""How long a leaving replica may take to finish its streams (Serve's graceful shutdown window).

When Serve removes a replica (scale-down, redeploy) it first stops routing to it, then waits while
the replica still has requests in flight, checking every `graceful_shutdown_wait_loop_s`, up to
`graceful_shutdown_timeout_s`; only then is the actor killed. The window must cover the longest
request the engine admits: up to max_model_len tokens generated at a full batch's step time.
"""
from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Optional

from batcher import simulated
from batcher.config import EngineConfig

# SmolLM2-135M-Instruct's context (config.json max_position_embeddings), for when the embedded model
# has not been prepared on this machine yet; a model whose length cannot be read gets the same.
EMBEDDED_MAX_MODEL_LEN = 8192
# Seconds per token of the embedded model at 64 sequences on 2 CPU cores (measured step ~0.25 s).
CPU_TOKEN_S = 0.3


def model_len(engine: EngineConfig) -> int:
    """max_model_len as the engine will resolve it, without loading the model."""
    if engine.max_model_len:
        return engine.max_model_len
    if simulated.is_simulated(engine.model):
        return simulated.preset_for(engine.model).max_model_len
    if engine.model == "tiny-llama":
        return 2048
    path = Path(engine.model) / "config.json"
    if path.is_file():
        return int(json.loads(path.read_text()).get("max_position_embeddings", EMBEDDED_MAX_MODEL_LEN))
    return EMBEDDED_MAX_MODEL_LEN


def token_seconds(engine: EngineConfig) -> float:
    """Seconds one decode step takes with max_num_seqs sequences at half the context each."""
    if simulated.is_simulated(engine.model):
        preset = simulated.preset_for(engine.model)
        n, length = engine.max_num_seqs, model_len(engine)
        return preset.step.step_seconds(0, n, n * length // 2)
    return CPU_TOKEN_S


def graceful_timeout_s(engine: EngineConfig, token_s: Optional[float], wait_loop_s: float) -> float:
    """The window: the longest admitted request at a full batch's pace, plus two checks."""
    per_token = token_s if token_s is not None else token_seconds(engine)
    return float(math.ceil(model_len(engine) * per_token + 2 * wait_loop_s))
