"""LLM decoding: prefill, then a decode step replayed as CUDA graphs per batch bucket, sampling on the GPU.

Per ``generate`` call: the prompts are prefilled, many per forward and packed with no padding
(:mod:`~fullthrottle.workloads.llm.prefill`), into their rows of the KV cache; then every decode
step runs all rows at once, padded to a batch bucket (1, 2, 4, ..., 256), as
one graph replay: model step + sampling (greedy / temperature / top-k / top-p, per row, branch-free,
with each row's own seed) + the stop mask. Nothing in a step waits for the host; the host looks at
the stop mask every ``check_every`` steps.

Graphs are captured largest bucket first into one pool; positions, sampling parameters, seeds and
the stop mask are static device tensors the host fills before replaying.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from ...core import kernels
from ...core.config import LlmSettings, Runtime, default_buckets
from ...core.report import StageStats
from .checks import check_int, check_kv_memory, check_prompt
from .kv_pages import PAGE, PagedKV
from .llama import Llama
from .prefill import Piece, Prefill, plan
from .sampling import GOLDEN, check_sampling, row_seeds, sample, seeded_noise, token_logprobs
from .shapes import kv_buckets

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
    """Batched generation with a static KV cache: prompts prefilled many per forward, packed
    (:class:`~fullthrottle.workloads.llm.prefill.Prefill`), then one decode step per token for
    every row, replayed as the CUDA graph of its batch bucket and attention length.

    Args:
        model: a :class:`~fullthrottle.workloads.llm.llama.Llama` on its device and dtype.
        max_batch: most prompts per call (rounded up to a bucket).
        max_seq_len: prompt + new tokens, per row; the KV cache is allocated for it.
        graphs: capture the decode step (CUDA only; CPU runs eager).
        buckets: decode batch sizes to capture.
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

    Raises:
        ValueError: on :meth:`generate`, a prompt + max_new_tokens longer than ``max_seq_len``, or
            (paged) more than the free pages hold.
        RuntimeError: on :meth:`generate`, a later Generator on the same model took its KV cache.
    """

    def __init__(
        self,
        model: Llama,
        max_batch: int = LlmSettings.max_batch,
        max_seq_len: int = 512,
        graphs: bool = Runtime.graphs,
        buckets: Sequence[int] = DEFAULT_BUCKETS,
        check_every: int = LlmSettings.check_every,
        attn_buckets: Sequence[int] | None = None,
        max_prefill_tokens: int = LlmSettings.max_prefill_tokens,
        prefill_graph_tokens: int = LlmSettings.prefill_graph_tokens,
        logprobs: int = LlmSettings.logprobs,
        kv_pages: int = LlmSettings.kv_pages,
    ):
        self.model = model
        for name, v, lowest in (
            ("max_batch", max_batch, 1),
            ("max_seq_len", max_seq_len, 1),
            ("check_every", check_every, 1),
            ("max_prefill_tokens", max_prefill_tokens, 1),
            ("prefill_graph_tokens", prefill_graph_tokens, 0),
            ("kv_pages", kv_pages, 0),
        ):
            check_int(name, v, lowest)
        #: tokens one prefill forward takes at most; a longer prompt is prefilled in chunks
        self.max_prefill_tokens = max_prefill_tokens
        p = next(model.parameters())
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
        pf_graph_tokens = prefill_graph_tokens if use_graphs and kernels.use_triton(p) else 0
        #: the spare cache row that a prefill graph's padding tokens write into (when there are graphs)
        self.spare_row = self.max_batch
        rows = self.max_batch + bool(pf_graph_tokens)
        #: paged KV memory's free and held pages (None: the static cache)
        self.kv: PagedKV | None = None
        kv_pages = min(kv_pages, rows * -(-max_seq_len // PAGE))  # (more could never be used)
        if kv_pages:
            check_kv_memory(model, (kv_pages + 1) * PAGE, f"{kv_pages} pages of {PAGE} tokens", "take fewer kv_pages")
            model.setup_paged_cache(rows, max_seq_len, kv_pages, owner=self)
            self.kv = PagedKV(model.block_table, kv_pages)
        else:
            hint = "take fewer rows (max_batch), a shorter max_seq_len, or paged KV memory (kv_pages)"
            check_kv_memory(model, rows * max_seq_len, f"{rows} rows x {max_seq_len} positions", hint)
            model.setup_cache(rows, max_seq_len, owner=self)
        B, V = self.max_batch, model.cfg.vocab_size
        # static inputs of the decode step (views [:b] serve every bucket)
        self.tok = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.pos = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.temp = torch.zeros(B, 1, device=dev)
        self.topk = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.topp = torch.ones(B, 1, device=dev)
        self.done = torch.zeros(B, dtype=torch.bool, device=dev)
        self.eos = torch.full((1,), -1, dtype=torch.long, device=dev)
        self.seed = torch.zeros(B, 1, dtype=torch.int32, device=dev)  # each row's sampling seed (seed32)
        self.vocab_mix = torch.arange(V, dtype=torch.int32, device=dev) * GOLDEN  # (see seeded_noise)
        if not 0 <= logprobs <= min(20, V):
            raise ValueError(f"logprobs must be between 0 and {min(20, V)}, got {logprobs}")
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
        nxt = torch.where(self.done[:b], self.eos.clamp_min(0).expand(b), nxt)  # finished rows repeat EOS
        self.done[:b] |= nxt == self.eos
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
            logits = logits[torch.tensor(ends, dtype=torch.long, device=self.device)]
        r = torch.tensor([pieces[j][0] for j in ends], dtype=torch.long, device=self.device)
        n = torch.tensor([len(pieces[j][1]) for j in ends], dtype=torch.long, device=self.device)
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
        eos_id: int | None = None,
        stats: GenerateStats | None = None,
        on_tokens=None,
    ) -> list[list[int]]:
        """Token ids in, new token ids out (one list per prompt, stopped after EOS, which is kept).

        ``temperature``, ``top_k`` and ``top_p`` may be one value or a list with one per prompt.
        ``seed``: the sampling seed of each prompt (a list), or an int (prompt ``i`` gets ``seed + i``),
        or None (drawn from torch's global generator: ``torch.manual_seed`` makes a call repeatable).
        A prompt's sampled tokens depend on its own seed only, not on the other prompts of the call.
        ``on_tokens(chunks)``, if given, is called every ``check_every`` steps with each row's new
        tokens since the last call (streaming; rows past their EOS keep repeating it). If it returns
        True, generation stops there (every caller has gone): the rows end with what they have.

        Raises:
            ValueError: an empty prompt or token ids outside the vocabulary, too many prompts,
                max_new_tokens < 1, or prompt + max_new_tokens > max_seq_len.
        """
        self.check_sampling(temperature, top_k, top_p)
        check_int("max_new_tokens", max_new_tokens, 1)
        n = len(prompts)
        if n == 0 or n > self.max_batch:
            raise ValueError(f"between 1 and {self.max_batch} prompts per call, got {n}")
        for i, p in enumerate(prompts):
            check_prompt(p, self.model.cfg.vocab_size, f"prompt {i}")
            if len(p) + max_new_tokens > self.max_seq_len:
                raise ValueError(
                    f"prompt {i}: {len(p)} tokens + max_new_tokens {max_new_tokens} exceeds "
                    f"max_seq_len {self.max_seq_len} (the static KV cache's length)"
                )
        if self.kv is not None:  # (paged: rows 0..n-1 get their pages for the whole call; the call owns them all)
            self.kv.reset()
            self.kv.reserve_rows([len(p) + max_new_tokens for p in prompts])
        try:
            return self._generate(prompts, max_new_tokens, temperature, top_k, top_p, seed, eos_id, stats, on_tokens)
        finally:
            for i in range(n if self.kv is not None else 0):
                self.kv.release(i)

    def _generate(self, prompts, max_new_tokens, temperature, top_k, top_p, seed, eos_id, stats, on_tokens):
        n = len(prompts)
        seeds = self.row_seeds(seed, n)
        b = next(x for x in self.buckets if x >= n)
        greedy = all(t == 0 for t in (temperature if isinstance(temperature, (list, tuple)) else [temperature]))
        dev = self.device
        st = stats or GenerateStats()
        t0 = time.perf_counter()
        for buf, val in ((self.temp, temperature), (self.topk, top_k), (self.topp, top_p)):
            if isinstance(val, (list, tuple)):  # one value per prompt
                if len(val) != n:
                    raise ValueError(f"{len(val)} sampling values for {n} prompts")
                buf[:n, 0] = torch.tensor(val, dtype=buf.dtype)
            else:
                buf.fill_(val)
        self.seed[:n, 0] = torch.tensor(seeds, dtype=torch.int32)
        self.eos.fill_(-1 if eos_id is None else eos_id)
        self.done.zero_()
        self.done[n:] = True  # padding rows
        self.tok.zero_()
        self.pos.zero_()
        fws = plan([len(p) for p in prompts], self.max_prefill_tokens)  # prompt i into cache row i
        nxt = torch.cat([self._prefill([(i, prompts[i], a, b) for i, a, b in fw]) for fw in fws])
        self.tok[:n, 0] = nxt
        self.done[:n] = nxt == self.eos
        out = torch.empty(b, max_new_tokens, dtype=torch.long, device=dev)
        out[:n, 0] = nxt
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t1 = time.perf_counter()
        st.prefill_s += t1 - t0
        self.stats["prefill"].record(sum(len(p) for p in prompts), t1 - t0, t1 - t0)
        steps, sent = 1, 0
        longest = max(len(p) for p in prompts)
        for t in range(1, max_new_tokens):
            # this step feeds positions up to longest + t - 1: attend to the smallest length above
            kv = next(x for x in self.kv_buckets if x >= longest + t)
            if (b, greedy, kv) in self.graphs:
                out[:, t] = self.graph_set.replay((b, greedy, kv))
            else:
                out[:, t] = self._step(b, greedy, kv)
            steps += 1
            if t % self.check_every == 0:
                if on_tokens is not None:  # streaming: hand over what is new (one host read per chunk)
                    stop = on_tokens(out[:n, sent:steps].tolist())
                    sent = steps
                    if stop is True:
                        break
                if bool(self.done[:n].all()):
                    break
        rows = out[:n, :steps].tolist()
        if on_tokens is not None and sent < steps:
            on_tokens([r[sent:] for r in rows])
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t2 = time.perf_counter()
        st.decode_s += t2 - t1
        result = []
        for r in rows:
            if eos_id is not None and eos_id in r:
                r = r[: r.index(eos_id) + 1]
            result.append(r)
        st.new_tokens += sum(len(r) for r in result)
        self.stats["decode"].record(sum(len(r) for r in result), t2 - t1, t2 - t1)
        return result
