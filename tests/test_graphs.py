import gc
import threading
import time

import pytest
import torch
import torchvision

from fullthrottle.core.graphs import GraphRunner, GraphSet, graph_module

BUCKETS = (1, 2, 4, 8, 16, 32)


def _sizes():
    out = set()
    for b in BUCKETS:
        out |= {1, 3, b - 1, b, b + 1}
    return sorted(s for s in out if s >= 1)


# ---- CPU (CI): splitting, padding arithmetic and the eager fallback ---------------------------


def test_eager_fallback_splits_and_matches():
    calls = []

    def fn(x):
        calls.append(x.shape[0])
        return x * 2 + 1, x.sum(dim=1)

    r = GraphRunner(fn, (5,), torch.float32, (1, 4, 8), "cpu")
    assert not r.graphs_enabled and r.graphs == {}
    x = torch.randn(19, 5)
    a, s = r(x)
    assert calls == [8, 8, 3]  # split into the largest bucket, remainder unpadded on the eager path
    torch.testing.assert_close(a, x * 2 + 1, rtol=0, atol=0)
    torch.testing.assert_close(s, x.sum(dim=1), rtol=0, atol=0)


def test_eager_fallback_module():
    torch.manual_seed(0)
    m = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten())
    runner = graph_module(m, (3, 16, 16), BUCKETS, device="cpu", graphs=True)  # CPU: eager
    x = torch.randn(70, 3, 16, 16)
    with torch.no_grad():
        ref = m(x)
    torch.testing.assert_close(runner(x), ref, rtol=0, atol=0)


def test_wrong_item_shape_is_a_clear_error():
    r = GraphRunner(lambda x: x, (3,), torch.float32, (1, 2), "cpu")
    with pytest.raises(ValueError, match=r"expected input \(B, 3\)"):
        r(torch.zeros(2, 4))


# ---- GPU ------------------------------------------------------------------------------------


@pytest.fixture
def resnet():
    """A fresh seeded ResNet18 per test (graph_module moves and casts the module in place)."""
    torch.manual_seed(0)
    return torchvision.models.resnet18().eval()


@pytest.mark.gpu
def test_fp32_graphs_equal_eager_every_bucket(resnet):
    prev = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False  # compare fp32 against fp32, not TF32 choices per shape
    try:
        model = resnet.cuda().float()
        runner = graph_module(model, (3, 224, 224), BUCKETS, device="cuda", dtype=torch.float32)
        assert sorted(runner.graphs) == list(BUCKETS)
        gen = torch.Generator(device="cuda").manual_seed(1)
        for n in _sizes():
            x = torch.randn(n, 3, 224, 224, device="cuda", generator=gen)
            with torch.inference_mode():
                ref = model(x)
            out = runner(x)
            assert out.shape == ref.shape
            rel = ((out - ref).norm() / ref.norm()).item()
            assert rel <= 1e-4, (n, rel)
    finally:
        torch.backends.cudnn.allow_tf32 = prev


@pytest.mark.gpu
def test_bf16_graphs_top1_matches_eager(resnet):
    model = resnet.cuda().to(torch.bfloat16).to(memory_format=torch.channels_last)
    runner = graph_module(model, (3, 224, 224), BUCKETS, device="cuda", dtype=torch.bfloat16, channels_last=True)
    gen = torch.Generator(device="cuda").manual_seed(2)
    x = torch.randn(200, 3, 224, 224, device="cuda", generator=gen)
    with torch.inference_mode():
        ref = model(x.to(torch.bfloat16).contiguous(memory_format=torch.channels_last))
    out = runner(x)
    agree = (out.argmax(1) == ref.argmax(1)).float().mean().item()
    assert agree >= 0.99, agree


