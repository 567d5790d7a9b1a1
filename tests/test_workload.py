"""The workload contract offline: run_offline and ``fullthrottle run`` answer requests as the server
does (batches by count and cost, per-request and per-item errors, JSON checked)."""

import json

import pytest
from toy_workload import Fragile, Summer

from fullthrottle.core.json_body import parse_body
from fullthrottle.core.workload import run_offline


def test_run_offline_batches_across_requests_and_keeps_errors_per_request():
    w = Summer()
    w.setup("cpu")
    got = run_offline(w, [{"inputs": [[1, 2, 3, 4], [1, 1, 1, 1]]}, {"inputs": 3}, "x", {"inputs": [[0, 0, 0, 5]]}])
    assert got == [
        ({"results": [{"output": 10.0}, {"output": 4.0}]}, None),
        (None, "bad request: 'inputs' must be a list of 4-number lists"),
        (None, "bad request: the body must be a JSON object"),
        ({"results": [{"output": 5.0}]}, None),
    ]
    assert w.calls == [3]  # one predict() call for the items of both good requests


def test_run_offline_splits_by_max_batch_and_fails_only_whom_a_call_held():
    f = Fragile()  # max_batch 4; 'boom' breaks cost(); 'tensor' makes predict() return tensors
    f.setup("cpu")
    got = run_offline(f, [{"inputs": [[1, 1, 1, 1]] * 10}, {"inputs": ["boom"]}, {"inputs": [[0, 0, 0, 1]]}])
    assert got[0] == ({"results": [{"output": 4.0}] * 10}, None) and f.calls == [4, 4, 3]
    assert got[1] == (None, "cost() failed: KeyError: 'boom'")
    assert got[2] == ({"results": [{"output": 1.0}]}, None)
    got = run_offline(f, [{"inputs": ["tensor"]}])
    assert got[0][0] is None and got[0][1].startswith("the response is not JSON: TypeError")


