"""OpenAI request bodies checked and turned into engine work; anything else is an ApiError (status + OpenAI body)."""
from __future__ import annotations

import math
from dataclasses import dataclass

from strata_nb.errors import StrataError
from strata_nb.runtime.sampler import SamplerConfig

ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOPS = 4


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = status, message, param, code, kind

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


@dataclass
class Work:
    """A checked request: what the engine runs and how the answer goes back."""

    prompt: list[int]
    max_new: int
    sampler: SamplerConfig
    stop: list[str]
    stream: bool
    include_usage: bool
    boundary: int | None  # chat: where the last message starts in prompt (None: unknown or not a prefix)


def _bad(message: str, param: str | None = None, code: str | None = None) -> ApiError:
    return ApiError(400, message, param, code)


def _number(body: dict, key: str, default: float, lo: float, hi: float, lo_open: bool = False) -> float:
    v = body.get(key)
    if v is None:
        return default
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v > hi or v < lo or \
            (lo_open and v == lo):
        raise _bad(f"{key} must be a number in {'(' if lo_open else '['}{lo:g}, {hi:g}], got {v!r}", key)
    return float(v)


def _integer(body: dict, key: str, lo: int, hi: int) -> int | None:
    v = body.get(key)
    if v is None:
        return None
    if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
        raise _bad(f"{key} must be an integer in [{lo}, {hi}], got {v!r}", key)
    return v


def _refuse_unsupported(body: dict) -> None:
    if body.get("n", 1) != 1:
        raise _bad("only n = 1 is supported", "n")
    for key in ("logprobs", "top_logprobs", "echo", "suffix", "tools", "functions", "logit_bias"):
        if body.get(key):
            raise _bad(f"{key} is not supported by this server", key)
    if body.get("best_of", 1) != 1:
        raise _bad("only best_of = 1 is supported", "best_of")
    fmt = body.get("response_format")
    if fmt is not None and (not isinstance(fmt, dict) or fmt.get("type") != "text"):
        raise _bad("only response_format {\"type\": \"text\"} is supported", "response_format")


def _text_content(m: dict, i: int) -> str:
    c = m.get("content")
    if c is None and m["role"] == "assistant":
        return ""
    if isinstance(c, str):
        return c
    if isinstance(c, list) and all(isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                                   for p in c):
        return "".join(p["text"] for p in c)
    raise _bad(f"messages[{i}].content must be a string or a list of text parts", f"messages[{i}].content")


def messages_of(body: dict) -> list[dict]:
    msgs = body.get("messages")
    if not isinstance(msgs, list) or not msgs:
        raise _bad("messages must be a non-empty list", "messages")
    out = []
    for i, m in enumerate(msgs):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(f"messages[{i}] must be an object with a role", f"messages[{i}]")
        if m["role"] not in ROLES:
            raise _bad(f"messages[{i}].role {m['role']!r} is not one of {', '.join(ROLES)}", f"messages[{i}].role")
        role = "system" if m["role"] == "developer" else m["role"]
        out.append({"role": role, "content": _text_content(m, i)})
    return out


