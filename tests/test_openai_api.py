"""The LLM routes through the official ``openai`` client on 127.0.0.1 (a random small Llama with a
byte-level BPE tokenizer and a chat template, CPU): completions and chat, streamed and not, stop
strings, usage, seeds, /v1/models and the 400s; and TextStream's incremental decoding."""

import concurrent.futures as cf
import json
import re

import openai
import pytest
from test_pipeline import Tiny
from test_serve import Server

from fullthrottle.server.app import ServeOptions
from fullthrottle.workloads.llm.generate import Generator
from fullthrottle.workloads.llm.text import TextStream

TEXT = "naïve café, déjà vu: 😀 the quick brown fox"


def test_text_stream_gives_whole_characters_and_ends_before_the_first_stop(tiny_text):
    ids = tiny_text.encode(TEXT, special=False)
    assert tiny_text.decode(ids) == TEXT and len(ids) > 10
    for step in (1, 2, 3):
        ts = TextStream(tiny_text)
        parts = [ts.push(ids[i : i + step]) for i in range(0, len(ids), step)] + [ts.flush()]
        assert "".join(parts) == TEXT and not any("\ufffd" in p for p in parts)
    for stop in ("café", "vu: 😀", "fox", "ï"):  # whatever the chunking
        for step in (1, 4):
            ts = TextStream(tiny_text, [stop, "zzz"])
            out = "".join(ts.push(ids[i : i + step]) for i in range(0, len(ids), step)) + ts.flush()
            assert out == TEXT[: TEXT.find(stop)] and ts.stopped
    ts = TextStream(tiny_text, ["fox!"])  # a tail that could begin a stop string waits, then comes out
    out = "".join(ts.push([i]) for i in ids)
    assert out == TEXT[: -len("fox")] and out + ts.flush() == TEXT and not ts.stopped


def test_text_stream_counts_the_tokens_up_to_the_one_that_completes_the_stop(tiny_text):
    """``used``: the token that completes the stop string's last character (one split over byte
    tokens included), also when the stop is found in text held back over several pushes (bytes
    that make no character) and only at the flush."""
    ids = tiny_text.encode(TEXT, special=False)
    j = next(j for j in range(len(ids)) if tiny_text.decode(ids[: j + 1]).endswith("\ufffd"))  # a split character
    end = len(tiny_text.decode(ids[: j + 2]))  # (its last piece is token j + 1)
    for step in (1, len(ids)):
        ts = TextStream(tiny_text, [TEXT[end - 2 : end]])
        out = "".join(ts.push(ids[i : i + step]) for i in range(0, len(ids), step)) + ts.flush()
        assert ts.stopped and out == TEXT[: end - 2] and ts.used == j + 2, step
    lone = tiny_text.tokenizer.token_to_id("©")  # byte 0xA9 alone: no character, ever
    pieces = [tiny_text.encode("the quick", special=False) + [lone], tiny_text.encode(" brown", special=False) + [lone]]
    ts = TextStream(tiny_text, ["ick"])
    assert [ts.push(p) for p in pieces] == ["", ""] and not ts.stopped  # (all held back)
    assert ts.flush() == "the qu" and ts.stopped
    assert tiny_text.decode(pieces[0][: ts.used]).endswith("ick") and "ick" not in tiny_text.decode(
        pieces[0][: ts.used - 1]
    )


def test_token_bytes_rebuild_the_text_a_piece_of_a_character_included(tiny_text):
    """What chat logprobs' ``bytes`` hold: each token's own bytes (a token that is part of a UTF-8
    character among them), byte-level BPE and SentencePiece's byte tokens alike."""
    from tokenizers import Tokenizer, models

    from fullthrottle.workloads.llm.text import LlmText

    ids = tiny_text.encode(TEXT, special=False)
    pieces = [tiny_text.token_bytes(i) for i in ids]
    assert b"".join(pieces) == TEXT.encode("utf-8")
    assert tiny_text.token_bytes(tiny_text.tokenizer.token_to_id("</s>")) == b""  # (not in the reply's text)
    assert any(p and "\ufffd" in tiny_text.decode([i]) for i, p in zip(ids, pieces))  # (parts of characters)
    sp = LlmText(Tokenizer(models.WordLevel({"<0xE2>": 0, "<0x82>": 1, "hi": 2, "<unk>": 3}, unk_token="<unk>")))
    assert [sp.token_bytes(i) for i in (0, 1, 2)] == [b"\xe2", b"\x82", b"hi"]


