"""The OpenAI-compatible server with the real `openai` client on loopback, the conversation cache (resumed logits
bit-identical to a fresh run on the CPU engine), the engine's stop and penalty hooks, and `strata-nb chat` through a
pipe. Every wait is bounded."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import openai
import pytest
import uvicorn
from click.testing import CliRunner

from strata_nb.api import load
from strata_nb.cli.main import main
from strata_nb.runtime.sampler import Sampler, SamplerConfig
from strata_nb.runtime.session import Snapshot
from strata_nb.serve.app import create_app
from strata_nb.serve.conversations import ConversationCache, Runner
from strata_nb.serve.service import Service
from strata_nb.synth import write_synthetic

CTX = 256
HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(cond, timeout_s: float, what: str) -> None:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout_s:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    p = tmp_path_factory.mktemp("serve") / "tiny.gguf"
    write_synthetic(p, "tiny", arch="qwen3moe", quant="Q4_K_M", seed=1)
    return str(p)


class Server:
    """A Service on uvicorn in a thread, on a free loopback port."""

    def __init__(self, model: str, **service):
        self.service = Service(load(model, device="cpu", n_ctx=CTX, threads=1), **service)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.server = uvicorn.Server(uvicorn.Config(create_app(lambda: self.service), host="127.0.0.1",
                                                    port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        wait_until(lambda: self.server.started, 30, "uvicorn to start")

    def client(self, timeout: float = 60) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="none", max_retries=0, timeout=timeout)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)
        self.service.close()


@pytest.fixture(scope="module")
def server(model):
    s = Server(model, max_queue=16)
    yield s
    s.close()


def alone(engine, messages=None, prompt=None, n=12, **sampling) -> str:
    """The answer a request gets on its own: a fresh engine session, nothing kept."""
    from strata_nb.model.textstream import TextStream

    toks = engine.model.encode_chat(messages) if messages is not None else engine.model.encode(prompt)
    text = TextStream(engine.tokenizer, sampling.pop("stop", ()))
    parts = []
    engine.generate(toks, n, SamplerConfig(**sampling), on_token=lambda t: parts.append(text.push(t)) or text.stopped)
    return "".join(parts) + text.flush()


def chat_text(client, content: str, n: int = 12, **kw) -> str:
    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": content}], max_tokens=n,
                                       **kw)
    return r.choices[0].message.content


# --------------------------------------------------------------------------------------------- the routes
def test_models_health_metrics(server):
    c = server.client()
    assert [m.id for m in c.models.list().data] == ["tiny"]
    assert httpx.get(server.url + "/health", timeout=10).json()["status"] == "ok"
    chat_text(c, "count the metrics", n=5, temperature=0)
    m = httpx.get(server.url + "/metrics", timeout=10)
    assert m.status_code == 200 and m.headers["content-type"].startswith("text/plain")
    values = dict(line.rsplit(" ", 1) for line in m.text.splitlines() if not line.startswith("#"))
    for name in ("strata_nb_queue_length", "strata_nb_prefix_cache_hits_total", "strata_nb_completion_tokens_total",
                 "strata_nb_decode_tokens_per_second", 'strata_nb_requests_total{outcome="ok"}'):
        assert name in values, m.text
    assert int(values["strata_nb_completion_tokens_total"]) >= 5


def test_greedy_chat_is_the_clis_answer(server, model):
    prompt, n = "Write a haiku about numbers", 16
    res = CliRunner().invoke(main, ["generate", "-m", model, "--device", "cpu", "--chat", "-p", prompt, "-n", str(n)],
                             catch_exceptions=False)
    assert res.exit_code == 0, res.stderr
    r = server.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": prompt}],
                                                max_tokens=n, temperature=0)
    assert res.stdout == r.choices[0].message.content + "\n"
    toks = server.service.model.encode(prompt, chat=True)
    assert r.usage.prompt_tokens == len(toks) and r.usage.completion_tokens == n
    assert r.usage.total_tokens == len(toks) + n and r.choices[0].finish_reason == "length"


def test_stream_equals_whole_chat_and_completions(server):
    c = server.client()
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "tell me about rivers"}]
    for kw in ({"temperature": 0}, {"temperature": 0.9, "seed": 7, "top_p": 0.9}):
        whole = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, **kw)
        chunks = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=20, stream=True,
                                                stream_options={"include_usage": True}, **kw))
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == whole.choices[0].message.content and text
        assert chunks[0].choices[0].delta.role == "assistant"
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens == 20
        assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
        # the answer is the one the request gets alone
        assert text == alone(server.service.engine, msgs, n=20, **kw)
    whole = c.completions.create(model="tiny", prompt="The river flows", max_tokens=15, temperature=0)
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(model="tiny", prompt="The river flows",
                                                                         max_tokens=15, temperature=0, stream=True))
    assert streamed == whole.choices[0].text == alone(server.service.engine, prompt="The river flows", n=15,
                                                      temperature=0)
    ids = server.service.model.encode("The river flows")
    by_ids = c.completions.create(model="tiny", prompt=ids, max_tokens=15, temperature=0)
    assert by_ids.choices[0].text == whole.choices[0].text and by_ids.usage.prompt_tokens == len(ids)


def test_stop_strings_and_penalties(server):
    c = server.client()
    full = chat_text(c, "stop test", n=24, temperature=0)
    stop = full[len(full) // 2: len(full) // 2 + 3]
    assert len(stop) == 3 and full.find(stop) >= 0
    for stream in (False, True):
        if stream:
            chunks = list(c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "stop test"}],
                                                    max_tokens=24, temperature=0, stop=[stop, "\u2603never"],
                                                    stream=True))
            text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
            reason = chunks[-1].choices[0].finish_reason
        else:
            r = c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "stop test"}],
                                          max_tokens=24, temperature=0, stop=stop)
            text, reason = r.choices[0].message.content, r.choices[0].finish_reason
        assert text == full[:full.find(stop)] and reason == "stop"
    pen = chat_text(c, "stop test", n=24, temperature=0, frequency_penalty=1.5, presence_penalty=0.5)
    assert pen == alone(server.service.engine, [{"role": "user", "content": "stop test"}], n=24, temperature=0,
                        frequency_penalty=1.5, presence_penalty=0.5)
    assert pen != full  # the penalties change this greedy answer (checked on this model)


def test_eight_concurrent_clients_each_get_their_answer_alone(server):
    eng = server.service.engine
    jobs = [(f"question number {i}", {"temperature": 0} if i % 2 else {"temperature": 0.8, "seed": i})
            for i in range(8)]
    want = [alone(eng, [{"role": "user", "content": q}], n=16, **kw) for q, kw in jobs]
    # the server's own sequential answers first: the cache kept from them must not change a concurrent answer
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda j: chat_text(server.client(), j[0], n=16, **j[1]), jobs))
    assert got == want
    assert len(set(want)) >= 6  # different answers (two greedy ones may agree on this random model)


def test_bad_inputs_are_refused_and_the_server_keeps_serving(server):
    url = server.url
    long_prompt = "word " * (CTX * 2)
    ok = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    cases = [
        ("/v1/chat/completions", b"{not json", 400),
        ("/v1/chat/completions", b"[1, 2]", 400),
        ("/v1/chat/completions", b"[" * 100000, 400),  # nested past the parser's recursion limit
        ("/v1/chat/completions", {"model": "tiny"}, 400),
        ("/v1/chat/completions", {**ok, "messages": []}, 400),
        ("/v1/chat/completions", {**ok, "messages": [{"role": "wizard", "content": "hi"}]}, 400),
        ("/v1/chat/completions", {**ok, "messages": [{"role": "user", "content": 5}]}, 400),
        ("/v1/chat/completions", {**ok, "messages": ["hi"]}, 400),
        ("/v1/chat/completions", {**ok, "max_tokens": -1}, 400),
        ("/v1/chat/completions", {**ok, "max_tokens": 0}, 400),
        ("/v1/chat/completions", {**ok, "max_tokens": CTX}, 400),
        ("/v1/chat/completions", {**ok, "max_tokens": "3"}, 400),
        ("/v1/chat/completions", {**ok, "messages": [{"role": "user", "content": long_prompt}]}, 400),
        ("/v1/chat/completions", {**ok, "model": "gpt-4o"}, 404),
        ("/v1/chat/completions", {**ok, "temperature": -1}, 400),
        ("/v1/chat/completions", {**ok, "top_p": 0}, 400),
        ("/v1/chat/completions", {**ok, "frequency_penalty": 3}, 400),
        ("/v1/chat/completions", {**ok, "seed": -5}, 400),
        ("/v1/chat/completions", {**ok, "n": 2}, 400),
        ("/v1/chat/completions", {**ok, "stop": ["a", "b", "c", "d", "e"]}, 400),
        ("/v1/chat/completions", {**ok, "logprobs": True}, 400),
        ("/v1/chat/completions", {**ok, "stream": "yes"}, 400),
        ("/v1/completions", {"model": "tiny", "prompt": "", "max_tokens": 2}, 400),
        ("/v1/completions", {"model": "tiny", "prompt": [10**9], "max_tokens": 2}, 400),
        ("/v1/completions", {"model": "tiny", "prompt": ["a", "b"], "max_tokens": 2}, 400),
        ("/v1/completions", {"model": "tiny", "prompt": long_prompt, "max_tokens": 2}, 400),
        ("/v1/nowhere", ok, 404),
    ]
    for path, body, status in cases:
        kw = {"content": body} if isinstance(body, bytes) else {"json": body}
        r = httpx.post(url + path, timeout=30, headers={"content-type": "application/json"}, **kw)
        assert r.status_code == status, (path, body if isinstance(body, dict) else body[:20], r.text[:300])
        err = r.json()["error"]
        assert err["message"] and err["type"], r.text
    with pytest.raises(openai.BadRequestError, match="context"):
        server.client().chat.completions.create(model="tiny", messages=[{"role": "user", "content": long_prompt}])
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="other", messages=[{"role": "user", "content": "x"}])
    assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"
    assert chat_text(server.client(), "still here?", n=4, temperature=0)


def _slowed(service, delay_s: float) -> list:
    """Each generated token takes delay_s longer; returns the list each run's token count is appended to."""
    counts: list = []
    real = service.runner.run

    def run(prompt, max_new, sampler, on_token=None, boundary=None):
        def slow(t):
            time.sleep(delay_s)
            return on_token(t)
        turn = real(prompt, max_new, sampler, on_token=slow, boundary=boundary)
        counts.append(len(turn.result.tokens))
        return turn

    service.runner.run = run
    return counts


