"""Continuous batching on the :class:`~fullthrottle.workloads.llm.generate.Generator`'s static KV cache:
a step loop, as vLLM's and SGLang's schedulers have, in which requests join at the next step and
leave when done, instead of a batch running until its longest request ends.

Each running request holds one row of the cache from its prefill to its last token. A step
(:meth:`Scheduler.step`) first does at most the Generator's ``max_prefill_tokens`` of prefill work:
the next chunk of a prompt too long for one step (chunked prefill: it goes on over several steps,
in its own row, while the others decode), then waiting requests into free rows, oldest first, all
in one forward, packed with no padding (variable-length attention:
:mod:`~fullthrottle.workloads.llm.prefill`); then it decodes one token for every running
request as one replay of the decode graph of the batch bucket holding the highest row in use and
of the attention length holding the longest sequence (the Generator's graphs; eager without them).
Rows between running ones that are free ride along masked (their position held at 0, their token
discarded). Tokens are read back once per step; with ``ahead`` > 1, a step in which no request waits
for admission runs up to ``ahead`` decode replays back to back before that read (as vLLM's multi-step
scheduling), so that the host's work between tokens does not leave the GPU idle.

Each request samples with its own seed (:func:`~fullthrottle.workloads.llm.sampling.seeded_noise`): its
tokens depend on its prompt, sampling values and seed, not on which requests run beside it.

With paged KV memory (the Generator's ``kv_pages``) a request holds the pages of the tokens it has:
it is admitted when the pages of its prompt (and one page to spare for each running request) are
free, and takes a page more as its tokens cross into one. When none is free, the request admitted
last is preempted, as vLLM does: its pages are given back and it waits first in line, to be prefilled
again, prompt and tokens so far, and go on (recomputation; its seeded tokens do not change, since each
token's noise depends on the seed and the position only).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from ...core.batch import OpenBatch, bucket_for
from .checks import MAX_STOP_IDS, check_int, check_request
from .checks import stop_ids as check_stop_ids


@dataclass(eq=False)  # (compared and hashed by identity: a request is its own key)
class Request:
    """One request in the scheduler: its prompt, limits and sampling values, and the tokens so far."""

    prompt: list[int]
    max_new_tokens: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int = 0  # its sampling seed (seed32)
    logprobs: int | None = None  # None: none; k: each token's log-probability and the top k
    stop: tuple[int, ...] = ()  # the token ids that end it (kept as its last token)
    #: with ``logprobs``: per token, (its log-probability, the top k ids, their log-probabilities)
    lps: list[tuple[float, list[int], list[float]]] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    row: int = -1  # its KV-cache row while it runs
    prefilled: int = 0  # prompt tokens in the cache so far
    done: bool = False
    t_submit: float = field(default_factory=time.perf_counter)
    t_first: float | None = None  # when its first token was made (time to first token)
    admitted: int = 0  # the order of its (latest) admission: the last admitted is preempted first

    def context(self) -> list[int]:
        """What its prefill takes: the prompt, and the tokens made before a preemption."""
        return self.prompt + self.tokens if self.tokens else self.prompt


class Scheduler:
    """Requests in, tokens out, continuously: :meth:`submit` queues a request, :meth:`step` runs one
    step, :meth:`run` steps until every request given is done.

    Args:
        gen: the Generator whose cache rows, graphs and sampler the steps use (``gen.max_batch``
            requests run at once; more wait for a free row).
        eos_id: the token that ends a request (kept as its last token), several (any one ends it), or
            None: what a request ends at unless it names its own (:meth:`submit`'s ``stop_ids``).
        ahead: decode steps a :meth:`step` may run before reading the tokens back, when no request waits
            for admission, none is mid-prefill and none asks for logprobs (each request still stops at
            its own end: rows past their EOS are masked). 1: a read back per token, for the least
            delay to the requests that join; the Generator's ``check_every`` for offline work.
        on_first: called with no arguments in a :meth:`step` whose prefill made first tokens, after
            they are in their requests' ``tokens`` and before the step's decode: a server sends them
            then, so a request's time to first token does not include a decode step.

    The newest Scheduler on a Generator owns its state: the steps of an older one raise RuntimeError
    (as do ``gen.generate`` calls' steps after it: one engine, one step loop at a time).

    Raises:
        ValueError: ``eos_id`` not None or token ids of the vocabulary (at most
            :data:`~fullthrottle.workloads.llm.checks.MAX_STOP_IDS`), ``ahead`` not an integer >= 1.
        ValueError (:meth:`submit`): an empty prompt, token ids outside the vocabulary, max_new_tokens
            not an integer >= 1, or prompt + max_new_tokens over the cache length (or, paged, over all
            the KV pages there are).
    """

    def __init__(
        self,
        gen,
        eos_id: int | Sequence[int] | None = None,
        ahead: int = 1,
        on_first: Callable[[], None] | None = None,
    ):
        check_int("ahead", ahead, 1)
        self.eos_ids = check_stop_ids(eos_id, gen.model.cfg.vocab_size, "eos_id")
        self.gen, self.ahead, self.on_first = gen, ahead, on_first
        gen.scheduler = self  # (the engine's state is this one's: an older Scheduler's steps now raise)
        self.waiting: collections.deque[Request] = collections.deque()
        self.running: dict[int, Request] = {}  # row -> request
        self.free = list(range(gen.max_batch))
        self.prefilling: Request | None = None  # the prompt being prefilled in chunks, in its row
        self.steps = 0
        self.preemptions = 0  # requests preempted for KV pages
        self._admissions = 0
        if gen.kv is not None:  # (pages a previous owner left held, if it failed mid-step)
            gen.kv.reset()
        gen.eos.fill_(-1)
        gen.done.fill_(True)  # rows not running
        gen.pos.zero_()

    @property
    def busy(self) -> bool:
        """Whether any request is waiting, being prefilled or running."""
        return bool(self.waiting or self.running or self.prefilling)

    def submit(
        self,
        prompt: Sequence[int],
        max_new_tokens: int,
        temperature: float = 0.0,
        top_k: int = 0,
        top_p: float = 1.0,
        seed: int | None = None,
        logprobs: int | None = None,
        stop_ids: Sequence[int] | None = None,
    ) -> Request:
        """Queue one request; it joins at the next step with a free row. Returns its record, whose
        ``tokens`` grow as it runs and whose ``done`` turns True at its end. ``seed``: its sampling
        seed (None: one drawn from torch's global generator). ``logprobs``: report each token's
        log-probability and the top ``logprobs`` (``lps``; up to the Generator's ``logprobs``).
        ``stop_ids``: the token ids that end this request (None: the Scheduler's ``eos_id``)."""
        self.gen.check_sampling(temperature, top_k, top_p)
        if logprobs is not None and not 0 <= logprobs <= self.gen.logprobs:
            raise ValueError(
                f"logprobs must be between 0 and {self.gen.logprobs}"
                + (" (this engine reports none: build its Generator with logprobs=N)" if not self.gen.logprobs else "")
            )
        check_request(self.gen, prompt, max_new_tokens)
        stop = self.eos_ids if stop_ids is None else check_stop_ids(stop_ids, self.gen.model.cfg.vocab_size)
        (seed,) = self.gen.row_seeds(seed, 1)
        s = Request(
            list(prompt), max_new_tokens, float(temperature), int(top_k), float(top_p), seed, logprobs, stop=stop
        )
        self.waiting.append(s)
        return s

    def _finish(self, s: Request, tok: int) -> bool:
        s.tokens.append(tok)
        if tok in s.stop or len(s.tokens) >= s.max_new_tokens:
            s.done = True
            del self.running[s.row]
            self._free_row(s.row)
            self.gen.done[s.row] = True
        return s.done

    def _free_row(self, row: int) -> None:
        self.free.append(row)
        if self.gen.kv is not None:
            self.gen.kv.release(row)

    def _take_row(self, s: Request) -> None:
        """The lowest free row for ``s`` (the decode bucket stays small), its pages, its sampling values."""
        self.free.sort()
        s.row = self.free.pop(0)
        if self.gen.kv is not None:
            self.gen.kv.reserve(s.row, len(s.context()) + 1)
        self._admissions += 1
        s.admitted = self._admissions
        self._set_row(s)

    def _pages(self, s: Request) -> int:
        """The KV pages ``s`` takes when admitted: its context and the first new token (0 without paging)."""
        return 0 if self.gen.kv is None else self.gen.kv.pages_for(len(s.context()) + 1)

    def _fits(self, s: Request, pages_taken: int = 0) -> bool:
        """Whether the KV pages ``s`` needs are free, beside ``pages_taken`` planned and a page to spare for
        each running request (so that admitting does not preempt at once); always without paging."""
        spare = len(self.running) + (self.prefilling is not None)
        return self.gen.kv is None or self._pages(s) + pages_taken + spare <= len(self.gen.kv.free)

    def _grow_or_preempt(self) -> None:
        """Before a decode step (paged): every running request holds the page its next token's slot is
        in, oldest first; when no page is free, the request admitted last is preempted."""
        kv = self.gen.kv
        for s in sorted(self.running.values(), key=lambda r: r.admitted):
            while s.row >= 0 and not kv.grow(s.row, len(s.prompt) + len(s.tokens)):
                held = [*self.running.values(), *([self.prefilling] if self.prefilling else [])]
                self._preempt(max(held, key=lambda r: r.admitted))

    def _preempt(self, s: Request) -> None:
        """``s`` gives its row and pages back and waits first in line, its tokens kept."""
        if s is self.prefilling:
            self.prefilling = None
        else:
            del self.running[s.row]
            self.gen.done[s.row] = True
        self._free_row(s.row)
        s.row, s.prefilled = -1, 0
        self.waiting.appendleft(s)
        self.preemptions += 1

    def cancel(self, s: Request) -> None:
        """End ``s`` now (its client went away): out of the queue, or its row freed at once."""
        if s.done:
            return
        s.done = True
        if s is self.prefilling:
            self.prefilling = None
            self._free_row(s.row)
        elif s.row in self.running and self.running[s.row] is s:
            del self.running[s.row]
            self._free_row(s.row)
            self.gen.done[s.row] = True
        else:
            try:
                self.waiting.remove(s)
            except ValueError:
                pass

    @torch.inference_mode()
    def _admit(self) -> list[Request]:
        """Prefill work of one step, one packed forward of at most the Generator's ``max_prefill_tokens``:
        the next chunk of the prompt being prefilled in chunks, if any; then waiting requests into
        free rows, oldest first, whole, as the budget allows; then, if the next one's prompt is longer
        than what is left, its first chunk (it goes on in the next steps, in its own row, while the
        others decode; one such at a time)."""
        g, finished = self.gen, []
        budget = g.max_prefill_tokens
        t0 = time.perf_counter()
        work: list[tuple[Request, int, int]] = []  # (request, start, stop) of its context
        if self.prefilling is not None:
            s = self.prefilling
            stop = min(len(s.context()), s.prefilled + budget)
            work.append((s, s.prefilled, stop))
            budget -= stop - s.prefilled
        pages = 0
        if self.free and budget > 0:  # (oldest first: one that does not fit holds the others back)
            batch = OpenBatch(len(self.free), budget)
            while (
                self.waiting
                and len(self.waiting[0].context()) <= budget
                and batch.fits(tokens=len(self.waiting[0].context()))
                and self._fits(self.waiting[0], pages)
            ):
                s = self.waiting.popleft()
                batch.add(s, tokens=len(s.context()))
                pages += self._pages(s)
            for s in batch.take():
                self._take_row(s)
                work.append((s, 0, len(s.context())))
                budget -= len(s.context())
        head = self.waiting[0] if self.waiting else None
        if self.prefilling is None and head and self.free and budget > 0 and self._fits(head, pages):
            s = self.prefilling = self.waiting.popleft()  # too long for what is left: chunks, in a row of its own
            self._take_row(s)
            work.append((s, 0, budget))
        if not work:
            return finished
        ctxs = [s.context() for s, _, _ in work]
        first = g._prefill([(s.row, ctx, a, b) for (s, a, b), ctx in zip(work, ctxs)])
        ended = [s for (s, _, b), ctx in zip(work, ctxs) if b == len(ctx)]
        for s, _, b in work:
            s.prefilled = b
        if self.prefilling in ended:
            self.prefilling = None
        if ended:
            finished += self._start(ended, first)
        dt = time.perf_counter() - t0  # (the Generator's stage counters: what reports and /metrics show)
        g.stats["prefill"].record(sum(b - a for _, a, b in work), dt, dt)
        if ended and self.on_first is not None:
            self.on_first()
        return finished

    def _keep_logprobs(self, reqs) -> None:
        """Append this step's log-probabilities to the requests of ``reqs`` that asked for them."""
        want = [s for s in reqs if s.logprobs is not None]
        if want:
            rows = [s.row for s in want]
            vals, ids = self.gen.lp[rows].tolist(), self.gen.lp_ids[rows].tolist()
            for s, v, i in zip(want, vals, ids):
                s.lps.append((v[0], i[: s.logprobs], v[1 : 1 + s.logprobs]))

    def _set_row(self, s: Request) -> None:
        g, row = self.gen, s.row
        g.temp[row, 0], g.topk[row, 0], g.topp[row, 0], g.seed[row, 0] = s.temperature, s.top_k, s.top_p, s.seed
        g.eos[row] = torch.tensor([*s.stop, *[-1] * (MAX_STOP_IDS - len(s.stop))])

    def _start(self, started: list[Request], first: torch.Tensor) -> list[Request]:
        """``started`` requests, prefilled, begin decoding with their first tokens ``(len(started),)``
        (on the device: they feed the next decode step); those that end with it are returned."""
        g, rows = self.gen, [s.row for s in started]
        g.tok[rows, 0] = first
        g.done[rows] = False
        now, finished = time.perf_counter(), []
        self._keep_logprobs(started)
        for s, tok in zip(started, first.tolist()):
            s.t_first = s.t_first or now
            s.prefilled = len(s.context())
            self.running[s.row] = s
            if self._finish(s, tok):
                finished.append(s)
        return finished

    def _steps_ahead(self) -> int:
        """Decode replays the next step runs before its read back: ``ahead`` when nothing waits for
        admission, no prompt is mid-prefill and no running request asks for logprobs (each step's
        are kept), cut so that no request passes its max_new_tokens nor (paged) the pages it holds."""
        if self.ahead == 1 or self.waiting or self.prefilling is not None:
            return 1
        k, kv = self.ahead, self.gen.kv
        for s in self.running.values():
            if s.logprobs is not None:
                return 1
            k = min(k, s.max_new_tokens - len(s.tokens))
            if kv is not None:  # this step writes positions n-1 .. n+k-2
                k = min(k, len(kv.held.get(s.row, ())) * kv.page - (len(s.prompt) + len(s.tokens)) + 1)
        return max(k, 1)

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Admit what fits, then decode one token (or, see ``ahead``, several) for every running
        request. Returns the requests that ended in this step."""
        if self.gen.scheduler is not self:
            raise RuntimeError("a newer Scheduler took this Generator's engine: step that one (one at a time)")
        finished = self._admit()
        if self.gen.kv is not None:
            self._grow_or_preempt()
        if not self.running:
            return finished
        g, t0 = self.gen, time.perf_counter()
        top = max(self.running) + 1
        b = bucket_for(top, g.buckets)
        parked = self.prefilling.row if self.prefilling is not None else -1
        idle = [r for r in range(b) if r not in self.running and r != parked]
        if idle:  # free rows in the bucket ride along from position 0 (their own row's first slots)
            g.pos[idle] = 0
        if 0 <= parked < b:  # a row mid-prefill rides along at the cache's last slot, written before any read
            g.pos[parked] = g.max_seq_len - 1
        k = self._steps_ahead()  # (1 whenever a row is parked: its position must not pass the cache)
        longest = max(len(s.prompt) + len(s.tokens) for s in self.running.values())
        kv = next(x for x in g.kv_buckets if x >= longest + k - 1)  # (the last replay reads that far)
        greedy = all(s.temperature == 0 for s in self.running.values())
        key = (b, greedy, kv)
        if k == 1:
            toks = [(g.graph_set.replay(key) if key in g.graphs else g._step(*key)).tolist()]
        else:
            out = torch.empty(k, b, dtype=torch.long, device=g.device)
            for j in range(k):  # (each replay's tokens copied out before the next overwrites them)
                out[j] = g.graph_set.replay(key) if key in g.graphs else g._step(*key)
            toks = out.tolist()  # one read back for the k steps
        self.steps += k
        if k == 1:
            self._keep_logprobs(self.running.values())
        made = 0
        for row, s in list(self.running.items()):
            for step_toks in toks:
                made += 1
                if self._finish(s, step_toks[row]):
                    finished.append(s)
                    break
        dt = time.perf_counter() - t0
        g.stats["decode"].record(made, dt, dt)
        return finished

    def run(self, requests: Sequence[dict]) -> list[list[int]]:
        """Every request (``{"prompt", "max_new_tokens", "temperature", "top_k", "top_p", "seed",
        "logprobs"}``) to its end, joining as rows free up; each request's new tokens, in the order
        given."""
        seqs = [self.submit(**r) for r in requests]
        while self.busy:
            self.step()
        return [s.tokens for s in seqs]
