"""The LLM routes of the server, in OpenAI's shapes, on
:class:`~fullthrottle.server.services.CompletionService` (continuous batching):

- ``POST /v1/completions``: ``prompt`` (text, or a list of token ids);
- ``POST /v1/chat/completions``: ``messages``, made into a prompt by the model's chat template;
- ``GET /v1/models``: the models served (the LLM's, the embeddings model's).

Both generation routes take ``max_tokens`` (chat: also ``max_completion_tokens``), ``temperature``,
``top_p``, ``top_k``, ``seed`` (a request's own: its tokens do not depend on other requests; any
integer, taken modulo 2**32, so seeds that differ by a multiple of 2**32 give the same tokens),
``stop`` (up to 4 strings: the text ends before the first, and generation stops there),
``stream`` (server-sent events, one chunk per few tokens, ending in ``data: [DONE]``) and
``stream_options.include_usage`` (a last chunk with the token counts). A client that disconnects
frees its KV-cache row at the next step. Without a model both answer 404; while the models load, 503
with Retry-After. When the server stops
(SIGTERM), streams still open :data:`STREAM_END_MARGIN_S` before its drain ends
(:func:`end_streams_in`) end with a last chunk whose finish_reason is ``"error"`` (the reason in its
``error``), then ``data: [DONE]``, rather than being cut off mid-body.
:func:`add_text_routes` adds them to the app of :func:`~fullthrottle.server.app.create_app`.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid

from fastapi import Request  # module level: FastAPI resolves handler annotations from module globals

from ..core.errors import Overloaded
from ..core.json_body import json_type, parse_body
from ..workloads.llm.api import chat_request, completion_request
from ..workloads.llm.text import TextStream
from .guard import HTTPError as _HTTPError
from .guard import check_json_size, check_json_type, error_body, overloaded, past_deadline, read_body

#: how often (s) a non-streaming request checks, between its tokens, whether its client went away
DISCONNECT_CHECK_S = 0.5
#: how long (s) before the end of the server's drain its open streams are ended, each with its last chunk
STREAM_END_MARGIN_S = 1.0


class ShuttingDown(Exception):
    """What ends a stream still open as the server's drain runs out (the last chunk's error)."""


def end_streams_in(state: dict, drain_s: float) -> None:
    """Called as the server starts to drain (from its event loop): the streams open
    ``drain_s - STREAM_END_MARGIN_S`` seconds later end then, with their last chunk and [DONE]."""

    def end():
        for out in list(state.get("streams", ())):
            out.put_nowait(ShuttingDown("the server is shutting down: the stream ends here"))

    asyncio.get_running_loop().call_later(max(drain_s - STREAM_END_MARGIN_S, 0.0), end)


class _Reply:
    """One request's answer being built: its ids, the text so far and the OpenAI shapes of it."""

    def __init__(self, chat: bool, req: dict, model: str, tok, on_first=None):
        self.chat, self.req, self.model, self.on_first = chat, req, model, on_first  # on_first(): its first token came
        self.id = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex
        self.created = int(time.time())
        self.tok = tok
        self.text = TextStream(tok, req["stop"]) if tok is not None else None
        self.tokens: list[int] = []
        self.lps: list = []  # per token, with logprobs: (its log-probability, top ids, top values)
        self.sent = 0  # tokens already in a streamed chunk (their ids and logprobs)
        self._offset = 0  # characters of the completion's tokens so far (text_offset)

    def take(self, new: list[int]) -> str | None:
        """New token ids (a TokenChunk) in (none count after a stop string); returns the text they
        make final (None: no tokenizer)."""
        if self.text is not None and self.text.stopped:
            return ""
        if new and not self.tokens and self.on_first is not None:
            self.on_first()
        self.tokens += new
        self.lps += getattr(new, "logprobs", None) or []
        text = None
        if self.text is not None:
            text = self.text.push(new)
            self._cut_at_stop()
        return text

    def _cut_at_stop(self) -> None:
        """After a stop string, the tokens after the one that completed it do not count."""
        if self.text.stopped:
            self.tokens, self.lps = self.tokens[: self.text.used], self.lps[: self.text.used]

    @property
    def _sendable(self) -> int:
        """Tokens a streamed chunk may carry: those no stop string can cut any more."""
        return len(self.tokens) if self.text is None else min(len(self.tokens), self.text.settled)

    @property
    def unsent(self) -> int:
        """Tokens taken, and no longer to be cut by a stop string, that no streamed chunk has carried yet."""
        return max(self._sendable - self.sent, 0)

    def _token(self, i: int) -> str:
        return self.tok.decode([i]) if self.tok is not None else f"token_id:{i}"

    def _shown(self, i: int) -> str:
        """A token as the completions shape names it: its text, or ``bytes:\\xNN...`` for a piece of a
        UTF-8 character (as OpenAI's API shows one; its text would be U+FFFD, the same for them all)."""
        t = self._token(i)
        if "\ufffd" in t and self.tok is not None:
            b = self.tok.token_bytes(i)
            try:
                b.decode("utf-8")
            except UnicodeDecodeError:
                return "bytes:" + "".join(f"\\x{c:02x}" for c in b)
        return t

    def _top_dict(self, ids: list[int], vals: list[float], chosen: int, lp: float) -> dict:
        """The completions shape's ``{token: logprob}`` (:meth:`_shown`): the most likely tokens and,
        as OpenAI's API gives it, always the chosen one (up to ``logprobs`` + 1 entries); tokens shown
        alike keep the likeliest."""
        out: dict = {}
        for j, v in zip(ids, vals):
            out.setdefault(self._shown(j), v)
        out.setdefault(self._shown(chosen), lp)
        return out

    def logprobs(self, start: int, stop: int) -> dict | None:
        """OpenAI's ``logprobs`` for tokens ``[start, stop)`` (None unless the request asked)."""
        if self.req.get("logprobs") is None:
            return None
        rows = list(zip(self.tokens[start:stop], self.lps[start:stop]))
        if self.chat:

            def item(i: int, lp: float) -> dict:  # (bytes: the token's own, a part of a character included)
                b = self.tok.token_bytes(i) if self.tok is not None else self._token(i).encode("utf-8")
                return {"token": self._token(i), "logprob": lp, "bytes": list(b)}

            return {
                "content": [
                    {**item(i, lp), "top_logprobs": [item(j, v) for j, v in zip(ids, vals)]}
                    for i, (lp, ids, vals) in rows
                ]
            }
        offsets = []
        for i, _ in rows:  # (in the text: a piece of a character counts as its U+FFFD)
            offsets.append(self._offset)
            self._offset += len(self._token(i))
        return {
            "tokens": [self._shown(i) for i, _ in rows],
            "token_logprobs": [lp for _, (lp, _, _) in rows],
            "top_logprobs": [self._top_dict(ids, vals, i, lp) for i, (lp, ids, vals) in rows],
            "text_offset": offsets,
        }

    def rest(self) -> str | None:
        """The text held back, once no more tokens come (a stop string found in it cuts the tokens after it)."""
        if self.text is None:
            return None
        out = self.text.flush()
        self._cut_at_stop()
        return out

    @property
    def stopped(self) -> bool:
        return self.text is not None and self.text.stopped

    def finish_reason(self) -> str:
        ends = self.req.get("stop_ids", ())
        return "stop" if self.stopped or (self.tokens and self.tokens[-1] in ends) else "length"

    def usage(self) -> dict:
        n, k = len(self.req["ids"]), len(self.tokens)
        return {"prompt_tokens": n, "completion_tokens": k, "total_tokens": n + k}

    def _head(self, obj: str) -> dict:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model}

    def chunk(self, text: str | None, finish: str | None = None, first: bool = False) -> dict:
        """A streamed chunk of ``text`` and of the tokens taken since the last chunk (their ids and
        logprobs), those that a stop string may still cut held back until it no longer can."""
        upto = self._sendable
        ids = self.tokens[self.sent : upto]
        lp = self.logprobs(self.sent, upto) if ids else None
        self.sent = max(self.sent, upto)
        if self.chat:
            delta = {"role": "assistant", "content": text or ""} if first else {"content": text} if text else {}
            choice = {"index": 0, "delta": delta, "logprobs": lp, "finish_reason": finish}
            out = {**self._head("chat.completion.chunk"), "choices": [choice]}
        else:
            choice = {"index": 0, "text": text, "token_ids": ids, "logprobs": lp, "finish_reason": finish}
            out = {**self._head("text_completion"), "choices": [choice]}
        if self.req["include_usage"]:
            out["usage"] = None
        return out

    def usage_chunk(self) -> dict:
        return {
            **self._head("chat.completion.chunk" if self.chat else "text_completion"),
            "choices": [],
            "usage": self.usage(),
        }

    def whole(self, text: str | None) -> dict:
        reason = self.finish_reason()
        lp = self.logprobs(0, len(self.tokens))
        if self.chat:
            msg = {"role": "assistant", "content": text}
            choices = [{"index": 0, "message": msg, "logprobs": lp, "finish_reason": reason}]
            return {**self._head("chat.completion"), "choices": choices, "usage": self.usage()}
        choice = {"index": 0, "text": text, "token_ids": self.tokens, "logprobs": lp, "finish_reason": reason}
        return {**self._head("text_completion"), "choices": [choice], "usage": self.usage()}