def test_disconnect_stops_generation(model):
    s = Server(model)
    try:
        counts = _slowed(s.service, 0.02)  # 200 tokens: 4 s
        body = {"model": "tiny", "messages": [{"role": "user", "content": "go on"}], "max_tokens": 200,
                "temperature": 0}
        with httpx.stream("POST", s.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=30) as r:
            lines = r.iter_lines()
            got = [next(lines) for _ in range(6)]
            assert any("content" in line for line in got)
        wait_until(lambda: counts, 10, "the streamed generation to stop")
        assert counts[-1] < 100
        with pytest.raises(httpx.ReadTimeout):  # a client that gives up on a whole answer
            httpx.post(s.url + "/v1/chat/completions", json=body, timeout=0.5)
        wait_until(lambda: len(counts) == 2, 10, "the whole-answer generation to stop")
        assert counts[-1] < 100
        assert chat_text(s.client(), "after", n=3, temperature=0)
    finally:
        s.close()


def test_full_queue_is_503_with_retry_after(model):
    s = Server(model, max_queue=1)
    try:
        gate = threading.Event()
        real = s.service.runner.run
        s.service.runner.run = lambda *a, **k: (gate.wait(30), real(*a, **k))[1]
        body = {"model": "tiny", "messages": [{"role": "user", "content": "q"}], "max_tokens": 3, "temperature": 0}
        with ThreadPoolExecutor(2) as pool:
            first = pool.submit(httpx.post, s.url + "/v1/chat/completions", json=body, timeout=30)
            wait_until(lambda: s.service.scheduler.running == 1, 10, "the first request to run")
            second = pool.submit(httpx.post, s.url + "/v1/chat/completions", json=body, timeout=30)
            wait_until(lambda: s.service.scheduler.queued == 1, 10, "the second request to queue")
            third = httpx.post(s.url + "/v1/chat/completions", json=body, timeout=30)
            assert third.status_code == 503 and third.headers["retry-after"] == "1"
            assert third.json()["error"]["code"] == "server_busy"
            gate.set()
            assert first.result(30).status_code == second.result(30).status_code == 200
        assert 'strata_nb_requests_total{outcome="rejected"} 1' in httpx.get(s.url + "/metrics", timeout=10).text
    finally:
        s.close()


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signals_shut_down_cleanly(model, sig):
    port = free_port()
    p = subprocess.Popen([sys.executable, "-m", "strata_nb.cli.main", "serve", "-m", model, "--port", str(port),
                          "--ctx", str(CTX), "--threads", "1", "--device", "cpu"], cwd=HERE,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        def up() -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200
            except httpx.HTTPError:
                assert p.poll() is None, p.stderr.read()
                return False

        wait_until(up, 120, "the server to start")
        body = {"messages": [{"role": "user", "content": "long"}], "max_tokens": CTX - 60, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/chat/completions", json=body, timeout=30) as r:
            next(r.iter_lines())
            p.send_signal(sig)
            out, err = p.communicate(timeout=30)
        assert p.returncode == 0, err[-2000:]
        assert "Traceback" not in err
    finally:
        if p.poll() is None:
            p.kill()
            p.wait(10)


# ------------------------------------------------------------------------------------ conversations kept
@pytest.fixture(scope="module", params=["qwen3moe", "qwen3next"])
def arch_model(request, tmp_path_factory) -> str:
    p = tmp_path_factory.mktemp("conv") / f"{request.param}.gguf"
    write_synthetic(p, "tiny", arch=request.param, quant="Q8_0", seed=3)
    return str(p)


def test_resumed_logits_are_a_fresh_runs(arch_model):
    """After resuming a kept conversation, the logits of the new tokens are bit for bit those of the whole prompt
    run fresh (CPU engine), for KV-only and recurrent models; a turn boundary is a snapshot point."""
    eng = load(arch_model, device="cpu", n_ctx=CTX, threads=1)
    r = Runner(eng, park_budget_bytes=10**9)
    sys_msg = {"role": "system", "content": "a long shared document " * 8}
    a = eng.model.encode_chat([sys_msg, {"role": "user", "content": "first question"}])
    boundary = len(eng.model.encode_chat([sys_msg], add_generation_prompt=False))
    assert a[:boundary] == eng.model.encode_chat([sys_msg], add_generation_prompt=False)
    turn = r.run(a, 6, SamplerConfig(), boundary=boundary)
    assert turn.cached_tokens == 0
    answered = list(r.session.tokens)  # the prompt and the answer (its last token sampled, not run)
    b = eng.model.encode_chat([sys_msg, {"role": "user", "content": "second question"}])
    for prompt, expect in ((answered + [7, 8, 9], len(answered)), (b, boundary)):
        r.session.truncate(0)  # nothing live: the state comes from the kept snapshots
        cached = r.resume(prompt)
        if eng.spec.recurrent or prompt is not b:
            assert cached == expect
        else:  # a KV cache resumes at the longest common prefix, past the boundary
            assert cached >= expect
        new = eng.forward(r.session, prompt[cached:], all_logits=True)
        np.testing.assert_array_equal(new, eng.logits(prompt)[cached:])


def test_cache_budget_lru_and_prefixes():
    def snap(tokens, nbytes=100):
        return Snapshot(len(tokens), tuple(tokens), ((np.zeros(nbytes, np.uint8),),))

    c = ConversationCache(budget_bytes=250, recurrent=False)
    c.put(snap([1, 2, 3]))
    c.put(snap([1, 2, 3, 4]))  # extends the first: it replaces it
    assert len(c) == 1 and c.nbytes == 100
    c.put(snap([5, 6]))
    assert c.best(np.array([1, 2, 3, 4, 9]))[1] == 4  # and marks it recently used
    c.put(snap([7, 8]))  # over budget: the least recently used ([5, 6]) goes
    assert len(c) == 2 and c.best(np.array([5, 6, 1]))[1] == 0
    assert c.best(np.array([1, 2, 7]))[1] == 2  # a common prefix is enough for a KV cache
    assert c.best(np.array([1, 2, 3, 4]))[1] == 3  # one prompt token is always left to run
    c.put(snap([9], nbytes=1000))  # larger than the budget alone: not kept
    assert len(c) == 2 and c.nbytes == 200
    rc = ConversationCache(budget_bytes=10**6, recurrent=True)
    rc.put(snap([1, 2, 3]))
    rc.put(snap([1, 2, 3, 4, 5]))  # a recurrent state needs its exact point: both kept
    assert len(rc) == 2
    assert rc.best(np.array([1, 2, 3, 4, 9]))[1] == 3 and rc.best(np.array([1, 2, 9]))[1] == 0


# ----------------------------------------------------------------------------------------- engine hooks
def test_frequency_and_presence_penalties():
    cfg = SamplerConfig(frequency_penalty=0.5, presence_penalty=0.25, repeat_penalty=2.0, repeat_last_n=4)
    s = Sampler(cfg, 8)
    lg = np.array([1, 2, 3, -4, 5, 6, 7, 8], np.float32)
    got = s._penalized(lg, [0, 3, 3, 1, 3, 3, 5])
    window = [1, 3, 3, 5]  # the last repeat_last_n tokens
    want = lg.copy()
    for t in set(window):
        v = want[t] * 2.0 if want[t] <= 0 else want[t] / 2.0
        want[t] = v - window.count(t) * 0.5 - 0.25
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    np.testing.assert_array_equal(lg, [1, 2, 3, -4, 5, 6, 7, 8])  # the caller's logits untouched
    assert cfg.host_only and not SamplerConfig().host_only
    with pytest.raises(Exception, match="frequency_penalty"):
        SamplerConfig(frequency_penalty=2.5).validate()


def test_text_stream_holds_back_a_stop_strings_beginning(model):
    from strata_nb.model.textstream import TextStream

    eng = load(model, device="cpu", n_ctx=CTX, threads=1)
    res = eng.generate(eng.model.encode("abc"), 30, SamplerConfig())
    full = eng.tokenizer.decode([t for t in res.tokens if t not in eng.tokenizer.eog_ids])
    stop = full[10:14]
    ts = TextStream(eng.tokenizer, [stop])
    pieces = []
    for t in res.tokens:
        pieces.append(ts.push(t))
        assert stop[:2] not in "".join(pieces)[9:] or ts.stopped  # no partial stop string shown
        if ts.stopped:
            break
    assert "".join(pieces) + ts.flush() == full[:full.find(stop)] and ts.stopped


def test_generate_stops_when_on_token_says_so(model):
    eng = load(model, device="cpu", n_ctx=CTX, threads=1)
    seen = []
    res = eng.generate(eng.model.encode("abc"), 30, SamplerConfig(), on_token=lambda t: seen.append(t) or
                       len(seen) == 5)
    assert res.stopped_by == "caller" and len(res.tokens) == 5 == len(seen)


# -------------------------------------------------------------------------------------------- strata-nb chat
def test_chat_cli_through_a_pipe(model, tmp_path):
    saved = tmp_path / "conv.npz"
    script = "\n".join(["hello there", "/stats", "and again", "/stats", f"/save {saved}", "/reset", "/stats",
                        f"/load {saved}", "/stats", "/quit"]) + "\n"
    p = subprocess.run([sys.executable, "-m", "strata_nb.cli.main", "chat", "-m", model, "-n", "8", "--ctx",
                        str(CTX), "--threads", "1", "--device", "cpu"], cwd=HERE, input=script,
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    answers = p.stdout.splitlines()
    eng = load(model, device="cpu", n_ctx=CTX, threads=1)
    first = [{"role": "user", "content": "hello there"}]
    assert answers[0] == alone(eng, first, n=8)
    second = first + [{"role": "assistant", "content": answers[0]}, {"role": "user", "content": "and again"}]
    assert answers[1] == alone(eng, second, n=8)  # the kept session answers as a fresh run of the whole chat
    stats = [line for line in p.stderr.splitlines() if " context tokens held" in line]
    assert len(stats) == 4, p.stderr
    kept = int(stats[1].split("(")[1].split(" kept")[0])
    assert kept >= len(eng.model.encode_chat(first))  # the second turn computed only what was new
    assert stats[2].startswith("0 messages, 0 of")  # /reset
    assert stats[3].startswith("4 messages,") and stats[3].split(" context")[0] == stats[1].split(" context")[0]
    assert saved.exists() and not list(tmp_path.glob("*.tmp"))


def test_chat_load_refuses_another_model(model, tmp_path):
    import io

    from strata_nb.serve.terminal import TerminalChat

    other = tmp_path / "other.gguf"
    write_synthetic(other, "tiny", arch="qwen3moe", quant="Q4_K_M", seed=2)  # same header, other weights
    saved = tmp_path / "conv.npz"
    out, err = io.StringIO(), io.StringIO()
    a = TerminalChat(load(model, device="cpu", n_ctx=CTX, threads=1), sampler=SamplerConfig(), max_new=4, out=out,
                     err=err)
    a.run(io.StringIO(f"hi\n/save {saved}\n"))
    b = TerminalChat(load(str(other), device="cpu", n_ctx=CTX, threads=1), sampler=SamplerConfig(), max_new=4,
                     out=out, err=err)
    b.run(io.StringIO(f"/load {saved}\n/load {tmp_path / 'missing.npz'}\n/stats\n"))
    assert "saved with another model" in err.getvalue() and "no such file" in err.getvalue()
    assert b.messages == [] and b.runner.session.pos == 0


def test_chat_request_marks_its_turn_boundary_for_recurrent_models(arch_model):
    """A chat request to a recurrent model carries where its last message starts (the snapshot point a follow-up
    with the same system prompt resumes at); a KV-only model needs none."""
    from types import SimpleNamespace

    from strata_nb.api import Model
    from strata_nb.serve import protocol

    m = Model(arch_model)
    svc = SimpleNamespace(model=m, model_id="x", n_ctx=CTX, recurrent=m.spec.recurrent, sampler=SamplerConfig())
    msgs = [{"role": "system", "content": "the document"}, {"role": "user", "content": "a question"}]
    work = protocol.parse({"messages": msgs, "max_tokens": 4}, svc, chat=True)
    assert work.prompt == m.encode_chat(msgs) and work.max_new == 4
    head = m.encode_chat(msgs[:1], add_generation_prompt=False)
    assert work.boundary == (len(head) if m.spec.recurrent else None)
    assert protocol.parse({"messages": msgs[1:]}, svc, chat=True).max_new == CTX - len(m.encode_chat(msgs[1:]))
