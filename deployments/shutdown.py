"""How long a leaving replica may take to finish its streams (Serve's graceful shutdown window).

When Serve removes a replica (scale-down, redeploy) it first stops routing to it, then waits while
the replica still has requests in flight, checking every `graceful_shutdown_wait_loop_s`, up to
`graceful_shutdown_timeout_s`; only then is the actor killed. The window must cover the longest
request the engine admits: up to max_model_len tokens generated at a full batch's step time.
"""

from __future__ import annotations

import math
from typing import Optional

from batcher import simulated
from batcher.config import EngineConfig
from batcher.model_files import context_length, is_local_model, model_config

# Seconds per token of the embedded model at 64 sequences on 2 CPU cores (measured step ~0.25 s).
CPU_TOKEN_S = 0.3


def model_len(engine: EngineConfig) -> int:
    """max_model_len as the engine will resolve it, from the model's config (no weights loaded)."""
    if engine.max_model_len and not is_local_model(engine.model):
        return engine.max_model_len  # a hub model: no download at deploy; the engine checks it when it loads
    try:
        config = model_config(engine.model)
    except OSError as e:  # a hub model whose config this node cannot fetch
        raise ValueError(
            f"cannot read the config of model {engine.model!r} to size the shutdown window "
            f"({e}); set engine.max_model_len or replica.graceful_shutdown_timeout_s"
        ) from None
    return context_length(config, engine.max_model_len)


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
