"""Penalties, logit_bias and min_tokens without Ray: the sampler's processed logits equal transformers'
own logits processors (and OpenAI's formula for presence/frequency), rows that ask for nothing are
untouched, and the engine's greedy output equals HF generate with the same settings."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from pydantic import ValidationError
from transformers.generation.logits_process import (
    MinNewTokensLengthLogitsProcessor,
    RepetitionPenaltyLogitsProcessor,
    SequenceBiasLogitsProcessor,
)

from batcher import EngineConfig, EngineInput, LLMEngine, SamplingParams
from batcher.errors import InvalidRequestError
from batcher.sampler import Sampler
from batcher.sequence import Sequence
from tests.reference import hf_greedy, mixed_prompts, reference_model

V = 1000
EOS = [7, 9]  # an engine may have several EOS ids: all are masked by min_tokens


def seq(i: int, prompt, output, **params) -> Sequence:
    return Sequence(
        f"r{i}",
        list(prompt),
        SamplingParams(max_tokens=64, temperature=0, **params),
        token_ids=list(prompt) + list(output),
    )


def history(rng: random.Random):
    # drawn from a small range so tokens repeat, and overlap the EOS ids
    prompt = [rng.randrange(0, 40) for _ in range(rng.randrange(1, 30))]
    output = [rng.randrange(0, 40) for _ in range(rng.randrange(0, 20))]
    return prompt, output


def random_logits(rows: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(rows, V, generator=g) * 3
    logits[:, :40] += 4  # the history's tokens are the likely ones, so penalties change argmaxes
    logits[:, 5] = 0.0  # a zero logit: neither divided nor multiplied into something else
    return logits


def openai_penalties(row: torch.Tensor, output, frequency: float, presence: float) -> torch.Tensor:
    """OpenAI's formula, token by token: mu[j] - c[j] * frequency - (c[j] > 0) * presence."""
    out = row.clone()
    for token, count in Counter(output).items():
        out[token] = row[token] - torch.tensor(frequency) * count - torch.tensor(presence) * 1.0
    return out


def hf_reference(row: torch.Tensor, s: Sequence) -> torch.Tensor:
    """transformers' processors in vLLM's order, then OpenAI's presence/frequency formula."""
    p, ids, scores = s.params, torch.tensor([s.token_ids]), row.unsqueeze(0).clone()
    if p.logit_bias:
        scores = SequenceBiasLogitsProcessor([[[t], b] for t, b in p.logit_bias.items()])(ids, scores)
    if p.min_tokens:
        stops = sorted(set(p.stop_token_ids) | (set() if p.ignore_eos else set(EOS)))
        scores = MinNewTokensLengthLogitsProcessor(s.num_prompt_tokens, p.min_tokens, stops)(ids, scores)
    if p.repetition_penalty != 1.0:
        scores = RepetitionPenaltyLogitsProcessor(p.repetition_penalty)(ids, scores)
    return openai_penalties(scores[0], s.output_token_ids, p.frequency_penalty, p.presence_penalty)


@pytest.mark.parametrize("seed", range(4))
def test_each_processing_equals_transformers_processor(seed):
    rng = random.Random(seed)
    cases = []
    for _ in range(6):
        prompt, output = history(rng)
        cases += [
            seq(len(cases), prompt, output, repetition_penalty=rng.choice([0.5, 1.3, 2.0])),
            seq(len(cases) + 1, prompt, output, frequency_penalty=rng.uniform(-2, 2)),
            seq(len(cases) + 2, prompt, output, presence_penalty=rng.uniform(-2, 2)),
            seq(
                len(cases) + 3, prompt, output, logit_bias={rng.randrange(V): rng.uniform(-100, 100) for _ in range(5)}
            ),
            seq(len(cases) + 4, prompt, output, min_tokens=rng.randrange(1, 25), stop_token_ids=[3, 11]),
        ]
    logits = random_logits(len(cases), seed)
    got = Sampler(0, EOS).process_logits(logits, cases)
    for i, s in enumerate(cases):
        assert torch.equal(got[i], hf_reference(logits[i], s)), (i, s.params)


