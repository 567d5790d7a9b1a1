import queue
import threading
import time

import numpy as np
import pytest

from fullthrottle.core.batch import Batch, Batcher, RequestBatcher, bucket_for, split_into_buckets
from fullthrottle.core.config import Config, default_buckets
from fullthrottle.core.report import StageStats
from fullthrottle.data.load import Item

END = object()


def test_default_buckets():
    assert default_buckets(64) == (1, 2, 4, 8, 16, 32, 64)
    assert default_buckets(48) == (1, 2, 4, 8, 16, 32, 48)
    assert default_buckets(1) == (1,)
    assert default_buckets(256, start=16) == (16, 32, 64, 128, 256)  # the embedder's sequence lengths
    assert default_buckets(8, start=16) == (8,)
    assert Config(max_batch_size=8).buckets == (1, 2, 4, 8)


def test_bucket_for():
    b = (1, 2, 4, 8)
    assert [bucket_for(n, b) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    with pytest.raises(ValueError, match="exceeds the largest bucket 8"):
        bucket_for(9, b)
    with pytest.raises(ValueError):
        bucket_for(0, b)


def test_split_into_buckets():
    assert split_into_buckets(1100, (1, 8, 512)) == [(512, 512), (512, 512), (76, 512)]
    assert split_into_buckets(9, (1, 2, 4, 8)) == [(8, 8), (1, 1)]
    assert split_into_buckets(8, (1, 2, 4, 8)) == [(8, 8)]
    assert split_into_buckets(3, (4,)) == [(3, 4)]


def _getter(q: queue.Queue):
    """``get(timeout_s) -> item | None``, as the pipeline hands it to the Batcher."""

    def get(t):
        try:
            return q.get(timeout=t) if t else q.get_nowait()
        except queue.Empty:
            return None

    return get


def _run_batcher(items, max_batch, wait_ms, feed_delay=0.0, n_end=1):
    q_in: queue.Queue = queue.Queue()
    out: list = []

    def put(o, block=True):
        out.append(o)
        return True

    get = _getter(q_in)

    b = Batcher(get, put, max_batch, wait_ms, n_end, END, StageStats("batch"), lambda: False)
    th = threading.Thread(target=b.run)
    th.start()
    for it in items:
        it.t_queued = time.perf_counter()
        q_in.put(it)
        if feed_delay:
            time.sleep(feed_delay)
    for _ in range(n_end):
        q_in.put(END)
    th.join(5)
    assert not th.is_alive()
    assert out[-1] is END
    return out[:-1]


def _items(n, errors=()):
    return [
        Item(i, f"#{i}", array=None if i in errors else np.zeros(1), error="bad" if i in errors else None)
        for i in range(n)
    ]


def test_full_batches_when_items_are_ready():
    out = _run_batcher(_items(20), max_batch=8, wait_ms=1000)
    assert [len(b) for b in out] == [8, 8, 4]  # last one flushed at end of stream, not after 1 s
    assert [it.index for b in out for it in b.items] == list(range(20))


def test_deadline_closes_partial_batches():
    t0 = time.perf_counter()
    out = _run_batcher(_items(3), max_batch=64, wait_ms=20, feed_delay=0.1)
    assert [len(b) for b in out] == [1, 1, 1]  # each waited 20 ms, not for 64 items
    assert time.perf_counter() - t0 < 2


def test_errors_bypass_batches():
    out = _run_batcher(_items(10, errors={3, 7}), max_batch=4, wait_ms=1000)
    errs = [o for o in out if isinstance(o, Item)]
    batches = [o for o in out if isinstance(o, Batch)]
    assert [e.index for e in errs] == [3, 7]
    assert sorted(it.index for b in batches for it in b.items) == [0, 1, 2, 4, 5, 6, 8, 9]
    assert all(len(b) <= 4 for b in batches)


def test_lists_of_items_are_batched_like_single_items():
    """A GPU decoder hands over its batch as one list: the same batches as item by item, errors
    passed on, nothing lost (lists and single items mixed)."""
    items = _items(30, errors={5, 17})
    q_in: queue.Queue = queue.Queue()
    out: list = []
    b = Batcher(
        _getter(q_in), lambda o, block=True: out.append(o) or True, 8, 1000, 1, END, StageStats("batch"), lambda: False
    )
    for it in items:
        it.t_queued = time.perf_counter()
    for chunk in (items[:12], items[12], items[13:14], items[14:30]):
        q_in.put(chunk)
    q_in.put(END)
    b.run()
    assert out[-1] is END
    errs = [o.index for o in out[:-1] if isinstance(o, Item)]
    batches = [o for o in out[:-1] if isinstance(o, Batch)]
    assert sorted(errs) == [5, 17]
    assert [len(x) for x in batches] == [8, 8, 8, 4]  # full batches across list boundaries, then the rest
    assert [it.index for x in batches for it in x.items] == [i for i in range(30) if i not in (5, 17)]
    assert b.batched_items == 28 and b.stats.items == 30


def test_waits_for_every_worker_end_marker():
    out = _run_batcher(_items(5), max_batch=2, wait_ms=1000, n_end=3)
    assert sum(len(b) for b in out) == 5


def test_busy_consumer_grows_batches():
    """While compute cannot take a batch, the batcher keeps filling the one it holds."""
    q_in: queue.Queue = queue.Queue()
    sent: list = []
    room = threading.Event()

    def put(o, block=True):
        if not block and not room.is_set():
            return False
        sent.append(o)
        return True

    get = _getter(q_in)

    b = Batcher(get, put, 100, 1.0, 1, END, StageStats("batch"), lambda: False)
    th = threading.Thread(target=b.run)
    th.start()
    for it in _items(30):
        it.t_queued = time.perf_counter()
        q_in.put(it)
        time.sleep(0.002)
    time.sleep(0.05)
    assert sent == []  # deadline long past, but compute is busy: still filling
    room.set()
    time.sleep(0.1)
    q_in.put(END)
    th.join(5)
    assert len(sent[0]) == 30 and sent[-1] is END


def test_busy_device_grows_batches_past_deadline():
    """While the device has batches in flight, a partial batch keeps filling past its deadline."""
    q_in: queue.Queue = queue.Queue()
    sent: list = []
    busy = threading.Event()
    busy.set()

    get = _getter(q_in)

    b = Batcher(
        get,
        lambda o, block=True: sent.append(o) or True,
        100,
        1.0,
        1,
        END,
        StageStats("batch"),
        lambda: False,
        device_busy=busy.is_set,
    )
    th = threading.Thread(target=b.run)
    th.start()
    for it in _items(20):
        it.t_queued = time.perf_counter()
        q_in.put(it)
        time.sleep(0.003)
    assert sent == []
    busy.clear()  # device idles: the held batch goes at once
    deadline = time.time() + 2
    while not sent and time.time() < deadline:
        time.sleep(0.005)
    assert len(sent) == 1 and len(sent[0]) == 20
    q_in.put(END)
    th.join(5)


def test_request_batcher_by_count_and_token_budget():
    q = queue.Queue()
    asked = []

    def tokens(r):
        asked.append(r["id"])
        return r["tokens"]

    reqs = [{"id": i, "texts": t, "tokens": k} for i, (t, k) in enumerate([(2, 10), (3, 10), (1, 90), (4, 5), (9, 1)])]
    for r in reqs:
        q.put(r)
    b = RequestBatcher(q, max_items=6, max_tokens=100, size=lambda r: r["texts"], tokens=tokens)
    ids = lambda batch: [r["id"] for r in batch]  # noqa: E731
    assert ids(b.next()) == [0, 1]  # request 2 would take the tokens to 110: it opens the next batch
    assert ids(b.next()) == [2, 3]  # 1 + 4 texts, 95 tokens; 9 texts more would pass 6
    assert ids(b.next()) == [4]  # alone over max_items: taken anyway (the first of a batch always is)
    assert b.next(timeout=0.01) == []
    assert asked == [0, 1, 2, 3, 4]  # each request's tokens asked once, the carried one too


def test_request_batcher_waits_for_more_only_when_asked():
    q = queue.Queue()
    q.put("a")
    threading.Timer(0.05, q.put, args=("b",)).start()
    assert RequestBatcher(q, max_items=8).next() == ["a"]  # max_wait_s 0: only what is queued
    assert q.get(timeout=1) == "b"
    q.put("a")
    threading.Timer(0.05, q.put, args=("b",)).start()
    t0 = time.perf_counter()
    assert RequestBatcher(q, max_items=8, max_wait_s=0.5).next() == ["a", "b"]
    assert time.perf_counter() - t0 >= 0.45  # waited out its deadline for more
    with pytest.raises(ValueError):
        RequestBatcher(q, max_items=0)


def test_open_batch_closes_by_count_token_budget_and_deadline():
    from fullthrottle.core.batch import OpenBatch

    b = OpenBatch(3, max_tokens=10, max_wait_s=0.5)
    assert not b and b.fits(size=99, tokens=99)  # the first item is always taken, even over a limit
    b.add("a", tokens=4, now=100.0)
    assert b.deadline == 100.5 and b.wait_s(now=100.2) == pytest.approx(0.3) and b.wait_s(now=101) == 0
    assert b.fits(tokens=6) and not b.fits(tokens=7) and not b.fits(size=3)
    b.add("b", tokens=6, now=100.1)
    assert b.full and b.deadline == 100.5  # the budget is spent; the deadline is the first item's
    assert b.take() == ["a", "b"] and not b and b.n == b.tokens == 0
    c = OpenBatch(4, max_wait_s=0.0)
    assert c.extend([1, 2], now=5.0) == [] and c.extend([3, 4, 5, 6]) == [5, 6] and c.full
    assert c.take() == [1, 2, 3, 4] and c.deadline == 5.0
    with pytest.raises(ValueError, match="max_items"):
        OpenBatch(0)
    with pytest.raises(ValueError, match="max_wait_s"):
        OpenBatch(1, max_wait_s=float("nan"))


def test_gpu_batches_take_lists_up_to_the_limit_and_keep_the_rest():
    import queue as q_

    from fullthrottle.data.gpu_feed import take_gpu_batch

    class FakeRun:
        END = object()
        gq = q_.Queue()

        def _get(self, q, timeout=0.05):
            try:
                return q.get(timeout=timeout) if timeout else q.get_nowait()
            except q_.Empty:
                return None

    run = FakeRun()
    for chunk in ([1, 2, 3], [4, 5, 6], run.END, [7]):
        run.gq.put(chunk)
    carry = []
    assert take_gpu_batch(run, carry, 4, 1.0, ends_wanted=1) == ([1, 2, 3, 4], 0) and carry == [5, 6]
    assert take_gpu_batch(run, carry, 4, 0.0, ends_wanted=1) == ([5, 6], 1) and carry == []  # the end
    assert take_gpu_batch(run, carry, 4, 0.0, ends_wanted=1) == ([7], 0)
    carry = list(range(10))  # more carried than a batch holds: no queue read at all
    assert take_gpu_batch(run, carry, 4, 0.0, ends_wanted=1) == ([0, 1, 2, 3], 0) and carry == list(range(4, 10))


def test_read_ahead_takes_what_came_when_the_source_stalls_and_raises_after_it():
    """ReadAhead: full lists from a fast source; from one that stalls, what came so far (within
    linger_s); the source's error after its last items; close() ends a take() waiting on a source
    that blocks."""
    import threading
    import time

    from fullthrottle.core.read_ahead import ReadAhead

    r = ReadAhead(range(10), 4)
    assert [r.take() for _ in range(3)] == [
        ([0, 1, 2, 3], None, False),
        ([4, 5, 6, 7], None, False),
        ([8, 9], None, True),
    ]
    gate = threading.Event()

    def stalls():
        yield "a"
        yield "b"
        gate.wait(30)  # (a terminal: nothing more until the user types)
        yield "c"
        raise ValueError("bad line")

    r = ReadAhead(stalls(), 100, linger_s=0.05)
    t0 = time.monotonic()
    assert r.take() == (["a", "b"], None, False) and time.monotonic() - t0 < 5
    gate.set()
    block, err, ended = r.take()
    assert block == ["c"] and isinstance(err, ValueError) and ended
    blocked = threading.Event()

    def never():
        yield 1
        blocked.wait()  # (never set: a read that does not return)
        yield 2

    r = ReadAhead(never(), 10)
    assert r.take() == ([1], None, False)
    threading.Timer(0.3, r.close).start()
    t0 = time.monotonic()
    assert r.take() == ([], None, False) and time.monotonic() - t0 < 5
    blocked.set()


def test_read_ahead_interrupted_anywhere_in_an_idle_take_raises_the_interrupt_and_closes():
    """A Ctrl-C raises KeyboardInterrupt at whichever bytecode the taking (main) thread is at: raised
    just after each C call of an idle take() in turn, take() raises it (not "release unlocked lock")
    and close() returns at once (no lock left held by a half-run ``with``)."""
    import sys
    import threading

    from interrupts import interrupt_at_c_call

    from fullthrottle.core.read_ahead import ReadAhead

    blocked = threading.Event()

    def never():
        yield 1
        blocked.wait()  # (a pipe that stays open)

    try:
        for n in range(1, 17):
            r = ReadAhead(never(), 4, linger_s=0.0)
            assert r.take() == ([1], None, False)
            try:
                with pytest.raises(KeyboardInterrupt):
                    sys.setprofile(interrupt_at_c_call(n, ReadAhead.take.__code__))
                    r.take()
            finally:
                sys.setprofile(None)
            closing = threading.Thread(target=r.close, daemon=True)
            closing.start()
            closing.join(5)
            assert not closing.is_alive(), f"close() hangs after an interrupt at the take's C call {n}"
    finally:
        blocked.set()
