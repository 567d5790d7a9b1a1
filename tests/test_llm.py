"""The Llama engine against transformers (test-only dependency) on a tiny random config, fp32 on CPU."""

import re

import pytest
import torch

transformers = pytest.importorskip("transformers")

from fullthrottle.core.config import LlmSettings  # noqa: E402
from fullthrottle.core.kernels.varlen import query_blocks  # noqa: E402
from fullthrottle.workloads.llm.generate import Generator  # noqa: E402
from fullthrottle.workloads.llm.llama import LlamaConfig, load_hf  # noqa: E402
from fullthrottle.workloads.llm.prefill import Packed  # noqa: E402
from fullthrottle.workloads.llm.sampling import GOLDEN, sample, seed32, seeded_noise  # noqa: E402

ROPE3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 32,
}


ROPE_LINEAR = {"rope_type": "linear", "factor": 4.0}


@pytest.fixture(scope="module", params=[None, ROPE3, ROPE_LINEAR], ids=["rope", "llama3-rope", "linear-rope"])
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    kw = dict(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=160,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_theta=500000.0,
    )
    if request.param:
        kw["rope_scaling"] = request.param
    hf = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    d = tmp_path_factory.mktemp("llama")
    hf.save_pretrained(d)
    return hf, load_hf(d)


def test_logits_equal_transformers(pair):
    hf, ours = pair
    ours.setup_cache(1, 64)
    ids = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    out = ours(ids, torch.arange(40)[None])
    torch.testing.assert_close(out, ref, atol=1e-4, rtol=0)


def test_packed_prefill_equals_each_prompt_alone(pair):
    """Prompts of 7, 1, 30 and 12 tokens packed end to end in one forward (no padding), into rows in any
    order: each prompt's last logits equal transformers' on it alone, and each row holds the keys its
    own forward writes."""
    hf, ours = pair
    ours.setup_cache(6, 64)
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 256, (n,), generator=g) for n in (7, 1, 30, 12)]
    rows = [5, 0, 3, 1]  # any distinct rows, in any order
    pieces = [(r, p.tolist(), 0, len(p)) for r, p in zip(rows, prompts)]
    sizes = (50, 4, len(query_blocks([7, 1, 30, 12])[0]))
    with torch.no_grad():
        got = ours.prefill(Packed.view(Packed.build(pieces, *sizes, pad_row=0), *sizes))
        refs = torch.cat([hf(p[None]).logits[:, -1] for p in prompts])
    torch.testing.assert_close(got, refs, atol=1e-4, rtol=0)
    k_packed = [blk.self_attn.k_cache.clone() for blk in ours.layers]
    for r, p in zip(rows, prompts):  # the same keys as a prompt's own forward writes
        ours(p[None], torch.arange(len(p))[None], row0=r)
        for blk, kb in zip(ours.layers, k_packed):
            torch.testing.assert_close(kb[r, :, : len(p)], blk.self_attn.k_cache[r, :, : len(p)], atol=1e-5, rtol=0)
    # a prefill budget smaller than the prompts: several forwards, prompts cut into chunks, the same tokens
    gen = Generator(ours, max_batch=4, max_seq_len=64, graphs=False)
    ref = gen.generate([p.tolist() for p in prompts], max_new_tokens=6)
    for budget in (30, 7, 1):
        gen.max_prefill_tokens = budget
        assert gen.generate([p.tolist() for p in prompts], max_new_tokens=6) == ref, budget


def test_greedy_tokens_equal_transformers(pair):
    hf, ours = pair
    gen = Generator(ours, max_batch=4, max_seq_len=96, graphs=False)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17, 9)]
    got = gen.generate(prompts, max_new_tokens=24)
    # attention reading only the slots in use (steps cross the lengths 16, 24, 32) changes nothing
    short = Generator(ours, max_batch=4, max_seq_len=96, graphs=False, attn_buckets=(16, 24, 32))
    assert short.kv_buckets == (16, 24, 32, 96)
    assert short.generate(prompts, max_new_tokens=24) == got
    for p, toks in zip(prompts, got):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([p]), max_new_tokens=24, do_sample=False, pad_token_id=0, eos_token_id=None)
        assert toks == ref[0, len(p) :].tolist()


