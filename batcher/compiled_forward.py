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
from pathlib import Path
from typing import Callable, Optional

import torch

from batcher import precompiled_forward
from batcher.model_files import cache_home
from batcher.paged_attention import PagedMetadata

logger = logging.getLogger(__name__)

# CUDA: steps replayed as CUDA graphs (cudagraph trees record one graph per distinct size, so the
# runner pads sizes to buckets). Run on an H100 (docs/forward.md#cuda).
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
    return types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)


def _forward(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    positions: torch.Tensor,
    sample_index: torch.Tensor,
    meta: PagedMetadata,
) -> torch.Tensor:
    """input_ids, positions (T,); sample_index (S,) rows whose logits are returned (S, vocab)."""
    out = model(
        input_ids=input_ids[None],
        position_ids=positions[None],
        use_cache=False,
        logits_to_keep=sample_index,
        paged_metadata=meta,
    )
    return out.logits[0]


def _no_weight_guards(entries) -> list:
    """Keeps every guard but those on the model's own weights and buffers (hundreds of tensors the
    engine never replaces: adapters and quantized weights are written in place)."""
    return [
        not (e.guard_type == "TENSOR_MATCH" and ("._parameters[" in e.name or "._buffers[" in e.name)) for e in entries
    ]


class StepForward:
    """Calls the model on one packed step. mode: 'eager', or 'inductor' (torch.compile). With
    `precompiled_path`, the compiled step is loaded from that file when it is there, else traced ahead
    of time on the first (warm-up) call and saved there (batcher/precompiled_forward.py)."""

    def __init__(
        self,
        model: torch.nn.Module,
        mode: str,
        cuda_graphs: bool = False,
        freezing: bool = False,
        precompiled_path: Optional[Path] = None,
    ):
        self.model = model
        self.mode = mode
        self.cuda_graphs = cuda_graphs and mode != "eager"
        self.freezing = freezing
        self.compile_seconds = 0.0
        self.warmed = False  # set once every graph the steps need has been compiled
        self.precompiled_path = precompiled_path if mode != "eager" else None
        self.precompiled: Optional[str] = None  # "loaded" or "saved" once the step runs from the file
        self._fn = _forward if mode == "eager" else self._compiled()
        if self.precompiled_path is not None:
            try:
                loaded = precompiled_forward.load(self.precompiled_path, _forward.__globals__)
            except Exception as exc:  # a torch upgrade, a truncated file: compile again
                logger.warning(
                    "the precompiled step %s did not load (%s); compiling it again",
                    self.precompiled_path.name,
                    _reason(exc),
                )
                self.precompiled_path.unlink(missing_ok=True)
                loaded = None
            if loaded is not None:
                # The file's key stands in for its guards, which torch 2.13 cannot check after a load
                # (a saved tensor guard expects autograd keys that inference tensors lack).
                loaded.disable_guard_check()
                self._fn, self.precompiled = loaded, "loaded"

    def _compiled(self) -> Callable:
        use_compile_cache()
        options = dict(CUDA_GRAPH_OPTIONS) if self.cuda_graphs else {}
        options["freezing"] = self.freezing
        options["guard_filter_fn"] = (
            _no_weight_guards
            if self.precompiled_path is None
            else precompiled_forward.serializable_guards(_no_weight_guards)
        )
        return torch.compile(_own_code(_forward), dynamic=None, fullgraph=True, options=options)

    def __call__(
        self, input_ids: torch.Tensor, positions: torch.Tensor, sample_index: torch.Tensor, meta: PagedMetadata
    ) -> torch.Tensor:
        args = (self.model, input_ids, positions, sample_index, meta)
        if self.mode == "eager" or (self.warmed and self.precompiled):
            return self._fn(*args)  # a saved step: its file's key stands in for guards, dynamo never runs
        # Sizes >= 2 by the runner's padding: one symbolic size each, never specialised.
        for t in (input_ids, positions, sample_index, meta.slot_mapping):
            torch._dynamo.mark_dynamic(t, 0)
        if not self.warmed:
            return self._warm_up_call(args)
        # Every graph was made at start (one per thread count, and with/without LoRA): only the guards
        # that tell them apart are evaluated, not the ~5,000 on the model's modules (with the weights'
        # guards dropped, 1.2-1.5 ms a step -> ~0.25 ms here, 10% of a decode step). Unsafe only if
        # something would need a new graph after start: nothing does (tests/test_compiled_forward.py).
        with torch.compiler.set_stance(skip_guard_eval_unsafe=True):
            return self._fn(*args)

    def _warm_up_call(self, args: tuple) -> torch.Tensor:
        """A start-up step: runs a loaded file's step (falling back to compiling when it fails), or
        traces the step and saves it to the file."""
        path = self.precompiled_path
        if self.precompiled == "loaded":
            try:
                return self._fn(*args)
            except Exception as exc:
                logger.warning(
                    "the precompiled step %s does not fit this model (%s); compiling it again", path.name, _reason(exc)
                )
                path.unlink(missing_ok=True)
                self._fn, self.precompiled = self._compiled(), None
        if path is not None and self.precompiled is None:
            try:
                self._fn, self.precompiled = precompiled_forward.save(self._fn, args, path), "saved"
            except Exception as exc:
                self.precompiled_path = None
                out = self._fn(*args)  # raises if the step cannot compile at all (build_step_forward logs)
                logger.warning("the compiled step cannot be saved whole (%s); a restart traces it again", _reason(exc))
                return out
        return self._fn(*args)

    def finish_warm_up(self) -> None:
        """Every graph is compiled: from now on steps skip guard evaluation."""
        self.warmed = True
        if self.precompiled == "saved":
            self._fn.disable_guard_check()


