"""Continuous batching (workloads/llm/scheduler.py) on a random small Llama, CPU: every request gets
exactly the tokens it gets alone, whatever joins or leaves around it."""

import random
import re

import pytest
import torch

from fullthrottle.workloads.llm.generate import Generator
from fullthrottle.workloads.llm.scheduler import Scheduler


def random_requests(seed: int, n: int, lengths, new: tuple[int, int], temperatures) -> list[dict]:
    """``n`` requests of random prompts (their lengths drawn from ``lengths``), ``max_new_tokens`` in
    ``new``, temperatures drawn from ``temperatures``, request ``i`` seeded ``i``."""
    rng = random.Random(seed)
    return [
        {
            "prompt": [rng.randrange(97) for _ in range(rng.choice(lengths))],
            "max_new_tokens": rng.randint(*new),
            "temperature": rng.choice(temperatures),
            "seed": i,
        }
        for i in range(n)
    ]


def test_greedy_continuous_batching_equals_each_request_alone(tiny_llama):
    rng = random.Random(0)
    reqs = [
        {"prompt": [rng.randrange(97) for _ in range(rng.randint(1, 12))], "max_new_tokens": rng.randint(1, 20)}
        for _ in range(11)
    ]
    alone = Generator(tiny_llama, max_batch=1, max_seq_len=64, graphs=False)
    refs = [alone.generate([r["prompt"]], max_new_tokens=r["max_new_tokens"])[0] for r in reqs]
    sched = Scheduler(Generator(tiny_llama, max_batch=4, max_seq_len=64, graphs=False))
    assert sched.run(reqs) == refs  # 11 requests through 4 rows: they join and leave mid-way
    assert sched.steps < sum(r["max_new_tokens"] for r in reqs)  # decode steps were shared
    # requests that arrive while others run
    first = [sched.submit(**r) for r in reqs[:3]]
    for _ in range(3):
        sched.step()
    later = [sched.submit(**r) for r in reqs[3:6]]
    while sched.waiting or sched.running:
        sched.step()
    assert [s.tokens for s in first + later] == refs[:6] and all(s.done for s in first + later)
    assert sorted(sched.free) == [0, 1, 2, 3] and not sched.running  # every row given back


def test_seeded_sampled_requests_get_their_own_tokens_whatever_joins_or_leaves(tiny_llama):
    rng = random.Random(2)
    reqs = [
        {
            "prompt": [rng.randrange(97) for _ in range(rng.randint(1, 12))],
            "max_new_tokens": rng.randint(1, 20),
            "temperature": 0.9,
            "top_k": rng.choice([0, 20]),
            "top_p": rng.choice([1.0, 0.9]),
            "seed": 1000 + i,
        }
        for i in range(9)
    ]
    gen = Generator(tiny_llama, max_batch=4, max_seq_len=64, graphs=False)
    refs = [
        gen.generate([r["prompt"]], r["max_new_tokens"], r["temperature"], r["top_k"], r["top_p"], [r["seed"]])[0]
        for r in reqs
    ]
    assert Scheduler(gen).run(reqs) == refs
    assert Scheduler(gen).run(reqs[::-1]) == refs[::-1]  # other batch mates, other rows
    other = Scheduler(gen).run([{**reqs[0], "seed": 5}])[0]
    assert other != refs[0] and len(set(map(tuple, refs))) == len(refs)


def test_chunked_prefill_gives_each_request_its_tokens_alone_and_decoding_goes_on(tiny_llama):
    """With a prefill budget of 8 tokens per step, prompts of up to 40 tokens are prefilled in chunks
    in their own row while the others decode: every request (greedy and seeded sampled) still gets
    exactly its tokens alone; a request cancelled mid-prefill gives its row back."""
    reqs = random_requests(3, 10, [3, 6, 19, 40], (2, 12), [0.0, 0.8])
    alone = Generator(tiny_llama, max_batch=1, max_seq_len=64, graphs=False)
    refs = [alone.generate([r["prompt"]], r["max_new_tokens"], r["temperature"], seed=[r["seed"]])[0] for r in reqs]
    gen = Generator(tiny_llama, max_batch=4, max_seq_len=64, graphs=False, max_prefill_tokens=8)
    sched = Scheduler(gen)
    seqs = [sched.submit(**r) for r in reqs]
    chunked_while_decoding = 0
    while sched.busy:
        sched.step()
        chunked_while_decoding += sched.prefilling is not None and bool(sched.running)
    assert [s.tokens for s in seqs] == refs and chunked_while_decoding > 0
    assert sorted(sched.free) == [0, 1, 2, 3] and sched.prefilling is None
    s = sched.submit([5] * 30, 4)
    sched.step()
    assert sched.prefilling is s and s.prefilled == 8
    sched.cancel(s)
    assert sched.prefilling is None and sorted(sched.free) == [0, 1, 2, 3] and not sched.busy