@pytest.fixture(params=[0, 6], ids=["static-kv", "paged-kv"])
def llm(make_tiny_llama, tiny_text, request):
    """(server, ``alone(ids, n)``: the greedy tokens of a prompt run alone, the LlmText); the server's
    KV memory a static row per request, or 6 pages of 64 tokens for its 4 rows (requests of 128
    positions take 2: three fit at once)."""
    model = make_tiny_llama(vocab_size=tiny_text.tokenizer.get_vocab_size(), max_position_embeddings=128)
    ref = Generator(model, max_batch=1, max_seq_len=128, graphs=False)
    refs = {}  # ref's answers, made before the server's Generator takes the model's KV cache

    def alone(ids, n):
        if (tuple(ids), n) not in refs:
            raise KeyError("compute references before the server starts")
        return refs[tuple(ids), n]

    for prompt, n in (("the quick brown fox", 20), ("hello world", 60)):
        ids = tiny_text.encode(prompt)
        refs[tuple(ids), n] = ref.generate([ids], n)[0]
    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    cids = tiny_text.encode(tiny_text.chat_prompt(msgs), special=False)
    refs[tuple(cids), 16] = ref.generate([cids], 16)[0]
    gen = Generator(model, max_batch=4, max_seq_len=128, graphs=False, check_every=4, kv_pages=request.param)
    with pytest.raises(RuntimeError, match="took its KV cache"):
        ref.generate([ids], 4)
    with Server(Tiny(), ServeOptions(llm=(gen, tiny_text), llm_name="tiny")) as s:
        s.gen = gen
        yield s, alone, tiny_text


def client(s) -> openai.OpenAI:
    return openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_completions_and_chat_through_the_openai_client(llm):
    s, ref, text = llm
    c = client(s)
    assert [m.id for m in c.models.list()] == ["tiny"] and c.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError, match="'gpt-4' is not served here"):
        c.models.retrieve("gpt-4")
    with pytest.raises(openai.NotFoundError, match="'gpt-4' is not served here"):  # another model's name
        c.completions.create(model="gpt-4", prompt="hi", max_tokens=2)
    import httpx

    assert httpx.get(s.url + "/readyz").json()["llm"] == "tiny"
    # a route or method the server lacks: OpenAI's error shape under /v1/, which its client shows
    r404, r405 = httpx.post(s.url + "/v1/responses", json={}), httpx.get(s.url + "/v1/completions")
    assert r404.status_code == 404 and r404.json()["error"]["message"] == "no route POST /v1/responses"
    assert r404.json()["error"]["type"] == "invalid_request_error"  # (not a model the server lacks)
    assert r405.status_code == 405 and r405.json()["error"]["type"] and "POST" in r405.headers["allow"]
    prompt = "the quick brown fox"
    ids = text.encode(prompt)
    want = text.decode(ref(ids, 20))  # greedy, the request alone
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
    assert r.choices[0].text == want and r.choices[0].finish_reason == "length"
    assert (r.usage.prompt_tokens, r.usage.completion_tokens, r.usage.total_tokens) == (len(ids), 20, len(ids) + 20)
    chunks = list(
        c.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=20,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert "".join(ch.choices[0].text or "" for ch in chunks if ch.choices) == want and len(chunks) > 3
    assert chunks[-2].choices[0].finish_reason == "length"
    assert not chunks[-1].choices and chunks[-1].usage.completion_tokens == 20

    msgs = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]
    rendered = text.chat_prompt(msgs)  # the template, applied
    assert rendered == "<s><|system|>\nbe brief</s>\n<|user|>\nhello world</s>\n<|assistant|>\n"
    cids = text.encode(rendered, special=False)
    cwant = text.decode(ref(cids, 16))
    r = c.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.choices[0].message.content == cwant and r.usage.prompt_tokens == len(cids)
    stream = list(c.chat.completions.create(model="tiny", messages=msgs, max_tokens=16, temperature=0, stream=True))
    assert stream[0].choices[0].delta.role == "assistant" and stream[-1].choices[0].finish_reason == "length"
    assert "".join(ch.choices[0].delta.content or "" for ch in stream) == cwant