def build_step_forward(
    model: torch.nn.Module,
    compile: str,
    warm_up: Callable[["StepForward"], None],
    device: torch.device,
    cuda_graphs: bool = False,
    freezing: bool = False,
    precompile_key: Optional[str] = None,
) -> StepForward:
    """compile: 'off' -> eager; 'auto' -> compiled, or eager with one log line when the model cannot
    be compiled; 'inductor' -> compiled, or CompileError. `warm_up(forward)` runs the steps that
    compile (a compile error surfaces there, at start-up, not in a request). precompile_key: the
    step's key when it is one graph that can be saved whole (batcher/precompiled_forward.py)."""
    if compile == "off":
        return StepForward(model, "eager")
    try:
        path = None if precompile_key is None else Path(use_compile_cache()) / "precompiled" / f"{precompile_key}.pt2"
        forward = StepForward(model, "inductor", cuda_graphs, freezing, path)
        t0 = time.perf_counter()
        warm_up(forward)
        forward.compile_seconds = time.perf_counter() - t0
        forward.finish_warm_up()
        logger.info(
            "compiled the forward on %s in %.1f s (cache: %s%s)",
            device,
            forward.compile_seconds,
            os.environ.get("TORCHINDUCTOR_CACHE_DIR"),
            f"; step {forward.precompiled} whole" if forward.precompiled else "",
        )
        return forward
    except Exception as exc:  # dynamo/inductor raise many types; all mean "cannot compile this model"
        reason = _reason(exc)
        if compile != "auto":
            raise CompileError(f"compile={compile!r} failed for {type(model).__name__}: {reason}") from exc
        # The traceback too: a bare AssertionError from inside dynamo/inductor says nothing on its own.
        logger.warning(
            "compile=auto: %s cannot be compiled (%s); running eagerly", type(model).__name__, reason, exc_info=True
        )
        return StepForward(model, "eager")


def _reason(exc: BaseException) -> str:
    """The root error of a failed compile in one line (inductor wraps it in BackendCompilerFailed)."""
    inner = getattr(exc, "inner_exception", None) or exc.__cause__ or exc
    lines = [line.strip() for line in str(inner).splitlines() if line.strip()]
    return f"{type(inner).__name__}: {lines[0] if lines else ''}"[:300]
