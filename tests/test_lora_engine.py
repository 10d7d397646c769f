"""Multi-LoRA in the engine, without Ray: greedy output with an adapter equals HF `generate` of the
PEFT model merged into the base (fp32), a batch of several adapters and the base equals each run
alone (with slots scarcer than adapters, and under preemption), adapters never share prefix-cache
blocks with the base or each other, bad adapters are refused naming the problem, memory is LRU and
never evicts an adapter in use."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from batcher import EngineConfig, EngineInput, LLMEngine, SamplingParams
from batcher.errors import InvalidRequestError, LoRANotFoundError
from batcher.lora_adapter import AdapterStore, LoRAAdapter
from batcher.model_loader import load_model, tiny_llama
from tests.reference import mixed_prompts

TINY = "tiny-llama"
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def make_adapter(directory: Path, seed: int, rank: int = 4, targets=ALL, base=None, **extra) -> str:
    """A PEFT adapter with random, non-zero A and B (init_lora_weights=False), saved to `directory`."""
    torch.manual_seed(seed)
    model = get_peft_model(
        base if base is not None else tiny_llama(0),
        LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=targets, init_lora_weights=False, **extra),
    )
    model.save_pretrained(str(directory))
    return str(directory)


def merged_greedy(adapter_dir, prompt, max_new_tokens: int, base_name: str = TINY):
    """HF generate of the PEFT model merged into a fresh base (EOS neither stops nor is suppressed)."""
    base, _ = load_model(base_name, torch.float32, torch.device("cpu"))
    model = base if adapter_dir is None else PeftModel.from_pretrained(base, adapter_dir).merge_and_unload()
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="module")
def adapters(tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        name: make_adapter(root / name, seed, rank, targets)
        for name, seed, rank, targets in [
            ("a", 1, 4, ALL),
            ("b", 2, 8, ["q_proj", "v_proj"]),
            ("c", 3, 2, ["down_proj", "o_proj"]),
        ]
    }


def engine_with(adapters, **lora) -> LLMEngine:
    return LLMEngine(EngineConfig(model=TINY, dtype="float32", num_kv_blocks=256, lora={"adapters": adapters, **lora}))


GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)


def test_each_adapter_equals_the_merged_peft_model_and_a_mixed_batch_equals_each_alone(adapters):
    engine = engine_with(adapters, max_loras=4)
    prompts = mixed_prompts(TINY, n_random=2)[:4]
    names = [None, "a", "b", "c"]
    alone = {}
    for name in names:
        for i, p in enumerate(prompts):
            request = engine.make_request(EngineInput(p, GREEDY, lora_name=name))
            engine.add(request)
            while engine.has_unfinished():
                engine.step()
            alone[name, i] = request.seq.output_token_ids
    for name in names:
        expected = merged_greedy(adapters.get(name), prompts[0], 12)
        assert alone[name, 0] == expected, name
    assert len({tuple(alone[n, 0]) for n in names}) == 4  # every adapter changes the output
    # one batch: every (adapter, prompt) pair at once
    requests = [engine.make_request(EngineInput(p, GREEDY, lora_name=n)) for n in names for p in prompts]
    for r in requests:
        engine.add(r)
    while engine.has_unfinished():
        engine.step()
    got = {
        (n, i): requests[k * len(prompts) + i].seq.output_token_ids
        for k, n in enumerate(names)
        for i in range(len(prompts))
    }
    assert got == alone
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks
    counters = engine.stats().lora_counters
    assert counters["a"]["requests"] == 2 * len(prompts) and counters["a"]["generated_tokens"] == 2 * len(prompts) * 12


def test_scarce_slots_and_preemption_keep_every_output(adapters):
    prompts = mixed_prompts(TINY, n_random=3)
    names = ["a", "b", "c", None, "a", "c"]
    plain = engine_with(adapters, max_loras=4)
    expected = {}
    for n, p in zip(names, prompts):
        request = plain.make_request(EngineInput(p, GREEDY, lora_name=n))
        plain.add(request)
        while plain.has_unfinished():
            plain.step()
        expected[n, tuple(p)] = request.seq.output_token_ids
    # one slot for three adapters, and a KV cache small enough to preempt
    tight = LLMEngine(
        EngineConfig(
            model=TINY,
            dtype="float32",
            num_kv_blocks=26,
            block_size=4,
            max_num_seqs=4,
            lora={"adapters": adapters, "max_loras": 1},
        )
    )
    requests = [tight.make_request(EngineInput(p, GREEDY, lora_name=n)) for n, p in zip(names, prompts)]
    for r in requests:
        tight.add(r)
    while tight.has_unfinished():
        tight.step()
        assert len({n for n in tight.lora.slots.names if n is not None}) <= 1
        running = {s.lora_id for s in tight.scheduler.running} - {None}
        assert len(running) <= 1  # never two adapters in one batch with one slot
    assert tight.scheduler.num_preemptions > 0
    for n, p, r in zip(names, prompts, requests):
        assert r.seq.output_token_ids == expected[n, tuple(p)], n


def test_adapters_never_share_cached_blocks(adapters):
    engine = engine_with(adapters)
    prompt = list(range(100, 140))
    full = (len(prompt) - 1) // 8 * 8  # the full blocks before the last token (block_size 8)
    for name, cached in [(None, 0), (None, full), ("a", 0), ("a", full), ("b", 0), (None, full)]:
        request = engine.make_request(EngineInput(prompt, SamplingParams(max_tokens=1, temperature=0), lora_name=name))
        engine.add(request)
        while engine.has_unfinished():
            engine.step()
        assert request.seq.num_cached_tokens == cached, name


def test_smollm2_adapter_equals_the_merged_peft_model(tmp_path):
    base, _ = load_model("smollm2-135m-instruct", torch.float32, torch.device("cpu"))
    path = make_adapter(tmp_path / "smol", 5, 8, ["q_proj", "v_proj", "up_proj"], base=base)
    engine = LLMEngine(
        EngineConfig(
            model="smollm2-135m-instruct", dtype="float32", kv_cache_memory_gib=0.1, lora={"adapters": {"smol": path}}
        )
    )
    prompt = mixed_prompts("smollm2-135m-instruct", n_random=0)[0]
    out = engine.make_request(EngineInput(prompt, GREEDY, lora_name="smol"))
    engine.add(out)
    while engine.has_unfinished():
        engine.step()
    assert out.seq.output_token_ids == merged_greedy(path, prompt, 12, "smollm2-135m-instruct")


def test_bad_adapters_are_refused_naming_the_problem(adapters, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    other = LlamaForCausalLM(
        LlamaConfig(
            vocab_size=49152,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
        )
    )
    make_adapter(tmp_path / "other", 1, base=other)
    make_adapter(tmp_path / "big", 1, rank=32)
    make_adapter(tmp_path / "head", 1, targets=["lm_head"])
    make_adapter(tmp_path / "dora", 1, targets=["q_proj"], use_dora=True)
    (tmp_path / "empty").mkdir()
    broken = Path(make_adapter(tmp_path / "broken", 1))
    (broken / "adapter_model.safetensors").write_bytes(b"not a safetensors file")
    engine = engine_with({}, max_lora_rank=16)
    cases = {
        "other": "another base model",
        "big": "rank 32 is over max_lora_rank 16",
        "head": "not a LoRA A/B matrix|not a decoder linear layer",
        "dora": "use_dora",
        "empty": "no adapter_config.json",
        "broken": "cannot read adapter_model.safetensors",
        "missing": "no adapter_config.json",
    }
    for name, words in cases.items():
        with pytest.raises(InvalidRequestError, match=words) as info:
            engine.load_lora(name, str(tmp_path / name))
        assert info.value.param == "lora"
    with pytest.raises(InvalidRequestError, match="must be 1-128"):
        engine.load_lora("../etc", adapters["a"])
    with pytest.raises(LoRANotFoundError):
        engine.make_request(EngineInput([5, 6, 7], GREEDY, lora_name="nobody"))
    assert engine.generate([5, 6, 7], GREEDY)[0].token_ids  # still serving
    assert engine.lora_names() == []


def test_dynamic_loading_and_unload(adapters, tmp_path):
    root = Path(adapters["a"]).parent
    engine = LLMEngine(
        EngineConfig(model=TINY, dtype="float32", num_kv_blocks=128, lora={"dynamic_lora_loading_path": str(root)})
    )
    request = engine.make_request(EngineInput([5, 6, 7], GREEDY, lora_name="b"))  # loaded from <root>/b on first use
    assert request.adapter.rank == 8 and engine.lora_names() == ["b"]
    assert engine.unload_lora("b") and engine.lora_names() == []
    assert json.loads((Path(adapters["b"]) / "adapter_config.json").read_text())["r"] == 8


def test_memory_is_lru_and_never_evicts_an_adapter_in_use():
    store = AdapterStore(2)
    mk = lambda n: LoRAAdapter(n, n, 1, n, {})  # noqa: E731
    store.put(mk("x"))
    store.pin("x", 1)  # a request in flight uses x
    store.put(mk("y"))
    store.put(mk("z"))  # over capacity: y goes (x is pinned)
    assert set(store.resident()) == {"x", "z"} and store.evictions == {"y": 1}
    store.pin("x", -1)
    store.get("z")
    store.put(mk("w"))  # x is now the least recently used and unpinned
    assert set(store.resident()) == {"z", "w"}


def test_concurrent_requests_for_a_cold_adapter_read_it_once(adapters):
    from concurrent.futures import ThreadPoolExecutor

    engine = LLMEngine(
        EngineConfig(
            model=TINY,
            dtype="float32",
            num_kv_blocks=128,
            lora={"dynamic_lora_loading_path": str(Path(adapters["a"]).parent)},
        )
    )
    with ThreadPoolExecutor(8) as pool:
        requests = list(
            pool.map(lambda i: engine.make_request(EngineInput([5, 6, 7 + i], GREEDY, lora_name="c")), range(8))
        )
    assert {id(r.adapter) for r in requests} == {id(requests[0].adapter)}
    assert engine.stats().lora_counters["c"]["loads"] == 1


def test_an_adapter_reloaded_with_other_weights_is_served_with_them(adapters):
    engine = engine_with({"a": adapters["a"]}, max_loras=2)
    prompt = mixed_prompts(TINY, n_random=0)[0]

    def run(name):
        request = engine.make_request(EngineInput(prompt, GREEDY, lora_name=name))
        engine.add(request)
        while engine.has_unfinished():
            engine.step()
        return request.seq.output_token_ids

    first = run("a")  # leaves a's weights in an unheld slot
    engine.load_lora("a", adapters["b"])  # new weights under the same name
    assert run("a") == merged_greedy(adapters["b"], prompt, 12) != first


def test_the_compiled_forward_serves_mixed_adapters_exactly_with_the_warm_up_graphs(adapters):
    """Steps with adapter tokens run the compiled graph warmed at start (a mask over every slot),
    base-only steps the graph without LoRA: both equal the eager engine's tokens (float32)."""
    prompts = mixed_prompts(TINY, n_random=3)
    names = ["a", None, "b", "c", None, "a"]
    eager = engine_with(adapters, max_loras=4)
    compiled = LLMEngine(
        EngineConfig(
            model=TINY,
            dtype="float32",
            num_kv_blocks=256,
            compile="auto",
            max_num_batched_tokens=40,
            lora={"adapters": adapters, "max_loras": 4},
        )
    )
    assert compiled.runner.forward.mode == "inductor"
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    outs = {}
    for engine in (eager, compiled):
        requests = [engine.make_request(EngineInput(p, GREEDY, lora_name=n)) for n, p in zip(names, prompts)]
        for r in requests:
            engine.add(r)
        while engine.has_unfinished():
            engine.step()
        outs[engine] = [r.seq.output_token_ids for r in requests]
    assert outs[compiled] == outs[eager]
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] == graphs  # nothing compiled mid-serving
