"""A stand-in for `python -m engine serve` until the real one lands: same CLI shape,
same "listening on" line, /health 503 while "loading", llama-server-shaped SSE chunks
carrying the engine's `k3` stats object. LS_FAKE_CRASH=N makes it die after N tokens."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import time

import uvicorn
from starlette.applications import Starlette
from starlette.responses import JSONResponse, StreamingResponse
from starlette.routing import Route

LOAD_S = 0.6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("checkpoint")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--api-key")
    ap.add_argument("--model-name", default="kimi-k3")
    args, rest = ap.parse_known_args()
    t0 = time.monotonic()
    crash_after = int(os.environ.get("LS_FAKE_CRASH", "0"))

    def auth_fail(request):
        if args.api_key and request.headers.get("authorization") != f"Bearer {args.api_key}":
            return JSONResponse({"error": {"code": 401, "message": "Invalid API Key",
                                           "type": "authentication_error"}}, 401)
        return None

    async def health(request):
        if time.monotonic() - t0 < LOAD_S:
            return JSONResponse({"error": {"code": 503, "message": "Loading model",
                                           "type": "unavailable_error"}}, 503)
        return JSONResponse({"status": "ok"})

    async def chat(request):
        if (fail := auth_fail(request)) is not None:
            return fail
        body = await request.json()
        n = int(body.get("max_tokens") or 8)

        def chunk(delta, finish=None, **extra):
            return "data: " + json.dumps({"choices": [{"index": 0, "delta": delta,
                                                       "finish_reason": finish}],
                                          "model": args.model_name,
                                          "object": "chat.completion.chunk", **extra}) + "\n\n"

        async def gen():
            yield chunk({"role": "assistant", "content": None})
            for i in range(n):
                if crash_after and i == crash_after:
                    print("fake engine: simulated crash", flush=True)
                    os._exit(3)
                k3 = {"s_per_token": 0.01 * (i + 1), "gb_read": 0.5 * i, "mb_per_s": 900.0,
                      "true_hit_rate": 0.25, "rss_gb": 1.5, "budget_gb": 4.0,
                      "compute_s": 0.004, "wait_trunk_s": 0.003, "wait_experts_s": 0.003}
                key = "reasoning_content" if i < n // 2 else "content"
                yield chunk({key: f"t{i} "}, k3=k3)
                await asyncio.sleep(0.01)
            yield chunk({}, "length" if n <= 8 else "stop")
            yield "data: " + json.dumps({"choices": [], "usage": {"completion_tokens": n,
                                         "prompt_tokens": 5, "total_tokens": n + 5}}) + "\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(gen(), media_type="text/event-stream")

    async def models(request):
        return JSONResponse({"object": "list", "data": [{"id": args.model_name}]})

    app = Starlette(routes=[Route("/health", health), Route("/v1/models", models),
                            Route("/v1/chat/completions", chat, methods=["POST"])])
    print(f"fake engine: {args.checkpoint} extra={rest}", flush=True)
    config = uvicorn.Config(app, host=args.host, port=args.port, log_level="warning")
    server = uvicorn.Server(config)

    async def serve():
        await server.startup()
        print(f"listening on http://{args.host}:{args.port}", flush=True)
        await server.main_loop()
        await server.shutdown()

    asyncio.run(serve())


if __name__ == "__main__":
    sys.exit(main())