@pytest.mark.parametrize("seed", range(4))
def test_a_mixed_batch_leaves_plain_rows_exactly_as_today(seed):
    rng = random.Random(seed)
    cases = []
    for i in range(12):
        prompt, output = history(rng)
        asks = (
            {}
            if i % 3 == 0
            else dict(
                repetition_penalty=rng.choice([1.0, 0.7, 1.5]),
                frequency_penalty=rng.choice([0.0, 1.0, -0.5]),
                presence_penalty=rng.choice([0.0, 2.0]),
                logit_bias=rng.choice([{}, {rng.randrange(V): 50.0}]),
                min_tokens=rng.choice([0, 30]),
                ignore_eos=rng.choice([False, True]),
            )
        )
        cases.append(seq(i, prompt, output, **asks))
    logits = random_logits(len(cases), seed + 100)
    raw = logits.clone()
    sampler = Sampler(0, EOS)
    got = sampler.process_logits(logits, cases)
    assert torch.equal(logits, raw)  # not in place unless asked
    tokens, _ = sampler.sample(logits.clone(), cases)  # in place: no row reports logprobs
    cases[1].params = cases[1].params.model_copy(update={"logprobs": 2})
    assert sampler.sample(logits, cases)[0] == tokens
    assert torch.equal(logits, raw)  # a row reports logprobs of the raw logits: they are never written
    for i, s in enumerate(cases):
        expected = hf_reference(raw[i], s) if s.params.processes_logits else raw[i]
        assert torch.equal(got[i], expected), (i, s.params)
        assert tokens[i] == int(expected.argmax())  # greedy picks from the processed logits
    changed = [i for i, s in enumerate(cases) if s.params.processes_logits and tokens[i] != int(raw[i].argmax())]
    assert changed  # the processing did steer some rows


def test_a_batch_asking_nothing_builds_nothing():
    cases = [seq(i, [1, 2, 3], [4, 4], seed=i) for i in range(4)]
    logits = random_logits(4, 0)
    assert Sampler(0, EOS).process_logits(logits, cases) is logits


def test_logprobs_are_of_the_raw_logits_and_sampling_uses_the_processed():
    logits = random_logits(3, 1)
    target = int(logits[0].argmin())
    cases = [
        seq(0, [1], [], logit_bias={target: 100.0}, logprobs=2),
        Sequence("r1", [1], SamplingParams(temperature=1.0, seed=3, logit_bias={target: 100.0})),
        Sequence("r2", [1], SamplingParams(temperature=1.0, seed=3, min_tokens=2, logit_bias={e: 100.0 for e in EOS})),
    ]
    tokens, logprobs = Sampler(0, EOS).sample(logits, cases)
    assert tokens[:2] == [target, target]
    assert tokens[2] not in EOS  # masked, biased or not
    assert logprobs[0].logprob == pytest.approx(float(torch.log_softmax(logits[0], -1)[target]))
    assert logprobs[0].logprob < -10  # the model's view, not the bias's
    assert list(logprobs[0].top_logprobs) == torch.topk(logits[0], 2).indices.tolist()


@pytest.mark.parametrize(
    "fields,field",
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -2.01}, "frequency_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty"),
        ({"logit_bias": {"1": 100.5}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"min_tokens": 17, "max_tokens": 16}, "min_tokens"),
    ],
)
def test_out_of_range_values_fail_validation_naming_the_field(fields, field):
    with pytest.raises(ValidationError) as info:
        SamplingParams(**fields)
    err = info.value.errors()[0]
    assert err["loc"][:1] == (field,) or field in err["msg"], err


def test_string_token_ids_are_converted():
    p = SamplingParams(logit_bias={"12": -100, "7": 5.5}, min_tokens=16)
    assert p.logit_bias == {12: -100.0, 7: 5.5} and p.processes_logits
    assert not SamplingParams(presence_penalty=0, frequency_penalty=0, repetition_penalty=1).processes_logits


# ---- the engine ----------------------------------------------------------------------------------

TINY = "tiny-llama"


def hf_generate(name, prompt_ids, max_new_tokens, **kwargs):
    model, _ = reference_model(name)
    out = model.generate(
        torch.tensor([prompt_ids]),
        attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        pad_token_id=0,
        **{"eos_token_id": None, **kwargs},
    )
    return out[0, len(prompt_ids) :].tolist()


@pytest.fixture(scope="module")
def tiny_engine():
    return LLMEngine(EngineConfig(model=TINY, dtype="float32"))


@pytest.mark.parametrize(
    "engine_kwargs",
    [{}, {"max_num_batched_tokens": 8, "num_kv_blocks": 40, "block_size": 4, "watermark": 0.0}],
    ids=["ample", "chunked-and-preempted"],
)
def test_greedy_with_repetition_penalty_equals_hf_generate(engine_kwargs):
    prompts = mixed_prompts(TINY)
    penalties = [0.5, 1.0, 1.3, 2.0, 0.8, 1.0, 1.6][: len(prompts)]
    engine = LLMEngine(EngineConfig(model=TINY, dtype="float32", **engine_kwargs))
    outs = engine.generate(
        prompts,
        [SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, repetition_penalty=r) for r in penalties],
    )
    expected = [hf_generate(TINY, p, 20, repetition_penalty=r) for p, r in zip(prompts, penalties)]
    assert [o.token_ids for o in outs] == expected
    plain = [hf_greedy(TINY, p, 20) for p in prompts]
    assert any(e != q for e, q, r in zip(expected, plain, penalties) if r != 1.0)  # the penalty mattered
    assert all(e == q for e, q, r in zip(expected, plain, penalties) if r == 1.0)
    stats = engine.stats()
    assert stats.kv_blocks_free == stats.kv_blocks_total
    if engine_kwargs:
        assert stats.preemptions > 0


