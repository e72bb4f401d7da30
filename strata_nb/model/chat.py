"""Chat prompts from a model's own jinja template, rendered the way transformers renders them.

Mirrors transformers' utils/chat_template_utils.py (_cached_compile_jinja_template and render_jinja_template):
an ImmutableSandboxedEnvironment with trim_blocks, lstrip_blocks and loop controls, a tojson filter that does
not HTML-escape, raise_exception, strftime_now, a sandboxed dict() and namespace(), the {% generation %} tag
(rendered as its plain body), messages reduced to plain JSON data with None-valued keys dropped, and reasoning
aliased under `reasoning_content` / `thinking`.
"""
from __future__ import annotations

import dataclasses
import json
from collections.abc import Mapping
from datetime import datetime
from functools import lru_cache
from typing import Any

import jinja2
import jinja2.ext
import numpy as np
import jinja2.nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment

from strata_nb.errors import StrataError

_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


class _GenerationTag(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: transformers uses it to mark assistant text; it renders its body."""

    tags = {"generation"}

    def parse(self, parser: jinja2.parser.Parser) -> jinja2.nodes.Node:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render"), [], [], body).set_lineno(lineno)

    def _render(self, caller: Any) -> str:
        return caller()


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None,
            sort_keys: bool = False) -> str:
    # jinja's own tojson HTML-escapes; chat templates expect plain JSON
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _TemplateDict:
    """dict() inside templates, without exposing the dict type itself."""

    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return dict(*args, **kwargs)

    def fromkeys(self, *args: Any, **kwargs: Any) -> dict:
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(jinja2.utils.Namespace):
    """namespace() that refuses underscore-prefixed attributes (no reaching CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # same signature trick as jinja's Namespace
        self, args = args[0], args[1:]
        for name in dict(*args, **kwargs):
            _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__init__(self, *args, **kwargs)

    def __setitem__(self, name: str, value: Any) -> None:
        _TemplateNamespace._check_name(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(
                f"chat templates cannot store underscore-prefixed attributes on a namespace: {name!r}")


@lru_cache(maxsize=16)
def _compile(template: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[_GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    env.globals["dict"] = _TemplateDict()
    env.globals["namespace"] = _TemplateNamespace
    return env.from_string(template)


def _plain(value: Any) -> Any:
    """Plain JSON-like data only: the sandbox does not know which methods of rich objects are dangerous."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if isinstance(value, np.generic):
        return _plain(value.item())  # np.bool_(False) must not become a truthy placeholder
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    return f"<{type(value).__name__}>"


def _prepare_messages(messages: list[dict]) -> list[dict]:
    out = []
    for m in messages:
        if not isinstance(m, Mapping):
            raise StrataError(f"chat messages must be dicts with 'role' and 'content', got {type(m).__name__}")
        m = _plain({k: v for k, v in m.items() if v is not None})  # templates handle a missing key, not None
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    lineno = getattr(e, "lineno", None)
    return f"{text} (template line {lineno})" if isinstance(e, jinja2.TemplateSyntaxError) and lineno else text


def render_chat(template: str, messages: list[dict], add_generation_prompt: bool = True, bos_token: str = "",
                eos_token: str = "", tools: list[dict] | None = None, documents: list[dict] | None = None,
                **template_vars: Any) -> str:
    """The prompt text a chat template makes of `messages` (list of {'role', 'content', ...} dicts).

    Extra keyword arguments become template variables (e.g. enable_thinking=False for Qwen3 templates).
    A template that does not compile or fails while rendering (including its own raise_exception) raises
    StrataError with one line saying why."""
    try:
        compiled = _compile(template)
    except jinja2.TemplateError as e:
        raise StrataError(f"chat template does not compile: {_one_line(e)}") from e
    variables = _plain({"bos_token": bos_token, "eos_token": eos_token, **template_vars})
    try:
        return compiled.render(messages=_prepare_messages(messages), tools=_plain(tools),
                               documents=_plain(documents), add_generation_prompt=add_generation_prompt,
                               **variables)
    except StrataError:
        raise
    except Exception as e:  # a template is untrusted code: whatever it raises is a template failure
        raise StrataError(f"chat template failed: {_one_line(e)}") from e