def test_logprobs_are_the_models_log_softmax_of_each_token(tiny_llama):
    """With logprobs, each token's log-probability and the top 3 equal log_softmax of the model's
    logits at that position (one forward over prompt + tokens), greedy or sampled, chunked or not."""
    import torch

    gen = Generator(tiny_llama, max_batch=4, max_seq_len=64, graphs=False, logprobs=3, max_prefill_tokens=8)
    sched = Scheduler(gen)
    reqs = [
        sched.submit([5, 6, 7], 6, logprobs=3),
        sched.submit(list(range(1, 20)), 5, temperature=0.9, seed=4, logprobs=2),  # prefilled in chunks
        sched.submit([9, 9], 4),  # asks for none
    ]
    while sched.busy:
        sched.step()
    assert reqs[2].lps == [] and [len(r.lps) for r in reqs[:2]] == [6, 5]
    for r in reqs[:2]:
        seq = r.prompt + r.tokens
        with torch.inference_mode():
            tiny_llama.kv_len = len(seq)
            logits = tiny_llama(torch.tensor([seq]), torch.arange(len(seq))[None], 0)[0]  # (S, V)
        ref = logits.float().log_softmax(-1)
        for j, (lp, ids, vals) in enumerate(r.lps):
            row = ref[len(r.prompt) - 1 + j]  # the distribution the j-th new token was drawn from
            assert abs(lp - row[r.tokens[j]].item()) < 1e-4
            top = row.topk(r.logprobs)
            assert ids == top.indices.tolist() and max(abs(a - b) for a, b in zip(vals, top.values.tolist())) < 1e-4
    with pytest.raises(ValueError, match="between 0 and 3"):
        sched.submit([1], 2, logprobs=4)
    with pytest.raises(ValueError, match="reports none"):
        Scheduler(Generator(tiny_llama, max_batch=1, max_seq_len=16, graphs=False)).submit([1], 2, logprobs=1)


def test_eos_ends_a_request_and_frees_its_row(tiny_llama):
    gen = Generator(tiny_llama, max_batch=2, max_seq_len=64, graphs=False)
    ref = gen.generate([[5, 6, 7]], max_new_tokens=10)[0]
    eos = ref[3]  # a token the prompt makes at step 4
    prompts = [([5, 6, 7], 10), ([1, 2], 10), ([3], 4)]
    alone = [gen.generate([p], max_new_tokens=n, eos_id=eos)[0] for p, n in prompts]
    sched = Scheduler(gen, eos_id=eos)
    seqs = [sched.submit(p, n) for p, n in prompts]  # the third waits for a row
    sched.step()
    assert seqs[2].row == -1 and len(sched.waiting) == 1
    while sched.waiting or sched.running:
        sched.step()
    assert [s.tokens for s in seqs] == alone and seqs[0].tokens[-1] == eos and len(seqs[0].tokens) == 4
    assert all(s.done for s in seqs) and sorted(sched.free) == [0, 1]
    with pytest.raises(ValueError, match="must fit the KV cache"):
        sched.submit([1] * 60, 10)
    for prompt, n, msg in (
        ([], 3, "prompt is empty"),
        ([5, 97], 3, r"token ids must be integers in \[0, 97\), got 97"),  # (vocab 97)
        ([5, -1], 3, "got -1"),
        ([5, 2.0], 3, "got 2.0"),
        ([5, True], 3, "got True"),
        ([5], 0, "max_new_tokens must be an integer >= 1, got 0"),
        ([5], 2.5, "got 2.5"),
    ):
        with pytest.raises(ValueError, match=msg):
            sched.submit(prompt, n)
    with pytest.raises(ValueError, match="temperature"):
        sched.submit([1], 3, temperature=-1)
    assert not sched.busy and sorted(sched.free) == [0, 1]  # nothing taken by the refused ones


def test_bad_settings_and_prompts_are_clear_errors_and_a_new_scheduler_starts_clean(tiny_llama):
    """The Generator refuses settings that are not integers in range, and a KV cache larger than the
    free memory (before allocating it); generate refuses bad token ids and max_new_tokens; a Scheduler
    built on an engine whose last owner failed mid-step finds every KV page free."""
    for kw, msg in (
        ({"max_prefill_tokens": float("nan")}, "max_prefill_tokens must be an integer >= 1, got nan"),
        ({"max_prefill_tokens": 1.5}, "max_prefill_tokens"),
        ({"max_prefill_tokens": 0}, "max_prefill_tokens"),
        ({"kv_pages": 2.5}, "kv_pages must be an integer >= 0"),
        ({"kv_pages": "3"}, "kv_pages"),
        ({"max_batch": 0}, "max_batch must be an integer >= 1"),
        ({"max_seq_len": 10**9}, "max_position_embeddings"),
    ):
        with pytest.raises(ValueError, match=msg):
            Generator(tiny_llama, **{"max_batch": 2, "max_seq_len": 64, "graphs": False, **kw})
    big = tiny_llama.cfg.max_position_embeddings
    with pytest.raises(ValueError, match=r"the KV cache \(10000000 rows x .* GiB free.*: take fewer rows"):
        Generator(tiny_llama, max_batch=10**7, max_seq_len=big, graphs=False)
    gen = Generator(tiny_llama, max_batch=2, max_seq_len=64, graphs=False, kv_pages=4)
    for prompts, n, msg in (
        ([[5, 300]], 2, r"prompt 0: token ids must be integers in \[0, 97\)"),
        ([[5], [10**20]], 2, "prompt 1: token ids"),
        ([[5]], 0, "max_new_tokens must be an integer >= 1"),
        ([[5]], -5, "max_new_tokens"),
    ):
        with pytest.raises(ValueError, match=msg):
            gen.generate(prompts, n)
    for eos in (40.5, -1, "40", 97, 2**70, True):  # (a float 40.5 would stop the device on 40, not the host)
        with pytest.raises(ValueError, match="eos_id must be"):
            gen.generate([[1, 2, 3]], 4, eos_id=eos)
    with pytest.raises(ValueError, match="ahead must be an integer >= 1"):
        Scheduler(gen, ahead=0)
    with pytest.raises(ValueError, match="logprobs must be an integer between 0 and 20"):
        Generator(tiny_llama, max_batch=2, max_seq_len=64, graphs=False, logprobs=21)
    assert gen.generate([[1, 2, 3]], 2)  # (a Generator refused before its cache: the model's cache kept)
    for kw, msg in (
        ({"temperature": "1"}, "temperature must be"),
        ({"top_k": 2.5}, "top_k must be"),
        ({"top_k": True}, "top_k must be"),
        ({"top_p": None}, "top_p must be"),
        ({"seed": 1.5}, "a seed must be an integer"),
    ):
        with pytest.raises(ValueError, match=msg):
            gen.generate([[1, 2, 3]], 2, **kw)
    ref = gen.generate([[1, 2, 3]], 6)
    with pytest.raises(RuntimeError, match="inside a generate call"):  # (it would take the running call's rows)
        gen.generate([[1, 2, 3]], 6, on_tokens=lambda chunks: gen.generate([[9, 9]], 2))
    first = Scheduler(gen)
    first.submit([1, 2, 3], 4)
    assert Scheduler(gen).run([{"prompt": [4, 5], "max_new_tokens": 3}])
    with pytest.raises(RuntimeError, match="a newer Scheduler took"):  # (its rows' state is gone)
        first.step()
    assert gen.generate([[1, 2, 3]], 6) == ref  # and the engine goes on as before
    sched = Scheduler(gen)
    sched.submit([5, 6, 7], 4)
    sched.step()
    assert gen.kv.pages_used == 1  # (a step that raised here would leave it held)
    again = Scheduler(gen)  # (what the server does after a failed step)
    assert gen.kv.pages_used == 0 and again.run([{"prompt": [5, 6, 7], "max_new_tokens": 4}])


