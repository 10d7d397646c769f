"""The model's forward as the engine calls it: eager, or compiled by `torch.compile` (inductor).

One compiled graph serves every step. The token dimension is dynamic (marked on every call) and
never 0 or 1 (the runner pads a step to at least 2 tokens and 2 sampled rows), so dynamo does not
specialise a second graph for one-token steps; the attention metadata has fixed shapes (the
runner's preallocated buffers). Static shapes per bucket would cost one compile each (30-40 s for
SmolLM2-135M on this CPU), too many for a start-up budget.

The compiled artefacts (FX graph, AOTAutograd and inductor caches) live under `cache_home()/compile`,
so a restart loads them instead of compiling. Inductor's `freezing` (weights folded in as constants,
packed once for oneDNN/MKL: faster CPU steps) is opt-in because it defeats that cache: the AOTAutograd
cache bypasses every frozen graph, and the FX graph cache bypasses a frozen bf16 graph (its packed
oneDNN weights cannot be pickled), so each start compiles from scratch.
"""
from __future__ import annotations

import logging
import os
import time
import types
from typing import Callable

import torch

from batcher.model_loader import cache_home
from batcher.paged_attention import PagedMetadata

logger = logging.getLogger(__name__)

# CUDA: steps replayed as CUDA graphs (cudagraph trees record one graph per distinct size, so the
# runner pads sizes to buckets). NOT YET RUN ON A GPU.
CUDA_GRAPH_OPTIONS = {"triton.cudagraphs": True}


class CompileError(RuntimeError):
    """The model could not be compiled and compiling was required."""


def use_compile_cache() -> str:
    """Points inductor's on-disk caches at the project's cache home (unless the caller's environment
    already chose a directory); returns the directory."""
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    directory = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if directory in (None, default_cache_dir()):  # inductor writes its /tmp default back on first use
        directory = os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(cache_home() / "compile")
    os.makedirs(directory, exist_ok=True)
    return directory


def _own_code(fn: Callable) -> Callable:
    """A copy of `fn` with a code object of its own. Dynamo keeps compiled graphs, their guards and
    its recompile limit per code object: without this, every runner in a process (tests build dozens)
    would add guards on its weights to one shared entry and, past 8, silently run eagerly."""
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__,
                              fn.__closure__)


def _forward(model: torch.nn.Module, input_ids: torch.Tensor, positions: torch.Tensor,
             sample_index: torch.Tensor, meta: PagedMetadata) -> torch.Tensor:
    """input_ids, positions (T,); sample_index (S,) rows whose logits are returned (S, vocab)."""
    out = model(input_ids=input_ids[None], position_ids=positions[None], use_cache=False,
                logits_to_keep=sample_index, paged_metadata=meta)
    return out.logits[0]


class StepForward:
    """Calls the model on one packed step. mode: 'eager', or 'inductor' (torch.compile)."""

    def __init__(self, model: torch.nn.Module, mode: str, cuda_graphs: bool = False, freezing: bool = False):
        self.model = model
        self.mode = mode
        self.cuda_graphs = cuda_graphs and mode != "eager"
        self.freezing = freezing
        self.compile_seconds = 0.0
        self._fn = _forward if mode == "eager" else self._compiled()

    def _compiled(self) -> Callable:
        use_compile_cache()
        options = dict(CUDA_GRAPH_OPTIONS) if self.cuda_graphs else {}
        options["freezing"] = self.freezing
        return torch.compile(_own_code(_forward), dynamic=None, fullgraph=True, options=options)

    def __call__(self, input_ids: torch.Tensor, positions: torch.Tensor, sample_index: torch.Tensor,
                 meta: PagedMetadata) -> torch.Tensor:
        if self.mode != "eager":
            # Sizes >= 2 by the runner's padding: one symbolic size each, never specialised.
            for t in (input_ids, positions, sample_index, meta.slot_mapping):
                torch._dynamo.mark_dynamic(t, 0)
        return self._fn(self.model, input_ids, positions, sample_index, meta)

    def warm_up(self, run_step: Callable[[], None]) -> None:
        """Compiles now (run_step runs one padded step through this forward), so no request pays."""
        t0 = time.perf_counter()
        run_step()
        self.compile_seconds = time.perf_counter() - t0


def build_step_forward(model: torch.nn.Module, compile: str, warm_up: Callable[["StepForward"], None],
                       device: torch.device, cuda_graphs: bool = False, freezing: bool = False) -> StepForward:
    """compile: 'off' -> eager; 'auto' -> compiled, or eager with one log line when the model cannot
    be compiled; 'inductor' -> compiled, or CompileError. `warm_up(forward)` runs the steps that
    compile (a compile error surfaces there, at start-up, not in a request)."""
    if compile == "off":
        return StepForward(model, "eager")
    try:
        forward = StepForward(model, "inductor", cuda_graphs, freezing)
        t0 = time.perf_counter()
        warm_up(forward)
        forward.compile_seconds = time.perf_counter() - t0
        logger.info("compiled the forward on %s in %.1f s (cache: %s)", device, forward.compile_seconds,
                    os.environ.get("TORCHINDUCTOR_CACHE_DIR"))
        return forward
    except Exception as exc:  # dynamo/inductor raise many types; all mean "cannot compile this model"
        reason = _reason(exc)
        if compile != "auto":
            raise CompileError(f"compile={compile!r} failed for {type(model).__name__}: {reason}") from exc
        logger.warning("compile=auto: %s cannot be compiled (%s); running eagerly", type(model).__name__,
                       reason)
        return StepForward(model, "eager")


def _reason(exc: BaseException) -> str:
    """The root error of a failed compile in one line (inductor wraps it in BackendCompilerFailed)."""
    inner = getattr(exc, "inner_exception", None) or exc.__cause__ or exc
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    return f"{type(inner).__name__}: {lines[0] if lines else ''}"[:300]
