"""LLM completions as a :class:`~fullthrottle.core.workload.Workload` (``fullthrottle run``, Ray,
``serve --workload``), and the request checks it shares with the server's ``POST /v1/completions``
(:func:`completion_request`). Non-streaming: one answer per request, in OpenAI's completions shape.
Requests batched together run through the server's continuous-batching
:class:`~fullthrottle.workloads.llm.scheduler.Scheduler`: each leaves at its own end, with its own
sampling values and seed.
"""

from __future__ import annotations

from ...core import env
from ...core.config import LlmSettings
from ...core.workload import Workload
from .checks import check_prompt, serving_context, stop_ids
from .text import MAX_STOPS, LlmText, TextStream, valid_unicode

#: OpenAI options this server does not implement: a request setting one to anything but its
#: default (the value here) is refused with 400, rather than answered as if it had been applied
UNSUPPORTED = {
    "echo": False,
    "best_of": 1,
    "suffix": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "logit_bias": None,
    "tools": None,
    "tool_choice": None,
    "response_format": None,
    "repetition_penalty": 1.0,  # (vLLM's sampling extensions)
    "min_tokens": 0,
    "min_p": 0.0,
    "typical_p": 1.0,
    "length_penalty": 1.0,
    "use_beam_search": False,
    "include_stop_str_in_output": False,
    "prompt_logprobs": None,
    "guided_json": None,
    "guided_regex": None,
    "guided_choice": None,
    "guided_grammar": None,
}
#: characters of text per token of context a text prompt may have before it is refused untokenized
#: (tokenizing a huge text only to refuse it would hold the server up)
MAX_CHARS_PER_TOKEN = 64


def _tokens(n: int) -> str:
    return f"{n} token{'s' * (n != 1)}"


def _get(p: dict, key: str, default):
    """``p[key]``, or ``default`` when it is absent or null (as OpenAI's API reads null)."""
    v = p.get(key)
    return default if v is None else v


def _number(p: dict, key: str, default: float) -> float:
    v = _get(p, key, default)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"{key} must be a number")
    try:
        return float(v)
    except OverflowError:
        raise ValueError(f"{key} is out of range") from None


def _integer(p: dict, key: str, default: int) -> int:
    v = _get(p, key, default)
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{key} must be an integer")
    return v


def _text_ids(tok, text: str, gen, special: bool, field: str = "prompt") -> list[int]:
    # (field: what the error names; chat's prompt is made from its messages)
    what = "prompt" if field == "prompt" else f"{field} make a prompt"
    if len(text) > MAX_CHARS_PER_TOKEN * gen.max_seq_len:
        raise ValueError(f"{what} of {len(text)} characters: far more than the context of {gen.max_seq_len} tokens")
    return tok.encode(text, special=special)


def completion_request(p: dict, gen, tok) -> dict:
    """A completions body checked against the generator ``gen`` and :class:`~.text.LlmText` ``tok``
    (or None): ``{"ids", "max_tokens", "temperature", "top_k", "top_p", "seed", "stop_ids", "stop",
    "include_usage", "logprobs"}`` (``logprobs``: None, or how many top tokens to report;
    ``stop_ids``: the token ids that end it: the model's end-of-sequence ids, unless ``ignore_eos``,
    and the body's ``stop_token_ids``, as vLLM reads them).

    Raises:
        ValueError: the reason, as the client should read it (the server: 400).
    """
    prompt = p.get("prompt")
    if isinstance(prompt, str):
        if tok is None:
            raise ValueError("this model has no tokenizer: send prompt as a list of token ids")
        valid_unicode("prompt", prompt)
        ids = _text_ids(tok, prompt, gen, special=True)
        if not ids:
            raise ValueError("prompt is empty (no tokens)")
    elif isinstance(prompt, list) and prompt and all(isinstance(i, int) and not isinstance(i, bool) for i in prompt):
        ids = prompt
    elif isinstance(prompt, list) and prompt and all(isinstance(x, (str, list)) for x in prompt):
        raise ValueError("prompt must be one prompt (a string or a list of token ids), not a list of them")
    else:
        raise ValueError("prompt must be a string or a non-empty list of token ids")
    lp = p.get("logprobs")  # (completions: how many top tokens; 0: the chosen token's only)
    if lp is not None and (isinstance(lp, bool) or not isinstance(lp, int)):
        raise ValueError("logprobs must be an integer (how many most likely tokens per position)")
    req = _request(p, gen, ids, _integer(p, "max_tokens", 16), lp)
    if req["stop"] and tok is None:  # (a stop string is matched in the text: ids alone have none)
        raise ValueError("stop strings need the model's tokenizer, and this model has none (token ids only)")
    return req