def parse(body: object, service, chat: bool) -> Work:
    """Check a /v1/chat/completions (chat) or /v1/completions body against the served model and its context."""
    if not isinstance(body, dict):
        raise _bad("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and model != service.model_id:
        raise ApiError(404, f"model {model!r} does not exist; this server serves {service.model_id!r}", "model",
                       "model_not_found")
    _refuse_unsupported(body)
    m = service.model
    boundary = None
    try:
        if chat:
            msgs = messages_of(body)
            prompt = m.encode_chat(msgs)
            if service.recurrent and len(msgs) > 1:  # the state before the last message is worth keeping
                boundary = _boundary(m, msgs, prompt)
        else:
            prompt = _completion_prompt(body, m)
    except StrataError as e:
        raise _bad(str(e), "messages" if chat else "prompt") from None
    n_ctx = service.n_ctx
    if len(prompt) >= n_ctx:
        raise _bad(f"the prompt is {len(prompt)} tokens; this server's context is {n_ctx}", "messages" if chat
                   else "prompt", "context_length_exceeded")
    key = "max_completion_tokens" if body.get("max_completion_tokens") is not None else "max_tokens"
    max_new = _integer(body, key, 1, n_ctx)
    if max_new is None:
        max_new = n_ctx - len(prompt)
    elif len(prompt) + max_new > n_ctx:
        raise _bad(f"the prompt ({len(prompt)} tokens) and {key} {max_new} exceed this server's context of "
                   f"{n_ctx} tokens", key, "context_length_exceeded")
    return Work(prompt=prompt, max_new=max_new, sampler=_sampler(body, service.sampler), stop=_stops(body),
                stream=_flag(body, "stream"), include_usage=_include_usage(body), boundary=boundary)


def _boundary(model, msgs: list[dict], prompt: list[int]) -> int | None:
    """Where the last message starts in prompt: the length of the earlier messages rendered alone, when that is a
    prefix of it (a template may refuse them alone, e.g. Qwen3's without a user message: then there is none)."""
    try:
        head = model.encode_chat(msgs[:-1], add_generation_prompt=False)
    except StrataError:
        return None
    return len(head) if prompt[:len(head)] == head else None


def _completion_prompt(body: dict, model) -> list[int]:
    p = body.get("prompt")
    if isinstance(p, list) and len(p) == 1 and isinstance(p[0], (str, list)):
        p = p[0]  # one prompt in a list
    if isinstance(p, str) and p:
        return model.encode(p)
    if isinstance(p, list) and p and all(isinstance(t, int) and not isinstance(t, bool) for t in p):
        bad = [t for t in p if not 0 <= t < model.spec.n_vocab]
        if bad:
            raise _bad(f"token id {bad[0]} out of range 0..{model.spec.n_vocab - 1}", "prompt")
        return list(p)
    raise _bad("prompt must be a non-empty string or a list of token ids (one prompt per request)", "prompt")


def _sampler(body: dict, defaults: SamplerConfig) -> SamplerConfig:
    seed = _integer(body, "seed", 0, 2**64 - 1)
    top_k = _integer(body, "top_k", 0, 1 << 30)  # llama-server's extensions: top_k, min_p, repeat_penalty
    return SamplerConfig(
        temperature=_number(body, "temperature", defaults.temperature, 0.0, 2.0),
        top_k=defaults.top_k if top_k is None else top_k,
        top_p=_number(body, "top_p", defaults.top_p, 0.0, 1.0, lo_open=True),
        min_p=_number(body, "min_p", defaults.min_p, 0.0, 1.0),
        repeat_penalty=_number(body, "repeat_penalty", defaults.repeat_penalty, 0.0, 10.0, lo_open=True),
        repeat_last_n=defaults.repeat_last_n,
        frequency_penalty=_number(body, "frequency_penalty", defaults.frequency_penalty, -2.0, 2.0),
        presence_penalty=_number(body, "presence_penalty", defaults.presence_penalty, -2.0, 2.0),
        seed=defaults.seed if seed is None else seed)


def _stops(body: dict) -> list[str]:
    s = body.get("stop")
    if s is None:
        return []
    stops = [s] if isinstance(s, str) else s
    if not isinstance(stops, list) or len(stops) > MAX_STOPS or not all(isinstance(x, str) and x for x in stops):
        raise _bad(f"stop must be a non-empty string or a list of up to {MAX_STOPS} of them", "stop")
    return stops


def _flag(body: dict, key: str) -> bool:
    v = body.get(key, False)
    if v is None:
        return False
    if not isinstance(v, bool):
        raise _bad(f"{key} must be true or false", key)
    return v


def _include_usage(body: dict) -> bool:
    opts = body.get("stream_options")
    if opts is None:
        return False
    if not isinstance(opts, dict):
        raise _bad("stream_options must be an object", "stream_options")
    return _flag(opts, "include_usage")
