"""A Pipeline's life against its caller: stops that must not wait on the caller's code, close() racing a
run's start or called from the run's own callbacks, the inputs iterable ending in any exception, error
kinds that an item's id cannot set, and the LLM Generator's one-call-at-a-time guard across threads."""

import asyncio
import threading
import time

import pytest
from test_pipeline import tiny_pipe

from fullthrottle import PipelineError
from fullthrottle.core.errors import error_info
from fullthrottle.workloads.classify import pipeline as pipeline_module
from fullthrottle.workloads.llm.generate import Generator


def test_a_stop_does_not_wait_for_a_generator_waiting_for_its_next_item(samples, no_thread_leak):
    release = threading.Event()

    def waiting(n):  # a server's queue of requests: the next one has not come
        yield from samples[:n]
        release.wait()

    with tiny_pipe() as pipe:
        t0 = time.perf_counter()
        for r in pipe.run(waiting(1)):
            assert r.ok
            break
        assert time.perf_counter() - t0 < 3  # (it waited the stop's whole 10 s for the generator)
        # the same from an event loop: cancelling the consumer must not block the loop
        ticks = []

        async def main():
            async def consume():
                async for _ in pipe.arun(waiting(2)):
                    pass

            async def tick():
                while True:
                    await asyncio.sleep(0.01)
                    ticks.append(time.perf_counter())

            ticker, task = asyncio.create_task(tick()), asyncio.create_task(consume())
            await asyncio.sleep(1.0)
            t1 = time.perf_counter()
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            await asyncio.sleep(0.2)
            ticker.cancel()
            return t1, time.perf_counter() - t1

        t1, took = asyncio.run(main())
        assert took < 3
        after = [t for t in ticks if t > t1]
        assert len(after) >= 5 and max(b - a for a, b in zip([t1] + after, after)) < 1.0  # the loop ran on
        assert pipe.classify(samples[:2])[1].ok  # and the Pipeline takes the next stream
        release.set()  # the parked load stages see the next item, the stop, and end (no_thread_leak)


def test_close_racing_the_start_of_a_run_stops_that_run(samples, monkeypatch):
    building = threading.Event()

    class SlowStart(pipeline_module.Run):
        def __init__(self, *a, **k):
            building.set()
            time.sleep(0.5)  # close() comes while the run is being built
            super().__init__(*a, **k)

    monkeypatch.setattr(pipeline_module, "Run", SlowStart)
    for preprocess in ("threads", "processes"):
        pipe = tiny_pipe(preprocess=preprocess)
        building.clear()  # (close() once the run is being built: a timer could fire after the run, under load)
        threading.Thread(target=lambda pipe=pipe: building.wait(15) and pipe.close(), daemon=True).start()
        box = []

        def classify(pipe=pipe, box=box):
            try:
                box.append(
                    pipe.classify(samples[:1] * 200)
                )  # (close() waits for the start: a run of one image could end first)
            except BaseException as e:  # noqa: BLE001
                box.append(e)

        t = threading.Thread(target=classify, daemon=True)
        t.start()
        t.join(15)
        assert not t.is_alive(), f"{preprocess}: the run hung after close()"
        assert isinstance(box[0], RuntimeError) and not isinstance(box[0], PipelineError), box[0]
        assert "closed" in str(box[0])


@pytest.mark.parametrize("where", ["generator", "drop"])
def test_close_from_the_runs_own_callbacks_closes_everything(samples, where, no_thread_leak):
    pipe = tiny_pipe(preprocess="processes")
    procs = [w.proc for w in pipe.decoders.workers]

    def inputs():
        for i, p in enumerate(samples[:40]):
            if i == 10 and where == "generator":
                pipe.close()
            yield p

    def drop(index):
        if index == 10:
            pipe.close()
        return False

    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match="closed while this stream ran"):
        list(pipe.run(inputs(), drop=drop if where == "drop" else None))
    assert time.perf_counter() - t0 < 5
    deadline = time.time() + 5
    while any(p.poll() is None for p in procs) and time.time() < deadline:
        time.sleep(0.05)
    assert all(p.poll() is not None for p in procs), "decoder processes outlived close()"
    assert pipe.closed


