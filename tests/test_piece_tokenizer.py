"""The ingress tokenizes a prompt a piece at a time between added tokens, each piece remembered: the
ids are the tokenizer's own, a chat's history is not tokenized again, and tokenizers where pieces
would not give the same ids are tokenized whole."""

import asyncio
import random
import re

import pytest
from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

from batcher.model_files import load_tokenizer
from deployments.piece_tokenizer import PieceTokenizer
from deployments.prompts import PromptPreparer, prepare
from deployments.protocol import GenerateRequest
from deployments.tool_calls import render_chat

WORDS = ["hello", "world", " spaced ", "\n\n", "naïve", "数字", "🙂", "<|im", "end|>", "x<|im_end|", "\t", "42"]


@pytest.fixture(scope="module")
def smol():
    return load_tokenizer("smollm2-135m-instruct")


def text(rng, n):
    return "".join(rng.choice(WORDS) + rng.choice(["", " "]) for _ in range(n))


def chat_turns(tokenizer, turns=6, seed=0):
    """The templated prompt of each turn of one chat, every turn resending the history."""
    rng = random.Random(seed)
    messages = [{"role": "system", "content": text(rng, 400)}]
    for _ in range(turns):
        messages.append({"role": "user", "content": text(rng, 80) + " <|im_end|> inside "})
        yield render_chat(tokenizer, messages)
        messages.append({"role": "assistant", "content": text(rng, 30) + "\n"})


def variant(smol, change) -> PreTrainedTokenizerFast:
    backend = Tokenizer.from_str(smol.backend_tokenizer.to_str())
    change(backend)
    return PreTrainedTokenizerFast(tokenizer_object=backend, chat_template=smol.chat_template)


def test_a_chat_is_tokenized_as_the_tokenizer_does_and_its_history_once(smol):
    pieces = PieceTokenizer(smol)
    assert not pieces.whole  # SmolLM2's tokenizer is cut at its added tokens
    misses = []
    for prompt in chat_turns(smol):
        assert pieces.encode(prompt) == smol(prompt)["input_ids"]
        misses.append(pieces.misses)
    # The first turn misses its system prompt and message; each later turn only its two new
    # messages (the last answer and the new question), never the history before them.
    new = [b - a for a, b in zip(misses, misses[1:])]
    assert misses[0] >= 2 and all(n <= 2 for n in new), misses
    assert pieces.hits >= sum(range(len(misses)))


def test_odd_text_round_added_tokens_gives_the_tokenizers_ids(smol):
    pieces = PieceTokenizer(smol)
    rng = random.Random(1)
    added = list(smol.backend_tokenizer.get_added_tokens_decoder().values())
    for _ in range(200):
        s = "".join(
            rng.choice([rng.choice(added).content, text(rng, rng.randint(0, 40)), " ", "\n"])
            for _ in range(rng.randint(1, 12))
        )
        assert pieces.encode(s) == smol(s)["input_ids"], repr(s)
    assert pieces.encode("") == smol("")["input_ids"]


def test_a_bos_added_by_the_post_processor_wraps_the_pieces(smol):
    bos = variant(
        smol,
        lambda t: setattr(
            t,
            "post_processor",
            processors.TemplateProcessing(single="<|endoftext|> $A", special_tokens=[("<|endoftext|>", 0)]),
        ),
    )
    pieces = PieceTokenizer(bos)
    assert not pieces.whole
    for prompt in chat_turns(bos, turns=3):
        ids = pieces.encode(prompt)
        assert ids == bos(prompt)["input_ids"] and ids[0] == 0 and ids.count(0) == 1


def sentencepiece_like() -> PreTrainedTokenizerFast:
    """A BPE with Metaspace's `prepend_scheme: first` (as Llama 2's and Mistral's tokenizers): only
    the text's first piece gets a leading '▁', so pieces encoded apart would each get one."""
    t = Tokenizer(models.BPE(unk_token="<unk>"))
    t.pre_tokenizer = pre_tokenizers.Metaspace(prepend_scheme="first")
    corpus = ["hello there world", "a b hi there", "user said hello", "<tool> <word> c"] * 20
    t.train_from_iterator(
        corpus, trainers.BpeTrainer(vocab_size=200, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>"])
    )
    return PreTrainedTokenizerFast(tokenizer_object=t)


@pytest.mark.parametrize(
    "make",
    [
        lambda smol: sentencepiece_like(),
        lambda smol: variant(smol, lambda t: t.add_special_tokens([AddedToken("<tool>", lstrip=True)])),
        lambda smol: variant(smol, lambda t: t.add_special_tokens([AddedToken("<word>", single_word=True)])),
    ],
    ids=["metaspace-first", "lstrip", "single-word"],
)
def test_tokenizers_whose_pieces_differ_are_tokenized_whole(smol, make):
    other = make(smol)
    pieces = PieceTokenizer(other)
    assert pieces.whole
    texts = ["a <tool> b <word>c", "hello<|im_start|>user\nhi there<|im_end|>\n there"]
    for s in texts:
        assert pieces.encode(s) == other(s)["input_ids"]
    # Why: cut at the added tokens anyway, these tokenizers give other ids.
    added = {t.content: i for i, t in other.backend_tokenizer.get_added_tokens_decoder().items()}
    forced = PieceTokenizer(other)
    forced._split = (
        re.compile("(" + "|".join(map(re.escape, sorted(added, key=len, reverse=True))) + ")"),
        added,
        [],
        [],
    )
    assert any(forced.encode(s) != other(s)["input_ids"] for s in texts)


def test_the_remembered_pieces_stay_within_their_bound(smol):
    pieces = PieceTokenizer(smol, max_chars=5_000)
    twice = "<|im_start|>user\n" + "the same long message " * 10 + "<|im_end|>\n"
    assert pieces.encode(twice * 2) == smol(twice * 2)["input_ids"] and pieces.misses == 1
    for seed in range(6):
        for prompt in chat_turns(smol, turns=3, seed=seed):
            assert pieces.encode(prompt) == smol(prompt)["input_ids"]
    assert 0 < pieces._chars <= 5_000 and pieces._chars == sum(map(len, pieces._pieces))


def test_the_ingress_prepares_chats_with_the_pieces(smol):
    """PromptPreparer (the ingress's) gives the ids `prepare` gives with the tokenizer's own call,
    and its second turn reuses the first's pieces."""
    from deployments.config import LimitsConfig
    from deployments.limits import RequestLimits

    limits = RequestLimits(LimitsConfig(), 8192, len(smol))
    preparer = PromptPreparer(smol)
    history = [{"role": "system", "content": "You are terse. " * 40}, {"role": "user", "content": "Hi " * 30}]
    for turn in range(2):
        request = GenerateRequest(messages=history, max_tokens=4)
        got = asyncio.run(preparer(request, limits))
        assert got.prompt_token_ids == prepare(smol, request, limits).prompt_token_ids
        history += [{"role": "assistant", "content": f"Answer {turn} " * 20}, {"role": "user", "content": "More " * 20}]
    assert preparer.pieces.hits >= 2
