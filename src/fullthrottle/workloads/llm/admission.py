"""Admission, the first part of a scheduler step (:class:`~fullthrottle.workloads.llm.scheduler.Scheduler`
inherits it): which waiting prompts take free rows (and, paged, KV pages) and are prefilled in one
packed forward, and how their first tokens come back."""

from __future__ import annotations

import time

import torch

from ...core.batch import OpenBatch
from .checks import MAX_STOP_IDS
from .step_records import Begun, Request, h2d, holds


class Admission:
    """The scheduler's admission steps; the state (``gen``, ``waiting``, ``running``, ``free``,
    ``prefilling``, ...) is the :class:`~fullthrottle.workloads.llm.scheduler.Scheduler`'s."""

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

    @torch.inference_mode()
    def _admit(self) -> Begun | None:
        """Prefill work of one step, one packed forward of at most the Generator's ``max_prefill_tokens``:
        the next chunk of the prompt being prefilled in chunks, if any; then waiting requests into
        free rows, oldest first, whole, as the budget allows; then, if the next one's prompt is longer
        than what is left, its first chunk (it goes on in the next steps, in its own row, while the
        others decode; one such at a time). The prompts it ends begin decoding (:meth:`_begin`); their
        first tokens are read back later (:meth:`_first`)."""
        g = self.gen
        budget = g.max_prefill_tokens
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
            return None
        ctxs = [s.context() for s, _, _ in work]
        start = self.clock.start()
        first = g._prefill([(s.row, ctx, a, b) for (s, a, b), ctx in zip(work, ctxs)])
        self.clock.stop("prefill", start)
        ended = [s for (s, _, b), ctx in zip(work, ctxs) if b == len(ctx)]
        for s, _, b in work:
            s.prefilled = b
        if self.prefilling in ended:
            self.prefilling = None
        tokens = sum(b - a for _, a, b in work)
        if not ended:  # (a chunk: no token yet; its tokens counted as it is launched)
            g.stats["prefill"].record(tokens, 0.0)
            return None
        return self._begin(ended, first, tokens)

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
        g.eos[row] = h2d([*s.stop, *[-1] * (MAX_STOP_IDS - len(s.stop))], g.device)

    def _begin(self, started: list[Request], first: torch.Tensor, tokens: int) -> Begun:
        """``started`` requests, prefilled, run from the next decode on, fed their first tokens ``first``
        ``(len(started),)`` on the device; the tokens' copy to the host is on its way."""
        g = self.gen
        rows = h2d([s.row for s in started], g.device)
        g.tok[rows, 0] = first
        g.done[rows] = False
        for s in started:
            s.prefilled, s.unread = len(s.context()), 1
            self.running[s.row] = s
        return Begun([(s.row, s, s.admitted) for s in started], self._host.first(first), tokens)

    def _first(self, begun: Begun) -> list[Request]:
        """The first tokens of :meth:`_begin`'s requests read back into them (those preempted or
        cancelled since skipped); then ``on_first``. Returns the requests that end with their first."""
        toks, finished, now = begun.tokens.read(), [], time.perf_counter()
        self.gen.stats["prefill"].record(begun.prompt_tokens, 0.0)
        live = [(s, tok) for (row, s, admitted), tok in zip(begun.reqs, toks) if holds(s, row, admitted)]
        self._keep_logprobs([s for s, _ in live])
        for s, tok in live:
            s.unread -= 1
            s.t_first = s.t_first or now
            if self._finish(s, tok):
                finished.append(s)
        if self.on_first is not None:
            self.on_first()
        return finished
