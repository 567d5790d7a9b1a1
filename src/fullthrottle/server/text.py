"""The LLM route of the server: ``POST /v1/completions`` (a subset of OpenAI's completions, streaming
as server-sent events), on :class:`~fullthrottle.server.services.CompletionService`.
:func:`add_text_routes` adds it to the app that :func:`~fullthrottle.server.app.create_app` makes;
without a model it answers 404. (``POST /v1/embeddings`` is a workload on the contract:
:class:`~fullthrottle.workloads.embed_api.EmbeddingsAPI`.)
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import Request  # module level: FastAPI resolves handler annotations from module globals

from ..core.workload import parse_body
from ..workloads.llm.api import completion_request
from .guard import HTTPError as _HTTPError
from .guard import read_body
from .services import Overloaded


def add_text_routes(app, state: dict, opts, reply, m_requests, m_latency) -> None:
    """Add the completions route to ``app``.

    Args:
        state: the app's state (``"llm"``: the :class:`~fullthrottle.server.services.CompletionService`,
            set in the app's lifespan).
        opts: the :class:`~fullthrottle.server.app.ServeOptions` (body limit, deadline, Retry-After).
        reply: ``reply(route, status, body, headers=None)``: the JSON response, counted in the metrics.
        m_requests, m_latency: the app's request counter and latency histogram (prometheus-client).
    """

    @app.post("/v1/completions")
    async def completions(request: Request):
        """OpenAI completions subset: prompt (text, or a list of token ids), max_tokens, temperature,
        top_p, top_k, seed, stream (server-sent events, one chunk per few tokens)."""
        from fastapi.responses import StreamingResponse

        route, t0 = "/v1/completions", time.perf_counter()
        try:
            svc = state.get("llm")
            if svc is None:
                raise _HTTPError(404, "completions are not enabled (start the server with --llm-model-dir)")
            body = await read_body(request, opts.max_body_bytes, opts.body_timeout_s)
            try:
                p = parse_body(body)
                if not isinstance(p, dict):
                    raise ValueError("JSON object body required")
                req = completion_request(p, svc.gen, svc.tok)
            except ValueError as e:
                raise _HTTPError(400, str(e)) from None
            ids = req["ids"]
            try:
                out = svc.submit(req)
            except Overloaded as e:
                raise _HTTPError(503, f"overloaded: {e}", {"Retry-After": str(opts.retry_after_s)}) from None

            def text(toks):
                return svc.tok.decode(toks) if svc.tok is not None else None

            if p.get("stream"):

                async def events():
                    last = None
                    try:
                        while True:
                            item = await out.get()
                            if item is None or isinstance(item, Exception):
                                break
                            last = item[-1]
                            chunk = {
                                "object": "text_completion",
                                "choices": [{"index": 0, "text": text(item), "token_ids": item, "finish_reason": None}],
                            }
                            yield f"data: {json.dumps(chunk)}\n\n"
                    finally:  # also when the client disconnects mid-stream: stop generating for it
                        req["cancelled"] = True
                    finish = (
                        "error"
                        if isinstance(item, Exception)
                        else "stop"
                        if req["eos"] is not None and last == req["eos"]
                        else "length"
                    )
                    end = {
                        "object": "text_completion",
                        "choices": [{"index": 0, "text": "", "token_ids": [], "finish_reason": finish}],
                    }
                    yield f"data: {json.dumps(end)}\n\n"
                    yield "data: [DONE]\n\n"

                m_requests.labels(route, "200").inc()
                return StreamingResponse(events(), media_type="text/event-stream")
            toks: list[int] = []
            deadline = t0 + opts.timeout_s
            try:
                while True:
                    try:
                        item = await asyncio.wait_for(out.get(), max(deadline - time.perf_counter(), 0.001))
                    except TimeoutError:
                        raise _HTTPError(504, f"deadline of {opts.timeout_s:g} s exceeded") from None
                    if item is None:
                        break
                    if isinstance(item, Exception):
                        raise _HTTPError(500, f"generation failed: {item}")
                    toks += item
            finally:  # answered, timed out (504) or cancelled: generate no more for it
                req["cancelled"] = True
            finish = "stop" if req["eos"] is not None and toks and toks[-1] == req["eos"] else "length"
            return reply(
                route,
                200,
                {
                    "object": "text_completion",
                    "choices": [{"index": 0, "text": text(toks), "token_ids": toks, "finish_reason": finish}],
                    "usage": {
                        "prompt_tokens": len(ids),
                        "completion_tokens": len(toks),
                        "total_tokens": len(ids) + len(toks),
                    },
                },
            )
        except _HTTPError as e:
            return reply(route, e.status, {"detail": e.detail}, e.headers)
        finally:
            m_latency.labels(route).observe(time.perf_counter() - t0)
