"""The OpenAI-compatible HTTP API over an :class:`~numatp.serve.engine.Engine` (FastAPI; ``numatp[serve]``).

Endpoints: ``POST /v1/completions`` (a prompt as text or as a list of token ids), ``POST
/v1/chat/completions`` (messages through the tokenizer's chat template), both with ``stream: true`` as
server-sent events in OpenAI's chunk format ending with ``data: [DONE]``; ``GET /v1/models``, ``/health``
and ``/metrics`` (Prometheus text, :mod:`numatp.serve.metrics`). Parameters as OpenAI names them:
``max_tokens`` (``max_completion_tokens`` for chat), ``temperature`` (0: greedy), ``top_p``, ``seed``,
``stop`` (strings, matched on the decoded text), ``stream``, ``stream_options.include_usage``, and
``ignore_eos`` (vLLM's and llama-server's: generate ``max_tokens`` whatever the tokens, for benchmarks).

Handlers only parse, tokenize, submit and stream: the engine thread runs every forward. Each choice also
carries ``token_ids`` (the generated ids; a model served without a tokenizer returns empty text and its
tokens there). Errors are OpenAI's JSON (``{"error": {"message", "type", "param", "code"}}``): 400 for a
malformed body or a bad parameter (``param`` names it), for a prompt longer than the context
(``code: context_length_exceeded``), for text sent to a model without a tokenizer and for chat without a
chat template; 404 for an unknown model; 429 with ``Retry-After`` when every slot is busy and the queue is
full; 500 for a failed forward (the engine and the server go on).
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request as HttpRequest
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from numatp.serve.engine import Engine, QueueFull, Request, RequestError

__all__ = ["create_app"]

_UNSUPPORTED = {"n": 1, "best_of": 1, "echo": False, "logprobs": None, "suffix": None, "tools": None,
                "functions": None, "top_logprobs": None}


class ApiError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, type_: str = "invalid_request_error",
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.type, self.code = status, message, param, type_, code
        self.headers = headers

    def response(self) -> JSONResponse:
        return JSONResponse({"error": {"message": self.message, "type": self.type, "param": self.param,
                                       "code": self.code}}, status_code=self.status, headers=self.headers)


def create_app(engine: Engine, *, model_name: str, tokenizer: Any = None) -> FastAPI:
    """The FastAPI app serving ``engine`` as model ``model_name``; ``tokenizer`` (a transformers tokenizer)
    for text prompts, text output, stop strings and chat. The engine is started (if it was not) when the
    app starts and stopped when it shuts down (uvicorn: after SIGTERM, once the open requests end)."""

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        if not engine.started:
            await asyncio.get_running_loop().run_in_executor(None, engine.start)
        yield
        engine.stop_accepting()
        engine.stop(timeout=30)

    app = FastAPI(title="numatp serve", lifespan=lifespan)
    created = int(time.time())
    metrics = engine.metrics
    metrics.gauges.update(active_slots=lambda: engine.active, max_slots=lambda: engine.max_batch,
                          queue_length=lambda: engine.queued)

    @app.exception_handler(ApiError)
    async def _api_error(request: HttpRequest, exc: ApiError) -> JSONResponse:
        metrics.reject(exc.code or exc.type)
        return exc.response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: HttpRequest, exc: StarletteHTTPException) -> JSONResponse:
        return ApiError(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}",
                        code="not_found" if exc.status_code == 404 else None).response()

    @app.exception_handler(Exception)
    async def _internal(request: HttpRequest, exc: Exception) -> JSONResponse:
        return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type_="server_error").response()

    @app.get("/health")
    async def health() -> JSONResponse:
        ok = engine.serving
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics_page() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [{"id": model_name, "object": "model", "created": created,
                                            "owned_by": "numatp", "max_model_len": engine.max_len}]}

    @app.post("/v1/completions")
    async def completions(request: HttpRequest) -> Any:
        body = await _body(request)
        _check_model(body, model_name)
        prompt = body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if tokenizer is None:
                raise ApiError(400, f"model {model_name!r} has no tokenizer, so it takes prompts as lists of token "
                               "ids, not text: send \"prompt\": [id, id, ...] (or start the server with "
                               "--tokenizer PATH)", "prompt")
            ids = tokenizer(prompt).input_ids
        elif isinstance(prompt, list) and prompt and all(isinstance(x, int) and not isinstance(x, bool)
                                                         for x in prompt):
            ids = list(prompt)
        else:
            raise ApiError(400, "prompt must be a string or a non-empty list of token ids (one prompt per request)",
                           "prompt")
        return await _generate(request, body, ids, chat=False, default_max=16)

    @app.post("/v1/chat/completions")
    async def chat(request: HttpRequest) -> Any:
        body = await _body(request)
        _check_model(body, model_name)
        if tokenizer is None or not getattr(tokenizer, "chat_template", None):
            why = "no tokenizer" if tokenizer is None else "a tokenizer without a chat template"
            raise ApiError(400, f"model {model_name!r} has {why}, so it cannot format chat messages: use "
                           "/v1/completions" + (" with token ids" if tokenizer is None else "")
                           + " (or start the server with --tokenizer PATH naming one with a chat template)",
                           "messages")
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages:
            raise ApiError(400, "messages must be a non-empty list of {\"role\", \"content\"} objects", "messages")
        plain = []
        for k, m in enumerate(messages):
            if not isinstance(m, dict) or not isinstance(m.get("role"), str):
                raise ApiError(400, f"messages[{k}] must be an object with a string \"role\"", f"messages[{k}]")
            content = m.get("content")
            if isinstance(content, list):   # [{"type": "text", "text": ...}, ...]
                try:
                    content = "".join(part["text"] for part in content if part.get("type") == "text")
                except (TypeError, KeyError, AttributeError) as e:
                    raise ApiError(400, f"messages[{k}].content: parts must be {{\"type\": \"text\", \"text\": "
                                   "...}", f"messages[{k}].content") from e
            if not isinstance(content, str):
                raise ApiError(400, f"messages[{k}].content must be a string or a list of text parts",
                               f"messages[{k}].content")
            plain.append({"role": m["role"], "content": content})
        try:
            text = tokenizer.apply_chat_template(plain, add_generation_prompt=True, tokenize=False)
        except Exception as e:   # the template's own errors (a role it does not know, say)
            raise ApiError(400, f"the chat template refused these messages: {e}", "messages") from e
        ids = tokenizer(text, add_special_tokens=False).input_ids
        return await _generate(request, body, ids, chat=True, default_max=None)

    async def _generate(request: HttpRequest, body: dict[str, Any], ids: list[int], *, chat: bool,
                        default_max: int | None) -> Any:
        for name, default in _UNSUPPORTED.items():
            if name in body and body[name] not in (default, None):
                raise ApiError(400, f"{name}={body[name]!r} is not supported by numatp serve", name)
        max_tokens = body.get("max_completion_tokens") if chat else None
        max_name = "max_completion_tokens" if max_tokens is not None else "max_tokens"
        if max_tokens is None:
            max_tokens = body.get("max_tokens")
        if max_tokens is None:
            max_tokens = default_max if default_max is not None else max(engine.max_len - len(ids), 1)
        max_tokens = _number(max_name, max_tokens, int, low=1)
        temperature = _number("temperature", body.get("temperature", 1.0), float, low=0, high=2)
        top_p = _number("top_p", body.get("top_p", 1.0), float, low=0, high=1)
        if top_p == 0:
            raise ApiError(400, "top_p=0: must be in (0, 1]", "top_p")
        seed = body.get("seed")
        if seed is not None:
            seed = _number("seed", seed, int)
        stop = body.get("stop")
        stops = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if not isinstance(stops, list) or not all(isinstance(s, str) and s for s in stops) or len(stops) > 4:
            raise ApiError(400, "stop must be a non-empty string or a list of up to 4 of them", "stop")
        if stops and tokenizer is None:
            raise ApiError(400, f"stop strings are matched on text, and model {model_name!r} has no tokenizer", "stop")
        ignore_eos = body.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise ApiError(400, f"ignore_eos={ignore_eos!r}: must be true or false", "ignore_eos")
        stream = body.get("stream", False)
        if not isinstance(stream, bool):
            raise ApiError(400, f"stream={stream!r}: must be true or false", "stream")
        options = body.get("stream_options") or {}
        usage_too = isinstance(options, dict) and bool(options.get("include_usage"))

        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()

        def on_event(kind: str, value: Any) -> None:
            loop.call_soon_threadsafe(events.put_nowait, (kind, value))

        req = Request(ids, max_tokens, on_event, temperature=temperature, top_p=top_p, seed=seed,
                      ignore_eos=ignore_eos)
        try:
            engine.submit(req)
        except RequestError as e:
            raise ApiError(400, str(e), e.param, code=e.code) from e
        except QueueFull as e:
            raise ApiError(429, f"numatp serve is at capacity: {e}; retry after {e.retry_after}s", None,
                           "rate_limit_exceeded", "rate_limit_exceeded",
                           headers={"Retry-After": str(e.retry_after)}) from e
        text = _Text(tokenizer, stops)
        rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
        obj = "chat.completion" if chat else "text_completion"

        sent: list[int] = []   # tokens given to the client (not those made after a stop string, before it left)

        def usage() -> dict[str, int]:
            return {"prompt_tokens": len(ids), "completion_tokens": len(sent), "total_tokens": len(ids) + len(sent)}

        async def next_piece() -> tuple[str, list[int], str | None]:
            """Text and token ids since the last call, and the finish reason once done."""
            new: list[int] = []
            while True:
                kind, value = await events.get()
                if kind == "token":
                    new.append(value)
                    sent.append(value)
                    if text.add(value):   # a stop string: leave now
                        req.cancel()
                        return text.take(), new, "stop"
                    if events.empty():
                        return text.take(), new, None
                elif kind == "done":
                    return text.take(final=True), new, "stop" if value == "cancelled" else value
                else:
                    raise ApiError(500, f"the forward failed: {value}", type_="server_error")

        if not stream:
            pieces: list[str] = []
            tokens: list[int] = []
            try:
                while True:
                    task = asyncio.ensure_future(next_piece())
                    while not task.done():
                        await asyncio.wait({task}, timeout=1.0)
                        if not task.done() and await request.is_disconnected():
                            task.cancel()
                            req.cancel()
                            return PlainTextResponse("", status_code=499)
                    piece, new, finish = task.result()
                    pieces.append(piece)
                    tokens += new
                    if finish is not None:
                        break
            finally:
                req.cancel()
            out = "".join(pieces)
            choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "token_ids": tokens}
            if chat:
                choice["message"] = {"role": "assistant", "content": out}
            else:
                choice.update(text=out, logprobs=None)
            return {"id": rid, "object": obj, "created": int(time.time()), "model": model_name,
                    "choices": [choice], "usage": usage()}

        async def sse() -> AsyncIterator[str]:
            def chunk(choice: dict[str, Any], **extra: Any) -> str:
                data = {"id": rid, "object": obj + ".chunk" if chat else obj, "created": int(time.time()),
                        "model": model_name, "choices": [choice], **extra}
                return f"data: {json.dumps(data)}\n\n"
            try:
                if chat:
                    yield chunk({"index": 0, "delta": {"role": "assistant", "content": ""}, "finish_reason": None})
                while True:
                    try:
                        piece, new, finish = await next_piece()
                    except ApiError as e:
                        yield f"data: {json.dumps({'error': {'message': e.message, 'type': e.type, 'param': None, 'code': None}})}\n\n"  # noqa: E501
                        break
                    if piece or new:
                        if chat:
                            yield chunk({"index": 0, "delta": {"content": piece}, "finish_reason": None,
                                         "token_ids": new})
                        else:
                            yield chunk({"index": 0, "text": piece, "logprobs": None, "finish_reason": None,
                                         "token_ids": new})
                    if finish is not None:
                        last: dict[str, Any] = {"index": 0, "finish_reason": finish}
                        if chat:
                            last["delta"] = {}
                        else:
                            last.update(text="", logprobs=None)
                        yield chunk(last)
                        if usage_too:
                            data = {"id": rid, "object": obj + ".chunk" if chat else obj, "created": int(time.time()),
                                    "model": model_name, "choices": [], "usage": usage()}
                            yield f"data: {json.dumps(data)}\n\n"
                        break
                yield "data: [DONE]\n\n"
            finally:   # the client went away (the stream is cancelled), or done: the slot is freed either way
                req.cancel()

        return StreamingResponse(sse(), media_type="text/event-stream",
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    return app


async def _body(request: HttpRequest) -> dict[str, Any]:
    raw = await request.body()
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}") from e
    if not isinstance(body, dict):
        raise ApiError(400, f"the request body must be a JSON object, got {type(body).__name__}")
    return body


def _check_model(body: dict[str, Any], name: str) -> None:
    model = body.get("model")
    if model is None:
        raise ApiError(400, f"model is required: this server serves {name!r}", "model")
    if model != name:
        raise ApiError(404, f"the model {model!r} does not exist: this server serves {name!r}", "model",
                       code="model_not_found")


def _number(name: str, value: Any, kind: type, *, low: float | None = None, high: float | None = None) -> Any:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and (kind is float or isinstance(value, int))
    if not ok:
        raise ApiError(400, f"{name}={value!r}: must be {'an integer' if kind is int else 'a number'}", name)
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low:g}" if high is None else f"between {low:g} and {high:g}"
        raise ApiError(400, f"{name}={value!r}: must be {bounds}", name)
    return kind(value)


class _Text:
    """Incremental detokenization with stop strings: :meth:`add` a token (True once a stop string appeared),
    :meth:`take` the text that is safe to send (not an unfinished character, nor a possible start of a stop
    string), ``final=True`` for the rest."""

    def __init__(self, tokenizer: Any, stops: list[str]):
        self.tokenizer, self.stops = tokenizer, stops
        self.tokens: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped = False

    def add(self, token: int) -> bool:
        if self.tokenizer is None or self.stopped:
            return self.stopped
        self.tokens.append(token)
        self.text = self.tokenizer.decode(self.tokens, skip_special_tokens=True)
        for s in self.stops:
            at = self.text.find(s, max(0, self.sent - len(s)))
            if at >= 0:
                self.text = self.text[:at]
                self.stopped = True
        return self.stopped

    def take(self, final: bool = False) -> str:
        end = len(self.text)
        if not final and not self.stopped:
            if self.text.endswith("\ufffd"):
                end -= 1
            for s in self.stops:   # hold back a tail that may become a stop string
                for k in range(min(len(s) - 1, end - self.sent), 0, -1):
                    if self.text[end - k:end] == s[:k]:
                        end -= k
                        break
        piece = self.text[self.sent:max(end, self.sent)]
        self.sent = max(end, self.sent)
        return piece