def test_load_hf_says_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="model folder not found: .*nope"):
        load_hf(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="no config.json in"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no .safetensors weights in"):
        load_hf(tmp_path)


def test_max_seq_len_is_a_clear_error(pair):
    _, ours = pair
    gen = Generator(ours, max_batch=2, max_seq_len=32, graphs=False)
    with pytest.raises(ValueError, match="exceeds max_seq_len 32"):
        gen.generate([[1] * 20], max_new_tokens=13)
    assert len(gen.generate([[1] * 20], max_new_tokens=12)[0]) == 12


def test_prompts_as_tokenizers_give_them_and_clear_errors_for_the_rest(pair):
    """numpy and torch token ids are prompts like lists; a flat prompt, a string or a model that is
    not a Llama get a ValueError/TypeError saying what is wanted."""
    import numpy as np

    _, ours = pair
    gen = Generator(ours, max_batch=2, max_seq_len=32, graphs=False)
    want = gen.generate([[1, 2, 3]], max_new_tokens=4)
    assert gen.generate([np.array([1, 2, 3])], max_new_tokens=4) == want
    assert gen.generate([torch.tensor([1, 2, 3])], max_new_tokens=4) == want
    assert gen.generate([[np.int64(1), np.int32(2), torch.tensor(3)]], max_new_tokens=4) == want
    for bad in ([1, 2, 3], ["hello"]):
        with pytest.raises(
            ValueError, match=r"prompt 0 must be a list of token ids, got \w+ .* one prompt alone is \[ids\]"
        ):
            gen.generate(bad, max_new_tokens=4)
    with pytest.raises(ValueError, match="token ids must be integers"):
        gen.generate([np.array([1.5, 2.0])], max_new_tokens=4)
    assert gen.generate((p for p in [[1, 2, 3]]), max_new_tokens=4) == want  # (a generator of prompts)
    assert gen.generate(np.array([[1, 2, 3]]), max_new_tokens=4) == want  # (a 2-D array: one row each)
    with pytest.raises(ValueError, match=r"prompts is one flat sequence of token ids: pass a list of prompts"):
        gen.generate(torch.tensor([1, 2, 3]), max_new_tokens=4)
    with pytest.raises(TypeError, match="model must be a built Llama"):
        Generator("model")


def test_sampling_values_are_checked(pair):
    _, ours = pair
    gen = Generator(ours, max_batch=1, max_seq_len=32, graphs=False)
    for kw, msg in (
        ({"temperature": -1.0}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 2.0}, "top_p"),
        ({"top_k": -5}, "top_k"),
    ):
        with pytest.raises(ValueError, match=msg):
            gen.generate([[1, 2]], max_new_tokens=4, **kw)
    with pytest.raises(ValueError, match="exceeds the model's context"):
        Generator(ours, max_batch=1, max_seq_len=ours.cfg.max_position_embeddings + 1, graphs=False)
    # by default a row holds the model's context (256 here), at most LlmSettings.max_seq_len
    assert Generator(ours, max_batch=1, graphs=False).max_seq_len == min(256, LlmSettings.max_seq_len)


def test_eos_stops_a_row(pair):
    _, ours = pair
    gen = Generator(ours, max_batch=2, max_seq_len=64, graphs=False)
    free = gen.generate([[3, 4, 5]], max_new_tokens=10)[0]
    eos = free[3]
    stopped = gen.generate([[3, 4, 5], [7, 8]], max_new_tokens=10, eos_id=eos)
    assert stopped[0] == free[: free.index(eos) + 1]


def test_sampling_seeded_and_filters():
    torch.manual_seed(0)
    logits = torch.randn(4, 50)
    z = torch.zeros(4, 1)
    noise = torch.empty(4, 50).exponential_()
    greedy = sample(logits, z, torch.zeros(4, 1, dtype=torch.long), torch.ones(4, 1), noise)
    assert greedy.tolist() == logits.argmax(-1).tolist()
    one = torch.ones(4, 1)
    top1 = sample(logits, one, torch.ones(4, 1, dtype=torch.long), torch.ones(4, 1), noise)
    assert top1.tolist() == logits.argmax(-1).tolist()  # top-k 1 is greedy whatever the noise
    tiny_p = sample(logits, one, torch.zeros(4, 1, dtype=torch.long), torch.full((4, 1), 1e-6), noise)
    assert tiny_p.tolist() == logits.argmax(-1).tolist()  # nucleus of one token
    top5 = torch.stack(
        [
            sample(logits, one, torch.full((4, 1), 5), torch.ones(4, 1), torch.empty(4, 50).exponential_())
            for _ in range(200)
        ]
    )
    allowed = logits.topk(5).indices
    assert all(top5[:, r].unsqueeze(1).eq(allowed[r]).any(1).all() for r in range(4))
    assert len(set(top5[:, 0].tolist())) > 1  # it does sample