def add_text_routes(app, state: dict, opts, reply, m_requests, m_latency, m_ttft) -> None:
    """Add the LLM routes to ``app``.

    Args:
        state: the app's state (``"llm"``: the :class:`~fullthrottle.server.services.CompletionService`,
            set in the app's lifespan).
        opts: the :class:`~fullthrottle.server.app.ServeOptions` (body limit, deadline, Retry-After).
        reply: ``reply(route, status, body, headers=None)``: the JSON response, counted in the metrics.
        m_requests, m_latency: the app's request counter and latency histogram (prometheus-client);
        m_ttft: its histogram of the time to first token (from the request's arrival).
    """

    def served() -> list[dict]:
        svc, emb = state.get("llm"), state.get("workloads", {}).get("embeddings")
        names = ([svc.name] if svc is not None else []) + ([emb.workload.model_name] if emb is not None else [])
        return [{"id": n, "object": "model", "created": 0, "owned_by": "fullthrottle"} for n in names]

    def loading():  # (the models are named once they are up)
        return reply(
            "/v1/models", 503, error_body(503, "loading", openai=True), {"Retry-After": str(opts.retry_after_s)}
        )

    @app.api_route("/v1/models", methods=["GET", "HEAD"])
    async def models():
        if not state.get("ready"):
            return loading()
        return reply("/v1/models", 200, {"object": "list", "data": served()})

    @app.api_route("/v1/models/{model:path}", methods=["GET", "HEAD"])
    async def model(model: str):  # (OpenAI's models.retrieve)
        if not state.get("ready"):
            return loading()
        got = [m for m in served() if m["id"] == model]
        if got:
            return reply("/v1/models", 200, got[0])
        return reply("/v1/models", 404, error_body(404, f"model {model!r} is not served here", openai=True))

    @app.post("/v1/completions")
    async def completions(request: Request):
        """OpenAI completions: prompt (text, or a list of token ids) and the options of this module."""
        return await _generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        """OpenAI chat completions: messages, made a prompt by the model's chat template."""
        return await _generate(request, chat=True)

    async def _generate(request: Request, chat: bool):
        from fastapi.responses import StreamingResponse

        route = "/v1/chat/completions" if chat else "/v1/completions"
        t0, timed, observe = time.perf_counter(), True, m_latency.labels(route).observe
        try:
            svc = state.get("llm")
            if svc is None and opts.llm is not None:  # (its service starts once the models before it are up)
                raise _HTTPError(503, "loading", {"Retry-After": str(opts.retry_after_s)})
            if svc is None:
                raise _HTTPError(404, "completions are not enabled (start the server with --llm-model-dir)")
            check_json_type(request, route)
            body = await read_body(request, opts.max_body_bytes, opts.body_timeout_s)
            check_json_size(body)
            try:
                p = parse_body(body)
                if not isinstance(p, dict):
                    raise ValueError("JSON object body required")
                if p.get("model") is not None and not isinstance(p["model"], str):
                    raise ValueError(f"model must be a string, got {json_type(p['model'])}")
                if p.get("model") is not None and p["model"] != svc.name:  # (as OpenAI's API: not another's)
                    raise _HTTPError(
                        404, f"the model {p['model']!r} is not served here; this server serves {svc.name!r}"
                    )
                # (tokenizing and templating in a thread: a long prompt does not hold the event loop)
                req = await asyncio.to_thread(chat_request if chat else completion_request, p, svc.gen, svc.tok)
            except ValueError as e:
                raise _HTTPError(400, str(e)) from None
            try:
                out = svc.submit(req)
            except Overloaded as e:
                raise overloaded(e, opts.retry_after_s) from None
            r = _Reply(chat, req, svc.name, svc.tok, lambda: m_ttft.observe(time.perf_counter() - t0))
            if p.get("stream"):
                timed = False  # (a stream's latency is observed, and its status counted, as it ends)

                def ended(status: str) -> None:  # "200": its [DONE] sent; "499": its client left first
                    observe(time.perf_counter() - t0)
                    m_requests.labels(route, status).inc()

                events = _events(r, out, state.setdefault("streams", set()), ended)
                return StreamingResponse(events, media_type="text/event-stream")
            texts: list[str] = []
            deadline = t0 + opts.timeout_s
            try:
                check = time.perf_counter() + DISCONNECT_CHECK_S
                while not r.stopped:
                    now = time.perf_counter()
                    if now >= check:
                        check = now + DISCONNECT_CHECK_S
                        if await request.is_disconnected():  # the client went away: free its row now
                            return reply(route, 499, {"detail": "client closed the connection"})
                    left = deadline - now
                    try:
                        item = await asyncio.wait_for(out.get(), max(min(left, DISCONNECT_CHECK_S), 0.001))
                    except TimeoutError:
                        if left <= DISCONNECT_CHECK_S:
                            raise past_deadline(opts.timeout_s) from None
                        continue
                    if item is None:
                        break
                    if isinstance(item, Exception):
                        raise _HTTPError(500, f"generation failed: {item}")
                    texts.append(r.take(item) or "")
            finally:  # answered, stopped, timed out (504) or cancelled: generate no more for it
                req["cancelled"] = True
            text = "".join(texts) + (r.rest() or "") if svc.tok is not None else None
            return reply(route, 200, r.whole(text))
        except _HTTPError as e:  # OpenAI's error shape (its client reads error.message), and the server's own
            return reply(route, e.status, error_body(e.status, e.detail, openai=True), e.headers)
        finally:
            if timed:
                observe(time.perf_counter() - t0)


