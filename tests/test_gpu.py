"""GPU tests (marker ``gpu``; skipped without CUDA). Run on the device before resolving GPU issues."""

import copy

import numpy as np
import pytest
import torch
from conftest import sample_label

from fullthrottle import Config, Pipeline
from fullthrottle.data.preprocess import preprocess

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def crops(samples):
    return torch.from_numpy(np.stack([preprocess(p.read_bytes()) for p in samples]))  # (200,224,224,3) u8


def _logits(pipe, crops, bs=50):
    dev = pipe.engine.device
    return torch.cat([pipe.engine.forward(crops[i : i + bs].to(dev)).cpu() for i in range(0, len(crops), bs)])


def test_cuda_fp32_equals_cpu(crops):
    """fp32 on CUDA against fp32 on CPU, same weights. cuDNN may run fp32 convolutions in TF32
    (PyTorch's default for convolutions), so the tolerance is relative: ||gpu-cpu|| / ||cpu|| <= 1e-2,
    and top-1 must agree on >= 99% of the 200 images."""
    torch.manual_seed(0)
    cpu = Pipeline(Config(model="resnet18", device="cpu", max_batch_size=50))
    gpu = Pipeline(
        Config(device="cuda", gpu_decode=False, dtype="float32", max_batch_size=50),
        model=copy.deepcopy(cpu.engine.model),
    )
    cpu_ref = _logits(cpu, crops)
    out = _logits(gpu, crops)
    rel = (out - cpu_ref).norm() / cpu_ref.norm()
    agree = (out.argmax(1) == cpu_ref.argmax(1)).float().mean().item()
    print(f"fp32 cuda vs cpu: rel err {rel:.2e}, top-1 agreement {agree:.3f}")
    assert rel <= 1e-2 and agree >= 0.99


def test_bf16_top1_agrees_with_fp32(crops):
    torch.manual_seed(0)
    fp32 = Pipeline(Config(model="resnet18", device="cuda", gpu_decode=False, dtype="float32", max_batch_size=50))
    ref = _logits(fp32, crops)
    bf16 = Pipeline(
        Config(device="cuda", gpu_decode=False, dtype="bfloat16", channels_last=True, max_batch_size=50),
        model=copy.deepcopy(fp32.engine.model),
    )
    out = _logits(bf16, crops)
    agree = (out.argmax(1) == ref.argmax(1)).float().mean().item()
    print(f"bf16 vs fp32 top-1 agreement on 200 images: {agree:.3f}")
    assert agree >= 0.99


def test_pipeline_on_cuda_matches_engine(samples, no_thread_leak):
    torch.manual_seed(0)
    pipe = Pipeline(
        Config(model="resnet18", device="cuda", gpu_decode=False, dtype="float32", max_batch_size=16, threads=8)
    )
    res = pipe.classify(list(samples) + [samples[0].parent.parent / "bad-inputs"])
    good = [r for r in res if r.ok]
    assert len(res) == 214 and len(good) == 210
    crops = torch.from_numpy(np.stack([preprocess(p.read_bytes()) for p in samples[:32]])).cuda()
    probs = torch.softmax(pipe.engine.forward(crops), -1).topk(5)
    for r, ids in zip(res[:32], probs.indices.cpu()):
        assert r.class_ids[0] == ids[0].item()
    rep = pipe.last_report
    assert rep.ok == 210 and rep.failed == 4 and rep.device.startswith("cuda")


def test_fused_conv_relu_on_cuda_matches_unfused():
    """cuDNN's conv+bias+ReLU (and +add) calls equal the separate ops: fp32 with TF32 off, 1e-4 relative."""
    import torchvision

    from fullthrottle.workloads.classify.fuse import fold_batchnorm, fuse_conv_relu

    torch.manual_seed(0)
    folded, _ = fold_batchnorm(torchvision.models.resnet18().eval())
    fused, _ = fold_batchnorm(torchvision.models.resnet18().eval())
    fused.load_state_dict(folded.state_dict())
    assert fuse_conv_relu(fused) == 17
    x = torch.randn(8, 3, 224, 224, device="cuda")
    tf32 = torch.backends.cudnn.allow_tf32
    torch.backends.cudnn.allow_tf32 = False
    try:
        with torch.inference_mode():
            ref, out = folded.cuda()(x), fused.cuda()(x)
    finally:
        torch.backends.cudnn.allow_tf32 = tf32
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-4
    assert out.argmax(1).tolist() == ref.argmax(1).tolist()