def test_stop_strings_seeds_and_refusals(llm):
    s, ref, text = llm
    c = client(s)
    prompt = "hello world"
    full = c.completions.create(model="tiny", prompt=prompt, max_tokens=60, temperature=0).choices[0].text
    assert full == text.decode(ref(text.encode(prompt), 60))
    stop = full[12:15]
    assert stop.strip() and len(full) > 30
    cut = full[: full.find(stop)]
    r = c.completions.create(model="tiny", prompt=prompt, max_tokens=60, temperature=0, stop=[stop, "never here"])
    assert r.choices[0].text == cut and r.choices[0].finish_reason == "stop" and r.usage.completion_tokens < 60
    streamed = list(
        c.completions.create(model="tiny", prompt=prompt, max_tokens=60, temperature=0, stop=stop, stream=True)
    )
    assert "".join(ch.choices[0].text for ch in streamed) == cut and streamed[-1].choices[0].finish_reason == "stop"
    # whatever the stop string, streamed text is the whole reply's, also where the stop string ends
    # inside text held back so far (a part of a character, or what could begin the stop string)
    stops = list(dict.fromkeys(full[i : i + k] for k in (1, 2) for i in range(len(full))))
    for stop in [x for x in stops if "\ufffd" not in x][:40]:
        kw = dict(model="tiny", prompt=prompt, max_tokens=60, temperature=0, stop=stop)
        whole = c.completions.create(**kw)
        chunks = list(c.completions.create(stream=True, stream_options={"include_usage": True}, **kw))
        assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == whole.choices[0].text, stop
        assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason == "stop", stop
        n = whole.usage.completion_tokens  # the tokens up to the one that completes the stop string
        toks = ref(text.encode(prompt), 60)
        assert stop in text.decode(toks[:n]) and stop not in text.decode(toks[: n - 1]), stop
        assert chunks[-1].usage.completion_tokens == n, stop
        # the streamed ids are the whole reply's: none past the token that completes the stop string
        streamed_ids = [i for ch in chunks if ch.choices for i in ch.choices[0].token_ids]
        assert streamed_ids == whole.choices[0].token_ids == toks[:n], stop

    # a seeded, sampled request gets the same text alone and among others
    kw = dict(model="tiny", max_tokens=24, temperature=1.0, top_p=0.9)
    alone = c.completions.create(prompt=prompt, seed=7, **kw).choices[0].text
    with cf.ThreadPoolExecutor(4) as ex:
        futs = [
            ex.submit(c.completions.create, prompt=p, seed=sd, **kw)
            for p, sd in [(prompt, 7), ("the lazy dog", 1), ("café", 2), (prompt, 8)]
        ]
        got = [f.result().choices[0].text for f in futs]
    assert got[0] == alone and got[3] != alone

    with pytest.raises(openai.BadRequestError, match=r"max_tokens \(126\) exceeds the context of 128"):
        c.completions.create(model="tiny", prompt=prompt, max_tokens=126)
    with pytest.raises(openai.BadRequestError, match=r"max_tokens \(not given: its default, 16\) exceeds the context"):
        c.completions.create(model="tiny", prompt=[5] * 120)
    with pytest.raises(openai.BadRequestError, match="n must be 1"):
        c.completions.create(model="tiny", prompt=prompt, n=2)
    with pytest.raises(openai.BadRequestError, match="at most 4"):
        c.completions.create(model="tiny", prompt=prompt, stop=["a", "b", "c", "d", "e"])
    with pytest.raises(openai.BadRequestError, match="logprobs are off on this engine"):
        c.completions.create(model="tiny", prompt=prompt, logprobs=2)
    with pytest.raises(openai.BadRequestError, match=r"messages\[0\] must be an object with a string role"):
        c.chat.completions.create(model="tiny", messages=[{"content": "hi"}])
    with pytest.raises(openai.BadRequestError, match="non-empty list"):
        c.chat.completions.create(model="tiny", messages=[])
    hi = [{"role": "user", "content": "hi"}]  # (a chat has no prompt field: its messages are named)
    with pytest.raises(
        openai.BadRequestError, match=r"messages \(\d+ tokens\) \+ max_tokens \(126\) exceeds the context"
    ) as e:
        c.chat.completions.create(model="tiny", messages=hi, max_tokens=126)
    assert e.value.param == "messages"
    with pytest.raises(
        openai.BadRequestError, match=r"messages \(\d+ tokens in the chat template\) leave no room"
    ) as e:
        c.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi " * 200}])
    assert e.value.param == "messages"


def test_chat_needs_a_template(make_tiny_llama, tiny_text):
    from fullthrottle.workloads.llm.text import LlmText

    model = make_tiny_llama(vocab_size=tiny_text.tokenizer.get_vocab_size())
    gen = Generator(model, max_batch=1, max_seq_len=32, graphs=False)
    with Server(Tiny(), ServeOptions(llm=(gen, LlmText(tiny_text.tokenizer)))) as s:
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client(s).chat.completions.create(model="llm", messages=[{"role": "user", "content": "hi"}])
    with Server(Tiny(), ServeOptions(llm=(gen, None))) as s:  # token ids only
        with pytest.raises(openai.BadRequestError, match="no tokenizer"):
            client(s).chat.completions.create(model="llm", messages=[{"role": "user", "content": "hi"}])