@pytest.mark.gpu
def test_back_to_back_replays_keep_their_results(resnet):
    model = resnet.cuda().float()
    runner = graph_module(model, (3, 224, 224), (4,), device="cuda")
    x1 = torch.randn(4, 3, 224, 224, device="cuda")
    x2 = torch.randn(4, 3, 224, 224, device="cuda")
    with torch.inference_mode():
        r1, r2 = model(x1), model(x2)
    # raw replays share the static output: the second overwrites the first unless it is consumed
    _, (o1,) = runner.replay(x1)
    keep = o1.clone()
    _, (o2,) = runner.replay(x2)
    assert o1.data_ptr() == o2.data_ptr()
    torch.testing.assert_close(keep, r1, rtol=1e-3, atol=1e-3)
    # the public call copies out: both results stay their own
    a = runner(x1)
    b = runner(x2)
    torch.testing.assert_close(a, r1, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(b, r2, rtol=1e-3, atol=1e-3)


@pytest.mark.gpu
def test_engine_slots_in_flight_keep_their_results(samples):
    """Two batches submitted back to back (no collect in between) through the graphed engine."""
    import numpy as np

    from fullthrottle import Config
    from fullthrottle.data.preprocess import preprocess
    from fullthrottle.workloads.classify.compute import Engine

    torch.manual_seed(0)
    eng = Engine(Config(model="resnet18", device="cuda", dtype="float32", max_batch_size=8, graphs=True))
    arr = [preprocess(p.read_bytes()) for p in samples[:16]]
    a, b = eng.acquire(), eng.acquire()
    eng.submit(a, arr[:8])
    eng.submit(b, arr[8:13])  # padded to bucket 8
    pa, ia = eng.collect(a)
    pb, ib = eng.collect(b)
    ref = torch.softmax(eng.forward(torch.from_numpy(np.stack(arr[:13])).cuda()), -1).topk(5)
    assert (ia[:, 0] == ref.indices[:8, 0].cpu().numpy()).all()
    assert (ib[:, 0] == ref.indices[8:13, 0].cpu().numpy()).all()
    np.testing.assert_allclose(pb[:, 0], ref.values[8:13, 0].cpu().numpy(), rtol=1e-3)


@pytest.mark.gpu
def test_capture_while_another_thread_copies_pinned(resnet):
    stop = threading.Event()
    copies = [0]
    errors = []

    def copier():
        try:
            s = torch.cuda.Stream()
            src = torch.randn(1 << 20, pin_memory=True)
            dst = torch.empty(1 << 20, device="cuda")
            with torch.cuda.stream(s):
                while not stop.is_set():
                    dst.copy_(src, non_blocking=True)
                    s.synchronize()
                    copies[0] += 1
        except Exception as e:  # noqa: BLE001
            errors.append(e)

    t = threading.Thread(target=copier)
    t.start()
    try:
        while copies[0] < 10 and not errors:
            time.sleep(0.001)
        model = resnet.cuda().float()
        runner = graph_module(model, (3, 224, 224), BUCKETS, device="cuda")
    finally:
        stop.set()
        t.join()
    assert not errors and copies[0] > 10
    x = torch.randn(5, 3, 224, 224, device="cuda")
    with torch.inference_mode():
        ref = model(x)
    torch.testing.assert_close(runner(x), ref, rtol=2e-2, atol=2e-2)
    assert runner.info.total_capture_s > 0 and runner.info.pool_bytes > 0


@pytest.mark.gpu
def test_capture_survives_a_cycle_of_old_graphs_freed_meanwhile():
    # old graphs that only a reference cycle holds become garbage while a new capture runs, and the
    # captured function's allocations would trigger a collection there (freeing them destroys their
    # CUDA graphs and releases their memory pools, not permitted during a capture): no collection
    # runs while capturing, and the capture holds
    x = torch.ones(64, device="cuda")
    olds = [GraphSet("cuda") for _ in range(4)]
    for old in olds:
        old.capture(0, lambda: x * 3)
    del old
    thresholds = gc.get_threshold()
    collecting_while_capturing = []

    def fn():
        if torch.cuda.is_current_stream_capturing():
            collecting_while_capturing.append(gc.isenabled())
        if torch.cuda.is_current_stream_capturing() and olds:
            cycle = [olds[:]]
            cycle.append(cycle)
            olds.clear()  # the old graphs hang on a young cycle only
            del cycle
            _ = [[] for _ in range(5000)]  # container allocations: a collection unless it is off
        return x * 2

    gc.set_threshold(1, 1, 1)
    try:
        new = GraphSet("cuda")
        _, out = new.capture("k", fn)
    finally:
        gc.set_threshold(*thresholds)
    assert not olds and collecting_while_capturing == [False] and gc.isenabled()
    x.fill_(5)
    new.replay("k")
    torch.cuda.synchronize()
    assert out.tolist() == [10.0] * 64
    gc.collect()  # (the old graphs go now, outside any capture)


def test_fold_batchnorm_matches_eager_and_leaves_untraceable_models_alone():
    from fullthrottle.workloads.classify.fuse import fold_batchnorm

    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    for m in model.modules():  # non-trivial running statistics, so that folding has work to do
        if isinstance(m, torch.nn.BatchNorm2d):
            m.running_mean.uniform_(-0.5, 0.5)
            m.running_var.uniform_(0.5, 2.0)
            m.weight.data.uniform_(0.5, 1.5)
            m.bias.data.uniform_(-0.5, 0.5)
    folded, ok = fold_batchnorm(model)
    assert ok and not any(isinstance(m, torch.nn.BatchNorm2d) for m in folded.modules())
    assert any(isinstance(m, torch.nn.BatchNorm2d) for m in model.modules())  # the original is untouched
    x = torch.randn(3, 3, 224, 224)
    with torch.inference_mode():
        ref, out = model(x), folded(x)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-4)
    assert out.argmax(1).tolist() == ref.argmax(1).tolist()

    class Branchy(torch.nn.Module):  # data-dependent control flow: torch.fx cannot trace it
        def __init__(self):
            super().__init__()
            self.conv, self.bn = torch.nn.Conv2d(3, 3, 1), torch.nn.BatchNorm2d(3)

        def forward(self, x):
            return self.bn(self.conv(x)) if x.sum() > 0 else x

    m = Branchy().eval()
    assert fold_batchnorm(m) == (m, False)


