"""Chat templates rendered by strata_nb.model.chat against transformers' own rendering of the same template."""
from __future__ import annotations

import functools
import json

import pytest

from conftest_vocab import templates_dir, vocab_path
from strata_nb.errors import StrataError
from strata_nb.model.chat import render_chat
from strata_nb.model.tokenizer import Tokenizer

transformers = pytest.importorskip("transformers", reason="transformers is the reference renderer")
tokenizers = pytest.importorskip("tokenizers")

TOOLS = [{
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city (°C), e.g. «Zürich»",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "description": "城市"}},
                       "required": ["city"]},
    },
}]

CONVERSATIONS = {
    "single": [{"role": "user", "content": "Hello!"}],
    "system": [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}],
    "multi_turn": [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4."},
        {"role": "user", "content": "And 3+3? 日本語 🦙 <b>&amp;</b>"},
    ],
    "reasoning": [
        {"role": "user", "content": "Think first."},
        {"role": "assistant", "content": "Done.", "reasoning_content": "Let me see...", "tool_calls": None},
        {"role": "user", "content": "Again."},
    ],
    "no_user_first": [{"role": "assistant", "content": "Hi, I start."}, {"role": "user", "content": "ok"}],
}

# Variables the reference passes through unchanged; a fixed date keeps date-printing templates deterministic.
VARIABLES = {"bos_token": "<s>", "eos_token": "</s>", "date_string": "26 Jul 2024"}


@functools.lru_cache(maxsize=1)
def _reference_tokenizer():
    """A transformers tokenizer with no special tokens of its own: only the template and the variables given to
    apply_chat_template reach the rendering (its vocabulary plays no part when tokenize=False)."""
    vocab = tokenizers.Tokenizer(tokenizers.models.WordLevel({"<unk>": 0}, unk_token="<unk>"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=vocab)


def _reference(template: str, messages: list[dict], add_generation_prompt: bool, tools=None, **variables) -> str:
    """transformers' own rendering, through its public apply_chat_template (messages normalized, then rendered)."""
    return _reference_tokenizer().apply_chat_template(messages, tools=tools, chat_template=template,
                                                      add_generation_prompt=add_generation_prompt, tokenize=False,
                                                      **variables)


def _compare(template: str, messages: list[dict], add_generation_prompt: bool, tools=None, **extra) -> str:
    variables = {**VARIABLES, **extra}
    try:
        expected = _reference(template, messages, add_generation_prompt, tools, **variables)
    except Exception as e:  # the template refuses this input: we must refuse it too, with the same reason
        with pytest.raises(StrataError) as info:
            render_chat(template, messages, add_generation_prompt, tools=tools, **variables)
        reason = " ".join(str(e).split())
        assert reason in str(info.value) and "\n" not in str(info.value)
        return "raised"
    got = render_chat(template, messages, add_generation_prompt, tools=tools, **variables)
    assert got == expected
    return "rendered"


def test_qwen2_gguf_template():
    tok = Tokenizer.from_gguf(vocab_path("qwen2"))
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    for messages in CONVERSATIONS.values():
        for gen in (True, False):
            assert _compare(tok.chat_template, messages, gen) == "rendered"
    prompt = render_chat(tok.chat_template, CONVERSATIONS["single"])
    assert prompt == ("<|im_start|>system\nYou are a helpful assistant<|im_end|>\n"
                      "<|im_start|>user\nHello!<|im_end|>\n<|im_start|>assistant\n")
    # the rendered prompt tokenizes with its markers as single special tokens
    ids = tok.encode(prompt)
    assert ids.count(tok.token_to_id("<|im_start|>")) == 3 and ids.count(tok.token_to_id("<|im_end|>")) == 2


def _real_templates() -> list[str]:
    try:
        folder = templates_dir()
    except pytest.skip.Exception:
        return []
    return sorted(p.name for p in folder.glob("*.jinja"))


@pytest.mark.parametrize("name", _real_templates() or ["(templates folder missing)"])
def test_real_templates_match_transformers(name):
    path = templates_dir() / name
    template = path.read_text(encoding="utf-8")
    outcomes = set()
    for messages in CONVERSATIONS.values():
        for gen in (True, False):
            outcomes.add(_compare(template, messages, gen))
    outcomes.add(_compare(template, CONVERSATIONS["system"], True, tools=TOOLS))
    outcomes.add(_compare(template, CONVERSATIONS["system"], True,  # firefunction reads these two
                          functions=json.dumps(TOOLS), datetime="2024-07-26"))
    outcomes.add(_compare(template, CONVERSATIONS["multi_turn"], True, enable_thinking=False))
    assert "rendered" in outcomes  # every real template renders at least some ordinary conversation


LLAMA3_STYLE = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}"
)

ALTERNATING = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)


def test_llama3_style_template():
    for messages in CONVERSATIONS.values():
        for gen in (True, False):
            assert _compare(LLAMA3_STYLE, messages, gen) == "rendered"
    assert render_chat(LLAMA3_STYLE, CONVERSATIONS["single"], bos_token="<|begin_of_text|>") == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nHello!<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n")


def test_raise_exception_template():
    assert _compare(ALTERNATING, [{"role": "user", "content": "a"}, {"role": "assistant", "content": "b"}],
                    False) == "rendered"
    assert _compare(ALTERNATING, CONVERSATIONS["system"], True) == "raised"
    with pytest.raises(StrataError, match="Conversation roles must alternate"):
        render_chat(ALTERNATING, CONVERSATIONS["no_user_first"])


def test_tojson_is_plain_json():
    template = "{{ messages[0]['content'] | tojson }}|{{ tools | tojson(indent=2) }}"
    messages = [{"role": "user", "content": "<b> & \"q\" 中文"}]
    assert _compare(template, messages, False, tools=TOOLS) == "rendered"
    assert render_chat(template, messages, tools=TOOLS).startswith('"<b> & \\"q\\" 中文"|')


def test_template_errors_are_one_line():
    with pytest.raises(StrataError, match=r"does not compile: .*line 2"):
        render_chat("ok\n{% for m in messages %}{{ m }", CONVERSATIONS["single"])
    with pytest.raises(StrataError, match="underscore") as info:
        render_chat("{% set ns = namespace(_x=1) %}{{ ns._x }}", CONVERSATIONS["single"])
    assert "\n" not in str(info.value)
    with pytest.raises(StrataError, match="chat template failed"):
        render_chat("{{ messages[0]['content'] + 1 }}", CONVERSATIONS["single"])
    with pytest.raises(StrataError, match="multi line"):
        render_chat("{{ raise_exception('multi\nline') }}", CONVERSATIONS["single"])
