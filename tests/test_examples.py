"""The files in examples/ work as their docstrings say (a newcomer copies them first)."""

import sys
from pathlib import Path

import pytest

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"


@pytest.fixture
def examples_on_path(monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    yield
    for name in ("colour_model", "word_workload"):
        sys.modules.pop(name, None)


def test_colour_model_classifies_through_the_library_and_the_cli(examples_on_path, tmp_path, capsys):
    """The model of one's own names each photo's strongest colour, with its own transform and labels,
    in the library and as ``--model colour_model:ColourNet``."""
    import json

    from PIL import Image

    from fullthrottle import Config, Pipeline
    from fullthrottle.cli import main

    paths = []
    for name, rgb in (("r.jpg", (220, 30, 30)), ("g.jpg", (30, 220, 30)), ("b.png", (30, 30, 220))):
        Image.new("RGB", (120, 90), rgb).save(tmp_path / name)
        paths.append(str(tmp_path / name))
    from colour_model import ColourNet

    with Pipeline(Config(device="cpu", threads=1), model=ColourNet()) as pipe:
        assert [r.labels[0] for r in pipe.run(paths)] == ["red", "green", "blue"]
    args = ["--model", "colour_model:ColourNet", "--device", "cpu", "--threads", "1", "--no-progress", "--out", "-"]
    assert main(["classify", *paths, *args]) == 0
    out, err = capsys.readouterr()
    assert [json.loads(line)["top_k"][0]["label"] for line in out.splitlines()] == ["red", "green", "blue"]
    assert "WARNING" not in err


def test_word_workload_answers_batched_requests_with_per_item_errors(examples_on_path):
    """The workload of one's own: requests batched together, each answered in order; a text with no
    words fails alone; a bad body is that request's error."""
    from word_workload import Sentiment

    from fullthrottle.core.workload import run_offline

    w = Sentiment()
    w.setup("cpu")
    got = run_offline(w, [{"texts": ["a great day", "awful and sad", "123"]}, {"texts": "x"}, {"texts": ["fine"]}])
    (first, err0), (none, err1), (third, err2) = got
    assert err0 is None and err2 is None and none is None and "'texts' must be" in err1
    assert first["results"][:2] == [
        {"output": {"label": "positive", "score": 1}},
        {"output": {"label": "negative", "score": -2}},
    ]
    assert first["results"][2] == {"error": "no words in the text"}
    assert third["results"] == [{"output": {"label": "positive", "score": 1}}]
