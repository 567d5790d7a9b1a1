"""A workload of your own behind ``fullthrottle serve``, ``fullthrottle run`` and Ray: the contract
is :class:`fullthrottle.Workload` (``setup``, ``decode_request``, ``predict``, ``encode_response``;
see ``src/fullthrottle/core/workload.py``). This one labels texts by counting words of a small
lexicon: a stand-in for a text classifier, batched across requests like a real one::

    cd examples
    fullthrottle serve --workload word_workload:Sentiment --no-classify --device cpu
    curl -H 'content-type: application/json' -d '{"texts": ["a great day", "awful"]}' \\
        127.0.0.1:8000/v1/sentiment
    # {"results": [{"output": {"label": "positive", "score": 1}}, {"output": {"label": "negative", ...}}]}

    fullthrottle run requests.jsonl --workload word_workload:Sentiment   # one request body a line

A request body must be a JSON object; a bad one is a 400 (or that line's error offline); an item
the workload cannot take (:class:`fullthrottle.ItemError` in ``predict``'s outputs) fails alone.
"""

import re

from fullthrottle import ItemError, Workload

POSITIVE = {"good", "great", "fine", "love", "happy"}
NEGATIVE = {"bad", "awful", "sad", "hate", "poor"}


class Sentiment(Workload):
    name = "sentiment"  # served at POST /v1/sentiment; its counters in /metrics under this name
    max_batch = 256  # items of many requests per predict() call
    max_items_per_request = 64

    def setup(self, device: str) -> None:
        # load the model here, once, on ``device`` ("cpu", "cuda:0", ...)
        self.stats = {}

    def decode_request(self, body: dict) -> list:
        """``{"texts": [str, ...]}`` -> one item per text (a ValueError is the client's 400)."""
        texts = body.get("texts")
        if not isinstance(texts, list) or not texts or not all(isinstance(t, str) for t in texts):
            raise ValueError("'texts' must be a non-empty list of strings")
        return texts

    def predict(self, items: list) -> list:
        """Texts of many requests -> one output each, in order."""
        out = []
        for text in items:
            words = re.findall(r"[a-z]+", text.lower())
            if not words:
                out.append(ItemError("no words in the text"))
                continue
            score = sum(w in POSITIVE for w in words) - sum(w in NEGATIVE for w in words)
            label = "positive" if score > 0 else "negative" if score < 0 else "neutral"
            out.append({"label": label, "score": score})
        return out