@pytest.mark.parametrize("name, pairs", [("resnet18", 17), ("resnet50", 49)])
def test_fuse_conv_relu_rewrites_every_conv_relu_pair_and_computes_the_same(name, pairs):
    from fullthrottle.workloads.classify.fuse import conv_add_relu, conv_relu, fold_batchnorm, fuse_conv_relu

    torch.manual_seed(0)
    folded, ok = fold_batchnorm(getattr(torchvision.models, name)().eval())
    x = torch.randn(2, 3, 224, 224)
    with torch.inference_mode():
        ref = folded(x)
    assert fuse_conv_relu(folded) == pairs  # stem + every block's conv->relu and conv->add->relu
    calls = [n.target for n in folded.graph.nodes if n.op == "call_function"]
    assert calls.count(conv_add_relu) == {"resnet18": 8, "resnet50": 16}[name]
    assert calls.count(conv_relu) == pairs - calls.count(conv_add_relu)
    assert not any(isinstance(m, torch.nn.ReLU) for m in folded.modules())  # none left unfused
    with torch.inference_mode():
        torch.testing.assert_close(folded(x), ref, rtol=0, atol=0)  # on CPU: the same ops, fused by name only
    assert fuse_conv_relu(folded) == 0


def test_fuse_conv_relu_leaves_scalar_adds_and_computes_broadcast_adds_the_same():
    from fullthrottle.workloads.classify.fuse import _conv2d_out_shape, fuse_conv_relu

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Conv2d(3, 4, 3, stride=2, padding=1)
            self.b = torch.nn.Conv2d(3, 4, 3, padding=2, dilation=2)

        def forward(self, x):
            return torch.relu(self.a(x) + 1.0).sum() + torch.relu(self.b(x) + torch.ones(4, 1, 1)).sum()

    torch.manual_seed(0)
    gm = torch.fx.symbolic_trace(M())
    x = torch.randn(2, 3, 9, 11)
    ref = gm(x)
    assert fuse_conv_relu(gm) == 1  # the scalar add stays as it is; the tensor add is fused
    torch.testing.assert_close(gm(x), ref, rtol=0, atol=0)
    w = torch.randn(4, 3, 3, 3)  # the shape check that picks cuDNN on CUDA
    assert (
        _conv2d_out_shape(x, w, [2, 2], [1, 1], [1, 1])
        == tuple(torch.nn.functional.conv2d(x, w, stride=2, padding=1).shape)
        == (2, 4, 5, 6)
    )


