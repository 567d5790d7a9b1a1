"""LLM decoding: prefill, then a decode step replayed as CUDA graphs per batch bucket, sampling on the GPU.

The :class:`Generator` holds the engine: the KV cache (static rows or paged), the decode step for rows
``[:b]`` padded to a batch bucket (1, 2, 4, ..., 256) as one graph replay (model step + sampling:
greedy / temperature / top-k / top-p, per row, branch-free, with each row's own seed + the stop mask;
nothing in a step waits for the host), and the packed prefill forwards
(:mod:`~fullthrottle.workloads.llm.prefill`). :meth:`Generator.generate` runs prompts through the
:class:`~fullthrottle.workloads.llm.scheduler.Scheduler`, the step loop the server uses too.

Graphs are captured largest bucket first into one pool; positions, sampling parameters, seeds and
the stop mask are static device tensors the host fills before replaying.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...core import kernels
from ...core.config import LlmSettings, Runtime, default_buckets
from ...core.report import StageStats
from .checks import MAX_STOP_IDS, as_ids, check_int, check_kv_memory, check_request
from .kv_pages import PAGE, PagedKV
from .kv_pages import kv_dtype as kv_dtype_of
from .llama import Llama
from .prefill import Piece, Prefill
from .sampling import GOLDEN, check_sampling, row_seeds, sample, seeded_noise, token_logprobs
from .shapes import kv_buckets
from .step_records import h2d

DEFAULT_BUCKETS = default_buckets(256)


@dataclass
class GenerateStats:
    """Timing of one call: prefill and decode seconds, new tokens, tokens/s over all rows."""

    prefill_s: float = 0.0
    decode_s: float = 0.0
    new_tokens: int = 0

    @property
    def tokens_per_s(self) -> float:
        return self.new_tokens / self.decode_s if self.decode_s > 0 else 0.0


class Generator:
    """The generation engine: prompts prefilled many per forward, packed
    (:class:`~fullthrottle.workloads.llm.prefill.Prefill`), then one decode step per token for
    every running row, replayed as the CUDA graph of its batch bucket and attention length; its
    rows are handed out by a :class:`~fullthrottle.workloads.llm.scheduler.Scheduler`.

    Args:
        model: a :class:`~fullthrottle.workloads.llm.llama.Llama` on its device and dtype.
        max_batch: KV-cache rows: most sequences decoded at once (rounded up to a bucket).
        max_seq_len: prompt + new tokens, per row; the KV cache is allocated for it. None: the
            model's context (``max_position_embeddings``), at most ``LlmSettings.max_seq_len``.
        graphs: capture the decode step (CUDA only; CPU runs eager).
        buckets: decode batch sizes to capture.
        check_every: decode steps :meth:`generate` runs between reads of the tokens back (the
            Scheduler's ``ahead``).
        attn_buckets: attention lengths (cache slots read) to capture per batch bucket; default
            :func:`kv_buckets` of ``max_seq_len``. The largest is always ``max_seq_len``.
        max_prefill_tokens: tokens one prefill forward takes at most (a longer prompt is prefilled
            in chunks, over several forwards): bounds the activations' memory.
        prefill_graph_tokens: prefill forwards of up to this many tokens replay CUDA graphs, one per
            token bucket (16, 32, 64, ...): short prompts are bound by the host's kernel launches, not
            by the GPU. Their padding tokens write into one spare KV-cache row. 0: prefill eager only
            (and on the CPU, or without Triton).
        logprobs: 0, or how many most likely tokens (up to 20) each step also reports, with the
            chosen token's log-probability (:attr:`lp`, :attr:`lp_ids`, per row; in the graphs).
        kv_pages: 0: the static KV cache, a ``max_seq_len`` row per sequence; N: paged KV memory of N
            pages of :data:`~fullthrottle.workloads.llm.kv_pages.PAGE` tokens shared by all rows
            (:attr:`kv`), each sequence holding the pages its prompt + new tokens need (at most
            as many as every row full would use are allocated).
        kv_dtype: the paged KV memory's dtype: ``"auto"`` (the model's) or ``"fp8"`` (float8 e4m3:
            half the bytes of bf16 per token, so twice the tokens per page pool and half the bytes a
            decode step's attention reads; keys and values lose precision: 3 mantissa bits, saturated
            at 448). ``"fp8"`` needs paged KV memory, and on CUDA a GPU of compute capability 8.9 or
            newer.

    Raises:
        ValueError: on :meth:`generate`, a prompt + max_new_tokens longer than ``max_seq_len``, or
            (paged) more than the free pages hold.
        RuntimeError: on :meth:`generate`, a later Generator on the same model took its KV cache.
    """

    def __init__(
        self,
        model: Llama,
        max_batch: int = LlmSettings.max_batch,
        max_seq_len: int | None = None,
        graphs: bool = Runtime.graphs,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        check_every: int = LlmSettings.check_every,
        attn_buckets: Sequence[int] | None = None,
        max_prefill_tokens: int = LlmSettings.max_prefill_tokens,
        prefill_graph_tokens: int = LlmSettings.prefill_graph_tokens,
        logprobs: int = LlmSettings.logprobs,
        kv_pages: int = LlmSettings.kv_pages,
        kv_dtype: str = LlmSettings.kv_dtype,
    ):
        if not isinstance(model, torch.nn.Module) or not hasattr(model, "cfg"):
            raise TypeError(
                f"model must be a built Llama (fullthrottle.workloads.llm.llama), got {type(model).__name__}"
            )
        self.model = model
        self.scheduler = None  # the Scheduler that owns the engine's state (the newest one built on it)
        self._generating = threading.Lock()  # held by the generate call running (one at a time)
        if max_seq_len is None:
            max_seq_len = min(LlmSettings.max_seq_len, model.cfg.max_position_embeddings)
        for name, v, lowest in (
            ("max_batch", max_batch, 1),
            ("max_seq_len", max_seq_len, 1),
            ("check_every", check_every, 1),
            ("max_prefill_tokens", max_prefill_tokens, 1),
            ("prefill_graph_tokens", prefill_graph_tokens, 0),
            ("kv_pages", kv_pages, 0),
        ):
            check_int(name, v, lowest)
        p = next(model.parameters())
        kv_type = kv_dtype_of(kv_dtype, p.dtype)  # (ValueError: an unknown name)
        if kv_dtype != "auto" and not kv_pages:
            raise ValueError(f"kv_dtype {kv_dtype!r} needs paged KV memory: give kv_pages")
        if kv_type == torch.float8_e4m3fn and p.is_cuda and torch.cuda.get_device_capability(p.device) < (8, 9):
            raise ValueError(f"kv_dtype 'fp8' needs a GPU of compute capability 8.9 or newer; {p.device} is older")
        if not isinstance(logprobs, int) or not 0 <= logprobs <= min(20, model.cfg.vocab_size):
            raise ValueError(
                f"logprobs must be an integer between 0 and {min(20, model.cfg.vocab_size)}, got {logprobs!r}"
            )
        #: tokens one prefill forward takes at most; a longer prompt is prefilled in chunks
        self.max_prefill_tokens = max_prefill_tokens
        self.device = p.device
        bs = sorted(set(buckets))
        top = next((x for x in bs if x >= max_batch), max_batch)  # smallest bucket holding max_batch
        self.buckets = tuple(x for x in bs if x < top) + (top,)
        self.max_batch = self.buckets[-1]
        self.max_seq_len = max_seq_len
        self.check_every = check_every
        #: the stage counters (:class:`~fullthrottle.core.report.StageStats`) of every call so far:
        #: "prefill" (items: prompt tokens) and "decode" (items: generated tokens)
        self.stats = {name: StageStats(name) for name in ("prefill", "decode")}
        if max_seq_len > model.cfg.max_position_embeddings:
            raise ValueError(
                f"max_seq_len {max_seq_len} exceeds the model's context "
                f"(max_position_embeddings {model.cfg.max_position_embeddings})"
            )
        dev = self.device
        use_graphs = graphs and dev.type == "cuda"
        # (prefill graphs need the packed-attention kernel: its reference reads the pieces to the host)
        fits = kernels.prefill_kernel_fits(model.cfg.head_dim, PAGE if kv_pages else None)
        pf_graph_tokens = prefill_graph_tokens if use_graphs and kernels.use_triton(p) and fits else 0
        #: the spare cache row that a prefill graph's padding tokens write into (when there are graphs)
        self.spare_row = self.max_batch
        rows = self.max_batch + bool(pf_graph_tokens)
        #: paged KV memory's free and held pages (None: the static cache)
        self.kv: PagedKV | None = None
        kv_pages = min(kv_pages, rows * -(-max_seq_len // PAGE))  # (more could never be used)
        if kv_pages:
            what = f"{kv_pages} pages of {PAGE} tokens"
            check_kv_memory(model, (kv_pages + 1) * PAGE, what, "take fewer kv_pages", kv_type, max_prefill_tokens)
            model.setup_paged_cache(rows, max_seq_len, kv_pages, owner=self, dtype=kv_type)
            self.kv = PagedKV(model.block_table, kv_pages)
        else:
            hint = "take fewer rows (max_batch), a shorter max_seq_len, or paged KV memory (kv_pages)"
            check_kv_memory(
                model, rows * max_seq_len, f"{rows} rows x {max_seq_len} positions", hint, None, max_prefill_tokens
            )
            model.setup_cache(rows, max_seq_len, owner=self)
        B, V = self.max_batch, model.cfg.vocab_size
        # static inputs of the decode step (views [:b] serve every bucket)
        self.tok = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.temp = torch.zeros(B, 1, device=dev)
        self.topk = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.topp = torch.ones(B, 1, device=dev)
        self.done = torch.zeros(B, dtype=torch.bool, device=dev)
        #: per row, the token ids that end it (-1: none); a finished row repeats the first
        self.eos = torch.full((B, MAX_STOP_IDS), -1, dtype=torch.long, device=dev)
        self.seed = torch.zeros(B, 1, dtype=torch.int32, device=dev)  # each row's sampling seed (seed32)
        self.vocab_mix = torch.arange(V, dtype=torch.int32, device=dev) * GOLDEN  # (see seeded_noise)
        self.logprobs = logprobs
        #: per row, after each step: the chosen token's log-probability, then the top ``logprobs``
        self.lp = torch.zeros(B, 1 + logprobs, device=dev)
        self.lp_ids = torch.zeros(B, logprobs, dtype=torch.long, device=dev)  # their token ids
        self.kv_buckets = (
            tuple(sorted({min(int(x), max_seq_len) for x in attn_buckets} | {max_seq_len}))
            if attn_buckets
            else kv_buckets(max_seq_len)
        )
        # (batch bucket, greedy, kv length) -> graph and its output; greedy graphs skip the sampler
        self.graphs: dict[tuple[int, bool, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.capture_s = 0.0
        #: packed prefill forwards (graphs keyed by token bucket when captured)
        self.prefill = Prefill(model, self.max_batch, pf_graph_tokens, pad_row=self.spare_row)
        if use_graphs:
            self._capture()

    @torch.inference_mode()
    def _step(self, b: int, greedy: bool = False, kv: int | None = None) -> torch.Tensor:
        """One decode step for rows ``[:b]``: next tokens ``(b,)``; advances pos, updates done.

        ``greedy``: every row has temperature 0, so the token is the argmax (no sort, no noise drawn).
        ``kv``: attention reads cache slots ``[0, kv)`` (every row's position must be below it).
        """
        self.model.kv_len = kv or self.model.max_seq_len
        logits = self.model(self.tok[:b], self.pos[:b])[:, -1]  # (b, V)
        if greedy:
            nxt = logits.argmax(-1)
        else:
            noise = seeded_noise(self.seed[:b], self.pos[:b] + 1, self.vocab_mix)  # (the new token's position)
            nxt = sample(logits, self.temp[:b], self.topk[:b], self.topp[:b], noise)
        if self.logprobs:
            self._keep_logprobs(slice(0, b), logits, nxt)
        nxt = torch.where(self.done[:b], self.eos[:b, 0].clamp_min(0), nxt)  # finished rows repeat EOS
        self.done[:b] |= (nxt[:, None] == self.eos[:b]).any(-1)
        self.tok[:b, 0] = nxt
        self.pos[:b] += 1
        return nxt

    @torch.inference_mode()
    def _capture(self) -> None:
        from ...core.graphs import GraphSet

        t0 = time.perf_counter()
        self.graph_set = GraphSet(self.device)
        # every (batch bucket, sampler, attention length), largest first, all in one pool
        keys = [(b, g, kv) for b in reversed(self.buckets) for kv in reversed(self.kv_buckets) for g in (False, True)]
        for key in keys:
            saved = (self.tok.clone(), self.pos.clone(), self.done.clone())  # warm-up steps advance them
            self.graph_set.capture(key, lambda key=key: self._step(*key))
            self.tok.copy_(saved[0])
            self.pos.copy_(saved[1])
            self.done.copy_(saved[2])
        self.graphs = self.graph_set.graphs
        if self.prefill.buckets:
            self.prefill.capture()
        torch.cuda.synchronize(self.device)
        self.capture_s = time.perf_counter() - t0

    @torch.inference_mode()
    def _prefill(self, pieces: Sequence[Piece]) -> torch.Tensor:
        """One packed prefill forward of ``pieces`` (:data:`~fullthrottle.workloads.llm.prefill.Piece`:
        row, context, start, stop; at most one per row, their sampling values already in the rows):
        the first new tokens ``(k,)`` of the k pieces that end their context, in the order given; the
        row of each becomes positioned at its context's length."""
        self.check_cache()
        logits = self.prefill(pieces)  # (len(pieces), V)
        ends = [j for j, (_, ctx, _, stop) in enumerate(pieces) if stop == len(ctx)]
        if len(ends) < len(pieces):
            logits = logits[h2d(ends, self.device)]
        r = h2d([pieces[j][0] for j in ends], self.device)
        n = h2d([len(pieces[j][1]) for j in ends], self.device)
        return self._first_tokens(r, n, logits)

    def _first_tokens(self, r: torch.Tensor, n: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
        """Rows ``r`` ``(b,)`` prefilled to lengths ``n`` ``(b,)``: their first new tokens ``(b,)``,
        sampled from ``logits`` ``(b, V)`` with each row's values and seed (and their logprobs kept);
        each row's position becomes its length."""
        noise = seeded_noise(self.seed[r], n[:, None], self.vocab_mix)  # the first new token's position
        first = sample(logits, self.temp[r], self.topk[r], self.topp[r], noise)
        if self.logprobs:
            self._keep_logprobs(r, logits, first)
        self.pos[r, 0] = n
        return first

    def _keep_logprobs(self, rows, logits: torch.Tensor, chosen: torch.Tensor) -> None:
        lp, top, ids = token_logprobs(logits, chosen, self.logprobs)
        self.lp[rows, 0], self.lp[rows, 1:], self.lp_ids[rows] = lp, top, ids

    def check_cache(self) -> None:
        """Raises RuntimeError when a later Generator on the same model has replaced its KV cache
        (one model, one Generator at a time: the cache and the graphs live on the model)."""
        if self.model.cache_owner is not self:
            raise RuntimeError(
                "another Generator was built on this model since, and took its KV cache: "
                "use that one (or build this one again)"
            )

    row_seeds = staticmethod(row_seeds)
    check_sampling = staticmethod(check_sampling)

    @torch.inference_mode()
    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        max_new_tokens: int = 64,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | Sequence[int | None] | None = None,
        eos_id: int | Sequence[int] | None = None,
        stats: GenerateStats | None = None,
        on_tokens=None,
    ) -> list[list[int]]:
        """Token ids in, new token ids out (one list per prompt, stopped after EOS, which is kept; ``eos_id``:
        one token id or several, any of which ends a prompt; None, the default: each prompt runs to
        ``max_new_tokens``; the model's own is ``model.cfg.eos_token_id``), through
        the :class:`~fullthrottle.workloads.llm.scheduler.Scheduler` (the server's engine) with up to
        ``check_every`` decode steps per read back: more prompts than ``max_batch`` (or, paged, than
        the KV pages hold at once) join as rows free up.

        ``temperature``, ``top_k`` and ``top_p`` may be one value or a list with one per prompt.
        ``seed``: the sampling seed of each prompt (a list), or an int (prompt ``i`` gets ``seed + i``),
        or None (drawn from torch's global generator: ``torch.manual_seed`` makes a call repeatable).
        A prompt's sampled tokens depend on its own seed only, not on the other prompts of the call.
        ``on_tokens(chunks)``, if given, is called after each read back with every prompt's new tokens
        since the last call (an empty list for one with none; streaming). If it returns True,
        generation stops there (every caller has gone): the prompts end with what they have.

        A prompt is a list of ints, or a 1-D integer array or tensor (what tokenizers return).

        Raises:
            ValueError: no prompt, a prompt that is not a list of token ids (one prompt alone is
                ``[ids]``), an empty prompt or token ids outside the vocabulary, max_new_tokens
                < 1, prompt + max_new_tokens > max_seq_len (or, paged, over all the KV pages).
            RuntimeError: a later Generator on the same model took its KV cache, or a call is already
                running on this one (``generate`` from inside ``on_tokens``).
        """
        from .scheduler import Scheduler

        self.check_sampling(temperature, top_k, top_p)
        if getattr(prompts, "ndim", None) == 1:  # (one flat array or tensor of ids)
            raise ValueError("prompts is one flat sequence of token ids: pass a list of prompts ([ids])")
        prompts = list(prompts)  # (a generator read once; a 2-D array's rows)
        n = len(prompts)
        if n == 0:
            raise ValueError("no prompt given")
        per = {}
        for name, val in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p)):
            if isinstance(val, (list, tuple)) and len(val) != n:
                raise ValueError(f"{len(val)} sampling values for {n} prompts")
            per[name] = list(val) if isinstance(val, (list, tuple)) else [val] * n
        seeds = self.row_seeds(seed, n)
        prompts = [as_ids(p, f"prompt {i}") for i, p in enumerate(prompts)]
        for i, p in enumerate(prompts):  # (all checked before the Scheduler takes the engine)
            check_request(self, p, max_new_tokens, f"prompt {i}")
        self.check_cache()
        # (from inside on_tokens, or from another thread: a new call would take the running call's rows)
        if not self._generating.acquire(blocking=False):
            raise RuntimeError("this Generator is inside a generate call: one call at a time")
        try:
            st = stats or GenerateStats()
            busy0 = {k: v.busy_s for k, v in self.stats.items()}
            sched = Scheduler(self, eos_id=eos_id, ahead=self.check_every)
            reqs = [
                sched.submit(p, max_new_tokens, per["temperature"][i], per["top_k"][i], per["top_p"][i], seeds[i])
                for i, p in enumerate(prompts)
            ]
            sent = [0] * n
            while sched.busy:
                sched.step()
                if on_tokens is not None and any(len(r.tokens) > k for r, k in zip(reqs, sent)):
                    stop = on_tokens([r.tokens[k:] for r, k in zip(reqs, sent)])
                    sent = [len(r.tokens) for r in reqs]
                    if stop is True:
                        for r in reqs:
                            sched.cancel(r)
                        break
            sched.clock.settle()
        finally:
            self._generating.release()
        # (the device's time of each stage's launches: StageClock)
        st.prefill_s += self.stats["prefill"].busy_s - busy0["prefill"]
        st.decode_s += self.stats["decode"].busy_s - busy0["decode"]
        st.new_tokens += sum(len(r.tokens) for r in reqs)
        return [r.tokens for r in reqs]
