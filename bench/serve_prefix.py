"""Issue benchmark: time to first token through the server with a ~2,000-token shared prefix (a system prompt holding a
document), the first request against a follow-up that asks another question about the same document and so resumes
the kept state (CPU engine, a synthetic model with published layer shapes).

    python bench/serve_prefix.py --layers 4 --threads 2 --reps 3

Writes the synthetic GGUF once (to --dir), serves it in this process (uvicorn on a loopback port) and times each
request with the openai client, streaming: from sending the request to the first content chunk. Every repetition
uses a document of its own, so its first request finds nothing kept. Medians of --reps; the table goes under
bench/results/ with the command, the machine and its load average.
"""
from __future__ import annotations

import argparse
import os
import platform
import shlex
import socket
import statistics
import sys
import threading
import time
from pathlib import Path

import strata_nb  # noqa: F401  (numba settings)
from strata_nb.synth import write_synthetic

WORDS = ("the river model token expert layer cache prompt answer question document system memory engine state "
         "conversation kept resumed parked budget request stream server client first follow").split()


def document(seed: int, n_tokens: int, model) -> str:
    """A system prompt of random words whose chat rendering is about n_tokens tokens."""
    import numpy as np

    rng = np.random.default_rng(seed)
    words: list[str] = []
    while len(model.encode_chat([{"role": "system", "content": " ".join(words)}], False)) < n_tokens:
        words += [WORDS[i] for i in rng.integers(0, len(WORDS), 64)]
    return " ".join(words)


def ttft(client, messages: list[dict], max_tokens: int) -> tuple[float, int]:
    """Seconds to the first streamed content, and the prompt's cached tokens (from the usage chunk)."""
    t0 = time.perf_counter()
    first = None
    cached = -1
    for ch in client.chat.completions.create(model="m", messages=messages, max_tokens=max_tokens, temperature=0,
                                             stream=True, stream_options={"include_usage": True}):
        if first is None and ch.choices and ch.choices[0].delta.content:
            first = time.perf_counter() - t0
        if ch.usage is not None:
            cached = ch.usage.prompt_tokens_details.cached_tokens
    return first if first is not None else float("nan"), cached


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="qwen3-30b-a3b")
    ap.add_argument("--quant", default="Q4_K_M")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--prefix-tokens", type=int, default=2000)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", default="/tmp/strata-bench")
    ap.add_argument("--out", default=None, help="default: bench/results/serve_prefix.md")
    a = ap.parse_args()
    import openai
    import uvicorn

    from strata_nb.api import load
    from strata_nb.serve.app import create_app
    from strata_nb.serve.service import Service

    path = Path(a.dir) / f"{a.preset}-L{a.layers}-{a.quant}-sv.gguf"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        print(f"writing {path} ...", file=sys.stderr)
        write_synthetic(path, a.preset, layers=a.layers, quant=a.quant, seed=0, small_vocab=True)
    eng = load(path, device="cpu", n_ctx=a.prefix_tokens + 256, threads=a.threads)
    svc = Service(eng, model_id="m", park_budget_bytes=8 * 10**9)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(create_app(lambda: svc), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    t0 = time.monotonic()
    while not server.started:
        if time.monotonic() - t0 > 60:
            raise SystemExit("the server did not start within 60 s")
        time.sleep(0.05)
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=600)
    load0 = os.getloadavg()
    rows = []
    try:
        ttft(client, [{"role": "user", "content": "warm the server up"}], 2)
        for rep in range(a.reps):
            doc = {"role": "system", "content": document(100 + rep, a.prefix_tokens, eng.model)}
            first = ttft(client, [doc, {"role": "user", "content": "What is the first word?"}], a.max_tokens)
            follow = ttft(client, [doc, {"role": "user", "content": "And which word comes last?"}], a.max_tokens)
            n = len(eng.model.encode_chat([doc, {"role": "user", "content": "What is the first word?"}]))
            rows.append((n, first, follow))
            print(f"rep {rep}: prompt {n} tokens, first {first[0]:.3f} s ({first[1]} cached), follow-up "
                  f"{follow[0]:.3f} s ({follow[1]} cached)", file=sys.stderr)
    finally:
        server.should_exit = True
        thread.join(30)
        svc.close()
    load1 = os.getloadavg()
    med_first = statistics.median(r[1][0] for r in rows)
    med_follow = statistics.median(r[2][0] for r in rows)
    cmd = "python bench/serve_prefix.py " + " ".join(shlex.quote(x) for x in sys.argv[1:])
    lines = [f"# Time to first token with a shared {a.prefix_tokens}-token prefix, through the server",
             "",
             f"Synthetic {a.preset} shapes, {a.layers} layers, {a.quant}, small vocabulary; CPU engine, {a.threads} "
             f"threads; {platform.processor() or platform.machine()}, {os.cpu_count()} cores; load average "
             f"{load0[0]:.2f} before, {load1[0]:.2f} after. A system prompt of ~{a.prefix_tokens} tokens and a "
             f"question; the follow-up asks another question with the same system prompt. TTFT: request sent to "
             f"the first streamed content (openai client, loopback), max_tokens {a.max_tokens}, greedy. cached: the "
             f"prompt tokens resumed instead of computed (a first request's few are the template's opening, kept "
             f"from the warm-up request).",
             "",
             "| rep | prompt tokens | first request TTFT (s) | cached | follow-up TTFT (s) | cached | speed-up |",
             "|---|---|---|---|---|---|---|"]
    for i, (n, f, g) in enumerate(rows):
        lines.append(f"| {i} | {n} | {f[0]:.3f} | {f[1]} | {g[0]:.3f} | {g[1]} | {f[0] / g[0]:.1f}x |")
    lines += [f"| **median** | | **{med_first:.3f}** | | **{med_follow:.3f}** | | **{med_first / med_follow:.1f}x** |",
              "", f"command: `{cmd}`", ""]
    out = Path(a.out or Path(__file__).parent / "results" / "serve_prefix.md")
    out.write_text("\n".join(lines))
    print("\n".join(lines))
    print(f"wrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