def test_mapped_on_device_aliases_pinned_memory():
    """The device reads pinned host memory in place: a later host write shows in a device read;
    rows of bytes are widened to int64 columns; pageable memory is refused (None)."""
    from fullthrottle.data.device_copy import mapped_on_device

    host = torch.arange(64, dtype=torch.uint8).view(4, 16).pin_memory()
    view = mapped_on_device(host, torch.device("cuda"))
    assert view is not None and view.dtype == torch.int64 and tuple(view.shape) == (4, 2)
    assert view.data_ptr() == host.data_ptr()
    host[2] = 7
    assert torch.equal(view[2].cpu().view(torch.uint8), host[2])
    assert mapped_on_device(torch.zeros(4, 16, dtype=torch.uint8), torch.device("cuda")) is None


def test_pool_rows_gathered_in_place_match_the_copy_path(samples, monkeypatch, no_thread_leak):
    """FULLTHROTTLE_POOL_GATHER=mapped: crops from the decoder processes reach the model by one gather
    reading the pinned pool in place (mapped_on_device); top-1 equals the eager model on the CPU path's
    crops for every image, and the default (H2D copies into a device mirror) gives the same classes."""
    torch.manual_seed(0)
    cfg = dict(
        model="resnet18",
        device="cuda",
        gpu_decode=False,
        dtype="float32",
        max_batch_size=16,
        preprocess="processes",
        threads=4,
    )
    monkeypatch.setenv("FULLTHROTTLE_POOL_GATHER", "mapped")
    with Pipeline(Config(**cfg)) as pipe:
        assert pipe.engine.pool.mapped is not None and pipe.engine.pool.mirror is None
        res = pipe.classify(samples[:64])
        crops = torch.from_numpy(np.stack([preprocess(p.read_bytes()) for p in samples[:64]])).cuda()
        ref = pipe.engine.forward(crops).argmax(1).cpu().tolist()
        model = copy.deepcopy(pipe.engine.model)
    assert [r.class_ids[0] for r in res] == ref
    monkeypatch.delenv("FULLTHROTTLE_POOL_GATHER")
    with Pipeline(Config(**cfg), model=model) as pipe:
        assert pipe.engine.pool.mapped is None and pipe.engine.pool.mirror is not None
        res2 = pipe.classify(samples[:64])
    assert [r.class_ids[0] for r in res2] == ref


def _top1(res):
    return [r.labels[0] if r.ok else None for r in res]


def _accuracy(samples, labels):
    return float(np.mean([lab == sample_label(s) for s, lab in zip(samples, labels)]))


def test_efficientnet_lite0_bf16_graphs_agree_with_fp32_eager(samples, no_thread_leak):
    """The default model as it runs by default on CUDA (bf16, channels_last, BN folded, CUDA graphs per
    bucket) against fp32 eager: top-1 agreement >= 99% on the 200 samples; both accurate (>= 0.88)."""
    with Pipeline(
        Config(device="cuda", gpu_decode=False, dtype="float32", graphs=False, fold_bn=False, max_batch_size=64)
    ) as pipe:
        ref = _top1(pipe.classify(samples))
    with Pipeline(Config(device="cuda", gpu_decode=False, dtype="bfloat16", max_batch_size=64)) as pipe:
        assert pipe.engine.runner is not None and pipe.engine.bn_folded
        out = _top1(pipe.classify(samples))
    agree = float(np.mean([a == b for a, b in zip(out, ref)]))
    acc_ref, acc = _accuracy(samples, ref), _accuracy(samples, out)
    print(
        f"EfficientNet-Lite0 bf16 graphs vs fp32 eager: top-1 agreement {agree:.3f}; accuracy {acc:.3f} / {acc_ref:.3f}"
    )
    assert agree >= 0.99 and min(acc, acc_ref) >= 0.88


