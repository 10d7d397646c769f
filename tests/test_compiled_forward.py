"""The compiled forward (compile='auto'): HF-exact greedy tokens in float32, one graph per thread
count whatever the step's size, eager fallback with one log line, and the compiled step saved whole
and loaded by a new process without tracing."""

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from batcher import EngineConfig, LLMEngine, SamplingParams
from batcher.compiled_forward import CompileError
from batcher.model_loader import load_model
from batcher.model_runner import ModelRunner
from tests.reference import hf_greedy, mixed_prompts

TINY = "tiny-llama"
MAX_TOKENS = [24, 7, 16, 3, 30, 12, 20]


def _graphs() -> int:
    return torch._dynamo.utils.counters["stats"]["unique_graphs"]


def _greedy(n):
    return [
        SamplingParams(max_tokens=MAX_TOKENS[i % len(MAX_TOKENS)], temperature=0, ignore_eos=True) for i in range(n)
    ]


def test_compiled_engine_matches_hf_with_one_graph_per_thread_count():
    """Chunked prefills of many sizes, mixed decode batches and 1-token steps (1 and 2 threads) all run
    through the graphs compiled at start: tokens equal HF generate exactly (float32)."""
    prompts = mixed_prompts(TINY)
    expected = [hf_greedy(TINY, p, MAX_TOKENS[i % len(MAX_TOKENS)]) for i, p in enumerate(prompts)]
    before = torch.get_num_threads()
    try:
        engine = LLMEngine(
            EngineConfig(
                model=TINY,
                dtype="float32",
                compile="auto",
                max_num_batched_tokens=40,
                num_threads=2,
                small_step_threads=1,
                small_step_tokens=4,
            )
        )
        assert engine.runner.forward.mode == "inductor"
        compiled = _graphs()
        outs = engine.generate(prompts, _greedy(len(prompts)))
    finally:
        torch.set_num_threads(before)
    assert [o.token_ids for o in outs] == expected
    assert _graphs() == compiled  # no step compiled anything: every size reused the warm-up's graphs
    assert engine.stats().steps > 20 and engine.stats().kv_blocks_free == engine.stats().kv_blocks_total


def _uncompilable(name=TINY):
    """The real model with a graph break in its first layer: dynamo's fullgraph trace refuses it."""
    model, _ = load_model(name, torch.float32, torch.device("cpu"))
    model.model.layers[0].register_forward_pre_hook(lambda module, args: torch._dynamo.graph_break())
    return model


def test_auto_falls_back_to_eager_with_one_log_line(monkeypatch, caplog):
    import batcher.llm_engine as llm_engine

    real_load = llm_engine.load_model
    monkeypatch.setattr(llm_engine, "load_model", lambda *a, **k: (_uncompilable(), real_load(*a, **k)[1]))
    caplog.set_level(logging.INFO, logger="batcher.compiled_forward")
    engine = LLMEngine(EngineConfig(model=TINY, dtype="float32", compile="auto"))
    lines = [r for r in caplog.records if r.name == "batcher.compiled_forward"]
    assert len(lines) == 1 and lines[0].levelno == logging.WARNING
    assert "cannot be compiled" in lines[0].getMessage() and "running eagerly" in lines[0].getMessage()
    assert engine.runner.forward.mode == "eager"
    prompt = mixed_prompts(TINY)[0]
    [out] = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert out.token_ids == hf_greedy(TINY, prompt, 8)  # and it serves, exactly


def test_required_compile_that_fails_raises():
    with pytest.raises(CompileError, match="cannot|failed"):
        ModelRunner(
            _uncompilable(),
            num_blocks=16,
            block_size=4,
            dtype=torch.float32,
            device=torch.device("cpu"),
            compile="inductor",
        )


_CHILD = """
import json, sys, torch
from batcher import EngineConfig, LLMEngine, SamplingParams
engine = LLMEngine(EngineConfig(model="tiny-llama", dtype="float32", compile="auto", num_threads=1,
                                max_num_seqs=int(sys.argv[1])))
[out] = engine.generate([[5, 6, 7, 8, 9]], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
c = torch._dynamo.utils.counters
print(json.dumps({"mode": engine.runner.forward.mode, "precompiled": engine.runner.forward.precompiled,
                  "tokens": out.token_ids, "traced": c["stats"]["unique_graphs"]}))
"""


def _child_engine(home, max_num_seqs: int = 8) -> dict:
    """An engine in a new process with ITERSERVE_HOME=home (the embedded tokenizer linked in)."""
    from batcher.model_files import cache_home

    env = {**os.environ, "ITERSERVE_HOME": str(home)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    if not (home / "models").exists():
        (home / "models").mkdir()
        (home / "models" / "smollm2-135m-instruct").symlink_to(cache_home() / "models" / "smollm2-135m-instruct")
    done = subprocess.run(
        [sys.executable, "-c", _CHILD, str(max_num_seqs)],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
        cwd=os.getcwd(),
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_a_restart_loads_the_step_saved_whole_without_tracing(tmp_path):
    """Two processes with the same ITERSERVE_HOME: the first traces, compiles and saves the step; the
    second loads it (dynamo traces nothing) and answers the same tokens."""
    cold, warm = _child_engine(tmp_path), _child_engine(tmp_path)
    assert cold["mode"] == warm["mode"] == "inductor"
    assert cold["precompiled"] == "saved" and cold["traced"] == 1
    assert warm["precompiled"] == "loaded" and warm["traced"] == 0
    assert warm["tokens"] == cold["tokens"]
    assert len(list((tmp_path / "compile" / "precompiled").glob("*.pt2"))) == 1


def test_another_config_gets_its_own_saved_step():
    """The saved step's file is named by its key: a config whose graph differs (the metadata's shapes
    change with max_num_seqs, the KV cache's with num_kv_blocks) never loads another's file. Checked
    on the key (a third compiling process took ~27 s of the suite)."""

    def key(**config):
        engine = LLMEngine(EngineConfig(model=TINY, dtype="float32", compile="off", num_threads=1, **config))
        return engine.runner._precompile_key(torch.float32, {1}, False)

    base = key(max_num_seqs=8, num_kv_blocks=64)
    assert key(max_num_seqs=8, num_kv_blocks=64) == base  # a restart finds its file
    assert key(max_num_seqs=16, num_kv_blocks=64) != base
    assert key(max_num_seqs=8, num_kv_blocks=128) != base


def test_a_damaged_saved_step_is_replaced_with_one_warning(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "compile"))  # restored afterwards
    config = EngineConfig(model=TINY, dtype="float32", compile="auto", num_threads=1, max_num_seqs=4)
    first = LLMEngine(config)
    [saved] = list((tmp_path / "compile" / "precompiled").glob("*.pt2"))
    assert first.runner.forward.precompiled == "saved"
    saved.write_bytes(b"not a compiled function")
    caplog.set_level(logging.WARNING, logger="batcher.compiled_forward")
    again = LLMEngine(config)
    assert again.runner.forward.precompiled == "saved"  # compiled and saved anew
    assert [r.getMessage() for r in caplog.records if "did not load" in r.getMessage()]
    prompt = mixed_prompts(TINY)[0]
    [out] = again.generate([prompt], SamplingParams(max_tokens=8, temperature=0, ignore_eos=True))
    assert out.token_ids == hf_greedy(TINY, prompt, 8)