def test_smollm2_greedy_with_repetition_penalty_equals_hf_generate():
    name = "smollm2-135m-instruct"
    prompt = mixed_prompts(name, n_random=0)[1]
    engine = LLMEngine(EngineConfig(model=name, dtype="float32", num_threads=2, kv_cache_memory_gib=0.25))
    [out] = engine.generate(
        [prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, repetition_penalty=1.3)
    )
    assert out.token_ids == hf_generate(name, prompt, 24, repetition_penalty=1.3)
    assert out.token_ids != hf_greedy(name, prompt, 24)


def test_min_tokens_equals_hf_min_new_tokens(tiny_engine):
    prompt = mixed_prompts(TINY)[0]
    plain = tiny_engine.generate([prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))[0].token_ids
    stop = [plain[0], plain[3]]  # the greedy next token, and one that comes early
    early = tiny_engine.generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=stop)
    )[0]
    assert early.token_ids == plain[:1] and early.finish_reason == "stop"
    [out] = tiny_engine.generate(
        [prompt], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True, stop_token_ids=stop, min_tokens=6)
    )
    expected = hf_generate(TINY, prompt, 20, min_new_tokens=6, eos_token_id=stop)
    assert out.token_ids == expected[: len(out.token_ids)] and len(out.token_ids) >= 6
    assert not set(out.token_ids[:6]) & set(stop)
    if out.finish_reason == "stop":
        assert out.token_ids[-1] in stop and out.token_ids == expected  # HF stopped at the same token


def test_min_tokens_delays_eos(tiny_engine):
    forced = {e: 100.0 for e in tiny_engine.eos_token_ids}  # every EOS id is the argmax at every step
    [now] = tiny_engine.generate(["Hello there"], SamplingParams(max_tokens=10, temperature=0, logit_bias=forced))
    [later] = tiny_engine.generate(
        ["Hello there"], SamplingParams(max_tokens=10, temperature=0, logit_bias=forced, min_tokens=4)
    )
    assert len(now.token_ids) == 1 and now.token_ids[0] in tiny_engine.eos_token_ids and now.finish_reason == "stop"
    assert len(later.token_ids) == 5 and later.finish_reason == "stop"
    assert later.token_ids[-1] in tiny_engine.eos_token_ids
    assert not set(later.token_ids[:4]) & tiny_engine.eos_token_ids


def test_engine_refuses_logit_bias_outside_the_vocabulary(tiny_engine):
    for bad in (tiny_engine.vocab_size, -1):
        with pytest.raises(InvalidRequestError, match="logit_bias: token id"):
            tiny_engine.make_request(EngineInput("hi", SamplingParams(logit_bias={bad: 1.0})))
    tiny_engine.make_request(EngineInput("hi", SamplingParams(logit_bias={tiny_engine.vocab_size - 1: 1.0})))


class _DeviceLogits(torch.Tensor):
    """Logits that record whether the sampler copied them to the host (as it must from a GPU)."""

    copied = False

    def cpu(self, *args, **kwargs):
        type(self).copied = True
        return super().cpu(*args, **kwargs)


@pytest.mark.parametrize("extra, copies", [({}, False), ({"logprobs": 1}, True), ({"presence_penalty": 0.5}, True)])
def test_plain_greedy_rows_take_the_argmax_where_the_logits_are(extra, copies):
    """A batch of plain greedy rows copies token ids, not (rows x vocab) logits; a row asking for
    logprobs or a penalty brings the logits to the host. Tokens are the processed argmax either way."""
    rng = random.Random(0)
    seqs = [seq(i, *history(rng)) for i in range(3)] + [seq(3, *history(rng), **extra)]
    logits = random_logits(4, seed=1)
    expected = Sampler().process_logits(logits.clone(), seqs).argmax(dim=-1).tolist()
    _DeviceLogits.copied = False
    tokens, logprobs = Sampler().sample(logits.clone().as_subclass(_DeviceLogits), seqs)
    assert _DeviceLogits.copied is copies
    assert tokens == expected
    assert (logprobs[3] is not None) == ("logprobs" in extra)
