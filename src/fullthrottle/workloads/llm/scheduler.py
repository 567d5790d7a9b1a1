"""Continuous batching on the :class:`~fullthrottle.workloads.llm.generate.Generator`'s static KV cache:
a step loop, as vLLM's and SGLang's schedulers have, in which requests join at the next step and
leave when done, instead of a batch running until its longest request ends.

Each running request holds one row of the cache from its prefill to its last token. A step
(:meth:`Scheduler.step`) first admits waiting requests into free rows, oldest first, up to the
Generator's ``max_prefill_tokens`` (their prompts prefilled together, right-padded to the longest:
:meth:`~fullthrottle.workloads.llm.llama.Llama.prefill`; not yet chunked), then decodes one token for every running
request as one replay of the decode graph of the batch bucket holding the highest row in use and
of the attention length holding the longest sequence (the Generator's graphs; eager without them).
Rows between running ones that are free ride along masked (their position held at 0, their token
discarded). Tokens are read back once per step.

Each request samples with its own seed (:func:`~fullthrottle.workloads.llm.generate.seeded_noise`): its
tokens depend on its prompt, sampling values and seed, not on which requests run beside it.

Not yet (issue 14): chunked prefill, variable-length attention (no padding), paged KV memory.
"""

from __future__ import annotations

import collections
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from ...core.batch import OpenBatch, bucket_for


@dataclass(eq=False)  # (compared and hashed by identity: a request is its own key)
class Request:
    """One request in the scheduler: its prompt, limits and sampling values, and the tokens so far."""

    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0  # its sampling seed (seed32)
    tokens: list[int] = field(default_factory=list)
    row: int = -1  # its KV-cache row while it runs
    done: bool = False
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None  # when its first token was made (time to first token)


class Scheduler:
    """Requests in, tokens out, continuously: :meth:`submit` queues a request, :meth:`step` runs one
    step, :meth:`run` steps until every request given is done.

    Args:
        gen: the Generator whose cache rows, graphs and sampler the steps use (``gen.max_batch``
            requests run at once; more wait for a free row).
        eos_id: the token that ends a request (kept as its last token), or None.

    The scheduler owns the Generator's state while it runs: do not call ``gen.generate`` in between.

    Raises:
        ValueError (:meth:`submit`): an empty prompt, or prompt + max_new_tokens over the cache length.
    """

    def __init__(self, gen, eos_id: int | None = None):
        self.gen, self.eos_id = gen, eos_id
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: dict[int, Request] = {}  # row -> request
        self.free = list(range(gen.max_batch))
        self.steps = 0
        gen.eos.fill_(-1 if eos_id is None else eos_id)
        gen.done.fill_(True)  # rows not running
        gen.pos.zero_()

    def submit(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
    ) -> Request:
        """Queue one request; it joins at the next step with a free row. Returns its record, whose
        ``tokens`` grow as it runs and whose ``done`` turns True at its end. ``seed``: its sampling
        seed (None: one drawn from torch's global generator)."""
        self.gen.check_sampling(temperature, top_k, top_p)
        if not prompt:
            raise ValueError("empty prompt")
        if max_new_tokens < 1 or len(prompt) + max_new_tokens > self.gen.max_seq_len:
            raise ValueError(
                f"{len(prompt)} prompt tokens + max_new_tokens {max_new_tokens} must fit the KV cache's "
                f"{self.gen.max_seq_len} (and max_new_tokens be >= 1)"
            )
        (seed,) = self.gen.row_seeds(seed, 1)
        s = Request(list(prompt), max_new_tokens, float(temperature), int(top_k), float(top_p), seed)
        self.waiting.append(s)
        return s

    def _finish(self, s: Request, tok: int) -> bool:
        s.tokens.append(tok)
        if (self.eos_id is not None and tok == self.eos_id) or len(s.tokens) >= s.max_new_tokens:
            s.done = True
            del self.running[s.row]
            self.free.append(s.row)
            self.gen.done[s.row] = True
        return s.done

    def cancel(self, s: Request) -> None:
        """End ``s`` now (its client went away): out of the queue, or its row freed at once."""
        if s.done:
            return
        s.done = True
        if s.row in self.running and self.running[s.row] is s:
            del self.running[s.row]
            self.free.append(s.row)
            self.gen.done[s.row] = True
        else:
            try:
                self.waiting.remove(s)
            except ValueError:
                pass

    @torch.inference_mode()
    def _admit(self) -> list[Request]:
        """Waiting requests into free rows, oldest first, as many as the rows and the prefill token
        budget allow (the oldest always), all prefilled together."""
        g, finished = self.gen, []
        if not (self.waiting and self.free):
            return finished
        t0 = time.perf_counter()
        batch = OpenBatch(len(self.free), g.max_prefill_tokens)
        while self.waiting and batch.fits(tokens=len(self.waiting[0].prompt)):
            s = self.waiting.popleft()
            batch.add(s, tokens=len(s.prompt))
        admitted = batch.take()
        self.free.sort()
        for s in admitted:  # the lowest free rows: the decode bucket stays small
            s.row = row = self.free.pop(0)
            g.temp[row, 0], g.topk[row, 0], g.topp[row, 0], g.seed[row, 0] = s.temperature, s.top_k, s.top_p, s.seed
        rows = [s.row for s in admitted]
        first = g._prefill_rows(rows, [s.prompt for s in admitted])
        g.tok[rows, 0] = first
        g.done[rows] = False
        now = time.perf_counter()
        for s, tok in zip(admitted, first.tolist()):
            s.t_first = now
            self.running[s.row] = s
            if self._finish(s, tok):
                finished.append(s)
        dt = time.perf_counter() - t0  # (the Generator's stage counters: what reports and /metrics show)
        g.stats["prefill"].record(sum(len(s.prompt) for s in admitted), dt, dt)
        return finished

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Admit what fits, then decode one token for every running request. Returns the requests
        that ended in this step."""
        finished = self._admit()
        if not self.running:
            return finished
        g, t0 = self.gen, time.perf_counter()
        top = max(self.running) + 1
        b = bucket_for(top, g.buckets)
        idle = [r for r in range(b) if r not in self.running]
        if idle:  # free rows in the bucket ride along at position 0 (their own row's slot 0)
            g.pos[idle] = 0
        longest = max(len(s.prompt) + len(s.tokens) for s in self.running.values())
        kv = next(x for x in g.kv_buckets if x >= longest)
        greedy = all(s.temperature == 0 for s in self.running.values())
        if (b, greedy, kv) in g.graphs:
            nxt = g.graph_set.replay((b, greedy, kv))
        else:
            nxt = g._step(b, greedy, kv)
        toks = nxt.tolist()  # one read back per step
        self.steps += 1
        dt = time.perf_counter() - t0
        g.stats["decode"].record(len(self.running), dt, dt)
        for row, s in list(self.running.items()):
            if self._finish(s, toks[row]):
                finished.append(s)
        return finished

    def run(self, requests: Sequence[dict]) -> list[list[int]]:
        """Every request (``{"prompt", "max_new_tokens", "temperature", "top_k", "top_p", "seed"}``) to its
        end, joining as rows free up; each request's new tokens, in the order given."""
        seqs = [self.submit(**r) for r in requests]
        while self.waiting or self.running:
            self.step()
        return [s.tokens for s in seqs]
