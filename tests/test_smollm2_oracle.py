"""SmolLM2-135M-Instruct as we run it, against transformers reading the same GGUF file.

transformers does its own dequantization and q/k un-permutation, so agreement here checks
our GGUF import, model, RoPE, attention, KV-cache decoding, tokenizer and chat template at once.
"""

from __future__ import annotations

import pytest
import torch
from oracles import check_greedy_agreement, hf_greedy, last_logits_fn, random_ids, random_model, top2

from decodelab.decoding.generate import stream_token_ids
from decodelab.params import SamplingParams

LOGIT_TOL = 1e-4

LONG_TEXT = """\
The history of computing is a story of layers. At the bottom sit transistors, switching on
and off billions of times each second; above them, logic gates, then adders and registers,
then an instruction set that a compiler targets. Each layer hides the one below it, and
each was once the frontier. Programmers in the 1950s wrote machine code by hand; by 1957
FORTRAN let them write formulas instead, and by 1972 C gave them a portable assembler.

def moving_average(values, window=3):
    \"\"\"Return the mean of every run of `window` consecutive values.\"\"\"
    if window < 1:
        raise ValueError("window must be positive")
    total = sum(values[:window])
    out = [total / window]
    for i in range(window, len(values)):
        total += values[i] - values[i - window]
        out.append(total / window)
    return out

Language models add one more layer. They read text as tokens, turn each token into a
vector, and pass the vectors through dozens of attention blocks. Rotary position
embeddings tell every block how far apart two tokens are, which is why a model that
mixes up its query and key channels still answers short questions but loses the thread
of a long one. Summarize the passage above in two sentences, then explain the code."""

CONVERSATIONS = {
    "short": [{"role": "user", "content": "What is gravity?"}],
    "system": [
        {"role": "system", "content": "You are a terse assistant. Answer in one line."},
        {"role": "user", "content": "Name three prime numbers."},
    ],
    "multi_turn": [
        {"role": "user", "content": "Hi! Can you help me with Python?"},
        {"role": "assistant", "content": "Of course. What do you need?"},
        {"role": "user", "content": "How do I reverse a list in place?"},
    ],
    "long": [{"role": "user", "content": LONG_TEXT}],
}


@pytest.fixture(scope="module")
def prompt_ids(smollm2):
    _, tok = smollm2
    return {name: tok.encode(tok.apply_chat_template(msgs)) for name, msgs in CONVERSATIONS.items()}


def test_long_prompt_is_long(prompt_ids):
    assert 280 <= len(prompt_ids["long"]) <= 450, len(prompt_ids["long"])


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_logits_match_transformers(smollm2, hf_gguf_model, prompt_ids, name):
    model, _ = smollm2
    x = torch.tensor([prompt_ids[name]])
    with torch.no_grad():
        ours = model(x)
        ref = hf_gguf_model(x).logits.float()
    assert ours.shape == ref.shape
    diff = (ours - ref).abs().max().item()
    assert diff <= LOGIT_TOL, f"{name}: max |logit difference| {diff:.3g} over {x.shape[1]} tokens"
    # The agreement must be about something: logits of this model span tens of units.
    assert ref.abs().max() > 10


def test_greedy_generation_matches_transformers(smollm2, hf_gguf_model, prompt_ids):
    model, tok = smollm2
    ids, n = prompt_ids["system"], 24
    ours = list(
        stream_token_ids(model, ids, SamplingParams(temperature=0, max_tokens=n), stop_token_ids=tok.stop_token_ids())
    )
    ref = hf_greedy(hf_gguf_model, ids, n, eos_token_id=tok.eos_token_id)
    agreed = check_greedy_agreement(ids, ours, ref, [last_logits_fn(model), last_logits_fn(hf_gguf_model)])
    assert agreed >= 4, (ours, ref)


def test_near_tie_checker_rejects_a_real_disagreement():
    """The greedy comparison above can fail: a token swapped where the margin is wide is caught."""
    model = random_model(seed=3)
    ids = random_ids(10, model.config.vocab_size, seed=3)[0].tolist()
    ours = list(stream_token_ids(model, ids, SamplingParams(temperature=0, max_tokens=6)))
    fn = last_logits_fn(model)
    assert check_greedy_agreement(ids, ours, ours, [fn]) == 6
    _, margin = top2(fn(ids + ours[:2]))
    assert margin > 1e-3  # a clear choice at step 2 ...
    forged = ours[:2] + [(ours[2] + 1) % model.config.vocab_size] + ours[3:]
    with pytest.raises(AssertionError, match="no near-tie"):
        check_greedy_agreement(ids, ours, forged, [fn])  # ... so a different token there is an error
    with pytest.raises(AssertionError, match="different lengths"):
        check_greedy_agreement(ids, ours, ours[:-1], [fn])


TEXTS = [
    "Hello, world!",
    "  leading spaces, trailing tabs\t\t, and\n\nblank lines\n   \n",
    "Unicode: café, naïve, Zürich, Ελληνικά, русский, עברית, العربية",
    "Emoji: 🤗🚀 👩‍💻 family 👨‍👩‍👧‍👦 flags 🇫🇷🇯🇵",
    "中文分词测试：今天天气很好。日本語のテキスト、한국어 문장.",
    "def f(x):\n    if x > 2:\n        return x ** 2  # square\n\treturn -x\n",
    "In 2024 we computed 3.14159 and 1,000,000.50 plus 007 and 12345678901234567890.",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>",
    "<|endoftext|>between<|endoftext|><|im_start|><|im_end|>",
    "tabs\tand    runs of     spaces\u00a0non-breaking\u2003em-space",
    "MixedCASE words, URLs like https://example.com/a?b=c&d=e and e-mail a.b@c.org",
    "",
    "\n",
    "é",  # one character spread over two byte tokens
]


@pytest.mark.parametrize("text", TEXTS)
def test_tokenizer_matches_transformers(smollm2, hf_gguf_tokenizer, text):
    _, tok = smollm2
    ours = tok.encode(text)
    assert ours == hf_gguf_tokenizer(text, add_special_tokens=False)["input_ids"]
    assert ours == hf_gguf_tokenizer.encode(text)  # SmolLM2 adds no BOS either way
    assert tok.decode(ours) == text


def test_special_tokens_are_single_ids(smollm2):
    _, tok = smollm2
    assert tok.encode("<|im_start|>") == [1]
    assert tok.encode("<|im_end|>") == [2]
    assert tok.bos_token_id == 1 and tok.eos_token_id == 2
    assert tok.decode(tok.encode("<|im_start|>user\nhi<|im_end|>"), skip_special_tokens=True) == "user\nhi"


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_chat_template_renders_like_transformers(smollm2, hf_gguf_tokenizer, name):
    _, tok = smollm2
    messages = CONVERSATIONS[name]
    ours = tok.apply_chat_template(messages, add_generation_prompt=True)
    ref = hf_gguf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert ours == ref
    assert ours.startswith("<|im_start|>") and ours.endswith("<|im_start|>assistant\n")
    no_prompt = tok.apply_chat_template(messages, add_generation_prompt=False)
    assert no_prompt == hf_gguf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
