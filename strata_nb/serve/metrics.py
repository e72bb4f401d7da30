"""Server counters, rendered in the Prometheus text exposition format (GET /metrics)."""
from __future__ import annotations

import threading
from collections import Counter


class Metrics:
    """Counters updated by the request handlers and the engine thread (one lock)."""

    def __init__(self):
        self._lock = threading.Lock()
        self.requests: Counter[str] = Counter()  # by outcome: ok, cancelled, rejected (queue full), error
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.completion_tokens = 0
        self.prompt_s = 0.0
        self.decode_s = 0.0
        self.decode_steps = 0
        self.last_decode_tps = 0.0

    def request(self, outcome: str) -> None:
        with self._lock:
            self.requests[outcome] += 1

    def turn(self, turn) -> None:
        r = turn.result
        with self._lock:
            self.prompt_tokens += turn.prompt_tokens
            self.cached_tokens += turn.cached_tokens
            self.completion_tokens += len(r.tokens)
            self.prompt_s += r.prompt_s
            self.decode_s += r.decode_s
            self.decode_steps += r.decode_steps
            if r.decode_steps:
                self.last_decode_tps = r.decode_tps

    def render(self, queue_length: int, running: int, runner) -> str:
        """The exposition text; queue_length, running and the runner's cache are read at the call."""
        with self._lock:
            rows = [("strata_nb_requests_total", "counter", "Requests by outcome.",
                     [(f'{{outcome="{k}"}}', v) for k, v in sorted(self.requests.items())] or [('{outcome="ok"}', 0)]),
                    ("strata_nb_prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                     [("", self.prompt_tokens)]),
                    ("strata_nb_prompt_tokens_cached_total", "counter",
                     "Prompt tokens resumed from a kept conversation instead of computed.", [("", self.cached_tokens)]),
                    ("strata_nb_completion_tokens_total", "counter", "Generated tokens.",
                     [("", self.completion_tokens)]),
                    ("strata_nb_prompt_tokens_per_second", "gauge", "Computed prompt tokens per second, all requests.",
                     [("", (self.prompt_tokens - self.cached_tokens) / self.prompt_s if self.prompt_s else 0.0)]),
                    ("strata_nb_decode_tokens_per_second", "gauge", "Decode tokens per second, all requests.",
                     [("", self.decode_steps / self.decode_s if self.decode_s else 0.0)]),
                    ("strata_nb_last_decode_tokens_per_second", "gauge", "Decode tokens per second, last request.",
                     [("", self.last_decode_tps)])]
        rows += [("strata_nb_queue_length", "gauge", "Requests waiting for the engine.", [("", queue_length)]),
                 ("strata_nb_running", "gauge", "Requests on the engine (0 or 1).", [("", running)]),
                 ("strata_nb_prefix_cache_hits_total", "counter", "Requests that resumed a kept state.",
                  [("", runner.hits)]),
                 ("strata_nb_prefix_cache_misses_total", "counter", "Requests computed from the start.",
                  [("", runner.misses)]),
                 ("strata_nb_parked_conversations", "gauge", "Conversation states kept in host RAM.",
                  [("", len(runner.cache))]),
                 ("strata_nb_parked_bytes", "gauge", "Host RAM held by kept conversation states.",
                  [("", runner.cache.nbytes)])]
        out = []
        for name, kind, help_, samples in rows:
            out += [f"# HELP {name} {help_}", f"# TYPE {name} {kind}"]
            out += [f"{name}{labels} {value:g}" if isinstance(value, float) else f"{name}{labels} {value}"
                    for labels, value in samples]
        return "\n".join(out) + "\n"