def chat_request(p: dict, gen, tok) -> dict:
    """A chat completions body (``messages``): the prompt is the model's chat template applied to
    them (:meth:`~.text.LlmText.chat_prompt`), and the reply may take the rest of the context unless
    ``max_completion_tokens`` (or ``max_tokens``) says less; otherwise as :func:`completion_request`.

    Raises:
        ValueError: the reason (no tokenizer or chat template, malformed messages, limits).
    """
    if tok is None:
        raise ValueError("this model has no tokenizer.json: chat completions need one")
    ids = _text_ids(
        tok, tok.chat_prompt(p.get("messages")), gen, special=False, field="messages"
    )  # (BOS: the template's)
    if not ids:
        raise ValueError("the chat template made an empty prompt")
    key = "max_completion_tokens" if p.get("max_completion_tokens") is not None else "max_tokens"
    on = _get(p, "logprobs", False)  # (chat: a boolean, and top_logprobs the count)
    if not isinstance(on, bool):
        raise ValueError("logprobs must be true or false")
    top = _integer(p, "top_logprobs", 0)
    if top and not on:
        raise ValueError("top_logprobs needs logprobs: true")
    room = gen.max_seq_len if gen.kv is None else min(gen.max_seq_len, gen.kv.num_pages * gen.kv.page)
    if len(ids) >= room:
        raise ValueError(
            f"messages ({len(ids)} tokens in the chat template) leave no room for a reply in the context of {room}"
        )
    return _request(
        p, gen, ids, _integer(p, key, room - len(ids)), top if on else None, key, "top_logprobs", "messages"
    )