class _ConvThenInplace(torch.nn.Module):  # x changes in place between the conv and its ReLU
    def __init__(self):
        super().__init__()
        self.conv, self.r = torch.nn.Conv2d(8, 8, 3, padding=1), torch.nn.ReLU(inplace=True)

    def forward(self, x):
        y = self.conv(x)
        return torch.nn.functional.relu(y + self.r(x))


class _ConvTwice(torch.nn.Module):  # the add's two sides are the same conv
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        y = self.conv(x)
        return torch.nn.functional.relu(y + y)


class _ConvKeywords(torch.nn.Module):  # keyword inputs
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.Conv2d(8, 8, 3, padding=1)

    def forward(self, x):
        return torch.relu(input=self.conv(input=x))


class _ConvWeightNorm(torch.nn.Module):  # a parametrized weight
    def __init__(self):
        super().__init__()
        self.conv = torch.nn.utils.parametrizations.weight_norm(torch.nn.Conv2d(8, 8, 3, padding=1))

    def forward(self, x):
        return torch.nn.functional.relu(self.conv(x))


@pytest.mark.parametrize("cls", [_ConvThenInplace, _ConvTwice, _ConvKeywords, _ConvWeightNorm])
def test_fuse_conv_relu_leaves_graphs_it_cannot_rewrite_safely_alone(cls):
    from fullthrottle.workloads.classify.fuse import fuse_conv_relu

    torch.manual_seed(0)
    gm = torch.fx.symbolic_trace(cls().eval())
    x = torch.randn(2, 8, 9, 9)
    ref = gm(x.clone())
    assert fuse_conv_relu(gm) == 0
    torch.testing.assert_close(gm(x.clone()), ref, rtol=0, atol=0)


def _double(x):
    return x * 2


def _double_slowly(x):
    for _ in range(50):  # the same result, 50x the kernels
        x = x + 0
    return x * 2


def test_candidates_run_the_first_one_eagerly_on_cpu():
    runner = GraphRunner({"fast": _double, "slow": _double_slowly}, (4,), torch.float32, (1, 2, 4), "cpu")
    x = torch.arange(12.0).view(3, 4)
    assert torch.equal(runner(x), x * 2) and runner.info is None


@pytest.mark.gpu
def test_candidates_are_timed_per_bucket_and_the_fastest_kept():
    runner = GraphRunner({"fast": _double, "slow": _double_slowly}, (4096,), torch.float32, (1, 8, 64), "cuda")
    info = runner.info
    assert sorted(info.variant) == [1, 8, 64] and all(set(v) == {"fast", "slow"} for v in info.replay_ms.values())
    assert all(info.variant[b] == min(info.replay_ms[b], key=info.replay_ms[b].get) for b in info.variant)
    assert list(info.variant.values()).count("fast") >= 2  # 51 launches vs 1: measurably slower
    x = torch.randn(37, 4096, device="cuda")
    assert torch.equal(runner(x), x * 2)
    assert "fastest replay kept" in info.format()
