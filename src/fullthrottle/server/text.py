"""The text routes of the server: ``POST /v1/embeddings`` (OpenAI's embeddings shape) and
``POST /v1/completions`` (a subset of OpenAI's completions, streaming as server-sent events), on the
services of :mod:`~fullthrottle.server.services`. :func:`add_text_routes` adds them to the app that
:func:`~fullthrottle.server.app.create_app` makes; a route whose service is not enabled answers 404.
"""

from __future__ import annotations

import asyncio
import json
import time

from fastapi import Request  # module level: FastAPI resolves handler annotations from module globals

from .guard import HTTPError as _HTTPError
from .services import Overloaded

#: texts one embeddings request may carry (413 beyond)
MAX_TEXTS_PER_REQUEST = 2048


def add_text_routes(app, state: dict, opts, reply, m_requests, m_latency) -> None:
    """Add the embeddings and completions routes to ``app``.

    Args:
        state: the app's state (``"embed"``: the :class:`~fullthrottle.server.services.EmbedService`,
            ``"embed_name"``, ``"llm"``: the :class:`~fullthrottle.server.services.CompletionService`;
            set in the app's lifespan).
        opts: the :class:`~fullthrottle.server.app.ServeOptions` (body limit, deadline, Retry-After).
        reply: ``reply(route, status, body, headers=None)``: the JSON response, counted in the metrics.
        m_requests, m_latency: the app's request counter and latency histogram (prometheus-client).
    """

    @app.post("/v1/embeddings")
    async def embeddings(request: Request):
        """OpenAI embeddings shape: ``{"input": str | [str], "model": ...}`` -> ``{"data": [...]}``."""
        route, t0 = "/v1/embeddings", time.perf_counter()
        try:
            svc = state.get("embed")
            if svc is None:
                raise _HTTPError(404, "embeddings are not enabled (start the server with --embed-model)")
            body = await request.body()
            if len(body) > opts.max_body_bytes:
                raise _HTTPError(413, f"request body exceeds the limit of {opts.max_body_bytes} bytes")
            try:
                payload = json.loads(body)
                texts = payload.get("input") if isinstance(payload, dict) else None
            except ValueError:
                texts = None
            texts = [texts] if isinstance(texts, str) else texts
            if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
                raise _HTTPError(400, 'JSON body must be {"input": "text" | ["text", ...]}')
            if len(texts) > MAX_TEXTS_PER_REQUEST:
                raise _HTTPError(413, f"{len(texts)} texts in one request; at most {MAX_TEXTS_PER_REQUEST}")
            try:
                fut = svc.submit(texts)
            except Overloaded as e:
                raise _HTTPError(503, f"overloaded: {e}", {"Retry-After": str(opts.retry_after_s)}) from None
            try:
                vecs, trunc, toks = await asyncio.wait_for(fut, opts.timeout_s)
            except TimeoutError:
                raise _HTTPError(504, f"deadline of {opts.timeout_s:g} s exceeded") from None
            data = [
                {"object": "embedding", "index": i, "embedding": v.tolist(), "truncated": bool(t)}
                for i, (v, t) in enumerate(zip(vecs, trunc))
            ]
            n_tok = int(toks.sum())
            return reply(
                route,
                200,
                {
                    "object": "list",
                    "data": data,
                    "model": state["embed_name"],
                    "usage": {"prompt_tokens": n_tok, "total_tokens": n_tok},
                },
            )
        except _HTTPError as e:
            return reply(route, e.status, {"detail": e.detail}, e.headers)
        finally:
            m_latency.labels(route).observe(time.perf_counter() - t0)

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
            try:
                p = json.loads(await request.body())
                if not isinstance(p, dict):
                    raise ValueError
            except ValueError:
                raise _HTTPError(400, "JSON object body required") from None
            prompt = p.get("prompt")
            if isinstance(prompt, str):
                if svc.tok is None:
                    raise _HTTPError(400, "this model has no tokenizer: send prompt as a list of token ids")
                ids = svc.tok.encode(prompt).ids
            elif (
                isinstance(prompt, list)
                and prompt
                and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt)
            ):
                ids = prompt
            else:
                raise _HTTPError(400, "prompt must be a string or a non-empty list of token ids")
            vocab = svc.gen.model.cfg.vocab_size
            max_tokens = p.get("max_tokens", 16)
            if not isinstance(max_tokens, int) or max_tokens < 1:
                raise _HTTPError(400, "max_tokens must be a positive integer")
            if any(i < 0 or i >= vocab for i in ids):
                raise _HTTPError(400, f"token ids must be in [0, {vocab})")
            if len(ids) + max_tokens > svc.gen.max_seq_len:
                raise _HTTPError(
                    400,
                    f"prompt ({len(ids)} tokens) + max_tokens ({max_tokens}) exceeds the "
                    f"context of {svc.gen.max_seq_len}",
                )
            if not isinstance(p.get("stream", False), bool):
                raise _HTTPError(400, "stream must be true or false")
            try:
                svc.gen.check_sampling(
                    float(p.get("temperature", 1.0)), int(p.get("top_k", 0)), float(p.get("top_p", 1.0))
                )
            except (TypeError, ValueError) as e:
                raise _HTTPError(400, str(e)) from None
            eos = svc.gen.model.cfg.eos_token_id
            req = {
                "ids": ids,
                "max_tokens": max_tokens,
                "temperature": float(p.get("temperature", 1.0)),
                "top_p": float(p.get("top_p", 1.0)),
                "top_k": int(p.get("top_k", 0)),
                "seed": p.get("seed"),
                "eos": eos[0] if isinstance(eos, list) else eos,
            }
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
