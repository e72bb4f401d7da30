"""A small byte-level BPE vocabulary, trained deterministically, and its GGUF tokenizer metadata (gpt2 / qwen2)."""
from __future__ import annotations

import functools
import json

# Qwen2's pre-tokenizer split (llama.cpp: LLAMA_VOCAB_PRE_TYPE_QWEN2; transformers: the Qwen2 converter).
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
BPE_SIZE = 1021  # cap on byte alphabet + merges; the corpus yields 914, so the vocabulary is 917 with specials

# Qwen2-Instruct's ChatML template.
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# Training text: plain prose, a little code, numbers and punctuation, so merges cover common English and symbols.
CORPUS = """\
The quick brown fox jumps over the lazy dog. A model reads a prompt, one token at a time, and writes the next.
Once upon a time there was a small village near the mountains. The people of the village grew wheat and apples,
and in the evening they told stories about the river, the forest and the old stone bridge. Every morning the
baker opened his shop before the sun rose, and the smell of fresh bread filled the street.
Mixture of experts models route every token to a few experts out of many. Each layer has a router that scores the
experts, keeps the best ones, and mixes their outputs with weights that add up to one. The experts that are not
chosen do no work for that token, so a large model can run with the cost of a much smaller one.
Attention lets every position look at the positions before it. The keys and values of earlier tokens stay in a
cache, so the next token only needs one new query. Rotary position embeddings turn pairs of channels by an angle
that grows with the position; the base frequency sets how fast the angle turns.
Question: What is the capital of France? Answer: The capital of France is Paris.
Question: How many days are in a week? Answer: There are seven days in a week.
Question: What color is the sky on a clear day? Answer: The sky is blue on a clear day.
def add(a, b):
    return a + b

for i in range(10):
    print(i, add(i, i * 2))

x = [1, 2, 3, 4, 5]; y = {"key": "value", "count": 42}
if x and y["count"] > 40:
    print("hello, world!")
Numbers: 0 1 2 3 4 5 6 7 8 9 10 11 12 100 256 1024 2048 4096 3.14159 2.71828 1e-6 -7 +8 50% $12.50
Symbols: ( ) [ ] { } < > = + - * / \\ | & ^ % $ # @ ! ? : ; , . ' " ` ~ _
It was the best of times, it was the worst of times, it was the age of wisdom, it was the age of foolishness.
She said that she would come back tomorrow, but nobody knew whether the weather would let her travel.
We're sure they'll find it; I'd say you've done well, and it's time we'd all go home.
The engine plans memory itself: it reads how much memory the machine has, keeps a reserve, and tells the user
what it chose before the first token. When a file is damaged or a tensor is missing, it stops with a clear error.
Good morning! How are you today? I am fine, thank you. The weather is warm and the garden is full of flowers.
Water boils at one hundred degrees. Ice melts when it is warm. Light travels faster than sound.
The cat sat on the mat. The dog ran in the park. The bird sang in the tree. The fish swam in the lake.
In the beginning the computer was a room full of machines; now a phone in a pocket holds more power than all of them.
"""


@functools.lru_cache(maxsize=1)
def trained_bpe() -> tuple[tuple[str, ...], tuple[str, ...]]:
    """(tokens, merges) of the byte-level BPE, specials last. Deterministic: the trainer sees one fixed text."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QWEN2_SPLIT), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    trainer = trainers.BpeTrainer(vocab_size=BPE_SIZE, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS.splitlines(keepends=True), trainer=trainer)
    model = json.loads(tok.to_str())["model"]
    vocab: dict[str, int] = model["vocab"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    merges = [m if isinstance(m, str) else " ".join(m) for m in model["merges"]]
    return tuple(tokens) + SPECIAL_TOKENS, tuple(merges)


def tokenizer_metadata(vocab_size: int | None) -> tuple[list[tuple[str, str, object]], int]:
    """GGUF tokenizer keys as (key, type, value) triples, and the vocabulary size.

    `vocab_size` pads the list with "[PAD<i>]" tokens (type UNUSED) up to a published model's embedding rows,
    as convert_hf_to_gguf does for checkpoints whose embedding is larger than the tokenizer."""
    tokens, merges = trained_bpe()
    n_real = len(tokens)
    if vocab_size is not None and vocab_size < n_real:
        raise ValueError(f"vocab_size {vocab_size} is smaller than the trained vocabulary ({n_real})")
    n = vocab_size or n_real
    tok_list = list(tokens) + [f"[PAD{i}]" for i in range(n_real, n)]
    # token types (llama.cpp LLAMA_TOKEN_TYPE_*): 1 normal, 3 control, 5 unused
    types = [1] * (n_real - len(SPECIAL_TOKENS)) + [3] * len(SPECIAL_TOKENS) + [5] * (n - n_real)
    eot, im_end = tokens.index("<|endoftext|>"), tokens.index("<|im_end|>")
    meta: list[tuple[str, str, object]] = [
        ("tokenizer.ggml.model", "str", "gpt2"),
        ("tokenizer.ggml.pre", "str", "qwen2"),
        ("tokenizer.ggml.tokens", "[str]", tok_list),
        ("tokenizer.ggml.token_type", "[i32]", types),
        ("tokenizer.ggml.merges", "[str]", list(merges)),
        ("tokenizer.ggml.eos_token_id", "u32", im_end),
        ("tokenizer.ggml.padding_token_id", "u32", eot),
        ("tokenizer.ggml.bos_token_id", "u32", eot),
        ("tokenizer.ggml.add_bos_token", "bool", False),
        ("tokenizer.chat_template", "str", CHAT_TEMPLATE),
    ]
    return meta, n
