"""One request path: the ingress prepares every request once (template, tokens, limits); replicas
take only that prepared form; `cache_salt` keeps tenants' prefix caches apart end to end."""

from __future__ import annotations

import httpx
import openai
import pytest
from conftest import SMOL
from ray import serve

from batcher import SamplingParams
from deployments.errors import APIError
from deployments.protocol import GenerateRequest, PreparedRequest

# Long enough to fill several KV blocks, so a repeat finds them cached.
SYSTEM = "You are a careful assistant who answers in one short sentence. " * 6


@pytest.fixture(scope="module")
def smol(smol_app):
    return openai.OpenAI(base_url=f"{smol_app}/v1", api_key="unused", max_retries=0, timeout=120)


def _cached(client, salt, question="Name a colour."):
    extra = {"cache_salt": salt} if salt is not None else None
    out = client.chat.completions.create(
        model=SMOL,
        max_tokens=2,
        temperature=0,
        extra_body=extra,
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
    )
    return out.usage.prompt_tokens_details.cached_tokens


def test_a_cache_salt_shares_blocks_only_within_its_tenant(smol):
    """One replica (the smol app): the same prompt is a cache hit under the same salt, a miss under
    another salt or none (what a tenant could otherwise learn from the first token's timing)."""
    assert _cached(smol, "tenant-a", "Name a fruit.") == 0  # a prompt nobody sent before
    assert _cached(smol, "tenant-a", "Name a fruit.") > 0
    assert _cached(smol, "tenant-b", "Name a fruit.") == 0
    assert _cached(smol, None, "Name a fruit.") == 0
    assert _cached(smol, None, "Name a fruit.") > 0


def test_an_empty_cache_salt_is_a_400_naming_it(smol_app):
    r = httpx.post(f"{smol_app}/v1/completions", json={"prompt": "hi", "max_tokens": 1, "cache_salt": ""}, timeout=60)
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"


def test_the_replica_takes_only_prepared_requests(smol_app):
    """Callers go through the ingress; a GenerateRequest (or a dict) sent straight to the replica
    deployment is refused with a 400 naming the ingress, and a PreparedRequest is served."""
    llm = serve.get_deployment_handle("LLMServer", "smol")
    for raw in (GenerateRequest(prompt="hi", max_tokens=2), {"prompt": "hi"}):
        with pytest.raises(APIError) as info:
            llm.generate.remote(raw).result(timeout_s=60)
        assert info.value.status_code == 400 and "PreparedRequest" in str(info.value)
    prepared = PreparedRequest(
        request_id="direct-1", prompt_token_ids=[1, 2, 3, 4], params=SamplingParams(max_tokens=3, ignore_eos=True)
    )
    out = llm.generate.remote(prepared).result(timeout_s=60)
    assert out.completion_tokens == 3 and out.request_id == "direct-1"
    with pytest.raises(APIError) as info:  # ids are still checked where they are used
        llm.generate.remote(
            PreparedRequest(request_id="direct-2", prompt_token_ids=[10**9], params=SamplingParams(max_tokens=1))
        ).result(timeout_s=60)
    assert info.value.status_code == 400


def test_prepare_templates_tokenizes_and_resolves_max_tokens_once():
    """What every request becomes at the ingress: the chat template's token ids (as the offline
    engine would compute them), an id, and max_tokens=None as the rest of the context window."""
    from batcher.model_files import load_tokenizer
    from deployments.config import LimitsConfig
    from deployments.limits import RequestLimits
    from deployments.prompts import prepare

    tok = load_tokenizer(SMOL)
    limits = RequestLimits(LimitsConfig(), 512, len(tok))
    messages = [{"role": "user", "content": "Hi"}]
    out = prepare(tok, {"messages": messages, "cache_salt": "t"}, limits)
    ids = tok(tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True))["input_ids"]
    assert out.prompt_token_ids == ids and out.max_tokens == 512 - len(ids)
    assert out.cache_salt == "t" and out.prompt_param == "messages" and out.request_id
    assert prepare(tok, GenerateRequest(prompt=[5, 6], max_tokens=7), limits).max_tokens == 7
    with pytest.raises(APIError) as info:
        prepare(tok, {"prompt": "x", "prompt_token_ids": [1]}, limits)  # callers cannot forge the ids
    assert info.value.status_code == 400 and "prompt_token_ids" in str(info.value)


def test_the_ingress_prepares_off_its_event_loop():
    """A long prompt's template and tokenization run in the preparer's thread: the event loop keeps
    relaying streams and routing meanwhile (on the loop, a wave of chats queued behind each other's
    tokenization). Measured by a ticker on the loop: its longest gap is a fraction of the prepare."""
    import asyncio
    import time

    from batcher.model_files import load_tokenizer
    from deployments.config import LimitsConfig
    from deployments.limits import RequestLimits
    from deployments.prompts import PromptPreparer

    tok = load_tokenizer(SMOL)
    text = "a fairly long turn of a conversation, " * 8000  # ~72k tokens: a few hundred ms to tokenize
    limits = RequestLimits(LimitsConfig(), 200_000, len(tok))
    preparer = PromptPreparer(tok)

    async def prepare_while_ticking():
        gaps, done = [], asyncio.Event()

        async def tick():
            last = time.perf_counter()
            while not done.is_set():
                await asyncio.sleep(0.001)
                gaps.append(time.perf_counter() - last)
                last = time.perf_counter()

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0.01)
        t0 = time.perf_counter()
        out = await preparer({"messages": [{"role": "user", "content": text}], "max_tokens": 1}, limits)
        took = time.perf_counter() - t0
        done.set()
        await ticker
        return out, took, max(gaps)

    out, took, longest_gap = asyncio.run(prepare_while_ticking())
    assert len(out.prompt_token_ids) > 50_000 and out.max_tokens == 1
    assert longest_gap < took / 4, (longest_gap, took)