@pytest.mark.parametrize("exc", [SystemExit(3), KeyboardInterrupt(), ValueError("x"), ValueError()])
def test_any_exception_of_the_inputs_iterable_answers_every_item_before_it(samples, exc):
    """... then an Exception comes as a PipelineError naming it; a KeyboardInterrupt or SystemExit as
    it is, as from a plain generator (a caller's ``except KeyboardInterrupt`` still takes it)."""

    def inputs():
        yield from samples[:7]
        raise exc

    got = []
    with tiny_pipe() as pipe:
        said = (
            f"the inputs iterable raised {type(exc).__name__}{': x' if str(exc) else ''} (after 7 items, all answered)"
        )
        with pytest.raises(PipelineError if isinstance(exc, Exception) else type(exc)) as info:
            for r in pipe.run(inputs()):
                got.append(r)
        if isinstance(exc, Exception):
            assert str(info.value) == said and info.value.__cause__ is exc
        else:
            assert info.value is exc
        assert [r.index for r in got] == list(range(7)) and all(r.ok for r in got)
        assert pipe.classify(samples[:1])[0].ok


def test_an_items_id_does_not_set_its_error_kind(samples, tmp_path):
    text = tmp_path / "cannot read this.jpg"  # (a kind's words in a file name)
    text.write_text("hello")
    with tiny_pipe() as pipe:
        r1, r2, r3 = pipe.classify(
            [text, ("file not found: upload-1", b"plain text"), ("compute failed: x", samples[0].read_bytes())]
        )
    assert (r1.error_stage, r1.error_kind) == ("preprocess", "unsupported_format"), r1.error
    assert (r2.error_stage, r2.error_kind) == ("preprocess", "unsupported_format"), r2.error
    assert r3.ok and r3.error_kind is None
    assert r1.to_dict()["error_kind"] == "unsupported_format"
    # an id that is a part of the message's own words: the whole message decides
    assert error_info("e: empty file (0 bytes)", "e") == ("preprocess", "empty")
    assert error_info("file not found: file", "file") == ("load", "not_found")
    assert error_info("x.jpg: model output is not finite", "x.jpg") == ("compute", "non_finite")


def test_generate_from_two_threads_at_once_refuses_the_second_plainly(tiny_llama):
    gen = Generator(tiny_llama, max_batch=4, max_seq_len=64, graphs=False)
    ref = gen.generate([[1, 2, 3, 4], [5, 6, 7]], 4)
    barrier, errors, outs = threading.Barrier(2), [], []

    def call():
        for _ in range(40):
            barrier.wait()
            try:
                outs.append(gen.generate([[1, 2, 3, 4], [5, 6, 7]], 4))
            except RuntimeError as e:
                errors.append(str(e))

    threads = [threading.Thread(target=call) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert all(o == ref for o in outs) and len(outs) >= 40
    assert all("inside a generate call: one call at a time" in e for e in errors), set(errors)


def test_an_iterator_left_unfinished_at_exit_ends_the_process_cleanly(samples):
    """A script that takes one result of ``pipe.run(...)`` and exits (the iterator neither exhausted
    nor closed, with or without ``with``/``close()``): exit 0 and nothing on stderr. The stage threads,
    still running at the interpreter's teardown, aborted the process about half the time
    ("terminate called without an active exception", exit 134), and the iterator's late finish
    printed "Exception ignored ... import ... halted"."""
    import os
    import subprocess
    import sys

    script = (
        "import sys\nfrom fullthrottle import Config, Pipeline\n"
        f"img = {str(samples[0])!r}\n"
        "pipe = Pipeline(Config(device='cpu', model='resnet18', weights=None))\n"
        "it = pipe.run([img] * 3)\nassert next(it).ok\n"
        "if sys.argv[1] == 'close': pipe.close()\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    procs = [  # (several at once: the abort came in about half the runs)
        subprocess.Popen([sys.executable, "-c", script, how], stderr=subprocess.PIPE, text=True, env=env)
        for how in ("leave", "leave", "leave", "close")
    ]
    for p in procs:
        _, err = p.communicate(timeout=240)
        assert p.returncode == 0, (p.returncode, err[-1500:])
        assert "Exception ignored" not in err and "terminate called" not in err, err[-1500:]
