"""The HTTP routes: OpenAI's /v1/models, /v1/chat/completions and /v1/completions (streamed as server-sent events
or not), /health and /metrics. Every refusal is an OpenAI error body with its status; the server keeps serving."""
from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections.abc import AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from strata_nb.serve import protocol
from strata_nb.serve.protocol import ApiError
from strata_nb.serve.scheduler import Job, QueueFull

MAX_BODY_BYTES = 32 << 20
DISCONNECT_POLL_S = 0.25  # how often a non-streamed request checks that its client is still there


def create_app(get_service: Callable[[], object]) -> FastAPI:
    """The app; get_service returns the Service of this process (under Ray, each replica's own)."""
    app = FastAPI(title="strata-nb", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(request: Request, e: ApiError) -> JSONResponse:
        return JSONResponse(e.body(), status_code=e.status, headers={"Retry-After": "1"} if e.status == 503 else None)

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException) -> JSONResponse:
        return JSONResponse(ApiError(e.status_code, str(e.detail), kind="invalid_request_error").body(),
                            status_code=e.status_code)

    @app.exception_handler(Exception)
    async def _internal(request: Request, e: Exception) -> JSONResponse:
        return JSONResponse(ApiError(500, f"internal error: {type(e).__name__}", kind="server_error").body(),
                            status_code=500)

    @app.get("/health")
    async def health() -> dict:
        svc = get_service()
        return {"status": "ok", "model": svc.model_id, "queued": svc.scheduler.queued, "pid": os.getpid()}

    @app.get("/metrics")
    async def metrics() -> PlainTextResponse:
        return PlainTextResponse(get_service().metrics_text(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict:
        svc = get_service()
        return {"object": "list", "data": [{"id": svc.model_id, "object": "model", "created": 0,
                                            "owned_by": "strata-nb"}]}

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await _complete(request, get_service(), chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await _complete(request, get_service(), chat=False)

    return app


async def _body(request: Request) -> object:
    data = bytearray()
    async for chunk in request.stream():
        data += chunk
        if len(data) > MAX_BODY_BYTES:
            raise ApiError(413, f"request body larger than {MAX_BODY_BYTES} bytes")
    try:
        return json.loads(data)
    except (ValueError, RecursionError) as e:
        raise ApiError(400, f"invalid JSON body: {e}") from None


class _Reply:
    """A job's events, handed from the engine thread to the request's event loop."""

    def __init__(self, work: protocol.Work):
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.job = Job(prompt=work.prompt, max_new=work.max_new, sampler=work.sampler, stop=work.stop,
                       boundary=work.boundary, emit=self._emit)

    def _emit(self, kind: str, value: object) -> None:
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


def _finish_reason(job: Job, turn) -> str:
    return "length" if turn.result.stopped_by in ("length", "context") and not job.stopped_by_string else "stop"


def _usage(turn) -> dict:
    n = len(turn.result.tokens)
    return {"prompt_tokens": turn.prompt_tokens, "completion_tokens": n, "total_tokens": turn.prompt_tokens + n,
            "prompt_tokens_details": {"cached_tokens": turn.cached_tokens}}


async def _complete(request: Request, svc, chat: bool):
    body = await _body(request)
    work = await run_in_threadpool(protocol.parse, body, svc, chat)
    reply = _Reply(work)
    try:
        svc.scheduler.submit(reply.job)
    except QueueFull as e:
        svc.metrics.request("rejected")
        raise ApiError(503, f"server busy: {e}; retry later", code="server_busy", kind="server_error") from None
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    head = {"id": rid, "object": "chat.completion" if chat else "text_completion", "created": int(time.time()),
            "model": svc.model_id}
    if work.stream:
        return StreamingResponse(_stream(reply, head, chat, work.include_usage), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
    return await _whole(request, reply, head, chat)


async def _whole(request: Request, reply: _Reply, head: dict, chat: bool) -> JSONResponse:
    parts: list[str] = []
    loop = asyncio.get_running_loop()
    check_at = loop.time() + DISCONNECT_POLL_S
    try:
        while True:
            # checked on a clock, not only when idle: tokens arriving faster than the poll would hide a gone client
            if loop.time() >= check_at:
                if await request.is_disconnected():
                    reply.job.cancel.set()
                    return JSONResponse({}, status_code=499)  # nobody reads it
                check_at = loop.time() + DISCONNECT_POLL_S
            try:
                kind, value = await asyncio.wait_for(reply.events.get(), max(check_at - loop.time(), 0.0))
            except asyncio.TimeoutError:
                continue
            if kind == "text":
                parts.append(value)
            elif kind == "error":
                raise ApiError(500, value, kind="server_error")
            else:
                text = "".join(parts)
                choice = ({"index": 0, "message": {"role": "assistant", "content": text}} if chat
                          else {"index": 0, "text": text, "logprobs": None})
                choice["finish_reason"] = _finish_reason(reply.job, value)
                return JSONResponse({**head, "choices": [choice], "usage": _usage(value)})
    finally:
        reply.job.cancel.set()  # a handler that ends early (an error, a cancelled task) stops its generation


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


async def _stream(reply: _Reply, head: dict, chat: bool, include_usage: bool) -> AsyncIterator[str]:
    head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}

    def chunk(piece: str | None, finish: str | None = None, role: bool = False) -> dict:
        if chat:
            delta = ({"role": "assistant", "content": ""} if role else {}) | ({"content": piece} if piece else {})
            c = {"index": 0, "delta": delta, "finish_reason": finish}
        else:
            c = {"index": 0, "text": piece or "", "logprobs": None, "finish_reason": finish}
        return {**head, "choices": [c]} | ({"usage": None} if include_usage else {})

    try:
        if chat:
            yield _sse(chunk(None, role=True))
        while True:
            kind, value = await reply.events.get()
            if kind == "text":
                yield _sse(chunk(value))
            elif kind == "error":
                yield _sse(ApiError(500, value, kind="server_error").body())
                break
            else:
                yield _sse(chunk(None, _finish_reason(reply.job, value)))
                if include_usage:
                    yield _sse({**head, "choices": [], "usage": _usage(value)})
                break
        yield "data: [DONE]\n\n"
    finally:  # the client went away (the response task is cancelled) or the stream ended: stop the generation
        reply.job.cancel.set()