async def _events(r: _Reply, out: asyncio.Queue, streams: set, ended):
    """The server-sent events of one streaming request (its queue in ``streams`` while it runs;
    ``ended(status)`` called once as it ends: ``"200"`` with its ``[DONE]`` sent, ``"499"`` when
    its client went away first)."""
    item, first, status = None, True, "499"
    streams.add(out)
    try:
        try:
            while not r.stopped:
                item = await out.get()
                if item is None or isinstance(item, Exception):
                    break
                text = r.take(item)
                # a chunk as soon as there is text, or tokens (completions; the first chat chunk); chat
                # tokens of no text yet go with the next chunk, their logprobs too
                if text or (r.unsent and (not r.chat or first)):
                    yield f"data: {json.dumps(r.chunk(text, first=first))}\n\n"
                    first = False
        finally:  # also when the client disconnects mid-stream: stop generating for it
            r.req["cancelled"] = True
            streams.discard(out)
        failed = isinstance(item, Exception)
        # (the rest before the finish reason: a stop string may be in it; no text without a tokenizer)
        rest = r.rest() if not failed else None if r.text is None else ""
        last = r.chunk(rest, "error" if failed else r.finish_reason(), first=first)
        if failed:  # (the stream has sent 200 already: the reason goes in its last chunk)
            why = str(item) if isinstance(item, ShuttingDown) else f"generation failed: {item}"
            last["error"] = {"message": why, "type": "server_error"}
        yield f"data: {json.dumps(last)}\n\n"
        if r.req["include_usage"]:
            yield f"data: {json.dumps(r.usage_chunk())}\n\n"
        yield "data: [DONE]\n\n"
        status = "200"
    finally:
        ended(status)