def test_seeded_noise_draws_from_the_distribution_and_depends_on_seed_and_position_only():
    """The exponential race with seeded_noise samples softmax(logits): over 4000 seeds the frequency
    of each of 8 tokens is within 4 standard errors of its probability; the noise of a row is a
    function of (seed, position, token id) alone."""
    V = 8
    vm = torch.arange(V, dtype=torch.int32) * GOLDEN
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, 0.25]])
    n = 4000
    seeds = torch.arange(n, dtype=torch.int32)[:, None]
    noise = seeded_noise(seeds, torch.full((n, 1), 11), vm)
    one = torch.ones(n, 1)
    drawn = sample(logits.expand(n, V), one, torch.zeros(n, 1, dtype=torch.long), one, noise)
    freq = torch.bincount(drawn, minlength=V).double() / n
    p = logits[0].double().softmax(-1)
    assert ((freq - p).abs() <= 4 * (p * (1 - p) / n).sqrt() + 1e-3).all(), (freq, p)
    a = seeded_noise(torch.tensor([[5], [6], [5]], dtype=torch.int32), torch.tensor([[3], [3], [3]]), vm)
    assert torch.equal(a[0], a[2]) and not torch.equal(a[0], a[1])
    b = seeded_noise(torch.tensor([[5]], dtype=torch.int32), torch.tensor([[4]]), vm)
    assert not torch.equal(a[0], b[0]) and (a > 0).all()
    assert seed32(2**32 + 7) == 7 and seed32(-1) == -1 and seed32(2**31) == -(2**31)


def test_a_seeded_prompt_samples_the_same_tokens_whatever_runs_beside_it(pair):
    _, ours = pair
    gen = Generator(ours, max_batch=4, max_seq_len=64, graphs=False)
    kw = dict(max_new_tokens=16, temperature=1.0, top_k=50, top_p=0.95)
    prompts = [[3, 4, 5], [9, 10, 11, 12, 13], [7]]
    alone = [gen.generate([p], seed=[100 + i], **kw)[0] for i, p in enumerate(prompts)]
    assert gen.generate(prompts, seed=[100, 101, 102], **kw) == alone
    assert gen.generate(prompts[::-1], seed=[102, 101, 100], **kw) == alone[::-1]
    assert gen.generate(prompts, seed=100, **kw) == alone  # an int: prompt i gets seed + i
    assert gen.generate([prompts[0]], seed=[999], **kw)[0] != alone[0]
    with pytest.raises(ValueError, match="2 seeds for 3 prompts"):
        gen.generate(prompts, seed=[1, 2], **kw)


def test_config_from_transformers5_layout():
    cfg = LlamaConfig.from_dict(
        {"hidden_size": 64, "num_attention_heads": 4, "rope_parameters": {"rope_theta": 5e5, **ROPE3}}
    )
    assert cfg.rope_theta == 5e5 and cfg.rope_scaling["rope_type"] == "llama3" and cfg.head_dim == 16