def test_a_full_admission_queue_answers_503_with_retry_after(make_tiny_llama):
    import httpx

    model = make_tiny_llama(max_position_embeddings=1024)
    gen = Generator(model, max_batch=1, max_seq_len=1024, graphs=False)
    with Server(Tiny(), ServeOptions(llm=(gen, None), max_queue=2, retry_after_s=3, timeout_s=600)) as s:
        # (a deadline far past the 4 x 400 tokens the accepted requests generate in turn on a slow CPU)
        body = {"prompt": [1, 2, 3], "max_tokens": 400, "temperature": 0}  # 1 running, 1 waiting, 2 queued
        with cf.ThreadPoolExecutor(10) as ex:
            futs = [ex.submit(httpx.post, s.url + "/v1/completions", json=body, timeout=120) for _ in range(10)]
            seen = set()  # /metrics meanwhile: one request holds the only row, others wait for it
            while not all(f.done() for f in futs):
                m = httpx.get(s.url + "/metrics").text
                run = re.search(r'fullthrottle_requests_running\{workload="generate"\} (\S+)', m)
                wait = re.search(r'fullthrottle_requests_waiting\{workload="generate"\} (\S+)', m)
                if run and wait:
                    seen.add((float(run.group(1)), float(wait.group(1)) > 0))
            got = [f.result() for f in futs]
        assert (1.0, True) in seen, seen
        codes = sorted(r.status_code for r in got)
        busy = [r for r in got if r.status_code == 503]
        assert codes.count(200) >= 3 and busy and set(codes) == {200, 503}, codes
        m = httpx.get(s.url + "/metrics").text  # every answer given: none running or waiting, at once
        assert 'fullthrottle_requests_running{workload="generate"} 0.0' in m
        assert 'fullthrottle_requests_waiting{workload="generate"} 0.0' in m
        assert busy[0].headers["retry-after"] == "3" and "queue full" in busy[0].json()["error"]["message"]
        assert all(len(r.json()["choices"][0]["token_ids"]) == 400 for r in got if r.status_code == 200)


