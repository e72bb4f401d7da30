"""`strata-nb serve --ray --replicas 2`: two engines behind one endpoint (Ray Serve, a local cluster started by the
command), each answering as the plain server does. Skipped only where ray is not installed."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import pytest

pytest.importorskip("ray.serve")

from test_serve import CTX, HERE, alone, free_port, wait_until  # noqa: E402

from strata_nb.api import load  # noqa: E402
from strata_nb.synth import write_synthetic  # noqa: E402


@pytest.mark.slow
def test_two_replicas_behind_one_endpoint(tmp_path):
    model = tmp_path / "tiny.gguf"
    write_synthetic(model, "tiny", arch="qwen3moe", quant="Q4_K_M", seed=1)
    port = free_port()
    log = open(tmp_path / "serve.log", "w")  # Ray logs a lot: a pipe nobody reads would fill and block it
    p = subprocess.Popen([sys.executable, "-m", "strata_nb.cli.main", "serve", "--ray", "--replicas", "2", "-m",
                          str(model), "--port", str(port), "--ctx", str(CTX), "--threads", "1", "--device", "cpu"],
                         cwd=HERE, stdout=log, stderr=subprocess.STDOUT, text=True,
                         env={**os.environ, "RAY_AUTH_MODE": "disabled"})  # a local cluster for this test only
    url = f"http://127.0.0.1:{port}"
    try:
        def up() -> bool:
            assert p.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                return httpx.get(url + "/health", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_until(up, 240, "the replicas to start")
        pids = set()
        t0 = time.monotonic()
        while len(pids) < 2 and time.monotonic() - t0 < 60:  # Ray's proxy spreads requests over both replicas
            pids.add(httpx.get(url + "/health", timeout=10).json()["pid"])
        assert len(pids) == 2
        msgs = [{"role": "user", "content": "hello from ray"}]
        want = alone(load(str(model), device="cpu", n_ctx=CTX, threads=1), msgs, n=10, temperature=0)
        for _ in range(4):
            r = httpx.post(url + "/v1/chat/completions", json={"messages": msgs, "max_tokens": 10, "temperature": 0},
                           timeout=60)
            assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == want
        bad = httpx.post(url + "/v1/chat/completions", json={"messages": []}, timeout=60)
        assert bad.status_code == 400 and bad.json()["error"]["message"]
    finally:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(10)
        log.close()
    assert p.returncode == 0, (tmp_path / "serve.log").read_text()[-3000:]