@pytest.mark.gpu
def test_graph_tokens_equal_eager_and_padding_rows_do_not_matter(pair):
    _, ours = pair
    model = ours.cuda()
    eager = Generator(model, max_batch=8, max_seq_len=96, graphs=False)
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17, 9)]
    ref = eager.generate(prompts, max_new_tokens=30, temperature=0.8, top_k=20, top_p=0.9, seed=7)
    # attention lengths 32, 64, 96: replays switch graphs as the rows grow past 32 and 64
    graphed = Generator(model, max_batch=8, max_seq_len=96, graphs=True, attn_buckets=(32, 64))
    assert sorted(graphed.graphs) == [(b, g, kv) for b in (1, 2, 4, 8) for g in (False, True) for kv in (32, 64, 96)]
    # prefill graphs: 3 prompts of 31 tokens in all replay the graph of 32 tokens, its padding into the spare row
    assert graphed.prefill.buckets[:3] == [16, 32, 64] and 32 in graphed.prefill.graphs
    assert model.layers[0].self_attn.k_cache.shape[0] == 8 + 1
    assert graphed.generate(prompts, max_new_tokens=30, temperature=0.8, top_k=20, top_p=0.9, seed=7) == ref
    assert graphed.generate(prompts, max_new_tokens=30, temperature=0.8, top_k=20, top_p=0.9, seed=8) != ref
    alone = [graphed.generate([p], max_new_tokens=30)[0] for p in prompts]
    assert graphed.generate(prompts, max_new_tokens=30) == alone  # greedy: batch-mates change nothing
    full = graphed.generate([prompts[0]], max_new_tokens=96 - len(prompts[0]))[0]  # up to the cache's end
    assert len(full) == 96 - len(prompts[0])
    with pytest.raises(ValueError, match="max_seq_len 96"):  # one past it: a clear error, no device assert
        graphed.generate([prompts[0]], max_new_tokens=97 - len(prompts[0]))
    assert graphed.generate(prompts, max_new_tokens=30) == alone  # and the engine is still usable
    kw = dict(max_new_tokens=30, temperature=0.8, top_k=20, top_p=0.9)
    one_by_one = [graphed.generate([p], seed=[40 + i], **kw)[0] for i, p in enumerate(prompts)]
    assert graphed.generate(prompts, seed=[40, 41, 42], **kw) == one_by_one  # seeded rows: mates change nothing
    vm = graphed.vocab_mix
    seeds, pos = torch.tensor([[7], [-3]], dtype=torch.int32), torch.tensor([[5], [900]])
    on_gpu = seeded_noise(seeds.cuda(), pos.cuda(), vm)
    on_cpu = seeded_noise(seeds, pos, vm.cpu())  # the same draws on both devices (log's rounding aside)
    assert (
        torch.allclose(on_gpu.cpu(), on_cpu, rtol=1e-6, atol=0)
        and on_gpu.argmax(-1).tolist() == on_cpu.argmax(-1).tolist()
    )


def test_cli_generate_streams_the_library_tokens(pair, tmp_path, capsys):
    from fullthrottle.cli import main

    hf, ours = pair
    hf.save_pretrained(tmp_path / "m")
    gen = Generator(ours, max_batch=1, max_seq_len=30, graphs=False)
    eos = hf.config.eos_token_id
    ref = gen.generate([[5, 6, 7]], max_new_tokens=20, eos_id=eos)[0]
    rc = main(
        [
            "generate",
            "--model-dir",
            str(tmp_path / "m"),
            "--tokens",
            "5,6,7",
            "--max-new-tokens",
            "20",
            "--device",
            "cpu",
        ]
    )
    out, err = capsys.readouterr()
    assert rc == 0
    assert [int(t) for t in out.split()] == ref
    assert "decode alone: " in err and " token/s; prefill " in err
    # the stage table every workload ends with: prefill counts the prompt's tokens, decode the tokens
    # of the decode steps (all new ones but the first, which the prefill forward makes)
    rows = dict(re.findall(r"^(prefill|decode) +1 +[\d.]+ +([\d.]+)", err, re.M))
    assert set(rows) == {"prefill", "decode"} and f"{len(ref)} tokens in " in err
    assert "token/s on cpu" in err and "bottleneck: " in err
    assert gen.stats["prefill"].items == 3 and gen.stats["decode"].items == len(ref) - 1
    assert main(["generate", "--model-dir", str(tmp_path / "m"), "--tokens", "999"]) == 2


def test_unsupported_rope_scaling_is_refused():
    from fullthrottle.workloads.llm.llama import rope_inv_freq

    cfg = LlamaConfig(
        vocab_size=16,
        hidden_size=8,
        intermediate_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        rope_scaling={"rope_type": "dynamic", "factor": 2.0},
    )
    with pytest.raises(ValueError, match="'dynamic' is not supported"):
        rope_inv_freq(cfg)


def test_random_weights_have_no_end_of_sequence_token():
    """``--random`` / ``--llm-random`` weights have no end-of-sequence token: a request runs to its
    max_tokens (serve stopped it at token 2, the config's default eos, where generate did not)."""
    from fullthrottle.cli.generate import random_llama
    from fullthrottle.workloads.llm.api import completion_request

    model = random_llama("tiny", torch.device("cpu"), torch.float32)
    gen = Generator(model, 1, 64, graphs=False)
    assert model.cfg.eos_token_id is None
    assert completion_request({"prompt": [1, 2], "max_tokens": 8}, gen, None)["stop_ids"] == ()