def test_kv_pages_auto_sizes_the_pool_to_the_free_memory(make_tiny_llama, monkeypatch):
    """``serve --llm-kv-pages auto``: as many pages as fit in 90% of the free memory, the model's own
    KV cache counted as free and a prefill's activations set aside (the Generator's max_prefill_tokens
    by default); a clear error when none fits or the free memory cannot be read."""
    from fullthrottle.core.config import LlmSettings
    from fullthrottle.workloads.llm import checks

    model = make_tiny_llama()  # 2 layers x (k, v) x 2 kv heads x head dim 8 x 4 bytes: 256 bytes a position
    cfg = model.cfg
    per_prefill_token = (8 * cfg.hidden_size + 3 * cfg.intermediate_size) * 4  # (float32)
    assert checks.prefill_bytes(model, 100) == 100 * per_prefill_token
    monkeypatch.setattr(checks, "free_bytes", lambda device: 2**20)
    assert checks.pages_that_fit(model, 64, prefill_tokens=0) == int(0.9 * 2**20 // (64 * 256)) - 1 == 56
    aside = LlmSettings.max_prefill_tokens * per_prefill_token
    monkeypatch.setattr(checks, "free_bytes", lambda device: 2**26)
    assert checks.pages_that_fit(model, 64) == int(0.9 * (2**26 - aside) // (64 * 256)) - 1
    monkeypatch.setattr(checks, "free_bytes", lambda device: 2**20)
    assert (
        checks.pages_that_fit(model, 64, prefill_tokens=16)
        == int(0.9 * (2**20 - 16 * per_prefill_token) // (64 * 256)) - 1
    )
    Generator(model, max_batch=2, max_seq_len=64, graphs=False, max_prefill_tokens=16)  # a static cache of 32 KiB
    assert checks.pages_that_fit(model, 64, prefill_tokens=0) == int(0.9 * (2**20 + 2 * 64 * 256) // (64 * 256)) - 1
    monkeypatch.setattr(checks, "free_bytes", lambda device: 10_000)
    with pytest.raises(ValueError, match="no KV page of 64 tokens fits"):
        checks.pages_that_fit(make_tiny_llama(), 64)
    monkeypatch.setattr(checks, "free_bytes", lambda device: aside + 64 * 256)  # room for the prefill alone
    with pytest.raises(ValueError, match=f"set aside for a prefill of {LlmSettings.max_prefill_tokens} tokens"):
        checks.pages_that_fit(make_tiny_llama(), 64)
    monkeypatch.setattr(checks, "free_bytes", lambda device: None)
    with pytest.raises(ValueError, match="give the number of KV pages"):
        checks.pages_that_fit(model, 64)


def test_the_cache_leaves_room_for_a_prefill_of_the_budget(make_tiny_llama, monkeypatch):
    """A Generator's KV cache (static or paged) must leave a prefill of its max_prefill_tokens its
    activations: where it would not, the construction says so (naming max_prefill_tokens) instead of
    a step running out of memory later; with a smaller budget the same cache fits."""
    from fullthrottle.workloads.llm import checks

    model = make_tiny_llama()  # 256 bytes of keys and values a position
    cache = 4 * 64 * 256  # 4 rows x 64 positions
    monkeypatch.setattr(checks, "free_bytes", lambda device: int(cache / 0.9) + checks.prefill_bytes(model, 256) + 64)
    Generator(model, max_batch=4, max_seq_len=64, graphs=False, max_prefill_tokens=256)
    with pytest.raises(ValueError, match="set aside for a prefill of 4096 tokens: .* or a smaller max_prefill_tokens"):
        Generator(make_tiny_llama(), max_batch=4, max_seq_len=64, graphs=False, max_prefill_tokens=4096)
    with pytest.raises(ValueError, match="set aside for a prefill of 4096 tokens: take fewer kv_pages"):
        Generator(make_tiny_llama(), max_batch=4, max_seq_len=64, graphs=False, kv_pages=4, max_prefill_tokens=4096)


@pytest.mark.gpu
@pytest.mark.parametrize("kv_pages", [0, 12])  # the static cache; paged KV memory (2 pages a row)
def test_cuda_graph_steps_equal_each_request_alone(tiny_llama, kv_pages):
    model = tiny_llama.cuda()
    rng = random.Random(1)
    reqs = [
        {"prompt": [rng.randrange(97) for _ in range(rng.randint(1, 30))], "max_new_tokens": rng.randint(1, 40)}
        for _ in range(13)
    ]
    alone = Generator(model, max_batch=1, max_seq_len=96, graphs=False)
    refs = [alone.generate([r["prompt"]], max_new_tokens=r["max_new_tokens"])[0] for r in reqs]
    gen = Generator(model, max_batch=8, max_seq_len=96, graphs=True, attn_buckets=(32, 64), kv_pages=kv_pages)
    for ahead in (1, 8):  # a read back per token; up to 8 replays per read back once nothing waits
        sched = Scheduler(gen, ahead=ahead)
        assert sched.run(reqs) == refs, ahead  # replays switch batch and KV bucket as rows join, grow, leave
        assert sorted(sched.free) == list(range(8)) and not sched.running
        assert gen.kv is None or gen.kv.pages_used == 0
    # each row's own stop ids, inside the decode graphs: request i stops at the first of its 1-3 ids
    # (taken from its own tokens, and ids it never makes); a row that stopped inside a run of 8
    # replays makes nothing more
    stops = [[r[len(r) // 2], 96 - i % 3] if len(r) > 2 and i % 2 else [96, 95, 94 - i % 2] for i, r in enumerate(refs)]
    cut = [next((r[: j + 1] for j, t in enumerate(r) if t in st), r) for r, st in zip(refs, stops)]
    assert cut != refs  # (some of them stop early)
    for ahead in (1, 8):
        sched = Scheduler(gen, ahead=ahead)
        recs = [sched.submit(r["prompt"], r["max_new_tokens"], stop_ids=st) for r, st in zip(reqs, stops)]
        while sched.busy:
            sched.step()
        assert [s.tokens for s in recs] == cut, ahead


@pytest.mark.gpu
def test_fp8_kv_memory_graph_steps_equal_eager_steps_alone(tiny_llama):
    """Float8 paged KV memory through the CUDA graphs (prefill and decode replays, the Triton kernels
    reading float8 pages) gives each greedy request the tokens it gets alone, eagerly."""
    import torch

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("float8 KV memory needs compute capability 8.9")
    model = tiny_llama.cuda()
    reqs = random_requests(2, 13, (1, 9, 30), (1, 40), (0.0,))
    alone = Generator(model, max_batch=1, max_seq_len=96, graphs=False, kv_pages=2, kv_dtype="fp8")
    refs = [alone.generate([r["prompt"]], max_new_tokens=r["max_new_tokens"])[0] for r in reqs]
    gen = Generator(model, max_batch=8, max_seq_len=96, graphs=True, attn_buckets=(32, 64), kv_pages=12, kv_dtype="fp8")
    assert gen.graphs and model.layers[0].self_attn.k_cache.dtype == torch.float8_e4m3fn
    for ahead in (1, 8):
        assert Scheduler(gen, ahead=ahead).run(reqs) == refs, ahead


@pytest.mark.parametrize("kv_pages", [0, 8])
def test_prompts_of_any_lengths_are_prefilled_in_one_packed_forward_without_padding(tiny_llama, monkeypatch, kv_pages):
    """Prompts of 30, 3, 28 and 4 tokens and the last 8 tokens of a 20-token prompt whose first 12 are
    already in its row (a chunk) go into one forward of exactly 73 tokens: each gets the first token
    it gets alone, for its own row, in the order given; a piece that does not end its prompt gets none."""
    lengths = [30, 3, 28, 4, 20]
    rng = random.Random(5)
    prompts = [[rng.randrange(3, 97) for _ in range(n)] for n in lengths]
    alone = Generator(tiny_llama, max_batch=1, max_seq_len=64, graphs=False)
    refs = [alone.generate([p], max_new_tokens=1)[0][0] for p in prompts]
    gen = Generator(tiny_llama, max_batch=8, max_seq_len=64, graphs=False, kv_pages=kv_pages)
    forwards = []
    real = tiny_llama.prefill
    monkeypatch.setattr(tiny_llama, "prefill", lambda pk: forwards.append(pk.ids.shape[0]) or real(pk))
    gen.temp.zero_()  # greedy rows
    rows = [3, 0, 2, 1, 6]
    if gen.kv is not None:
        for r, n in zip(rows, lengths):
            gen.kv.reserve(r, n + 1)
    assert gen._prefill([(6, prompts[4], 0, 12)]).tolist() == []  # the chunk: no first token
    first = gen._prefill([(r, p, 12 if r == 6 else 0, len(p)) for r, p in zip(rows, prompts)]).tolist()
    assert first == refs and forwards == [12, 30 + 3 + 28 + 4 + 8]
    assert gen.pos[rows, 0].tolist() == lengths


def test_paged_kv_memory_gives_each_request_its_tokens_alone_and_admits_what_fits(tiny_llama):
    """Paged KV memory of 3, then 6 pages of 64 positions under 4 rows: requests of up to 150
    positions (3 pages) take pages as their tokens grow and wait for pages, not only for rows;
    running requests are preempted when pages run out, and prefilled again later; prompts longer than the
    prefill budget go in chunks that read their earlier pages. Greedy and seeded sampled requests
    get exactly their tokens alone (static cache); every page comes back; a request larger than the
    whole pool is refused."""
    reqs = random_requests(4, 10, [2, 30, 70, 110], (2, 40), [0.0, 0.8])
    reqs[1:1] = [  # short prompts, long answers: admitted on one page, they grow to three
        {"prompt": [5, 6], "max_new_tokens": 140, "temperature": 0.8, "seed": 99},
        {"prompt": [7], "max_new_tokens": 130, "temperature": 0.0, "seed": 98},
    ]
    alone = Generator(tiny_llama, max_batch=1, max_seq_len=192, graphs=False)
    refs = [alone.generate([r["prompt"]], r["max_new_tokens"], r["temperature"], seed=[r["seed"]])[0] for r in reqs]
    greedy5 = [alone.generate([r["prompt"]], 5)[0] for r in reqs[:2]]
    for pages in (3, 6):
        gen = Generator(tiny_llama, max_batch=4, max_seq_len=192, graphs=False, max_prefill_tokens=48, kv_pages=pages)
        sched = Scheduler(gen)
        seqs = [sched.submit(**r) for r in reqs]
        most_pages, waited_for_memory = 0, 0
        while sched.busy:
            sched.step()
            most_pages = max(most_pages, gen.kv.pages_used)
            waited_for_memory += bool(sched.waiting and sched.free and sched.prefilling is None)
        assert [s.tokens for s in seqs] == refs, pages
        assert most_pages <= pages and waited_for_memory > 0
        assert sched.preemptions > 0  # (prefilled again later: the same tokens)
        assert gen.kv.pages_used == 0 and not gen.model.block_table.any()  # every page given back
    # the library's call on the same pages, and one whose prompts do not fit at once: they take turns
    assert gen.generate([r["prompt"] for r in reqs[:2]], 5) == greedy5 and gen.kv.pages_used == 0
    long = [[1 + i] * 100 for i in range(4)]  # 4 x 3 pages, in a pool of fewer
    assert gen.generate(long, 60) == [gen.generate([p], 60)[0] for p in long] and gen.kv.pages_used == 0
    small = Scheduler(Generator(tiny_llama, max_batch=2, max_seq_len=192, graphs=False, kv_pages=2))
    with pytest.raises(ValueError, match="more KV memory than there is"):
        small.submit([1] * 100, max_new_tokens=50)  # 3 pages: more than the pool holds
    live = small.submit([1, 2], max_new_tokens=3)
    with pytest.raises(ValueError, match="prompt 0: 100 tokens .* more KV memory than there is"):
        small.gen.generate([[1] * 100], 50)  # refused before it takes the engine from the live Scheduler
    while small.busy:
        small.step()
    ref = Generator(tiny_llama, max_batch=1, max_seq_len=192, graphs=False).generate([[1, 2]], 3)[0]
    assert live.done and live.tokens == ref
    big = Generator(tiny_llama, max_batch=2, max_seq_len=192, graphs=False, kv_pages=10**9)
    assert big.kv.num_pages == 2 * 3  # no more than two full rows could use


@pytest.mark.parametrize("kv_pages", [0, 5])
def test_decode_steps_ahead_give_every_request_the_same_tokens_in_fewer_reads(tiny_llama, kv_pages):
    """``Scheduler(ahead=8)``: while nothing waits for admission, up to 8 decode replays run per read
    back. Every request's tokens (greedy and seeded sampled; some ended by EOS inside such a run; paged
    ones crossing page boundaries, with preemptions in a pool of 5 pages) equal those of ``ahead=1``,
    in fewer steps; a request asking for logprobs gets one per token."""
    reqs = random_requests(9, 12, [1, 9, 40, 70], (1, 90), [0.0, 0.9])

    def run(ahead, eos=None, logprobs=0, reqs=reqs):
        gen = Generator(tiny_llama, max_batch=4, max_seq_len=192, graphs=False, kv_pages=kv_pages, logprobs=logprobs)
        sched = Scheduler(gen, eos_id=eos, ahead=ahead)
        seqs = [sched.submit(**r, logprobs=logprobs or None) for r in reqs]
        calls = 0
        while sched.busy:
            sched.step()
            calls += 1
        return [s.tokens for s in seqs], calls, seqs

    free, _, _ = run(1)
    long = max(free, key=len)
    eos = long[len(long) // 2]  # a token some request makes midway
    one, calls1, _ = run(1, eos)
    eight, calls8, _ = run(8, eos)
    assert eight == one and calls8 < calls1, (calls1, calls8)
    four = [dict(r, max_new_tokens=80, temperature=0.0) for r in reqs[:4]]  # all in at once
    alone, calls1, _ = run(1, reqs=four)
    got, calls8, _ = run(8, reqs=four)
    assert got == alone and calls1 >= 79  # (the first token from the prefill, then a step a token)
    # (79 decode tokens, 8 a launch: 10 launches, each read back in the step after it)
    assert calls8 == 11 if not kv_pages else calls8 < calls1 / 2
    ended = [t for t, r in zip(one, reqs) if t[-1] == eos and len(t) < r["max_new_tokens"]]
    assert ended and one != free  # (EOS did cut some requests short)
    with_lp, _, seqs = run(8, eos, logprobs=2)
    assert with_lp == one and all(len(s.lps) == len(s.tokens) for s in seqs)


INTERPRETED = """
import os, random, torch
from fullthrottle.workloads.llm.generate import Generator
from fullthrottle.workloads.llm.llama import Llama, LlamaConfig
from fullthrottle.workloads.llm.scheduler import Scheduler

torch.manual_seed(0)
cfg = LlamaConfig(vocab_size=97, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, eos_token_id=None, max_position_embeddings=256)
model = Llama(cfg).eval()  # head dim 16: the Triton kernels' smallest
rng = random.Random(6)
reqs = [{"prompt": [rng.randrange(97) for _ in range(n)], "max_new_tokens": rng.randint(2, 6)}
        for n in (3, 52, 20, 3, 12)]  # (52 > 48: a prompt prefilled in two chunks; 5 > 4 rows: one waits)
os.environ["FULLTHROTTLE_TRITON"] = "0"  # the references
refs = [Generator(model, max_batch=1, max_seq_len=128, graphs=False).generate([r["prompt"]], r["max_new_tokens"])[0]
        for r in reqs]
fp8 = Generator(model, max_batch=4, max_seq_len=128, graphs=False, max_prefill_tokens=48, kv_pages=8, kv_dtype="fp8")
refs8 = Scheduler(fp8).run(reqs)
os.environ["FULLTHROTTLE_TRITON"] = "1"  # the kernels the GPU runs, in Triton's interpreter
for pages, dt, want in ((0, "auto", refs), (8, "auto", refs), (8, "fp8", refs8)):
    gen = Generator(model, max_batch=4, max_seq_len=128, graphs=False, max_prefill_tokens=48, kv_pages=pages, kv_dtype=dt)
    assert Scheduler(gen).run(reqs) == want, (pages, dt)
print("ok")
"""


def test_packed_prefill_and_decode_kernels_in_the_interpreter_give_each_request_its_tokens():
    """The scheduler on the Triton kernels the GPU runs (packed prefill attention with chunks, decode
    attention; static cache and paged), in Triton's interpreter on CPU: every request's tokens equal
    those of the plain-PyTorch references, request alone."""
    import os
    import subprocess
    import sys

    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    out = subprocess.run([sys.executable, "-c", INTERPRETED], capture_output=True, text=True, env=env, timeout=600)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@pytest.mark.parametrize("kv_pages", [0, 8])
def test_a_padded_pack_as_a_prefill_graph_holds_it_gives_the_same_logits_and_writes_only_the_spare_row(
    tiny_llama, kv_pages
):
    """What a prefill graph replays, checked on the CPU: pieces packed into the static sizes of a token
    bucket (padding tokens, empty padding pieces, unused kernel blocks) give the logits of the exact
    pack, and the padding writes the spare row only (static cache) or page 0 (paged)."""
    import torch

    from fullthrottle.workloads.llm.kv_pages import PagedKV
    from fullthrottle.workloads.llm.prefill import Packed, Prefill

    kv = None  # 4 rows and the spare row 4, as a Generator with prefill graphs has
    if kv_pages:
        tiny_llama.setup_paged_cache(5, 64, kv_pages)
        kv = PagedKV(tiny_llama.block_table, kv_pages)
    else:
        tiny_llama.setup_cache(5, 64)
    pf = Prefill(tiny_llama, max_pieces=4, graph_tokens=64, pad_row=4)  # (its sizes; no graphs on CPU)
    rng = random.Random(8)
    pieces = [(r, [rng.randrange(97) for _ in range(n)], 0, n) for r, n in ((2, 9), (0, 1), (3, 20))]
    for r, _, _, n in pieces if kv is not None else []:
        kv.reserve(r, n)
    exact = (30, 3, 3)
    with torch.inference_mode():
        want = tiny_llama.prefill(Packed.view(Packed.build(pieces, *exact, pad_row=4), *exact))
        cache = [blk.self_attn.k_cache.clone() for blk in tiny_llama.layers]
        sizes = pf._sizes(32)  # the bucket of 32 tokens: 2 padding tokens, 1 padding piece
        assert sizes == (32, 4, 1 + 4)
        got = tiny_llama.prefill(Packed.view(Packed.build(pieces, *sizes, pad_row=4), *sizes))
    torch.testing.assert_close(got[:3], want, atol=1e-5, rtol=0)
    for blk, before in zip(tiny_llama.layers, cache):
        k = blk.self_attn.k_cache
        if kv is None:  # rows 0..3 as the exact pack left them; row 4 (the spare) took the padding
            torch.testing.assert_close(k[:4], before[:4], atol=1e-6, rtol=0)
        else:  # pages 1.. as the exact pack left them; page 0 took the padding
            torch.testing.assert_close(k[1:], before[1:], atol=1e-6, rtol=0)


def test_fp8_kv_memory_holds_float8_keys_and_values_and_gives_what_their_rounding_gives(tiny_llama, monkeypatch):
    """kv_dtype="fp8": the pages are float8 e4m3 (a quarter of float32's bytes: four times the pages
    in the same memory), and every request's tokens and logprobs are exactly those of model-dtype pages
    holding the same keys and values rounded to float8 and back: the attention reads what was written.
    The rounding changes the logprobs (so the float8 pages are what was read), by a little."""
    import torch

    from fullthrottle.workloads.llm import checks

    reqs = random_requests(4, 9, (1, 7, 30, 61), (1, 24), (0.0, 0.8))
    for r in reqs:
        r["logprobs"] = 2

    def run(kv_dtype):
        gen = Generator(
            tiny_llama, max_batch=4, max_seq_len=96, graphs=False, kv_pages=7, kv_dtype=kv_dtype, logprobs=2
        )
        sched = Scheduler(gen)
        seqs = [sched.submit(**r) for r in reqs]
        while sched.busy:
            sched.step()
        return gen, [(s.tokens, [x[0] for x in s.lps]) for s in seqs]

    gen, fp8 = run("fp8")
    assert all(blk.self_attn.k_cache.dtype == torch.float8_e4m3fn for blk in tiny_llama.layers)
    assert gen.kv.num_pages == 7
    from fullthrottle.core.kernels import norm_rope

    rounded = norm_rope.to_kv

    def through_fp8(x, dtype):  # model-dtype pages holding float8-rounded values
        return rounded(x, torch.float8_e4m3fn).to(dtype)

    monkeypatch.setattr(norm_rope, "to_kv", through_fp8)  # (where every page write converts)
    _, same = run("auto")
    assert same == fp8
    monkeypatch.undo()
    _, exact = run("auto")
    diffs = [abs(a - b) for (ta, la), (tb, lb) in zip(fp8, exact) if ta == tb for a, b in zip(la, lb)]
    assert diffs and 0 < max(diffs) < 0.05
    per32, _ = checks._kv_bytes_and_free(tiny_llama)
    per8, _ = checks._kv_bytes_and_free(tiny_llama, torch.float8_e4m3fn)
    assert per32 == 4 * per8 == 4 * 2 * 2 * 2 * 8  # k and v, 2 layers, 2 heads of 8 dims
    with pytest.raises(ValueError, match="kv_dtype 'fp8' needs paged KV memory: give kv_pages"):
        Generator(tiny_llama, max_batch=2, max_seq_len=64, graphs=False, kv_dtype="fp8")
    for bad in ("int4", "FP8", ["fp8"], None):
        with pytest.raises(ValueError, match=re.escape(f"kv_dtype must be one of auto, fp8, got {bad!r}")):
            Generator(tiny_llama, max_batch=2, max_seq_len=64, graphs=False, kv_pages=4, kv_dtype=bad)


def test_first_tokens_are_handed_over_before_the_decode_of_their_step(tiny_llama):
    """Scheduler(on_first=f): f runs in each step whose prefill made first tokens, when those requests
    hold exactly their first token (the decode of that step has not run), and in no other step; the
    tokens are those of a scheduler without it."""
    from fullthrottle.workloads.llm.generate import Generator
    from fullthrottle.workloads.llm.scheduler import Scheduler

    gen = Generator(tiny_llama, max_batch=4, max_seq_len=64, graphs=False, max_prefill_tokens=16)
    reqs = [{"prompt": list(range(3, 3 + n)), "max_new_tokens": 5} for n in (6, 12, 9)]
    ref = Scheduler(gen).run(reqs)
    seen: list[list[int]] = []
    sched = Scheduler(gen, on_first=lambda: seen.append([len(s.tokens) for s in recs]))
    recs = [sched.submit(**r) for r in reqs]
    steps = 0
    while sched.busy:
        sched.step()
        steps += 1
    assert [s.tokens for s in recs] == ref
    # (a budget of 16 tokens: the prompts are prefilled over several steps) each request holds exactly
    # one token in one call, the one right after its prefill: had the call come after the decode, two
    assert seen and all(1 in counts for counts in seen), seen
    assert len(seen) < steps and sum(c.count(1) for c in seen) == len(reqs), seen


@pytest.mark.parametrize("kv_pages", [0, 3])
def test_overlapped_steps_give_every_request_the_tokens_of_steps_read_at_once(tiny_llama, kv_pages):
    """``Scheduler(overlap=True)``, the default, reads each step's tokens back in the step after, while
    the next one runs. Every request's tokens (greedy and seeded sampled, some ended by EOS, prompts
    prefilled in chunks, preemptions in a pool of 3 pages, requests joining as others leave) equal
    those of ``overlap=False``; one cancelled midway holds a prefix of its tokens; every page comes back."""
    reqs = random_requests(11, 10, [1, 9, 40, 70], (1, 60), [0.0, 0.9])
    reqs[2:2] = [  # short prompts, long answers: they grow to three pages each
        {"prompt": [5, 6], "max_new_tokens": 140, "temperature": 0.8, "seed": 99},
        {"prompt": [7], "max_new_tokens": 130, "temperature": 0.0, "seed": 98},
    ]

    def run(overlap, eos=None):
        gen = Generator(
            tiny_llama, max_batch=4, max_seq_len=192, graphs=False, kv_pages=kv_pages, max_prefill_tokens=48
        )
        sched = Scheduler(gen, eos_id=eos, overlap=overlap)
        seqs = [sched.submit(**r) for r in reqs]
        lagged, steps = 0, 0
        while sched.busy:
            sched.step()
            steps += 1
            if steps == 6:
                sched.cancel(seqs[0])  # (its client left)
            lagged += sched._pending is not None  # a launch whose tokens the next step reads
        assert gen.kv is None or gen.kv.pages_used == 0 and not gen.model.block_table.any()
        return [s.tokens for s in seqs], lagged, sched

    free, _, _ = run(False)
    longest = max(free, key=len)
    for eos in (None, longest[len(longest) // 2]):  # (then a token some request makes midway)
        sync, lagged0, s0 = run(False, eos)
        over, lagged1, s1 = run(True, eos)
        assert over[1:] == sync[1:] and sync[0][: len(over[0])] == over[0], eos
        assert lagged0 == 0 and lagged1 > 10
        if eos is None:  # (the two long answers outgrow the pool)
            assert s1.preemptions > 0 if kv_pages else s1.preemptions == 0
    assert any(t[-1] == eos and len(t) < r["max_new_tokens"] for t, r in zip(sync[1:], reqs[1:]))  # (EOS cut some)


def test_overlapped_steps_survive_preemptions_and_the_cache_edge(tiny_llama):
    """Overlapped steps where it is tight: requests preempted while a token of theirs is still on its
    way (it is dropped and made again), and a request whose last token is made while others go on
    decoding several replays per read back, in a cache exactly as long as it needs: every request gets
    the tokens of non-overlapped steps."""
    from fullthrottle.cli.generate import random_llama

    model = random_llama("tiny", torch.device("cpu"), torch.float32)  # (vocab 512)
    for seed in (3, 6, 8):  # 20 sampled requests, 8 rows, 6 pages of 64 positions
        rng = random.Random(seed)
        reqs = [
            {
                "prompt": [rng.randrange(512) for _ in range(rng.choice([50, 60, 63, 100, 126]))],
                "max_new_tokens": rng.choice([2, 3, 5, 10, 70]),
                "temperature": 0.8,
                "seed": rng.randrange(99),
            }
            for _ in range(20)
        ]
        got = {}
        for overlap in (False, True):
            sched = Scheduler(Generator(model, max_batch=8, max_seq_len=512, kv_pages=6), overlap=overlap)
            got[overlap] = sched.run(reqs)
            assert sched.preemptions > 0 and sched.gen.kv.pages_used == 0
        assert got[True] == got[False], seed
    reqs = [
        {"prompt": [1 + i % 90 for i in range(100)], "max_new_tokens": 5},
        {"prompt": [1, 2, 3], "max_new_tokens": 40},
    ]
    alone = Generator(tiny_llama, max_batch=1, max_seq_len=105, graphs=False)
    refs = [alone.generate([r["prompt"]], r["max_new_tokens"])[0] for r in reqs]
    gen = Generator(tiny_llama, max_batch=2, max_seq_len=105, graphs=False)  # (the longest request's length)
    assert Scheduler(gen, ahead=8).run(reqs) == refs


def test_the_stage_counters_hold_each_prefill_and_decode_once(tiny_llama):
    """The Generator's stage counters (what reports and /metrics show) count every prompt token and
    decoded token, and, on the CPU, each launch's own time: both stages busy, together no more than the
    run's wall clock (chunked prompts and overlapped steps included)."""
    import time

    reqs = random_requests(3, 9, (5, 14, 40), (2, 9), (0.0,))
    for overlap in (False, True):
        gen = Generator(tiny_llama, max_batch=4, max_seq_len=64, graphs=False, max_prefill_tokens=16)
        t0 = time.perf_counter()
        out = Scheduler(gen, overlap=overlap).run(reqs)
        wall = time.perf_counter() - t0
        p, d = gen.stats["prefill"], gen.stats["decode"]
        assert p.items == sum(len(r["prompt"]) for r in reqs) and d.items == sum(len(o) - 1 for o in out)
        assert 0 < p.busy_s and 0 < d.busy_s and p.busy_s + d.busy_s <= wall, (overlap, p.busy_s, d.busy_s, wall)


@pytest.mark.gpu
def test_on_cuda_overlapped_steps_count_the_devices_prefill_time_as_steps_that_wait(make_tiny_llama):
    """On CUDA the stage counters hold the device's time of each launch (CUDA events): with overlapped
    steps a long prefill's time is prefill's, as when each step waits for its own work, not the time
    of whichever read back waited for it."""
    import time

    model = make_tiny_llama(
        vocab_size=1000,
        hidden_size=1024,
        intermediate_size=4096,
        num_hidden_layers=8,
        num_attention_heads=8,
        num_key_value_heads=8,
        max_position_embeddings=1024,
    )
    model = model.to("cuda", torch.bfloat16)
    gen = Generator(model, max_batch=64, max_seq_len=600, graphs=True, max_prefill_tokens=4096)
    rng = random.Random(0)
    reqs = [{"prompt": [rng.randrange(1000) for _ in range(512)], "max_new_tokens": 16} for _ in range(64)]
    Scheduler(gen).run(reqs[:4])  # (warm-up)
    got = {}
    for overlap in (False, True) * 3:
        before = [gen.stats[k].busy_s for k in ("prefill", "decode")]
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        Scheduler(gen, overlap=overlap).run(reqs)  # (8 prefill steps of 4096 tokens, decodes between)
        torch.cuda.synchronize()
        wall = time.perf_counter() - t0
        p, d = (gen.stats[k].busy_s - b for k, b in zip(("prefill", "decode"), before))
        assert 0 < p and 0 < d and p + d <= wall * 1.02, (overlap, p, d, wall)
        got.setdefault(overlap, []).append(p)
    # (the device time of the same prefills either way; counted by the read backs, overlapped steps gave
    # a quarter of it)
    assert 0.6 < sum(got[True]) / sum(got[False]) < 1.6, got


def test_the_stage_clock_counts_a_launch_once_its_end_has_passed(monkeypatch):
    """:class:`StageClock` on CUDA, with stand-in events holding device times: a launch's time (its
    end event's minus its start's) goes to its stage once the end has passed, oldest first, each once;
    one still running is counted at a later collect."""
    from fullthrottle.core.report import StageStats
    from fullthrottle.workloads.llm.step_records import StageClock

    class Event:  # (torch.cuda.Event's part that the clock uses; ``now``: the device's clock, s)
        now, recorded = 0.0, []

        def __init__(self, enable_timing=False):
            assert enable_timing
            self.t, self.passed = None, False

        def record(self):
            self.t = Event.now
            Event.recorded.append(self)

        def synchronize(self):  # (one stream: every event recorded before it has passed too)
            for ev in Event.recorded[: Event.recorded.index(self) + 1]:
                ev.passed = True

        def query(self):
            return self.passed

        def elapsed_time(self, end):  # (ms; CUDA raises unless both have passed)
            assert self.passed and end.passed
            return (end.t - self.t) * 1e3

    monkeypatch.setattr(torch.cuda, "Event", Event)
    stats = {k: StageStats(k) for k in ("prefill", "decode")}
    clock = StageClock(torch.device("cuda"), stats)
    events = []
    for stage, t0, t1 in (("prefill", 1.0, 3.0), ("decode", 3.0, 3.5), ("decode", 3.5, 4.25)):
        Event.now = t0
        start = clock.start()
        Event.now = t1
        clock.stop(stage, start)
        events.append((start, clock._open[-1][2]))
    clock.collect()
    assert stats["prefill"].busy_s == stats["decode"].busy_s == 0  # (nothing has passed yet)
    for ev in (*events[0], *events[1]):
        ev.passed = True
    clock.collect()
    assert stats["prefill"].busy_s == pytest.approx(2.0) and stats["decode"].busy_s == pytest.approx(0.5)
    for ev in events[2]:
        ev.passed = True
    clock.collect()
    clock.collect()
    assert stats["prefill"].busy_s == pytest.approx(2.0) and stats["decode"].busy_s == pytest.approx(1.25)
    assert stats["prefill"].work_s == pytest.approx(2.0) and stats["decode"].items == 0
    Event.now = 5.0  # settle(): a run's end waits for its last launch, then counts what is open
    start = clock.start()
    Event.now = 5.75
    clock.stop("prefill", start)
    clock.settle()
    assert stats["prefill"].busy_s == pytest.approx(2.75) and not clock._open