def test_cli_run_answers_a_jsonl_file_in_order(tmp_path, capsys):
    from fullthrottle.cli import main

    src = tmp_path / "req.jsonl"
    src.write_text(
        '{"inputs": [[1,2,3,4]]}\n\n{"inputs": 3}\nnot json\n{"inputs": [[1,1,1,1],"x"]}\n{"inputs": ["x"]}\n'
    )
    out = tmp_path / "out.jsonl"
    assert main(["run", str(src), "--workload", "toy_workload:Summer", "--device", "cpu", "--out", str(out)]) == 1
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["line"] for r in rows] == [1, 3, 4, 5, 6]
    assert rows[0] == {"line": 1, "response": {"results": [{"output": 10.0}]}}
    assert "must be a list" in rows[1]["error"] and rows[2]["error"].startswith("malformed JSON")
    assert rows[3]["response"]["results"][0] == {"output": 4.0} and "error" in rows[3]["response"]["results"][1]
    assert rows[4]["error"] == "unprocessable: every item failed" and "error" in rows[4]["response"]["results"][0]
    assert "5 requests: 2 ok, 3 failed (sum)" in capsys.readouterr().err  # (all items failed: the server's 422)
    out.write_text("kept")  # a failed start leaves an existing --out as it was
    assert main(["run", str(src), "--workload", "toy_workload:BadSetup", "--device", "cpu", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "workload 'badsetup': setup() failed:" in err and "toy_workload.py" in err and out.read_text() == "kept"
    assert main(["run", str(src), "--workload", "toy_workload:ExitInSetup", "--device", "cpu"]) == 2
    assert "workload 'exitinsetup': setup() failed:" in (err := capsys.readouterr().err) and "SystemExit: 5" in err
    assert main(["run", str(src), "--workload", "toy_workload:BadStats", "--device", "cpu"]) == 2
    assert "workload 'badstats': stats must map names to fullthrottle.StageStats" in capsys.readouterr().err
    assert main(["run", str(src), "--workload", "toy_workload:Summer", "--out", str(src)]) == 2  # not the input
    assert "is the same file as the input" in capsys.readouterr().err and src.read_text().startswith('{"inputs"')
    (tmp_path / "blank.jsonl").write_text("\n\n")  # (no request: said; one request: in the singular)
    assert main(["run", str(tmp_path / "blank.jsonl"), "--workload", "toy_workload:Summer", "--device", "cpu"]) == 0
    assert capsys.readouterr().err.endswith(
        f"0 requests: 0 ok, 0 failed (sum)\nnote: {tmp_path / 'blank.jsonl'} holds no request (one JSON request "
        "body a line; blank lines are skipped)\n"
    )
    (tmp_path / "one.jsonl").write_text('{"inputs": [[1,2,3,4]]}\n')
    assert main(["run", str(tmp_path / "one.jsonl"), "--workload", "toy_workload:Summer", "--device", "cpu"]) == 0
    assert "1 request: 1 ok, 0 failed (sum)" in capsys.readouterr().err
    # an --out that cannot be written: said as generate says it, before setup() (here one that fails)
    assert main(["run", str(src), "--workload", "toy_workload:BadSetup", "--out", str(tmp_path)]) == 2
    assert capsys.readouterr().err.endswith(f"fullthrottle: error: cannot write --out {tmp_path}: Is a directory\n")
    assert main(["run", str(tmp_path / "nope.jsonl"), "--workload", "toy_workload:Summer"]) == 2
    assert "cannot read " + str(tmp_path / "nope.jsonl") + ": No such file" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["run", str(src)])  # --workload is required


def test_cli_run_gives_each_bad_line_its_own_error(tmp_path):
    """Not UTF-8, NaN, nesting 100,000 deep, a cut-off body: that line's error; a byte order mark is
    skipped; the lines around them are answered."""
    from fullthrottle.cli import main

    src = tmp_path / "req.jsonl"
    lines = [b'\xef\xbb\xbf{"inputs": [[1,2,3,4]]}', b'{"inputs": "\xff"}', b'{"inputs": [[NaN,1,2,3]]}']
    src.write_bytes(b"\n".join(lines + [b"[" * 100_000 + b"]" * 100_000, b'{"inputs": [[0,0,0,2]]}', b"{"]) + b"\n")
    out = tmp_path / "out.jsonl"
    assert main(["run", str(src), "--workload", "toy_workload:Summer", "--device", "cpu", "--out", str(out)]) == 1
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows[0]["response"] == {"results": [{"output": 10.0}]} and rows[4]["response"] == {
        "results": [{"output": 2.0}]
    }
    assert "not UTF-8" in rows[1]["error"] and "NaN is not JSON" in rows[2]["error"]
    assert rows[3]["error"] == "malformed JSON body: nested too deep"
    with pytest.raises(ValueError, match=r"^malformed JSON body: a number of more than \d+ digits$"):
        parse_body(b'{"n": ' + b"9" * 5000 + b"}")  # (not Python's words naming its setting)
    with pytest.raises(ValueError, match=r"^malformed JSON body: the number -1e999 is too large for a float$"):
        parse_body(b'{"n": [1.5, -1e999]}')  # (float() makes it -inf: Infinity by the back door)
    assert parse_body(b'{"n": [1.5, 1e308, -0.0, 2]}') == {"n": [1.5, 1e308, -0.0, 2]}
    with pytest.raises(ValueError, match=r"the number 1000000000000000000000000000000000000\.\.\. is too large"):
        parse_body(b"[1" + b"0" * 400 + b".5]")  # (cut, and said to be)
    for empty in (b"", b" \r\n"):  # (an empty body, and what curl -d name=value sends, said as such)
        with pytest.raises(ValueError, match=r"^malformed JSON body: it is empty$"):
            parse_body(empty)
    with pytest.raises(ValueError, match=r"^malformed JSON body: it is form-encoded \(name=value\), not JSON$"):
        parse_body(b"input=a+cat&model=x")
    # (a position inside a body is a column of its line: the row's "line" is the file's)
    assert rows[5]["line"] == 6 and rows[5]["error"].endswith("double quotes: column 2 (char 1)"), rows[5]


def test_run_offline_holds_workloads_to_the_contract_as_the_server_does():
    """Too many items, decode_request not giving a list, a negative cost, encode_response not giving a
    dict: each request's own error, worded as the server's."""
    from fullthrottle.core.workload import ContractError, TooManyItems, cost_of, items_of

    class Odd(Summer):
        name = "odd"
        max_batch_cost = 100

        def decode_request(self, body):
            return None if body.get("none") else super().decode_request(body)

        def cost(self, item):
            return -5 if item == [9, 9, 9, 9] else 1

        def encode_response(self, outputs):
            return outputs if outputs == [4.0] else super().encode_response(outputs)

    w = Odd()
    w.setup("cpu")
    got = run_offline(
        w,
        [{"inputs": [[1, 1, 1, 1]] * 9}, {"none": 1}, {"inputs": [[9, 9, 9, 9]]}, {"inputs": [[1, 1, 1, 1]]}],
    )
    assert got[0] == (None, "bad request: 9 items in one request; at most 8")
    assert got[1] == (None, "decode_request() must return a list, got NoneType")
    assert got[2] == (None, "cost() must return an integer >= 0, got -5")
    assert got[3] == (None, "encode_response() must return a dict, got list")
    with pytest.raises(TooManyItems):
        items_of(w, {"inputs": [[1, 1, 1, 1]] * 9})
    with pytest.raises(ContractError):
        cost_of(w, [9, 9, 9, 9])


def test_load_workload_names_what_is_not_a_workload():
    """A class or an instance of the contract loads; another object is named for what it is."""
    from fullthrottle.core.workload import load_workload

    assert isinstance(load_workload("toy_workload:Summer"), Summer)
    with pytest.raises(
        ValueError,
        match="^--workload collections:OrderedDict: an object of type OrderedDict is not a workload: subclass",
    ):
        load_workload("collections:OrderedDict")
    with pytest.raises(ValueError, match=r"NeedsArgs\(\) failed: TypeError: .*'scale'"):
        load_workload("toy_workload:NeedsArgs")
    from fullthrottle.core.workload import check_workload

    class Nameless(Summer):
        name = ""

    with pytest.raises(ValueError, match="Nameless.name must be 1-64 of a-z"):
        check_workload(Nameless())

    class Awaiting(Summer):
        async def decode_request(self, body):
            return [1]

    with pytest.raises(ValueError, match=r"Awaiting.decode_request\(\) is async: the contract's methods are plain"):
        check_workload(Awaiting())


def test_classification_through_the_contract_equals_the_library(samples, bad_dir):
    """ClassifyImages (base64 images in JSON) answers as Pipeline.classify on the same bytes; a string
    that is not base64 and a corrupt image fail alone."""
    import base64

    from fullthrottle import Config, Pipeline
    from fullthrottle.workloads.classify.api import ClassifyImages

    photos = [p.read_bytes() for p in samples[:6]]
    corrupt = next(p for p in sorted(bad_dir.iterdir()) if "truncated" in p.name or "corrupt" in p.name).read_bytes()
    w = ClassifyImages(threads=1)
    w.setup("cpu")
    b64 = [base64.b64encode(b).decode() for b in photos]
    got = run_offline(w, [{"images": b64[:4]}, {"images": b64[4:] + ["%%%", base64.b64encode(corrupt).decode()]}])
    ref = Pipeline(Config(device="cpu", threads=1)).classify([(f"image {i}", b) for i, b in enumerate(photos)])
    res = got[0][0]["results"] + got[1][0]["results"][:2]
    assert [[t["class_id"] for t in r["top_k"]] for r in res] == [r.class_ids for r in ref]
    assert [r["index"] for r in got[1][0]["results"]] == [0, 1, 2, 3]
    bad = got[1][0]["results"][2:]
    assert "not base64" in bad[0]["error"] and bad[0]["error_kind"] == "unsupported_input", bad
    assert bad[1]["error_stage"] == "preprocess", bad
    # as browsers (a data URL) and the base64 tool (lines of 76) write it, and with its padding left out
    j = next(j for j, b in enumerate(b64) if b.endswith("="))  # (a photo whose base64 is padded)
    wrapped = "\n".join(b64[j][k : k + 76] for k in range(0, len(b64[j]), 76)) + "\n"
    forms = [f"data:image/jpeg;base64,{b64[j]}", wrapped, b64[j].rstrip("="), f"DATA:image/jpeg;BASE64,{b64[j]}"]
    forms += ["data:text/plain,abc", "abcde", 7, None, {"b64": b64[j]}]
    got = run_offline(w, [{"images": forms}])[0][0]["results"]
    assert [[t["class_id"] for t in r["top_k"]] for r in got[:4]] == [ref[j].class_ids] * 4
    assert "not base64: a data: URL must be ';base64,'-encoded" in got[4]["error"]
    assert "not base64" in got[5]["error"] and "1 more than a multiple of 4" in got[5]["error"], got[5]
    # an entry that is not a string is that entry's error, named (the others are answered)
    assert [(r.get("error"), r.get("error_kind")) for r in got[6:]] == [
        (f"image {i}: not base64: a string is expected, not {t}", "unsupported_input")
        for i, t in ((6, "a number"), (7, "null"), (8, "an object"))
    ]


def test_completions_through_the_contract_equal_each_prompt_alone(tiny_llama):
    """The completions workload offline (continuous batching): requests batched together give, greedy,
    the tokens each prompt gets alone from the Generator, each ending at its own max_tokens; sampled
    with a seed, the same tokens alone and among others; a prompt past the context is its request's
    own error."""
    from fullthrottle.workloads.llm.api import Completions
    from fullthrottle.workloads.llm.generate import Generator

    model = tiny_llama
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    alone = Generator(model, max_batch=1, max_seq_len=64, graphs=False)
    refs = [alone.generate([p], max_new_tokens=n)[0] for p, n in zip(prompts, (5, 9, 7))]
    w = Completions(model=model, max_batch=4, max_seq_len=64)
    w.setup("cpu")
    bodies = [{"prompt": p, "max_tokens": n, "temperature": 0} for p, n in zip(prompts, (5, 9, 7))]
    got = run_offline(w, bodies + [{"prompt": [1], "max_tokens": 100}, {"prompt": "text"}])
    for (answer, err), ref in zip(got, refs):
        assert err is None and answer["choices"][0]["token_ids"] == ref
        assert answer["usage"]["completion_tokens"] == len(ref) and answer["choices"][0]["finish_reason"] == "length"
    assert "exceeds the context of 64" in got[3][1] and "no tokenizer" in got[4][1]
    # sampled, with a seed: the same tokens alone as batched beside others (each its own seed)
    seeded = {"prompt": [3, 1, 4, 1, 5], "max_tokens": 12, "temperature": 0.9, "top_k": 20, "seed": 7}
    (alone_answer, err), *_ = run_offline(w, [seeded])
    batched = run_offline(w, bodies[:2] + [seeded] + bodies[2:])
    assert err is None and batched[2][1] is None
    assert batched[2][0]["choices"][0]["token_ids"] == alone_answer["choices"][0]["token_ids"]
    assert len(alone_answer["choices"][0]["token_ids"]) == 12
    with pytest.raises(ValueError, match="FULLTHROTTLE_LLM_MODEL"):
        Completions().setup("cpu")


def test_run_offline_keeps_a_workloads_system_exit_and_deep_answers_to_their_request():
    """predict() raising SystemExit, or an answer nested deeper than JSON can be written: that
    request's error; the others are answered."""

    class Echo(Summer):
        name = "echo"
        max_batch = 1

        def decode_request(self, body):
            return [body["x"]]

        def predict(self, items):
            if items == ["exit"]:
                raise SystemExit(3)
            if items == ["nan"]:
                return [[1.0, float("nan")]]
            return [["deep"] if x == "deep" else x for x in items] if items != ["deep"] else [_nest(5000)]

    got = run_offline(Echo(), [{"x": 1}, {"x": "exit"}, {"x": "deep"}, {"x": 2}, {"x": "nan"}])
    assert got[0] == ({"results": [{"output": 1}]}, None) and got[3] == ({"results": [{"output": 2}]}, None)
    assert got[4] == (
        None,
        "the response is not JSON: it holds nan at results[0].output[1] (JSON has no NaN or Infinity)",
    )
    assert got[1] == (None, "predict() failed: exit(3)")
    assert got[2][0] is None and got[2][1].startswith("the response is not JSON: RecursionError")


def test_a_workload_of_its_own_class_without_stats_is_told_how_to_have_them():
    """A class that follows the contract without subclassing Workload, and keeps no ``stats``: the
    error says what to do (it said "stats must map names to StageStats, got None")."""
    from fullthrottle.core.workload import check_stats

    class Duck:
        name = "duck"

    with pytest.raises(ValueError, match=r"^workload 'duck' has no stats: set self.stats = \{\}, or subclass"):
        check_stats(Duck())


def test_counts_in_contract_errors_are_said_in_the_singular_for_one():
    """predict() giving no output for 1 item, a prompt of 1 token: each said in the singular."""
    from fullthrottle.workloads.llm.api import _tokens

    class Short(Summer):
        name = "short"

        def predict(self, items):
            return []

    assert run_offline(Short(), [{"inputs": [[1, 2, 3, 4]]}]) == [
        (None, "predict() failed: RuntimeError: predict() returned 0 outputs for 1 item")
    ]
    assert (_tokens(1), _tokens(2)) == ("1 token", "2 tokens")


def _nest(depth: int):
    x: list = []
    for _ in range(depth):
        x = [x]
    return x


def test_a_small_request_waits_a_call_or_two_not_every_call_of_a_large_one():
    """Requests larger than one call run in turns with the ones that arrive meanwhile (round robin):
    a one-item request sent while a 64-item request runs in 16 calls is answered after two calls,
    and the large one still gets every output, in order."""
    import asyncio
    import time

    from toy_workload import Slow

    from fullthrottle.server.workload_routes import WorkloadService

    class Small(Slow):  # 16 calls of 0.05 s for 64 items
        delay_s = 0.05
        max_items_per_request = 64

    w = Small()
    w.setup("cpu")
    svc = WorkloadService(w)

    async def main():
        big = svc.submit([[k, 0, 0, 0] for k in range(64)])
        await asyncio.sleep(0.12)
        t0 = time.perf_counter()
        assert await asyncio.wait_for(svc.submit([[2, 2, 2, 2]]), 5) == [8.0]
        waited = time.perf_counter() - t0
        assert not big.done() and waited < 0.3, (waited, w.calls)  # (all 16 calls: 0.8 s)
        assert await asyncio.wait_for(big, 5) == [float(k) for k in range(64)]
        assert sum(w.calls) == 65 and max(w.calls) == 4

    try:
        asyncio.run(main())
    finally:
        svc.close()


def test_requests_waiting_counts_only_callers_that_still_wait():
    """The service's ``waiting`` (/metrics' fullthrottle_requests_waiting): requests queued behind a
    predict() call in progress, less those whose callers left (a 504, a client gone), which stay
    queued until the batching thread skips them."""
    import asyncio

    from toy_workload import Hanging

    from fullthrottle.server.workload_routes import WorkloadService

    w = Hanging()
    w.setup("cpu")
    svc = WorkloadService(w)

    async def main():
        first = svc.submit([[1, 0, 0, 0]])
        assert await asyncio.to_thread(w.entered.wait, 5)  # (the first request is in predict())
        queued = [svc.submit([[k, 0, 0, 0]]) for k in range(3)]
        assert svc.waiting == 3
        queued[0].cancel()
        queued[2].cancel()
        assert svc.waiting == 1 and svc.q.qsize() == 3
        w.release.set()
        assert await asyncio.wait_for(first, 5) == [1.0] and await asyncio.wait_for(queued[1], 5) == [1.0]
        assert svc.waiting == 0

    try:
        asyncio.run(main())
    finally:
        w.release.set()
        svc.close()


def test_the_server_runs_a_large_request_in_calls_of_its_budget_and_drops_it_once_its_caller_left():
    """A request of more items than the budget holds runs in calls of the budget's size; a request
    answered as soon as its last call is done; the calls of one whose caller left are not made, so a
    request that comes after it is answered after the call in progress only."""
    import asyncio
    import time

    from toy_workload import Slow

    from fullthrottle.server.workload_routes import WorkloadService

    class Budget(Slow):
        delay_s = 0.05
        max_batch = 64
        max_batch_cost = 12  # tokens per call
        max_items_per_request = 64
        max_wait_ms = 20.0

        def cost(self, item):
            return 3  # 4 items per call

    w = Budget()
    w.setup("cpu")
    svc = WorkloadService(w)

    async def main():
        small = svc.submit([[1, 1, 1, 1]] * 2)
        got = await asyncio.wait_for(small, 5)
        assert got == [4.0, 4.0] and w.calls == [2]
        both = [svc.submit([[1, 0, 0, 0]] * 10), svc.submit([[0, 0, 0, 2]])]
        assert await asyncio.wait_for(both[0], 5) == [1.0] * 10 and await both[1] == [2.0]
        assert w.calls[1:] == [4, 4, 3]  # (calls of at most 12 tokens; the second request, over the
        # budget beside the first, joins after the first call, and the first request's turn comes first)
        del w.calls[:]
        big = svc.submit([[1, 1, 1, 1]] * 64)  # 16 calls of 0.05 s
        await asyncio.sleep(0.12)
        big.cancel()  # its caller left (a deadline, a client that hung up)
        t0 = time.perf_counter()
        assert await asyncio.wait_for(svc.submit([[2, 2, 2, 2]]), 5) == [8.0]
        waited = time.perf_counter() - t0
        assert len(w.calls) <= 5 and w.calls[-1] == 1 and waited < 0.4, (w.calls, waited)

    try:
        asyncio.run(main())
    finally:
        svc.close()


def test_calls_cut_items_by_count_and_budget_and_an_item_over_the_budget_runs_alone():
    from fullthrottle.core.workload import calls

    assert calls([3, 3, 3, 3, 9, 1], 64, 6) == [(0, 2), (2, 4), (4, 5), (5, 6)]
    assert calls([1] * 10, 4, None) == [(0, 4), (4, 8), (8, 10)]
    assert calls([5, 1, 1], 2, 100) == [(0, 2), (2, 3)] and calls([], 4, 10) == []


def test_an_item_that_makes_predict_raise_fails_its_own_request_only_offline_and_served():
    """A call that raises runs again item by item: the request of the item that raises alone fails,
    the others of the call are answered (offline and in the server alike)."""
    import asyncio

    from toy_workload import Unlucky

    from fullthrottle.server.workload_routes import WorkloadService

    w = Unlucky()
    w.setup("cpu")
    got = run_offline(w, [{"inputs": [[1, 1, 1, 1]]}, {"inputs": [[13, 13, 13, 13]]}, {"inputs": [[2, 2, 2, 2]]}])
    assert got == [
        ({"results": [{"output": 4.0}]}, None),
        (None, "predict() failed: RuntimeError: unlucky 13"),
        ({"results": [{"output": 8.0}]}, None),
    ]
    assert w.calls == [3, 1, 1, 1]  # (the call, then its items one by one)
    svc = WorkloadService(w)

    async def main():
        futs = [svc.submit([[k] * 4]) for k in (1, 13, 2)]
        return await asyncio.gather(*futs, return_exceptions=True)

    try:
        a, b, c = asyncio.run(main())
    finally:
        svc.close()
    assert a == [4.0] and c == [8.0] and isinstance(b, RuntimeError) and "unlucky 13" in str(b)


def test_predict_returning_no_list_of_outputs_is_the_workloads_error():
    """A dict (its keys), a str (its characters) or None from predict() are no outputs: each
    request's error, never keys answered as outputs."""

    class Mapper(Summer):
        name = "mapper"

        def predict(self, items):
            return {k: sum(x) for k, x in enumerate(items)} if items[0][0] == 1 else "ab"[: len(items)]

    w = Mapper()
    w.setup("cpu")
    got = run_offline(w, [{"inputs": [[1, 1, 1, 1], [1, 2, 3, 4]]}])
    assert got == [
        (None, "predict() failed: RuntimeError: predict() returned a dict, not a list of one output per item")
    ]
    got = run_offline(w, [{"inputs": [[5, 5, 5, 5], [2, 2, 2, 2]]}])
    assert got[0][1].endswith("predict() returned a str, not a list of one output per item")


def test_cli_run_writes_answers_as_they_come_and_ctrl_c_keeps_them(tmp_path):
    """``fullthrottle run`` writes each few batches' answers as they end: a SIGINT midway exits 130
    with the answered lines in --out."""
    import os
    import signal
    import subprocess
    import sys
    import time

    src, out = tmp_path / "req.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(f'{{"inputs": [[{k}, 0, 0, 0]]}}\n' for k in range(80)))  # 20 calls of 0.3 s
    here = os.path.dirname(__file__)
    proc = subprocess.Popen(
        [sys.executable, "-m", "fullthrottle.cli", "run", str(src), "--workload", "toy_workload:Slow"]
        + ["--device", "cpu", "--out", str(out)],
        env=dict(os.environ, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", "")),
        stderr=subprocess.PIPE,
    )
    deadline = time.time() + 60
    while time.time() < deadline and not (out.exists() and out.read_text().count("\n") >= 16):
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    assert proc.wait(30) == 130, proc.stderr.read()[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert 16 <= len(rows) < 80 and [r["line"] for r in rows] == list(range(1, len(rows) + 1))
    assert rows[3]["response"] == {"results": [{"output": 3.0}]}


def test_cli_run_writes_each_answer_before_the_next_runs(tmp_path):
    """Each answer is written (and flushed) once it and those before it are answered, not at the end
    of a chunk of requests: a workload that ends the process on request 4 leaves 1-3 in --out."""
    import os
    import subprocess
    import sys

    src, out = tmp_path / "req.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(f'{{"inputs": [[{k}, 0, 0, 0]]}}\n' for k in (1, 2, 3, 9, 5)))
    here = os.path.dirname(__file__)
    proc = subprocess.run(
        [sys.executable, "-m", "fullthrottle.cli", "run", str(src), "--workload", "toy_workload:DiesOnNine"]
        + ["--device", "cpu", "--out", str(out)],
        env=dict(os.environ, PYTHONPATH=here + os.pathsep + os.environ.get("PYTHONPATH", "")),
        capture_output=True,
        timeout=120,
    )
    assert proc.returncode == 7, proc.stderr[-2000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert rows == [{"line": k, "response": {"results": [{"output": float(k)}]}} for k in (1, 2, 3)]


def test_cli_embed_names_a_model_folder_without_a_model(tmp_path, capsys):
    from fullthrottle.cli import main

    (tmp_path / "texts.txt").write_text("hello\n")
    args = ["embed", "--model-dir", str(tmp_path), str(tmp_path / "texts.txt"), "--out", str(tmp_path / "v.npy")]
    assert main([*args, "--device", "cpu"]) == 2
    assert f"no sentence-transformers model in {tmp_path}: " in capsys.readouterr().err


def test_cli_embed_names_a_model_that_is_not_bert(tmp_path, capsys):
    """A folder of another kind of model (a Llama's config), or one whose weights lack BERT's tensors,
    is named as such (it was a KeyError of a tensor's name)."""
    import json

    import torch
    from safetensors.torch import save_file

    from fullthrottle.cli import main
    from fullthrottle.workloads.embed import default_model_dir

    (tmp_path / "texts.txt").write_text("hello\n")
    llama, wrong = tmp_path / "llama", tmp_path / "wrong"
    llama.mkdir()
    (llama / "config.json").write_text(json.dumps({"model_type": "llama", "max_position_embeddings": 2048}))
    wrong.mkdir()
    for f in default_model_dir().iterdir():  # (all-MiniLM-L6-v2's files, its weights replaced)
        if f.name != "model.safetensors":
            (wrong / f.name).symlink_to(f)
    save_file({"decoder.weight": torch.zeros(2, 2)}, str(wrong / "model.safetensors"))
    for folder, why in (
        (llama, "a 'llama' model; the embedder reads BERT models"),
        (wrong, "not a BERT model's weights"),
    ):
        args = ["embed", "--model-dir", str(folder), str(tmp_path / "texts.txt"), "--out", str(tmp_path / "v.npy")]
        assert main([*args, "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert why in err and "KeyError" not in err, err


def test_a_slow_decode_request_or_encode_response_leaves_the_server_answering():
    """The workload's own per-request code runs off the event loop: while three requests spend 1 s
    each in decode_request, /healthz answers at once and the three overlap."""
    import concurrent.futures as cf
    import time

    import httpx
    from test_serve import Server, Tiny

    from fullthrottle.server.app import ServeOptions

    class SlowParse(Summer):
        name = "slowparse"

        def decode_request(self, body):
            time.sleep(1.0)
            return super().decode_request(body)

        def encode_response(self, outputs):
            time.sleep(0.5)
            return super().encode_response(outputs)

    with Server(Tiny(), ServeOptions(workloads=(SlowParse(),), classify=False)) as s:
        ask = lambda k: httpx.post(s.url + "/v1/slowparse", json={"inputs": [[k, 0, 0, 0]]}, timeout=30)  # noqa: E731
        with cf.ThreadPoolExecutor(3) as ex:
            t0 = time.perf_counter()
            futs = [ex.submit(ask, k) for k in range(3)]
            time.sleep(0.3)
            t1 = time.perf_counter()
            assert httpx.get(s.url + "/healthz", timeout=30).status_code == 200
            health_s = time.perf_counter() - t1
            answers = [f.result().json()["results"] for f in futs]
            wall = time.perf_counter() - t0
    assert answers == [[{"output": float(k)}] for k in range(3)]
    assert health_s < 0.5 and wall < 3.0, (health_s, wall)  # (on the event loop: ~0.7 s and 4.5 s)


def test_the_deadline_counts_decode_request_and_predict_together():
    """--timeout-s bounds a workload request's whole time: a decode_request still running at the
    deadline is 504 then (it was answered 200 whenever it ended), and predict gets what is left."""
    import time

    import httpx
    from test_serve import Server, Tiny

    from fullthrottle.server.app import ServeOptions

    class SlowBoth(Summer):
        name = "slowboth"

        def decode_request(self, body):
            time.sleep(body["parse_s"])
            return super().decode_request(body)

        def predict(self, items):
            time.sleep(0.8)
            return super().predict(items)

    with Server(Tiny(), ServeOptions(workloads=(SlowBoth(),), classify=False, timeout_s=1.2)) as s:
        ask = lambda parse_s: httpx.post(  # noqa: E731
            s.url + "/v1/slowboth", json={"inputs": [[1, 0, 0, 0]], "parse_s": parse_s}, timeout=30
        )
        t0 = time.perf_counter()
        stuck = ask(3.0)
        stuck_s = time.perf_counter() - t0
        late, fine = ask(0.7), ask(0.0)  # 0.7 + 0.8 s is past 1.2; 0 + 0.8 s is not
    assert stuck.status_code == 504 and stuck.json()["detail"] == "deadline of 1.2 s exceeded"
    assert 1.1 < stuck_s < 2.5, stuck_s
    assert late.status_code == 504, late.text
    assert fine.status_code == 200 and fine.json()["results"] == [{"output": 1.0}]


def test_decode_requests_left_past_their_deadline_do_not_hold_up_other_requests():
    """A decode_request that overruns the deadline goes on in its thread after the 504. Eight such at
    once held every thread of asyncio's default pool (6 on 2 cores), so a request that decodes at
    once waited for them and got 504 too; each now holds a daemon thread of its own."""
    import concurrent.futures as cf
    import threading
    import time

    import httpx
    from test_serve import Server, Tiny

    from fullthrottle.server.app import ServeOptions

    started = threading.Semaphore(0)

    class Stuck(Summer):
        name = "stuck"

        def decode_request(self, body):
            if body.get("stuck"):
                started.release()
                time.sleep(3.0)
            return super().decode_request(body)

    with Server(Tiny(), ServeOptions(workloads=(Stuck(),), classify=False, timeout_s=1.0)) as s:
        ask = lambda stuck: httpx.post(  # noqa: E731
            s.url + "/v1/stuck", json={"inputs": [[2, 0, 0, 0]], "stuck": stuck}, timeout=30
        )
        with cf.ThreadPoolExecutor(8) as ex:
            stuck = [ex.submit(ask, True) for _ in range(8)]
            for _ in range(6):  # (at least the default pool's threads are taken)
                assert started.acquire(timeout=10)
            t0 = time.perf_counter()
            fine = ask(False)
            fine_s = time.perf_counter() - t0
            codes = [f.result().status_code for f in stuck]
    assert codes == [504] * 8
    assert fine.status_code == 200 and fine.json()["results"] == [{"output": 2.0}], fine.text
    assert fine_s < 0.8, fine_s


def test_workload_code_past_its_deadline_holds_at_most_max_workload_threads(monkeypatch):
    """Each decode_request left running past its 504 keeps a thread: past MAX_WORKLOAD_THREADS (4
    here) a request is answered 503 with Retry-After at once, where every such request added a
    thread; an encode_response past the deadline is 504 then (it was 200 whenever it ended)."""
    import concurrent.futures as cf
    import threading
    import time

    import httpx
    from test_serve import Server, Tiny

    from fullthrottle.server import workload_routes
    from fullthrottle.server.app import ServeOptions

    deadline = time.time() + 15  # (threads an earlier test left sleeping end first)
    while workload_routes._threads[0] and time.time() < deadline:
        time.sleep(0.1)
    monkeypatch.setattr(workload_routes, "MAX_WORKLOAD_THREADS", 4)
    started, release = threading.Semaphore(0), threading.Event()

    class Stuck(Summer):
        name = "stuck"

        def decode_request(self, body):
            if body.get("stuck"):
                started.release()
                release.wait(20)
            return super().decode_request(body)

        def encode_response(self, outputs):
            if outputs and outputs[0] == 7.0:
                time.sleep(2.0)
            return super().encode_response(outputs)

    with Server(Tiny(), ServeOptions(workloads=(Stuck(),), classify=False, timeout_s=1.0)) as s:
        ask = lambda body: httpx.post(s.url + "/v1/stuck", json={"inputs": [[1, 0, 0, 0]], **body}, timeout=30)  # noqa: E731
        with cf.ThreadPoolExecutor(4) as ex:
            stuck = [ex.submit(ask, {"stuck": True}) for _ in range(4)]
            for _ in range(4):
                assert started.acquire(timeout=10)
            assert [f.result().status_code for f in stuck] == [504] * 4
        busy = ask({})
        assert busy.status_code == 503 and busy.headers["retry-after"] == "1", busy.text
        assert "running in 4 threads already" in busy.json()["detail"]
        release.set()
        deadline = time.time() + 10
        while workload_routes._threads[0] and time.time() < deadline:
            time.sleep(0.05)
        assert ask({}).status_code == 200
        t0 = time.perf_counter()
        slow = httpx.post(s.url + "/v1/stuck", json={"inputs": [[7, 0, 0, 0]]}, timeout=30)
        assert slow.status_code == 504 and time.perf_counter() - t0 < 1.8, (slow.text, time.perf_counter() - t0)


def test_a_json_route_refuses_image_and_binary_bodies_with_415():
    """A workload's route reads JSON: a body sent as an image, a file or multipart gets 415 naming
    the route (it got 400 "malformed JSON body"); JSON sent as curl -d sends it is read."""
    import httpx
    from test_serve import Server, Tiny

    from fullthrottle.server.app import ServeOptions

    with Server(Tiny(), ServeOptions(workloads=(Summer(),), classify=False)) as s:
        url = s.url + "/v1/" + Summer.name
        refused = [
            httpx.post(url, content=b"\xff\xd8\xff\xe0", headers={"content-type": t}, timeout=30)
            for t in ("image/jpeg", "application/octet-stream", "multipart/form-data; boundary=B")
        ]
        curl_d = httpx.post(
            url,
            content=b'{"inputs": [[1, 2, 0, 0]]}',
            headers={"content-type": "application/x-www-form-urlencoded"},
            timeout=30,
        )
    assert [(r.status_code, r.json()["detail"]) for r in refused] == [
        (415, f"Content-Type {t} is not accepted: /v1/{Summer.name} reads a JSON body (application/json)")
        for t in ("image/jpeg", "application/octet-stream", "multipart/form-data")
    ]
    assert curl_d.status_code == 200 and curl_d.json()["results"] == [{"output": 3.0}]


def test_a_keyboard_interrupt_raised_in_decode_request_or_encode_response_is_the_workloads_error():
    """Raised in the workload's own code (a thread: never a signal), it fails that request with a
    JSON 500 naming the method, as any other exception would; the server answers the next one."""
    import httpx
    from test_serve import Server, Tiny

    from fullthrottle.server.app import ServeOptions

    class Interrupting(Summer):
        name = "interrupting"

        def decode_request(self, body):
            if body.get("stop"):
                raise KeyboardInterrupt
            return super().decode_request(body)

        def encode_response(self, outputs):
            if outputs[0] == 7.0:
                raise KeyboardInterrupt
            return super().encode_response(outputs)

    with Server(Tiny(), ServeOptions(workloads=(Interrupting(),), classify=False)) as s:
        ask = lambda body: httpx.post(s.url + "/v1/interrupting", json=body, timeout=30)  # noqa: E731
        r = ask({"stop": True, "inputs": [[1, 1, 1, 1]]})
        assert (r.status_code, r.json()) == (500, {"detail": "decode_request() failed: KeyboardInterrupt"})
        r = ask({"inputs": [[7, 0, 0, 0]]})
        assert (r.status_code, r.json()) == (500, {"detail": "encode_response() failed: KeyboardInterrupt"})
        r = ask({"inputs": [[1, 2, 0, 0]]})
        assert (r.status_code, r.json()) == (200, {"results": [{"output": 3.0}]})


def test_cli_run_keeps_a_workloads_prints_out_of_the_answers_on_stdout(tmp_path, capsys):
    """``run`` with the answers on stdout: what the workload's own code prints goes to stderr (it
    was written among the JSON lines)."""
    from fullthrottle.cli import main

    src = tmp_path / "req.jsonl"
    src.write_text('{"inputs": [[1,2,3,4]]}\n{"inputs": [[1,1,1,1]]}\n')
    assert main(["run", str(src), "--workload", "toy_workload:Chatty", "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert [json.loads(line)["response"]["results"][0]["output"] for line in out.splitlines()] == [10.0, 4.0]
    assert "setting up" in err and "predicting" in err
