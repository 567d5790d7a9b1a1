"""What the scheduler's step loop (:class:`~fullthrottle.workloads.llm.scheduler.Scheduler`) keeps:
each request's record (:class:`Request`), and token ids on their way from the GPU to the host for
its overlapped steps: each copy D2H is queued on the current stream behind the work that makes the
tokens, into pinned memory, with an event behind it; the host waits for that event only when it
reads them, so it can queue the next step first."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

import torch


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
    unread: int = 0  # tokens made on the device and not yet read back into ``tokens``

    def context(self) -> list[int]:
        """What its prefill takes: the prompt, and the tokens made before a preemption."""
        return self.prompt + self.tokens if self.tokens else self.prompt


def holds(s: Request, row: int, admitted: int) -> bool:
    """Whether ``s`` still runs in ``row`` as admitted then (not ended, cancelled or preempted since):
    a launch's tokens are read back into the requests that do."""
    return not s.done and s.row == row and s.admitted == admitted


def h2d(values, device: torch.device, dtype: torch.dtype = torch.long) -> torch.Tensor:
    """``values`` (a list) as a tensor on ``device``, its copy queued on the current stream: the
    host does not wait for the work queued before it (``torch.tensor(values, device=...)`` and list
    indexes of device tensors copy, then wait for the whole stream)."""
    t = torch.tensor(values, dtype=dtype)
    return t.to(device, non_blocking=True) if device.type == "cuda" else t


class Copied:
    """Tokens ``(k, b)`` or ``(n,)`` copied (or being copied) to the host; :meth:`read` waits for
    them and returns them as lists."""

    def __init__(self, host: torch.Tensor, event: torch.cuda.Event | None):
        self.host, self.event = host, event

    def read(self) -> list:
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()


class HostTokens:
    """Pinned host buffers for the decoded tokens (two, used in turn: the one of the step being read
    is not written by the next) and for a prefill's first tokens, on ``device`` (on the CPU: plain
    copies). ``decode_size``: the most tokens of one decode launch (replays x rows); ``rows``: the
    most first tokens of one prefill."""

    def __init__(self, device: torch.device, decode_size: int, rows: int):
        self.cuda = device.type == "cuda"
        pin = self.cuda
        self._dec = [torch.empty(decode_size, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._first = torch.empty(rows, dtype=torch.long, pin_memory=pin)
        self._turn = 0

    def _copy(self, buf: torch.Tensor, t: torch.Tensor) -> Copied:
        host = buf[: t.numel()].view(t.shape)
        if not self.cuda:
            host.copy_(t)
            return Copied(host, None)
        host.copy_(t, non_blocking=True)
        ev = torch.cuda.Event()
        ev.record()
        return Copied(host, ev)

    def decoded(self, out: torch.Tensor) -> Copied:
        """``out`` ``(k, b)``: the tokens of a decode launch."""
        self._turn ^= 1
        return self._copy(self._dec[self._turn], out)

    def first(self, first: torch.Tensor) -> Copied:
        """``first`` ``(n,)``: a prefill's first tokens (read back in the same step)."""
        return self._copy(self._first, first)


class StageClock:
    """The device's time in each stage of the step loop, into the Generator's stage counters (``stats``:
    name -> :class:`~fullthrottle.core.report.StageStats`, what reports and /metrics show). On CUDA an
    event before and after each launch on the current stream, their time counted once a later wait of
    the loop has passed them (:meth:`collect`: no wait of its own; the steps overlap on the host, not
    on the stream, so no time counts twice); on the CPU, where a launch's work is done when it
    returns, the launch's own time."""

    def __init__(self, device: torch.device, stats: dict):
        self.cuda, self.stats = device.type == "cuda", stats
        self._open: collections.deque = collections.deque()  # (stage, start, end) not counted yet

    def start(self):
        """Before a launch: a token for :meth:`stop`."""
        if not self.cuda:
            return time.perf_counter()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        return ev

    def stop(self, stage: str, start) -> None:
        """After the launch that ``start`` began: its time goes to ``stage``."""
        if not self.cuda:
            dt = time.perf_counter() - start
            self.stats[stage].record(0, dt, dt)
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._open.append((stage, start, end))

    def collect(self) -> None:
        """Count the launches that have ended (oldest first: the stream runs them in order)."""
        while self._open and self._open[0][2].query():
            stage, a, b = self._open.popleft()
            dt = a.elapsed_time(b) / 1e3
            self.stats[stage].record(0, dt, dt)

    def settle(self) -> None:
        """Wait for the last launch to end, then count them all (a run's end: its counters complete)."""
        if self._open:
            self._open[-1][2].synchronize()
        self.collect()


@dataclass
class Launched:
    """A decode launch: its requests ``(row, request, its admission number)`` as they were, its
    tokens on their way to the host and the replays it ran."""

    reqs: list
    tokens: Copied
    k: int


@dataclass
class Begun:
    """A prefill's ended prompts ``(row, request, its admission number)``, their first tokens on their
    way to the host and the prompt tokens the prefill took."""

    reqs: list
    tokens: Copied
    prompt_tokens: int
