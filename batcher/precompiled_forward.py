"""The compiled step saved whole, so a warm start skips dynamo's trace (torch's AOT precompile).

Inductor's caches make a restart skip code generation, but dynamo still traces the whole Hugging
Face model symbolically on every start: ~8 of the ~11 s SmolLM2-135M's engine took to start warm
here. `torch.compile(...).aot_compile` captures the traced graph, its guards and inductor's artefact
in one file; `torch.compiler.load_compiled_function` brings it back without tracing (engine start
~3.5 s), and a step calls it with no guard evaluation at all (the key below stands in for them).

The file is keyed by everything the graph depends on: torch's and transformers' versions, the
sources of this package's forward and kernels and of the model's modeling code, the model's config
and its modules' classes, parameter shapes and dtypes, and the runner's facts (dtype, device, attention
backend, thread count, step buffer and KV cache shapes). A changed input is a new key: the old file is
never loaded. A file that fails to load, or whose guards reject the warm-up step, is deleted and the
step compiled again (one warning). Used for steps with one graph: on CPU, without LoRA adapters, at
one thread count (batcher/model_runner.py decides); the rest compile as before.
"""

from __future__ import annotations

import hashlib
import inspect
from pathlib import Path
from typing import Any, Callable, Dict, Optional

import torch
import transformers

_BATCHER = Path(__file__).parent
# This package's files that shape the traced graph or the ops inside it.
SOURCES = (
    "compiled_forward.py",
    "precompiled_forward.py",
    "paged_attention.py",
    "cpu_linear.py",
    "quantization.py",
    "attention/op.py",
    "attention/cpu_kernel.py",
    "native/paged_attention.cpp",
    "native/linear.cpp",
)


def precompile_key(model: torch.nn.Module, facts: Dict[str, Any]) -> str:
    """A digest of everything the compiled step depends on (see the module's docstring)."""
    h = hashlib.sha256()

    def add(*parts: Any) -> None:
        for part in parts:
            h.update(part if isinstance(part, bytes) else str(part).encode())
            h.update(b"\0")

    add(torch.__version__, transformers.__version__)
    for name in SOURCES:
        add(name, (_BATCHER / name).read_bytes())
    add(Path(inspect.getfile(type(model))).read_bytes())  # the model's modeling code
    add(model.config.to_json_string(use_diff=False))
    for name, module in model.named_modules():
        add(name, type(module).__qualname__)
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        add(name, tuple(t.shape), t.dtype, t.device)
    for key in sorted(facts):
        add(key, facts[key])
    return h.hexdigest()[:32]


def serializable_guards(keep: Callable[[list], list]) -> Callable[[list], list]:
    """A guard filter: `keep`'s choice, less the guards aot_compile cannot save (global ones and the
    identity-based types torch lists as unsupported)."""
    from torch._dynamo.guards import CheckFunctionManager

    unsupported = set(CheckFunctionManager.UNSUPPORTED_SERIALIZATION_GUARD_TYPES)

    def _filter(entries: list) -> list:
        return [
            k and not (g.is_global or g.guard_type in unsupported or unsupported & set(g.derived_guard_types or ()))
            for k, g in zip(keep(entries), entries)
        ]

    return _filter


def load(path: Path, f_globals: dict) -> Optional[Callable]:
    """The compiled step saved at `path`, or None when there is none (an unreadable file raises)."""
    if not path.exists():
        return None
    with open(path, "rb") as f:
        return torch.compiler.load_compiled_function(f, f_globals=f_globals)


def save(compiled: Any, args: tuple, path: Path) -> Callable:
    """Traces and compiles `compiled` (a torch.compile'd function) on `args` ahead of time, saves it to
    `path` (atomically) and returns it."""
    fn = compiled.aot_compile((args, {}))
    path.parent.mkdir(parents=True, exist_ok=True)
    fn.save_compiled_function(str(path))
    return fn