def _request(
    p: dict,
    gen,
    ids: list[int],
    max_tokens: int,
    logprobs: int | None = None,
    key="max_tokens",
    lp_key="logprobs",
    prompt_key="prompt",
) -> dict:
    """The checked request (``key``: the field that gave ``max_tokens``; ``lp_key``: the one that gave
    ``logprobs``, the count of top tokens per position; ``prompt_key``: the one that gave ``ids``;
    each named in its errors)."""
    vocab = gen.model.cfg.vocab_size
    if max_tokens < 1:
        raise ValueError(f"{key} must be a positive integer")
    check_prompt(ids, vocab)
    said = f"{key} ({max_tokens})" if p.get(key) is not None else f"{key} (not given: its default, {max_tokens})"
    if len(ids) + max_tokens > gen.max_seq_len:
        raise ValueError(f"{prompt_key} ({_tokens(len(ids))}) + {said} exceeds the context of {gen.max_seq_len}")
    if gen.kv is not None:
        gen.kv.check_pool(f"{prompt_key} ({_tokens(len(ids))}) + {said}", len(ids) + max_tokens)
    if not isinstance(_get(p, "stream", False), bool):
        raise ValueError("stream must be true or false")
    opts = _get(p, "stream_options", {})
    if not isinstance(opts, dict) or not isinstance(_get(opts, "include_usage", False), bool):
        raise ValueError("stream_options must be an object with a boolean include_usage")
    if opts and not _get(p, "stream", False):  # (as OpenAI's API answers it)
        raise ValueError("stream_options is for streamed requests only: set stream to true, or leave it out")
    seed = p.get("seed")
    if seed is not None and (not isinstance(seed, int) or isinstance(seed, bool)):
        raise ValueError("seed must be an integer")
    if not isinstance(_get(p, "user", ""), str):  # (OpenAI's end-user id: taken, not used)
        raise ValueError("user must be a string")
    if _integer(p, "n", 1) != 1:
        raise ValueError("n must be 1 (one choice per request)")
    if logprobs is not None and not gen.logprobs:
        raise ValueError("logprobs are off on this engine (serve turns them on with --llm-logprobs N)")
    if logprobs is not None and not 0 <= logprobs <= gen.logprobs:
        raise ValueError(f"{lp_key} (the top tokens per position) must be between 0 and {gen.logprobs}")
    for key, default in UNSUPPORTED.items():
        v = _get(p, key, default)
        if key == "response_format" and v == {"type": "text"}:  # (OpenAI's default, as its clients send it)
            continue
        if (v != default or isinstance(v, bool) is not isinstance(default, bool)) and v not in ([], {}):
            raise ValueError(f"{key} is not supported")  # (best_of true is no 1)
    stop = _get(p, "stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not (isinstance(stop, list) and len(stop) <= MAX_STOPS and all(isinstance(x, str) and x for x in stop)):
        raise ValueError(f"stop must be a non-empty string or a list of at most {MAX_STOPS} of them")
    temperature, top_p, top_k = _number(p, "temperature", 1.0), _number(p, "top_p", 1.0), _integer(p, "top_k", 0)
    if isinstance(top_k, int) and top_k < 0:  # (-1: off, as vLLM's clients send it)
        if top_k != -1:
            raise ValueError(f"top_k must be an integer >= 0, or -1 (0 and -1: off), got {top_k}")
        top_k = 0
    gen.check_sampling(temperature, top_k, top_p)
    ignore_eos = _get(p, "ignore_eos", False)
    extra = _get(p, "stop_token_ids", [])
    if not isinstance(ignore_eos, bool):
        raise ValueError("ignore_eos must be true or false")
    if not isinstance(extra, list):
        raise ValueError("stop_token_ids must be a list of token ids")
    eos = () if ignore_eos else stop_ids(gen.model.cfg.eos_token_id, vocab, "the model's eos_token_id")
    ends = stop_ids([*eos, *extra], vocab, "stop_token_ids")
    return {
        "ids": ids,
        "max_tokens": max_tokens,
        "temperature": temperature,
        "top_p": top_p,
        "top_k": top_k,
        "seed": seed,
        "stop_ids": ends,
        "stop": stop,
        "include_usage": _get(opts, "include_usage", False),
        "logprobs": logprobs,
    }


class Completions(Workload):
    """``{"prompt": "text" | [ids], "max_tokens", "temperature", "top_k", "top_p", "seed"}`` ->
    ``{"object": "text_completion", "choices": [{"index": 0, "text", "token_ids", "finish_reason"}],
    "usage"}``.

    Args:
        model_dir: a Hugging Face Llama folder (config.json, safetensors, tokenizer.json for text);
            ``None``: ``$FULLTHROTTLE_LLM_MODEL``.
        max_batch: requests per generate call (the KV cache's rows); max_seq_len: its length
            (default: the model's context, at most 4096).
        model: a :class:`~fullthrottle.workloads.llm.llama.Llama` already built (tests), instead of a folder.

    Raises (in :meth:`setup`):
        ValueError: no folder given or in the environment, or one that does not load.
    """

    name = "completions_offline"
    max_wait_ms = 5.0
    max_items_per_request = 1

    def __init__(
        self,
        model_dir: str | None = None,
        max_batch: int = LlmSettings.max_batch,
        max_seq_len: int | None = None,
        model=None,
    ):
        self.model_dir = model_dir or env.get(env.LLM_MODEL) or None
        self.max_batch, self.max_seq_len, self.model = max_batch, max_seq_len, model
        self.gen = self.tok = None
        self.stats = {}

    def setup(self, device: str) -> None:
        import torch

        from .generate import Generator
        from .llama import load_hf

        model = self.model
        if model is None:
            if not self.model_dir:
                raise ValueError(f"no model: pass model_dir or set {env.LLM_MODEL} to a Llama folder")
            dtype = torch.bfloat16 if str(device).startswith("cuda") else torch.float32
            model = load_hf(self.model_dir, device, dtype)
            self.tok = LlmText.from_folder(self.model_dir)
        seq = self.max_seq_len or serving_context(model.cfg)
        self.gen = Generator(model, self.max_batch, seq)
        self.max_batch = self.gen.max_batch
        self.stats = self.gen.stats  # prefill, decode

    def decode_request(self, body: dict) -> list:
        return [completion_request(body, self.gen, self.tok)]

    def predict(self, items: list) -> list:
        from ...core.workload import ItemError
        from .scheduler import Scheduler

        sched = Scheduler(self.gen)  # (each request ends at its own stop_ids)
        recs: list = []
        for r in items:
            try:
                recs.append(
                    sched.submit(
                        r["ids"],
                        r["max_tokens"],
                        r["temperature"],
                        r["top_k"],
                        r["top_p"],
                        r["seed"],
                        stop_ids=r["stop_ids"],
                    )
                )
            except ValueError as e:  # (completion_request checks first: a caller of predict's own)
                recs.append(ItemError(str(e)))
        while sched.busy:
            sched.step()
        out = []
        for r, rec in zip(items, recs):
            if isinstance(rec, ItemError):
                out.append(rec)
                continue
            t = rec.tokens
            reason = "stop" if t and t[-1] in r["stop_ids"] else "length"
            out.append({"prompt_tokens": len(r["ids"]), "token_ids": t, "finish_reason": reason, "stop": r["stop"]})
        return out

    def encode_response(self, outputs: list) -> dict:
        (o,) = outputs
        text, reason = None, o["finish_reason"]
        if self.tok is not None:  # the text, cut before the first stop string
            ts = TextStream(self.tok, o["stop"])
            text = ts.push(o["token_ids"]) + ts.flush()
            reason = "stop" if ts.stopped else reason
        n, k = o["prompt_tokens"], len(o["token_ids"])
        return {
            "object": "text_completion",
            "choices": [{"index": 0, "text": text, "token_ids": o["token_ids"], "finish_reason": reason}],
            "usage": {"prompt_tokens": n, "completion_tokens": k, "total_tokens": n + k},
        }
