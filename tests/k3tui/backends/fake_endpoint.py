"""A remote OpenAI-compatible endpoint for tests: real HTTP(S) on 127.0.0.1, in its own process.

SGLang and vLLM need GPUs, so this stands in for them with the same wire format as
llama-server's (docs/reference/llama-server.md): `/health`, `/v1/models`, chat
completions streamed as SSE (`reasoning_content`/`content` deltas, `[DONE]`), Bearer
keys answered with 401 JSON errors. It can serve TLS with a given certificate and stream
slowly (`--interval`) so a test can kill it in the middle of an answer. Every request is
printed to stdout (path and whether a key came with it), never the key itself.

    python fake_endpoint.py --port P --api-key K [--certfile C --keyfile K]

`--port 0` binds a free port and prints it: "listening PORT".
"""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import sys
import time

import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, StreamingResponse
from starlette.routing import Route

MODEL = "fake-k3"


def build_app(api_key: str, chunks: int, interval: float) -> Starlette:
    def log(request: Request) -> None:
        has_key = "key" if request.headers.get("authorization") else "no-key"
        print(f"request {request.method} {request.url.path} {has_key}", flush=True)

    def refused(request: Request) -> JSONResponse | None:
        if request.headers.get("authorization") != f"Bearer {api_key}":
            return JSONResponse({"error": {"code": 401, "message": "Invalid API Key",
                                           "type": "authentication_error"}}, status_code=401)
        return None

    async def health(request: Request) -> JSONResponse:
        log(request)
        return JSONResponse({"status": "ok"})

    async def models(request: Request) -> JSONResponse:
        log(request)
        return refused(request) or JSONResponse(
            {"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "test"}]})

    async def chat(request: Request):
        log(request)
        if (denied := refused(request)) is not None:
            return denied
        body = await request.json()
        if not body.get("stream"):
            return JSONResponse({"object": "chat.completion", "model": MODEL, "choices": [
                {"index": 0, "finish_reason": "length",
                 "message": {"role": "assistant", "content": "OK"}}],
                "usage": {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}})

        def chunk(delta: dict, finish: str | None = None) -> str:
            return "data: " + json.dumps({"object": "chat.completion.chunk", "model": MODEL,
                                          "created": int(time.time()), "choices": [
                                              {"index": 0, "delta": delta,
                                               "finish_reason": finish}]}) + "\n\n"

        async def events():
            yield chunk({"role": "assistant", "content": None})
            yield chunk({"reasoning_content": "thinking"})
            for i in range(chunks):
                await asyncio.sleep(interval)
                yield chunk({"content": f"word{i} "})
            yield chunk({}, "stop")
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def moved(request: Request) -> RedirectResponse:  # a server that moved (/old/v1)
        log(request)
        return RedirectResponse("/v1/models", status_code=301)

    return Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                             Route("/v1/chat/completions", chat, methods=["POST"]),
                             Route("/old/v1/models", moved)])


class _Server(uvicorn.Server):
    def install_signal_handlers(self) -> None:  # let SIGTERM end the process at once
        pass


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--api-key", required=True)
    p.add_argument("--certfile")
    p.add_argument("--keyfile")
    p.add_argument("--chunks", type=int, default=3)
    p.add_argument("--interval", type=float, default=0.0)
    a = p.parse_args()
    sock = socket.create_server(("127.0.0.1", a.port))  # bound here: no port to race for
    config = uvicorn.Config(build_app(a.api_key, a.chunks, a.interval), log_level="warning",
                            ssl_certfile=a.certfile, ssl_keyfile=a.keyfile, lifespan="off")
    server = _Server(config)

    async def serve() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                sys.exit(1)
            await asyncio.sleep(0.02)
        print(f"listening {sock.getsockname()[1]}", flush=True)
        await task

    asyncio.run(serve())


if __name__ == "__main__":
    main()
