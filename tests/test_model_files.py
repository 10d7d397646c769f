"""batcher.model_files: the embedded tokenizer loaded by class is AutoTokenizer's, and what a replica
start imports (an ingress: no torch; a simulated engine: not the forward's modules, ~5 s of CPU a start
on a Zen 3 core together)."""

import json
import subprocess
import sys
from pathlib import Path

from transformers import AutoTokenizer

from batcher.model_files import embedded_model_dir, load_tokenizer

ROOT = Path(__file__).resolve().parent.parent
TEXTS = [
    "Hello world",
    "  leading spaces\n\ttabs",
    "<|im_start|>user\nhi<|im_end|>",
    "ünïcödé 日本語 🙂",
    "def f(x):\n    return x ** 2  # 42",
    "x" * 300,
]


def test_the_embedded_tokenizer_is_the_one_autotokenizer_loads():
    auto, ours = AutoTokenizer.from_pretrained(str(embedded_model_dir())), load_tokenizer("smollm2-135m-instruct")
    assert type(ours) is type(auto)
    assert ours.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
    assert ours.added_tokens_decoder == auto.added_tokens_decoder and ours.init_kwargs == auto.init_kwargs
    for attr in (
        "chat_template",
        "eos_token_id",
        "bos_token_id",
        "pad_token_id",
        "all_special_ids",
        "model_max_length",
        "clean_up_tokenization_spaces",
    ):
        assert getattr(ours, attr) == getattr(auto, attr), attr
    for text in TEXTS:
        for special in (True, False):
            ids = auto(text, add_special_tokens=special)["input_ids"]
            assert ours(text, add_special_tokens=special)["input_ids"] == ids
            assert ours.decode(ids) == auto.decode(ids)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TEXTS[3]}]
    assert ours.apply_chat_template(messages, add_generation_prompt=True) == auto.apply_chat_template(
        messages, add_generation_prompt=True
    )


_IMPORTS = """
import json, sys
import deployments.app, deployments.ingress
from batcher.model_files import load_tokenizer
load_tokenizer("sim:cpu-smollm2")
seen = {"ingress_torch": "torch" in sys.modules}
from batcher import EngineConfig, LLMEngine
LLMEngine(EngineConfig(model="sim:cpu-smollm2", max_num_seqs=4, max_model_len=512))  # KV sized from memory
seen["sim_forward"] = sorted(m for m in ("batcher.model_runner", "batcher.paged_attention", "torch._dynamo")
                             if m in sys.modules)
print(json.dumps(seen))
"""


def test_an_ingress_never_imports_torch_nor_a_simulated_engine_the_forward():
    out = subprocess.run([sys.executable, "-c", _IMPORTS], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {"ingress_torch": False, "sim_forward": []}
