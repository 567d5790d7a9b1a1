"""Shared fixtures: the sample images and bad inputs live in ../shared/data beside the repo."""

import os
import threading
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]


def _find_data() -> Path:
    env = os.environ.get("FULLTHROTTLE_DATA")
    # tests/data is a copy of ../shared/data (the 200 ImageNet samples and the bad inputs), so that a
    # fresh clone tests on its own
    for cand in ([Path(env)] if env else []) + [ROOT / "tests" / "data", ROOT.parent / "shared" / "data"]:
        if (cand / "imagenet-sample").is_dir():
            return cand
    raise RuntimeError(
        "test data not found: set FULLTHROTTLE_DATA to the folder holding imagenet-sample/ and bad-inputs/"
    )


DATA = _find_data()
SAMPLES = sorted((DATA / "imagenet-sample").glob("*.JPEG"))
BAD = DATA / "bad-inputs"


def sample_label(path) -> str:
    """The class a sample's file name names: ``n01484850_great_white_shark.JPEG`` -> 'great white shark'."""
    return path.name.split(".")[0].split("_", 1)[1].replace("_", " ")


@pytest.fixture(scope="session")
def samples():
    assert len(SAMPLES) == 200, f"expected the 200 sample images under {DATA}"
    return SAMPLES


@pytest.fixture(scope="session")
def bad_dir():
    return BAD


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def make_tiny_llama():
    """``make(**config overrides)``: a random 2-layer Llama (vocab 97, no EOS), seeded: the same
    weights in every test."""
    import torch

    from fullthrottle.workloads.llm.llama import Llama, LlamaConfig

    def make(**overrides):
        torch.manual_seed(0)
        kw = dict(
            vocab_size=97,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            eos_token_id=None,
        )
        return Llama(LlamaConfig(**{**kw, **overrides})).eval()

    return make


@pytest.fixture
def tiny_llama(make_tiny_llama):
    """:func:`make_tiny_llama` with its defaults."""
    return make_tiny_llama()


@pytest.fixture
def no_thread_leak():
    """Asserts that a test leaves no fullthrottle thread running (waits up to 5 s)."""
    yield
    import time

    deadline = time.time() + 5
    while time.time() < deadline:
        alive = [t.name for t in threading.enumerate() if t.name.startswith("ft-")]
        if not alive:
            return
        time.sleep(0.05)
    raise AssertionError(f"threads left running: {alive}")


@pytest.fixture
def http_server(samples, tmp_path):
    """A static file server on 127.0.0.1 (ephemeral port) holding ``a.jpg`` (a sample photo)."""
    import http.server
    from functools import partial

    (tmp_path / "a.jpg").write_bytes(samples[0].read_bytes())
    handler = partial(http.server.SimpleHTTPRequestHandler, directory=str(tmp_path))
    handler.log_message = lambda *a, **k: None
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()
    srv.server_close()


#: a chat template in the style of Zephyr's (tokenizer_config.json's chat_template)
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}{{ eos_token }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


@pytest.fixture(scope="session")
def tiny_text():
    """An :class:`~fullthrottle.workloads.llm.text.LlmText`: a byte-level BPE tokenizer (about 300
    tokens, trained here on a few sentences, with non-ASCII text) and :data:`CHAT_TEMPLATE`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    from fullthrottle.workloads.llm.text import LlmText

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    corpus = ["the quick brown fox jumps over the lazy dog", "naïve café, déjà vu: 😀 ünïcödé", "hello world"] * 20
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    tok.train_from_iterator(corpus, trainer)
    return LlmText(tok, CHAT_TEMPLATE, "<s>", "</s>")


def keep_alive_statuses(conns) -> list[int]:
    """``GET /healthz`` on each ``http.client`` connection in turn, each kept open (keep-alive) while
    the next asks: their statuses."""
    codes = []
    for c in conns:
        c.request("GET", "/healthz")
        r = c.getresponse()
        r.read()
        codes.append(r.status)
    return codes


def post_chunked(url: str, path: str, n_bytes: int, headers: str = "") -> bytes:
    """Everything a server at ``url`` sends back to ``POST path`` with a chunked body of ``n_bytes``
    (10,000-byte chunks; ``headers``: extra header lines, each ending in CRLF), read until it closes."""
    import socket
    import urllib.parse

    u = urllib.parse.urlsplit(url)
    with socket.create_connection((u.hostname, u.port), timeout=10) as c:
        c.sendall(f"POST {path} HTTP/1.1\r\nHost: x\r\n{headers}Transfer-Encoding: chunked\r\n\r\n".encode())
        try:
            for _ in range(n_bytes // 10_000):
                c.sendall(b"2710\r\n" + b"\xff" * 10_000 + b"\r\n")
            c.sendall(b"0\r\n\r\n")
        except OSError:
            pass  # (the server may close before all is sent)
        got = b""
        while chunk := c.recv(65536):
            got += chunk
    return got
