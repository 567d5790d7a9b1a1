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
scheduling), so that the host's work between tokens does not leave the GPU idle. With ``overlap`` (the
default, as vLLM's async scheduling) a step launches its prefill and decode first and then reads back
the tokens of the step before, while its own run: the GPU has the next step queued while the host
admits, grows page tables and hands tokens out. A request that ends is seen one step later, and runs
that step with the others, its token dropped.

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
from collections.abc import Callable, Sequence

import torch

from ...core.batch import bucket_for
from .admission import Admission
from .checks import check_int, check_request
from .checks import stop_ids as check_stop_ids
from .step_records import HostTokens, Request, StageClock, h2d, holds
from .step_records import Launched as _Launched


class Scheduler(Admission):
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
            they are in their requests' ``tokens`` and before the step's decode is read back (with
            ``overlap``, while it runs): a server sends them then, so a request's time to first token
            does not include a decode step.
        overlap: launch each step before reading back the tokens of the one before (see above); off
            for a step in which a request asks for logprobs (read back before the next step
            overwrites them). False: every step's tokens are read back within it.

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
        overlap: bool = True,
    ):
        check_int("ahead", ahead, 1)
        self.eos_ids = check_stop_ids(eos_id, gen.model.cfg.vocab_size, "eos_id")
        self.gen, self.ahead, self.on_first, self.overlap = gen, ahead, on_first, overlap
        self._pending: _Launched | None = None  # the decode launched last and not read back yet
        self._host = HostTokens(gen.device, ahead * gen.max_batch, gen.max_batch)
        self.clock = StageClock(gen.device, gen.stats)  # the device's time in prefill and decode
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
        return bool(self.waiting or self.running or self.prefilling or self._pending)

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

    def _grow_or_preempt(self) -> None:
        """Before a decode step (paged): every running request holds the page its next token's slot is
        in, oldest first; when no page is free, the request admitted last is preempted."""
        kv = self.gen.kv
        for s in sorted(self.running.values(), key=lambda r: r.admitted):
            if len(s.tokens) + s.unread >= s.max_new_tokens:
                continue  # (its tokens are all made: what it writes next lands in the spare page 0, unread)
            while s.row >= 0 and not kv.grow(s.row, len(s.prompt) + len(s.tokens) + s.unread):
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
        s.row, s.prefilled, s.unread = -1, 0, 0  # (its tokens not read back yet are made again)
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
            made = len(s.prompt) + len(s.tokens) + s.unread  # (the next replay writes position made - 1)
            k = min(k, self.gen.max_seq_len - made + 1)  # (its positions stay in the cache, whatever it makes)
            left = s.max_new_tokens - len(s.tokens) - s.unread
            if left <= 0:  # (none left: it ends as its tokens are read back, and what it makes is dropped)
                continue
            k = min(k, left)
            if kv is not None:  # this step writes positions n-1 .. n+k-2
                k = min(k, len(kv.held.get(s.row, ())) * kv.page - made + 1)
        return max(k, 1)

    def _wants_logprobs(self) -> bool:
        """Whether a request running, mid-prefill or waiting asks for logprobs (a step's are read back
        before the next step overwrites them: no overlap then)."""
        return any(s.logprobs is not None for s in (*self.running.values(), *self.waiting, self.prefilling) if s)

    @torch.inference_mode()
    def step(self) -> list[Request]:
        """Admit what fits, then decode one token (or, see ``ahead``, several) for every running
        request. Returns the requests whose end was read back in this step.

        With ``overlap`` (and no request asking for logprobs) the step launches its prefill and decode,
        then reads back the tokens of the step before, and its own prefill's first tokens, while its
        decode runs: the GPU has the next step queued while the host does its bookkeeping."""
        if self.gen.scheduler is not self:
            raise RuntimeError("a newer Scheduler took this Generator's engine: step that one (one at a time)")
        overlap = self.overlap and not self._wants_logprobs()
        finished, prev, self._pending = [], self._pending, None
        if prev is not None and not overlap:
            finished += self._read(prev)
            prev = None
        begun = self._admit()
        if begun is not None and not overlap:
            finished += self._first(begun)
            begun = None
        if self.gen.kv is not None:
            self._grow_or_preempt()
        # (no decode when every running request ends with its tokens not read back yet)
        going = any(len(s.tokens) + s.unread < s.max_new_tokens for s in self.running.values())
        now = self._decode() if going else None
        if prev is not None:  # (the step before's tokens, while this step's decode runs)
            finished += self._read(prev)
        if begun is not None:
            finished += self._first(begun)
        if now is not None and not overlap:
            finished += self._read(now)
        elif now is not None and not all(s.done for _, s, _ in now.reqs):  # (else nothing in it is read)
            self._pending = now
        self.clock.collect()
        return finished

    def _decode(self) -> _Launched:
        """Launches one decode replay (or ``k``, see ``ahead``) of every running request, the tokens'
        copy to the host behind them."""
        g, start = self.gen, self.clock.start()
        top = max(self.running) + 1
        b = bucket_for(top, g.buckets)
        parked = self.prefilling.row if self.prefilling is not None else -1
        idle = [r for r in range(b) if r not in self.running and r != parked]
        if idle:  # free rows in the bucket ride along from position 0 (their own row's first slots)
            g.pos[h2d(idle, g.device)] = 0
        if 0 <= parked < b:  # a row mid-prefill rides along at the cache's last slot, written before any read
            g.pos[parked] = g.max_seq_len - 1
        k = self._steps_ahead()  # (1 whenever a row is parked: its position must not pass the cache)
        longest = max(len(s.prompt) + len(s.tokens) + s.unread for s in self.running.values())
        kv = next(x for x in g.kv_buckets if x >= longest + k - 1)  # (the last replay reads that far)
        greedy = all(s.temperature == 0 for s in self.running.values())
        key = (b, greedy, kv)
        out = torch.empty(k, b, dtype=torch.long, device=g.device)
        for j in range(k):  # (each replay's tokens copied out before the next overwrites them)
            out[j] = g.graph_set.replay(key) if key in g.graphs else g._step(*key)
        self.steps += k
        reqs = [(row, s, s.admitted) for row, s in self.running.items()]
        for s in self.running.values():
            s.unread += k
        self.clock.stop("decode", start)  # (before the tokens' copy: a wait for those passes it)
        return _Launched(reqs, self._host.decoded(out), k)

    def _read(self, launched: _Launched) -> list[Request]:
        """A launched decode's tokens read back into its requests (those that ended, were cancelled or
        preempted since skipped: a preempted one makes them again); returns the requests that ended."""
        toks, finished, made = launched.tokens.read(), [], 0
        live = [(row, s) for row, s, admitted in launched.reqs if holds(s, row, admitted)]
        if launched.k == 1:
            self._keep_logprobs([s for _, s in live])
        for row, s in live:
            s.unread -= launched.k
            for step_toks in toks:
                made += 1
                if self._finish(s, step_toks[row]):
                    finished.append(s)
                    break
        self.gen.stats["decode"].record(made, 0.0)
        return finished

    def run(self, requests: Sequence[dict]) -> list[list[int]]:
        """Every request (``{"prompt", "max_new_tokens", "temperature", "top_k", "top_p", "seed",
        "logprobs"}``) to its end, joining as rows free up; each request's new tokens, in the order
        given."""
        seqs = [self.submit(**r) for r in requests]
        while self.busy:
            self.step()
        self.clock.settle()
        return [s.tokens for s in seqs]
