"""IncrementalDetokenizer: text equals a one-shot decode, stop strings cut at the earliest match."""

from batcher.detokenizer import IncrementalDetokenizer
from batcher.model_files import load_tokenizer

TOK = load_tokenizer("smollm2-135m-instruct")


def feed(text, stop=()):
    ids = TOK(text)["input_ids"]
    d = IncrementalDetokenizer(TOK, list(stop))
    pieces, hit = [], None
    for i in range(1, len(ids) + 1):
        hit = d.add(ids[:i])
        pieces.append(d.take(final=hit is not None or i == len(ids)))
        if hit:
            break
    return "".join(pieces), hit


def test_incremental_text_equals_full_decode_with_multibyte_characters():
    text = "Héllo wörld — 東京は晴れ 🌤️ and emoji 👍🏽 done."
    out, hit = feed(text)
    assert out == TOK.decode(TOK(text)["input_ids"]) and hit is None


def test_earliest_stop_string_wins_and_is_not_emitted():
    out, hit = feed("one two three four five", stop=["four", "two thr"])
    assert hit == "two thr" and out == "one "


def test_text_held_back_only_while_it_could_start_a_stop_string():
    d = IncrementalDetokenizer(TOK, ["STOP"])
    ids = TOK("abc defgh")["input_ids"]
    d.add(ids)
    assert d.take(final=False) == "abc defgh"[:-3]
    assert d.take(final=True) == "fgh"