def test_bad_values_get_a_400_naming_the_field_and_do_not_disturb_other_requests(llm):
    import httpx

    s, ref, text = llm
    url = s.url + "/v1/completions"
    ids = text.encode("hello world")
    with httpx.Client(timeout=60) as h:
        long = h.build_request("POST", url, json={"prompt": ids, "max_tokens": 100, "temperature": 0, "stream": True})
        running = h.send(long, stream=True)  # a request generating while the bad ones come in
        bad = [
            ({"top_k": 1e300}, "top_k must be an integer"),
            ({"top_k": 10**30}, "top_k must be an integer in [0, 2**63)"),
            ({"temperature": 1e300}, "temperature must be a number in [0, 3e38]"),
            ({"temperature": 10**400}, "temperature is out of range"),
            ({"temperature": "0.5"}, "temperature must be a number"),
            ({"top_k": True}, "top_k must be an integer"),
            ({"n": True}, "n must be an integer"),
            ({"echo": True}, "echo is not supported"),
            ({"stream_options": {"include_usage": True}}, "stream_options is for streamed requests only"),
            ({"presence_penalty": 0.5}, "presence_penalty is not supported"),
            ({"best_of": True}, "best_of is not supported"),  # (taken as 1)
            ({"response_format": {"type": "json_object"}}, "response_format is not supported"),
            ({"min_tokens": 3}, "min_tokens is not supported"),
            ({"model": ["x"]}, "model must be a string, got an array"),  # (was 404)
            ({"prompt": ""}, "prompt is empty"),
            ({"prompt": "a\ud800b"}, "prompt is not valid Unicode (a lone surrogate at character 1:"),
            ({"user": 5}, "user must be a string"),
            ({"prompt": "x" * (64 * 128 + 1)}, "far more than the context"),
        ]
        params = {}
        for extra, why in bad:
            body = json.dumps({"prompt": "hello", "max_tokens": 4, **extra})  # (ASCII: escapes lone surrogates)
            r = h.post(url, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400 and why in r.json()["error"]["message"], (extra, r.text)
            params[why] = r.json()["error"]["param"]
        # the field a message starts with is OpenAI's ``param`` (its client shows it); none for others
        assert params["temperature must be a number"] == "temperature" and params["n must be an integer"] == "n"
        assert params["model must be a string, got an array"] == "model"
        assert params["min_tokens is not supported"] == "min_tokens"  # (vLLM's extensions are fields too)
        from fullthrottle.server.guard import OPENAI_FIELDS
        from fullthrottle.workloads.llm.api import UNSUPPORTED

        assert set(UNSUPPORTED) <= OPENAI_FIELDS  # (each refused option is named as its field)
        assert params["prompt is not valid Unicode (a lone surrogate at character 1:"] == "prompt"
        ok = h.post(url, json={"prompt": "hello", "max_tokens": 2, "response_format": {"type": "text"}, "best_of": 1})
        assert ok.status_code == 200, ok.text  # (OpenAI's defaults, as its clients send them: was 400)
        chat = s.url + "/v1/chat/completions"
        for msgs, why in (
            ([{"role": "wizard", "content": "x"}], "messages[0].role must be one of system"),
            ([{"role": "user"}], "messages[0].content is required"),
            ([{"role": "system", "content": "be brief"}, {"role": "user", "content": None}], "messages[1].content"),
            # (a lone surrogate: named by its message and its place there, not the template's text)
            ([{"role": "user", "content": "ab\udc00"}], "messages[0].content is not valid Unicode (a lone surrogate at character 2:"),
            ([{"role": "user", "content": [{"type": "text", "text": "x"}, {"type": "text", "text": "\ud800"}]}],
             "messages[0].content is not valid Unicode (a lone surrogate at character 1:"),
            ([{"role": "user", "content": "x" * (64 * 128 + 1)}], "messages make a prompt of 8"),  # (no prompt field)
        ):  # fmt: skip
            body = json.dumps({"messages": msgs, "max_tokens": 4})  # (ASCII: escapes lone surrogates)
            r = h.post(chat, content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400 and why in r.json()["error"]["message"], (msgs, r.text)
            assert r.json()["error"]["param"] == "messages"
        import gzip

        for body in (gzip.compress(json.dumps({"prompt": "hello"}).encode()), json.dumps({"prompt": "hello"}).encode()):
            r = h.post(url, content=body, headers={"content-type": "application/json", "content-encoding": "gzip"})
            assert r.status_code == 415 and "Content-Encoding gzip is not accepted" in r.json()["error"]["message"]
        for route, ctype in ((url, "image/jpeg"), (chat, "multipart/form-data; boundary=B"), (url, "audio/wav")):
            r = h.post(route, content=b"\xff\xd8\xff", headers={"content-type": ctype})  # (as the other JSON routes)
            assert r.status_code == 415 and r.json()["error"]["message"] == (
                f"Content-Type {ctype.split(';')[0]} is not accepted: {route.removeprefix(s.url)} reads a JSON body "
                "(application/json)"
            ), r.text
        r = h.post(url, json={"prompt": ids, "max_tokens": None, "stream": None, "n": None, "temperature": 0})
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) == 16  # null: the default
        tiny_p = h.post(url, json={"prompt": ids, "max_tokens": 20, "temperature": 1.0, "top_p": 1e-300})
        greedy = h.post(url, json={"prompt": ids, "max_tokens": 20, "temperature": 0})
        assert tiny_p.json()["choices"][0]["token_ids"] == greedy.json()["choices"][0]["token_ids"]  # top token only
        lines = [x for x in running.iter_lines() if x.startswith("data: ")]
        running.close()
    assert lines[-1] == "data: [DONE]" and '"finish_reason": "length"' in lines[-2]


def test_a_non_streaming_client_that_hangs_up_frees_its_row(make_tiny_llama):
    import socket
    import time

    model = make_tiny_llama(max_position_embeddings=4096)
    gen = Generator(model, max_batch=1, max_seq_len=4096, graphs=False)
    decoded = gen.stats["decode"]
    with Server(Tiny(), ServeOptions(llm=(gen, None))) as s:
        body = b'{"prompt": [1, 2, 3], "max_tokens": 4000, "temperature": 0}'
        head = f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        sock = socket.create_connection(("127.0.0.1", s.port))
        sock.sendall(head.encode() + body)
        deadline = time.time() + 30
        while decoded.items == 0 and time.time() < deadline:
            time.sleep(0.05)
        sock.close()  # gone before its answer
        t0 = time.time()
        r = client(s).completions.create(model="llm", prompt=[5, 6], max_tokens=5)  # waits for the only row
        assert len(r.choices[0].token_ids) == 5 and time.time() - t0 < 10
    assert decoded.items < 3900  # the hung-up request stopped long before its 4000 tokens


def test_a_streaming_client_that_disconnects_mid_stream_frees_its_row(make_tiny_llama):
    """The OpenAI client reads a few chunks of a long stream and closes it: its request ends at the next
    step, so the next request gets the only row at once; /metrics counts it 499, not 200."""
    import time

    import httpx

    model = make_tiny_llama(max_position_embeddings=4096)
    gen = Generator(model, max_batch=1, max_seq_len=4096, graphs=False)
    decoded = gen.stats["decode"]
    with Server(Tiny(), ServeOptions(llm=(gen, None))) as s:
        c = client(s)
        stream = c.completions.create(model="llm", prompt=[1, 2, 3], max_tokens=4000, temperature=0, stream=True)
        chunks = iter(stream)
        got = [next(chunks) for _ in range(3)]
        assert [ch.object for ch in got] == ["text_completion"] * 3
        stream.close()  # gone mid-stream
        t0 = time.time()
        r = c.completions.create(model="llm", prompt=[5, 6], max_tokens=5)  # waits for the only row
        assert len(r.choices[0].token_ids) == 5 and time.time() - t0 < 10
        done = list(c.completions.create(model="llm", prompt=[5, 6], max_tokens=3, stream=True))
        assert done[-1].choices[0].finish_reason == "length"
        counts = {  # the dropped stream counted 499, the whole one 200, each once
            line.split("}")[0]: float(line.split()[-1])
            for line in httpx.get(f"{s.url}/metrics").text.splitlines()
            if line.startswith("fullthrottle_requests_total") and "/v1/completions" in line
        }
    assert decoded.items < 3900  # the closed stream stopped long before its 4000 tokens
    assert {k.split('status="')[1].rstrip('"'): v for k, v in counts.items()} == {"200": 2.0, "499": 1.0}


def test_chat_templates_that_do_not_compile_or_fail_give_clear_errors(tiny_text, tmp_path):
    from fullthrottle.workloads.llm.text import LlmText

    broken = LlmText(tiny_text.tokenizer, "{% for m in messages %}{{ m['content'] }")
    with pytest.raises(ValueError, match="does not compile: line 1"):
        broken.chat_prompt([{"role": "user", "content": "hi"}])
    tiny_text.tokenizer.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": broken.chat_template}))
    with pytest.raises(ValueError, match="does not compile"):  # at load: the server does not start with it
        LlmText.from_folder(tmp_path)
    failing = LlmText(tiny_text.tokenizer, "{{ 1 // (messages | length - 1) }}")
    with pytest.raises(ValueError, match="failed on these messages: ZeroDivisionError"):
        failing.chat_prompt([{"role": "user", "content": "hi"}])
    parts = [{"type": "text", "text": "hel"}, {"type": "text", "text": "lo"}]  # OpenAI's content parts, and null
    msgs = [{"role": "user", "content": parts}, {"role": "assistant", "content": None}]
    assert tiny_text.chat_prompt(msgs) == "<s><|user|>\nhello</s>\n<|assistant|>\n</s>\n<|assistant|>\n"


def test_completion_logprobs_name_a_piece_of_a_character_by_its_bytes(tiny_text):
    """In /v1/completions' logprobs a token that is part of a UTF-8 character is ``bytes:\\xNN``, as
    OpenAI's API shows one: such tokens keep apart in ``top_logprobs`` (each was U+FFFD, and all but
    the likeliest were lost); ``text_offset`` still counts the text."""
    from fullthrottle.server.text import _Reply

    ids = tiny_text.encode(TEXT, special=False)
    split = [i for i in ids if "\ufffd" in tiny_text.decode([i])][:2]
    whole = next(i for i in ids if "\ufffd" not in tiny_text.decode([i]))
    assert len(split) == 2 and tiny_text.token_bytes(split[0]) != tiny_text.token_bytes(split[1])
    rep = _Reply(False, {"logprobs": 3, "stop": []}, "llm", tiny_text)
    rep.tokens, rep.lps = (
        [split[0], whole],
        [(-0.5, [split[0], split[1], whole], [-0.5, -1.0, -2.0]), (-0.1, [whole], [-0.1])],
    )
    lp = rep.logprobs(0, 2)
    shown = ["bytes:" + "".join(f"\\x{b:02x}" for b in tiny_text.token_bytes(i)) for i in split]
    assert lp["tokens"] == [shown[0], tiny_text.decode([whole])]
    assert lp["top_logprobs"][0] == {shown[0]: -0.5, shown[1]: -1.0, tiny_text.decode([whole]): -2.0}
    assert lp["text_offset"] == [0, len(tiny_text.decode([split[0]]))]
    # the chosen token is always among top_logprobs, as OpenAI's API gives it (logprobs 0: it alone)
    rep = _Reply(False, {"logprobs": 0, "stop": []}, "llm", tiny_text)
    rep.tokens, rep.lps = [whole, split[1]], [(-0.7, [], []), (-3.0, [whole], [-0.2])]
    assert rep.logprobs(0, 2)["top_logprobs"] == [
        {tiny_text.decode([whole]): -0.7},
        {tiny_text.decode([whole]): -0.2, shown[1]: -3.0},
    ]


def test_logprobs_through_the_openai_client(make_tiny_llama, tiny_text):
    model = make_tiny_llama(vocab_size=tiny_text.tokenizer.get_vocab_size(), max_position_embeddings=128)
    gen = Generator(model, max_batch=2, max_seq_len=128, graphs=False, check_every=4, logprobs=5)
    with Server(Tiny(), ServeOptions(llm=(gen, tiny_text))) as s:
        c = client(s)
        r = c.completions.create(model="llm", prompt="hello world", max_tokens=9, temperature=0, logprobs=3)
        lp = r.choices[0].logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 9 == r.usage.completion_tokens
        for tok, chosen, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
            assert len(top) <= 3 and chosen <= 0 and abs(chosen - max(top.values())) < 1e-5  # greedy: the top one
            assert tok in top
        assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
        msgs = [{"role": "user", "content": "hi"}]
        chat = c.chat.completions.create(
            model="llm", messages=msgs, max_tokens=6, temperature=0, logprobs=True, top_logprobs=2
        )
        content = chat.choices[0].logprobs.content
        assert len(content) == 6 and all(len(t.top_logprobs) == 2 and t.logprob <= 0 for t in content)
        streamed = [
            x
            for ch in c.chat.completions.create(
                model="llm", messages=msgs, max_tokens=6, temperature=0, logprobs=True, stream=True
            )
            for x in ((ch.choices[0].logprobs.content if ch.choices[0].logprobs else []) or [])
        ]
        assert [t.logprob for t in streamed] == [t.logprob for t in content]  # every token once, in order
        for prompt in ("hello world", "café", "the quick brown fox"):  # (tokens that make no text yet included)
            msgs = [{"role": "user", "content": prompt}]
            kw = dict(model="llm", messages=msgs, max_tokens=40, temperature=0, logprobs=True)
            content = c.chat.completions.create(**kw).choices[0].logprobs.content
            chunks = list(c.chat.completions.create(stream=True, **kw))
            streamed = [x for ch in chunks if ch.choices[0].logprobs for x in ch.choices[0].logprobs.content]
            assert len(content) == 40 and [(t.token, t.logprob) for t in streamed] == [
                (t.token, t.logprob) for t in content
            ]
        kw = dict(model="llm", prompt="the quick brown fox", max_tokens=40, temperature=0, logprobs=2)
        full = c.completions.create(**kw).choices[0].text
        stops = [x for x in dict.fromkeys(full[i : i + 2] for i in range(0, 30, 3)) if x.strip() and "\ufffd" not in x]
        for stop in stops:  # streamed with a stop string: the whole reply's ids and logprobs, none past it
            whole = c.completions.create(stop=stop, **kw).choices[0]
            chunks = [ch.choices[0] for ch in c.completions.create(stop=stop, stream=True, **kw)]
            assert [i for ch in chunks for i in ch.token_ids] == whole.token_ids, stop
            lps = [x for ch in chunks if ch.logprobs for x in ch.logprobs.token_logprobs]
            assert lps == whole.logprobs.token_logprobs and len(lps) == len(whole.token_ids), stop
        with pytest.raises(
            openai.BadRequestError, match=r"logprobs \(the top tokens per position\) must be between 0 and 5"
        ):
            c.completions.create(model="llm", prompt="hi", logprobs=6)
        with pytest.raises(openai.BadRequestError, match=r"top_logprobs \(the top tokens per position\) must be"):
            c.chat.completions.create(model="llm", messages=msgs, logprobs=True, top_logprobs=6)  # (chat's count)
        with pytest.raises(openai.BadRequestError, match="top_logprobs needs logprobs"):
            c.chat.completions.create(model="llm", messages=msgs, top_logprobs=2)
    gen = Generator(model, max_batch=1, max_seq_len=64, graphs=False)
    with Server(Tiny(), ServeOptions(llm=(gen, tiny_text))) as s:
        with pytest.raises(openai.BadRequestError, match="logprobs are off on this engine"):
            client(s).completions.create(model="llm", prompt="hi", logprobs=1)


def test_a_request_larger_than_the_kv_pages_is_refused_with_400(make_tiny_llama, tiny_text):
    model = make_tiny_llama(vocab_size=tiny_text.tokenizer.get_vocab_size(), max_position_embeddings=128)
    gen = Generator(model, max_batch=2, max_seq_len=128, graphs=False, kv_pages=1)  # 64 tokens in all
    with Server(Tiny(), ServeOptions(llm=(gen, tiny_text), llm_name="tiny")) as s:
        c = client(s)
        with pytest.raises(openai.BadRequestError, match="needs more KV memory than there is"):
            c.completions.create(model="tiny", prompt="hello world", max_tokens=100)
        with pytest.raises(openai.BadRequestError, match="needs more KV memory"):
            c.completions.create(model="tiny", prompt="hello world", max_tokens=100, stream=True)
        ok = c.completions.create(model="tiny", prompt="hello world", max_tokens=8)  # fits: 1 page
        assert ok.usage.completion_tokens == 8
        import httpx

        m = httpx.get(s.url + "/metrics").text
        assert 'fullthrottle_kv_pages{state="total"} 1.0' in m and 'fullthrottle_kv_pages{state="used"} 0.0' in m
        assert "fullthrottle_llm_preemptions_total 0.0" in m


def test_stop_token_ids_several_eos_ids_and_the_chat_replys_default_length(llm):
    """A request ends at any of its stop token ids: the model's end-of-sequence ids (a list in
    config.json, as Llama 3's), unless ``ignore_eos``, and its own ``stop_token_ids`` (vLLM's);
    a chat reply without max_tokens may take the rest of the context; vLLM's sampling options this
    server does not apply are refused."""
    from fullthrottle.workloads.llm.api import completion_request

    s, ref, text = llm
    c = client(s)
    prompt = "the quick brown fox"
    toks = ref(text.encode(prompt), 20)
    k = next(i for i in range(3, 20) if toks[i] not in toks[:i])  # a token made first at step k
    kw = dict(model="tiny", prompt=prompt, max_tokens=20, temperature=0, extra_body={"stop_token_ids": [toks[k]]})
    r = c.completions.create(**kw)
    assert r.choices[0].token_ids == toks[: k + 1] and r.choices[0].finish_reason == "stop"
    streamed = list(c.completions.create(**kw, stream=True))
    assert streamed[-1].choices[0].finish_reason == "stop"
    assert "".join(ch.choices[0].text for ch in streamed) == text.decode(toks[: k + 1])
    for bad, msg in (
        ({"stop_token_ids": [10**9]}, "stop_token_ids must be token ids below"),
        ({"stop_token_ids": 5}, "stop_token_ids must be a list"),
        ({"ignore_eos": "yes"}, "ignore_eos must be true or false"),
        ({"repetition_penalty": 1.3}, "repetition_penalty is not supported"),
        ({"min_tokens": 4}, "min_tokens is not supported"),
        ({"min_p": 0.1}, "min_p is not supported"),
    ):
        with pytest.raises(openai.BadRequestError, match=msg):
            c.completions.create(model="tiny", prompt=prompt, max_tokens=4, extra_body=bad)

    gen = s.gen
    cfg = gen.model.cfg
    saved = cfg.eos_token_id
    try:
        cfg.eos_token_id = [1, 7]  # (what the route reads for each request)
        req = completion_request({"prompt": [3, 4], "stop_token_ids": [9, 7]}, gen, None)
        assert req["stop_ids"] == (1, 7, 9)
        assert completion_request({"prompt": [3, 4], "ignore_eos": True}, gen, None)["stop_ids"] == ()
        assert completion_request({"prompt": [3, 4], "top_k": -1}, gen, None)["top_k"] == 0  # (vLLM's "off")
        with pytest.raises(ValueError, match=r"top_k must be an integer >= 0, or -1 \(0 and -1: off\), got -2"):
            completion_request({"prompt": [3, 4], "top_k": -2}, gen, None)
        for several in ([[3, 4], [5]], ["a", "b"]):
            with pytest.raises(
                ValueError, match=r"prompt must be one prompt \(a string or a list of token ids\), not a list"
            ):
                completion_request({"prompt": several}, gen, None)
        cfg.eos_token_id = [toks[k + 2], toks[k]]  # several end-of-sequence ids: the first made ends it
        r = c.completions.create(model="tiny", prompt=prompt, max_tokens=20, temperature=0)
        assert r.choices[0].token_ids == toks[: k + 1] and r.choices[0].finish_reason == "stop"
        r = c.completions.create(
            model="tiny", prompt=prompt, max_tokens=20, temperature=0, extra_body={"ignore_eos": True}
        )
        assert r.choices[0].token_ids == toks and r.choices[0].finish_reason == "length"
    finally:
        cfg.eos_token_id = saved

    msgs = [{"role": "user", "content": "tell me a long story"}]
    r = c.chat.completions.create(model="tiny", messages=msgs, temperature=0)
    n_prompt = r.usage.prompt_tokens
    assert r.usage.completion_tokens == 128 - n_prompt or r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens > 16


def test_a_streams_latency_is_counted_to_its_end(llm):
    """/metrics' request latency of a streamed completion runs to its last chunk, not to its head; its
    time to first token is counted apart, once."""
    import time

    import httpx

    s, _, _ = llm

    def latency_sum(what=r'request_latency_seconds_sum\{route="/v1/completions"\}') -> float:
        m = re.search(rf"fullthrottle_{what} (\S+)", httpx.get(s.url + "/metrics").text)
        return float(m.group(1)) if m else 0.0

    before, ttft = latency_sum(), [latency_sum("llm_time_to_first_token_seconds_" + k) for k in ("count", "sum")]
    body = {"prompt": "hello world", "max_tokens": 100, "temperature": 0, "stream": True}
    with httpx.stream("POST", s.url + "/v1/completions", json=body, timeout=60) as r:
        t_head = time.perf_counter()
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
        t_end = time.perf_counter()
    assert events[-1] == "data: [DONE]" and t_end - t_head > 0.05
    time.sleep(0.1)
    assert latency_sum() - before >= 0.8 * (t_end - t_head), (latency_sum() - before, t_end - t_head)
    assert latency_sum("llm_time_to_first_token_seconds_count") == ttft[0] + 1
    assert 0 < latency_sum("llm_time_to_first_token_seconds_sum") - ttft[1] < t_end - t_head


def test_the_llm_routes_and_models_answer_503_with_retry_after_while_the_models_load(make_tiny_llama):
    """Before the app's lifespan has started its services (an engine process still loading behind
    HTTP workers that already take requests), the LLM routes and ``/v1/models`` answer 503 with
    Retry-After, as the other routes do: not 404 "not enabled", nor an empty list of models."""
    import asyncio

    import httpx

    from fullthrottle.core.config import Config
    from fullthrottle.server.app import create_app

    gen = Generator(make_tiny_llama(), max_batch=1, max_seq_len=32, graphs=False)
    opts = ServeOptions(llm=(gen, None), classify=False)
    app = create_app(Config(device="cpu"), opts, model=Tiny())  # (no lifespan run: loading)

    async def ask():
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as c:
            body = {"prompt": [1, 2], "max_tokens": 2}
            return [
                await c.post("/v1/completions", json=body),
                await c.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}),
                await c.get("/v1/models"),
                await c.get("/v1/models/llm"),
            ]

    for r in asyncio.run(ask()):
        assert (r.status_code, r.headers.get("retry-after")) == (503, str(opts.retry_after_s)), r.request.url
        assert r.json()["error"]["message"] == "loading"