def test_efficientnet_lite0_gpu_decode_agrees_with_cpu_decode(samples, no_thread_leak):
    """GPU-decoded and CPU-decoded inputs through the default model: top-1 agreement >= 99%,
    accuracy within 1 point of each other."""
    with Pipeline(Config(device="cuda", dtype="float32", gpu_decode=False, max_batch_size=64)) as pipe:
        cpu = _top1(pipe.classify(samples))
    with Pipeline(Config(device="cuda", dtype="float32", max_batch_size=64, gpu_decode=True)) as pipe:
        gpu = _top1(pipe.classify(samples))
        share = pipe.engine.splitter.routed_gpu_share
    agree = float(np.mean([a == b for a, b in zip(cpu, gpu)]))
    acc_cpu, acc_gpu = _accuracy(samples, cpu), _accuracy(samples, gpu)
    print(
        f"EfficientNet-Lite0 GPU vs CPU decode: top-1 agreement {agree:.3f}; accuracy {acc_gpu:.3f} "
        f"(GPU) / {acc_cpu:.3f} (CPU); {share:.0%} of eligible JPEGs decoded on the GPU"
    )
    assert agree >= 0.99 and abs(acc_cpu - acc_gpu) <= 0.01 and share > 0


def test_efficientnet_lite0_fused_form_on_cuda_equals_the_module():
    """The inference form (BN folded, Triton depthwise convolutions with their activations) equals the
    plain module on CUDA in fp32 (TF32 off) to 1e-4 relative, and is what the Engine runs."""
    from fullthrottle.workloads.classify.models import load_model

    model, _ = load_model("efficientnet_lite0")
    model = model.cuda()
    fused = model.fused_for_inference().cuda().eval()
    x = torch.randn(8, 3, 224, 224, device="cuda").contiguous(memory_format=torch.channels_last)
    tf32 = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    try:
        with torch.inference_mode():
            ref, out = model(x), fused(x)
    finally:
        torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = tf32
    assert ((out - ref).norm() / ref.norm()).item() <= 1e-4
    assert out.argmax(1).tolist() == ref.argmax(1).tolist()
    with Pipeline(Config(device="cuda", max_batch_size=8)) as pipe:
        assert pipe.engine.model_fused is not None and pipe.engine.bn_folded


def test_decoder_processes_sleep_while_waiting_for_the_gpu():
    """``sleep_while_waiting`` (what a GPU decoder process calls first) sets CU_CTX_SCHED_BLOCKING_SYNC on
    the primary context that torch then uses; a process that does not call it keeps CUDA's default."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import fullthrottle

    env = {**os.environ, "PYTHONPATH": str(Path(fullthrottle.__file__).parents[1])}
    code = """
import ctypes, sys, torch
from fullthrottle.core.device import sleep_while_waiting
ok = sleep_while_waiting() if sys.argv[1] == "1" else None
torch.zeros(1, device="cuda").sum().item()  # the primary context is created and used
cuda, dev = ctypes.CDLL("libcuda.so.1"), ctypes.c_int()
flags, active = ctypes.c_uint(), ctypes.c_int()
assert cuda.cuDeviceGet(ctypes.byref(dev), torch.cuda.current_device()) == 0
assert cuda.cuDevicePrimaryCtxGetState(dev, ctypes.byref(flags), ctypes.byref(active)) == 0
print(ok, flags.value & 7, active.value)
"""
    got = [
        subprocess.run([sys.executable, "-c", code, a], capture_output=True, text=True, timeout=120, env=env)
        for a in "10"
    ]
    assert [g.stdout.split() for g in got] == [["True", "4", "1"], ["None", "0", "1"]], [g.stderr[-800:] for g in got]
