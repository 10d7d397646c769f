"""Grammar-constrained decoding in the engine, without Ray: greedy output under a constraint equals HF
generate with xgrammar's own logits processor applied (the same mask), in a batch with unconstrained
rows (which stay exactly as before), across forks and preemption; bad constraints are refused
naming the problem, a compile past its deadline is refused and then cached."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch
from pydantic import ValidationError
from xgrammar.contrib.hf import LogitsProcessor as XgrammarLogitsProcessor

from batcher import EngineConfig, EngineInput, LLMEngine, SamplingParams
from batcher.errors import InvalidRequestError
from batcher.structured_outputs import StructuredOutputs
from tests.reference import hf_greedy, reference_model

SMOL = "smollm2-135m-instruct"

PERSON = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name", "age"],
}
CONSTRAINTS = {
    "json": StructuredOutputs(json=PERSON),
    "json_object": StructuredOutputs(json_object=True),
    "regex": StructuredOutputs(regex=r"[A-Z][a-z]+, [0-9]{2}"),
    "choice": StructuredOutputs(choice=["Paris", "London", 'Rome "city"']),
    "grammar": StructuredOutputs(grammar='root ::= "yes" | "no" | "maybe: " [a-z]+'),
}


@pytest.fixture(scope="module")
def engine():
    return LLMEngine(EngineConfig(model=SMOL, dtype="float32", max_num_seqs=16, num_kv_blocks=512))


def chat(engine, text: str):
    text = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return engine.tokenizer(text)["input_ids"]


def hf_constrained(engine, prompt, spec: StructuredOutputs, max_new_tokens: int):
    """HF generate under xgrammar's HF logits processor, stopping at the engine's EOS."""
    model, _ = reference_model(SMOL)
    processor = XgrammarLogitsProcessor(engine.builder.grammars.compile(spec))
    out = model.generate(
        torch.tensor([prompt]),
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        logits_processor=[processor],
        eos_token_id=sorted(engine.eos_token_ids),
        pad_token_id=0,
    )
    return out[0, len(prompt) :].tolist()


def test_constrained_greedy_equals_hf_with_the_same_mask_and_plain_rows_are_untouched(engine):
    prompt = chat(engine, "Describe a person called Ada, aged 36, as JSON.")
    plain_prompt = chat(engine, "What is the capital of France?")
    specs = list(CONSTRAINTS.values())
    params = [SamplingParams(max_tokens=40, temperature=0, structured_outputs=s) for s in specs]
    outs = engine.generate(
        [prompt] * len(specs) + [plain_prompt], params + [SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)]
    )
    for spec, out in zip(specs, outs):
        assert out.token_ids == hf_constrained(engine, prompt, spec, 40), spec.kind
        if spec.kind != "json_object":  # the model nests objects past 40 tokens there
            assert out.finish_reason == "stop", (spec.kind, out.text)  # the grammar ended it with EOS
    assert outs[-1].token_ids == hf_greedy(SMOL, plain_prompt, 12)
    jsonschema.validate(json.loads(outs[0].text), PERSON)
    assert outs[1].text.startswith("{")
    assert outs[3].text in CONSTRAINTS["choice"].choice
    assert engine.constrained is not None and len(engine.constrained) == 0  # matchers of ended requests freed


def test_forked_choices_and_sampled_rows_all_match(engine):
    prompt = chat(engine, "Give me a colour.")
    spec = StructuredOutputs(choice=["red", "green", "blue", "teal"])
    outs = engine.generate(
        [prompt], SamplingParams(max_tokens=8, temperature=1.5, seed=3, n=6, structured_outputs=spec)
    )
    assert len(outs) == 6 and all(o.text in spec.choice for o in outs)
    assert len({o.text for o in outs}) > 1  # forks sample their own streams under the same grammar


def test_preemption_keeps_the_grammar_state():
    # 24 blocks of 8 for 4 sequences of ~40 prompt tokens + 48 output tokens: preemption (recompute) is certain.
    engine = LLMEngine(EngineConfig(model=SMOL, dtype="float32", max_num_seqs=4, num_kv_blocks=24, block_size=8))
    engine.builder.compile(CONSTRAINTS["json"])  # makes the cache the reference uses
    prompts = [chat(engine, f"Describe person number {i} as JSON.") for i in range(4)]
    outs = engine.generate(
        prompts, SamplingParams(max_tokens=48, temperature=0, structured_outputs=CONSTRAINTS["json"])
    )
    assert engine.scheduler.num_preemptions > 0
    for prompt, out in zip(prompts, outs):
        assert out.token_ids == hf_constrained(engine, prompt, CONSTRAINTS["json"], 48)
    assert engine.block_manager.num_free_blocks == engine.block_manager.num_blocks


@pytest.mark.parametrize(
    "spec, message",
    [
        (StructuredOutputs(json={"type": "object", "properties": {"a": {"type": "frob"}}}), "frob"),
        (StructuredOutputs(regex="(ab"), "parenthesis"),
        (StructuredOutputs(grammar='root ::= "a" | '), "EBNF"),
        (StructuredOutputs(grammar='start ::= "a"'), "root"),
    ],
)
def test_bad_constraints_are_refused_naming_the_problem(engine, spec, message):
    with pytest.raises(InvalidRequestError, match=message):
        engine.make_request(EngineInput("hi", SamplingParams(structured_outputs=spec)))
    [out] = engine.generate("hi", SamplingParams(max_tokens=3, temperature=0))  # still serving
    assert len(out.token_ids) == 3


def test_a_compile_past_its_deadline_is_refused_then_cached():
    engine = LLMEngine(EngineConfig(model="tiny-llama", grammar_compile_timeout_s=1e-6))
    spec = StructuredOutputs(json={"type": "object", "properties": {f"k{i}": {"type": "string"} for i in range(40)}})
    with pytest.raises(InvalidRequestError, match="took longer than"):
        engine.make_request(EngineInput("hi", SamplingParams(structured_outputs=spec)))
    engine.builder.grammars.compile_timeout_s = 30  # the first compile finished in the background and was kept
    assert engine.make_request(EngineInput("hi", SamplingParams(structured_outputs=spec))).grammar is not None


def test_invalid_specs_fail_validation():
    with pytest.raises(ValidationError, match="exactly one"):
        StructuredOutputs(regex="a", choice=["a"])
    with pytest.raises(ValidationError, match="not valid JSON"):
        StructuredOutputs(json="{nope")
    with pytest.raises(ValidationError, match="ignore_eos"):
        SamplingParams(ignore_eos=True, structured_outputs=StructuredOutputs(json_object=True))
    assert StructuredOutputs(json='{"type": "object"}').json_schema == {"type": "object"}


def test_simulated_replicas_refuse_constraints():
    engine = LLMEngine(EngineConfig(model="sim:cpu-smollm2"))
    with pytest.raises(InvalidRequestError, match="simulated"):
        engine.make_request(EngineInput("hi", SamplingParams(structured_outputs=StructuredOutputs(json_object=True))))


SCHEMA_SUITE = {
    "nested": {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {
                    "name": {"type": "string"},
                    "address": {
                        "type": "object",
                        "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
                        "required": ["city", "zip"],
                    },
                },
                "required": ["name", "address"],
            }
        },
        "required": ["user"],
    },
    "array": {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": {"type": "string"}, "minItems": 1, "maxItems": 3}},
        "required": ["tags"],
    },
    "enum": {
        "type": "object",
        "properties": {
            "colour": {"enum": ["red", "green", "blue"]},
            "size": {"type": "integer", "minimum": 1, "maximum": 10},
        },
        "required": ["colour", "size"],
    },
    "optional": {
        "type": "object",
        "properties": {"title": {"type": "string"}, "year": {"type": "integer"}},
        "required": ["title"],
    },
    "anyOf": {
        "type": "object",
        "properties": {
            "id": {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 8}]},
            "ok": {"type": "boolean"},
        },
        "required": ["id", "ok"],
    },
    "formats": {
        "type": "object",
        "properties": {
            "email": {"type": "string", "format": "email"},
            "born": {"type": "string", "format": "date"},
            "ip": {"type": "string", "format": "ipv4"},
        },
        "required": ["email", "born", "ip"],
    },
    "pattern": {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{3}$"}, "score": {"type": "number"}},
        "required": ["code", "score"],
    },
}


def test_schema_suite_every_output_parses_and_validates(engine):
    names = list(SCHEMA_SUITE)
    prompts = [chat(engine, f"Answer with a JSON object: an example of a {name} record.") for name in names]
    params = [
        SamplingParams(max_tokens=120, temperature=0, structured_outputs=StructuredOutputs(json=SCHEMA_SUITE[n]))
        for n in names
    ]
    for name, out in zip(names, engine.generate(prompts, params)):
        assert out.finish_reason == "stop", (name, out.text)
        jsonschema.validate(json.loads(out.text), SCHEMA_SUITE[name], format_checker=jsonschema.FormatChecker())


def test_structured_bench_runs_every_mix_to_the_same_length(tmp_path):
    from load_tests.structured_bench import main

    result = main(
        [
            "--model",
            "tiny-llama",
            "--num-requests",
            "5",
            "--max-tokens",
            "6",
            "--repeats",
            "1",
            "--json",
            str(tmp_path / "bench.json"),
        ]
    )
    assert [r["constrained"] for r in result["rows"]] == [0, 0, 1, 5]
    assert all(r["rounds"][0]["tokens"] == 30 for r in result["rows"])  # the same work in every mix
    assert json.loads((tmp_path / "bench.json").read_text())["rows"][0]["vs_baseline"] == 1.0
