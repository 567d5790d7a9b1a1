"""The one knob set that drives the library, the CLI and the server."""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field, fields, replace
from typing import Any

from ..workloads.classify.models import DEFAULT_MODEL, transform_of
from ..workloads.classify.transform import INTERPOLATIONS, Transform, check_channels

DTYPES = ("float32", "bfloat16", "float16")
#: the compute dtype on CUDA when none is given (image models, LLMs; the CPU computes in float32)
CUDA_DTYPE = "bfloat16"


def resolve_dtype(name: str | None, device, cuda_default: str = CUDA_DTYPE) -> str:
    """``name``, or when it is ``None`` the default for ``device`` (a ``torch.device`` or its string):
    ``cuda_default`` on CUDA, ``"float32"`` elsewhere."""
    if name is not None:
        return name
    return cuda_default if str(device).startswith("cuda") else "float32"


def torch_dtype(name: str):
    """The ``torch.dtype`` of one of :data:`DTYPES` (torch is imported here, not with this module).

    Raises:
        ValueError: not one of :data:`DTYPES`.
    """
    import torch

    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {name!r}")
    return getattr(torch, name)


#: values of ``Config.gpu_decoder`` (:func:`fullthrottle.data.gpu_decoders.make_gpu_decoder`)
GPU_DECODERS = ("auto", "hardware", "nvjpeg")
#: batches a GPU decoder process holds at once: one decoding, the next waiting in its shared-memory slot
GPU_PROCESS_DEPTH = 2


#: Config field -> Transform field, for the input transform
_TRANSFORM = {
    "resize_size": "resize",
    "crop_size": "crop",
    "interpolation": "interpolation",
    "mean": "mean",
    "std": "std",
}


#: the largest image batch a Config allows (buffers for several such batches are allocated at start)
MAX_BATCH_SIZE = 4096


def default_buckets(max_batch_size: int, start: int = 1) -> tuple[int, ...]:
    """The bucket ladder of every workload: powers of two from ``start`` below ``max_batch_size``,
    plus ``max_batch_size`` itself (image batches; LLM batches; embedding batches and, from 16,
    sequence lengths).

    >>> default_buckets(48)
    (1, 2, 4, 8, 16, 32, 48)
    >>> default_buckets(256, start=16)
    (16, 32, 64, 128, 256)
    """
    out, b = [], start
    while b < max_batch_size:
        out.append(b)
        b *= 2
    out.append(max_batch_size)
    return tuple(out)


def usable_cores() -> int:
    """CPU cores this process may run on (its affinity mask: taskset, cgroups), else ``os.cpu_count()``."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


@dataclass(frozen=True)
class Runtime:
    """The settings every workload's engine shares (classification, embeddings, generation), each
    default stated here once: :class:`Config` takes its fields' defaults from these, the Embedder and
    the Generator theirs, and the CLI generates its ``--device``, ``--dtype`` and ``--graphs`` flags
    from them (:func:`fullthrottle.cli.options.add_runtime_flags`). Each field's ``help`` metadata is
    its flag's help."""

    device: str = field(default="auto", metadata={"help": "auto | cpu | cuda | cuda:N"})
    dtype: str | None = field(
        default=None,
        metadata={"help": f"compute dtype on CUDA (default: {CUDA_DTYPE}; the CPU always computes in float32)"},
    )
    graphs: bool = field(default=True, metadata={"help": "replay the model as CUDA graphs (CUDA only; default: on)"})
    max_batch_size: int = field(default=64, metadata={"help": "largest batch"})
    max_wait_ms: float = field(default=5.0, metadata={"help": "how long a partial batch waits for more, ms"})


@dataclass(frozen=True)
class LlmSettings:
    """The LLM engine's settings, each default stated here once: the
    :class:`~fullthrottle.workloads.llm.generate.Generator`'s arguments and ``serve``'s ``--llm-*``
    flags take theirs from these fields."""

    max_batch: int = field(default=8, metadata={"help": "KV-cache rows: requests decoded at once"})
    max_seq_len: int = field(default=512, metadata={"help": "prompt + new tokens a row holds (at most the context)"})
    check_every: int = field(default=8, metadata={"help": "decode steps between looks at the stop mask"})
    max_prefill_tokens: int = field(default=16384, metadata={"help": "prefill tokens per step (serve: fewer)"})
    prefill_graph_tokens: int = field(default=2048, metadata={"help": "prefills up to this size replay graphs"})
    logprobs: int = field(default=0, metadata={"help": "top tokens a step can report (0-20; 0: off)"})
    kv_pages: int = field(
        default=0, metadata={"help": "paged KV memory: pages of 64 tokens for all requests (0: a static row each)"}
    )
    kv_dtype: str = field(default="auto", metadata={"help": "paged KV memory's dtype: auto (the model's), fp8"})


@dataclass
class Config:
    """Everything a run can be tuned with.

    Attributes:
        model: a name of :data:`~fullthrottle.workloads.classify.models.MODELS` (``"efficientnet_lite0"``, the default, with
            its bundled ImageNet weights; the ResNets, MobileNet-V3 and any model added there) or any ``nn.Module`` taking
            float ``(B, 3, crop, crop)`` and returning logits ``(B, C)``.
        weights: ``.safetensors`` or ``.pth`` state dict (loaded with ``weights_only=True``; torchvision's
            own checkpoint files are such); ``None``: the model's bundled weights, or for a model with
            none (``MODELS[name].bundled_weights`` is None) random initialisation with a fixed seed (labels are then meaningless).
        labels: class names for a custom module (else its own ``labels`` attribute, a list of str); by default
            ImageNet's 1000 names for a model of 1000 classes, else each class named by its id.
        device: ``"auto"`` (CUDA when available), ``"cpu"``, ``"cuda"`` or ``"cuda:N"``.
        dtype: compute dtype on CUDA: ``"float32"``, ``"bfloat16"`` or ``"float16"``; ``None`` (the
            default): :data:`CUDA_DTYPE` (bfloat16). The CPU always computes in float32.
        channels_last: run the model in NHWC memory format on CUDA.
        graphs: replay normalise + model + top-k as CUDA graphs, one per batch bucket, captured when
            the pipeline is built (CUDA only; CPU runs eager).
        gpu_decode: decode JPEGs on the GPU as well as on the CPU (default on; CUDA only, ignored on
            the CPU). With decoder
            processes a JPEG goes to the GPU whenever no CPU decoder is idle; with threads the split
            follows the two decoders' measured rates. Only JPEGs the GPU decodes like the CPU path are
            decoded there; the rest (truncated, CMYK, EXIF-rotated) by the CPU path's decoder.
        gpu_decoder: which GPU JPEG decoder ``gpu_decode`` uses: ``"nvjpeg"`` (default),
            torchvision's nvJPEG (on GPUs with JPEG engines it opens nvJPEG's hardware backend and
            decodes baseline JPEGs there in batches, the rest one by one with Huffman decoding on the
            CPU: torchvision's ``decode_jpegs_cuda.cpp``); ``"hardware"``, the GPU's JPEG engines
            (NVJPG) through nvImageCodec (``pip install nvidia-nvimgcodec-cu13``; A100, H100, H200,
            B200); ``"auto"``: the engines when nvImageCodec is installed
            and the GPU has them, nvJPEG otherwise. nvJPEG is the default: end to end the engines
            through nvImageCodec are slower than torchvision's path, which uses the same engines for
            these JPEGs with less overhead around them (see docs/performance.md).
        gpu_decode_processes: with ``gpu_decode`` and decoder processes, how many processes decode on
            the GPU (each its own decoder and CUDA context, writing crops into the shared pool);
            torchvision serialises GPU decodes within one process. 0: one GPU decode thread in this
            process instead. Default (None): 12 when a CUDA MPS server is running (the processes'
            kernels then run at once; fewer on a machine of fewer than 16 cores), 6 otherwise (time-sliced contexts), decided where and when the
            :class:`~fullthrottle.Pipeline` is made (:func:`~fullthrottle.core.mps.default_processes`;
            its ``config`` then holds the number). 12 under MPS: more processes decode faster; 6 when
            time-sliced: more contexts slow the GPU down (see docs/performance.md).
        fold_bn: on CUDA, fold each eval-mode BatchNorm into the convolution before it (the standard
            inference rewrite TensorRT and ONNX Runtime also do; ``torch.fx.experimental.optimization.fuse``):
            then run each conv -> ReLU and conv -> residual add -> ReLU as one cuDNN call
            (``cudnn_convolution_relu`` / ``_add_relu``; :func:`~fullthrottle.workloads.classify.fuse.fuse_conv_relu`):
            the bias, the add and the clamp happen in the convolution's epilogue instead of separate
            passes over the activations, which makes large batches markedly faster (see
            docs/performance.md). Changes fp32 logits by ~1e-6 relative. A model that ``torch.fx``
            cannot trace runs unfolded.
        compile: ``torch.compile(mode="max-autotune-no-cudagraphs")`` the model before capture (kernel
            fusion only; the graphs stay ours). Slow first build.
        max_batch_size: largest batch the batcher forms (images).
        max_wait_ms: how long (ms) the batcher waits for a batch to fill once its first item arrived.
        buckets: batch sizes the compute stage runs; partial batches are padded up to the next one.
            Default: powers of two up to ``max_batch_size``.
        threads: preprocess (decode + resize) threads; default one per CPU core (with decoder
            processes, one per core but one: the main process's own threads need about a core).
        preprocess: where images are decoded: ``"threads"`` (in this process), ``"processes"``
            (``threads`` worker processes, fed by one dispatcher thread, outside this process's GIL, like a
            ``DataLoader``'s workers; bit-identical results), or ``"auto"``: processes on CUDA, where
            the compute thread must not wait for the GIL, threads on CPU. At most one process per
            core (each imports torch: ~0.5 GB resident).
        decode_timeout_s: with worker processes, an image still decoding after this many seconds
            gets an error and its worker is killed and replaced (a decoder hang costs one item).
        torch_threads: torch's intra-op CPU threads, set process-wide when the pipeline is built.
            Default: 1 on CUDA (the model runs on the GPU, and a wide intra-op pool would fight the
            preprocess threads for the cores), unchanged on CPU.
        top_k: how many classes come back per image.
        ordered: yield results in input order (default) or in completion order.
        queue_size: capacity of each inter-stage queue (items or batches).
        max_in_flight: most items between load and the consumer at once (bounds memory, also
            for the reorder buffer); default ``(4 + g) * max_batch_size + 2 * threads``, ``g`` twice the
            batches out at the GPU decoder processes (``4 * gpu_decode_processes``) when ``gpu_decode``
            is on: their batches are in flight, and as many wait to be sent to them next. A larger
            window trades latency for throughput while a stage waits on it.
        load_concurrency: concurrent file reads / HTTP requests in the load stage.
        http_timeout_s: timeout (s) for one HTTP(S) request.
        max_file_bytes: largest input accepted (bytes); larger files fail with an error.
        max_image_pixels: largest width*height accepted; checked on the header, before decoding.
        resize_size / crop_size / interpolation / mean / std: the input transform (shorter side to
            ``resize_size`` with the antialiased ``interpolation`` filter, center crop ``crop_size``,
            then ``(x / 255 - mean) / std`` per RGB channel on the device).
            ``None`` (the default): the model's own declaration
            (:func:`~fullthrottle.workloads.classify.models.transform_of`), filled in by :meth:`for_model` when the
            :class:`~fullthrottle.Pipeline` is made; a value given here overrides it.
        staging_slots: pinned host staging buffers (and device input buffers) in the ring, >= 2.
    """

    model: Any = DEFAULT_MODEL
    weights: str | None = None
    labels: list[str] | None = None
    device: str = Runtime.device
    dtype: str | None = Runtime.dtype  # (None: CUDA_DTYPE on CUDA)
    channels_last: bool = True
    graphs: bool = Runtime.graphs
    fold_bn: bool = True
    compile: bool = False
    gpu_decode: bool = True
    gpu_decoder: str = "nvjpeg"
    gpu_decode_processes: int | None = None  # (None: 12 under a CUDA MPS server, else 6)
    max_batch_size: int = Runtime.max_batch_size
    max_wait_ms: float = Runtime.max_wait_ms
    buckets: tuple[int, ...] | None = None
    threads: int | None = None
    preprocess: str = "auto"
    decode_timeout_s: float = 30.0
    torch_threads: int | None = None
    top_k: int = 5
    ordered: bool = True
    queue_size: int = 256
    max_in_flight: int | None = None
    load_concurrency: int = 32
    http_timeout_s: float = 10.0
    max_file_bytes: int = 256 * 1024 * 1024
    max_image_pixels: int = 89_478_485  # Pillow's own decompression-bomb threshold
    resize_size: int | None = None  # (None, and for the three below: the model's declaration)
    crop_size: int | None = None
    interpolation: str | None = None
    mean: tuple[float, float, float] | None = None
    std: tuple[float, float, float] | None = None
    staging_slots: int = 3
    extra: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        def is_int(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool)

        for name in (
            "max_batch_size",
            "top_k",
            "staging_slots",
            "queue_size",
            "load_concurrency",
            "max_file_bytes",
            "max_image_pixels",
        ):
            v = getattr(self, name)
            if not is_int(v) or v < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {v!r}")
        for name in ("max_in_flight", "torch_threads"):
            v = getattr(self, name)
            if v is not None and (not is_int(v) or v < 1):
                raise ValueError(f"{name} must be None (the default) or an integer >= 1, got {v!r}")
        for name in ("max_wait_ms", "http_timeout_s"):
            v, rule = getattr(self, name), "> 0" if name == "http_timeout_s" else ">= 0"
            if not isinstance(v, (int, float)) or not math.isfinite(v) or v < 0 or (rule == "> 0" and v == 0):
                raise ValueError(f"{name} must be a finite number {rule}, got {v!r}")
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", str(self.device)):  # (CUDA there or not: at Pipeline)
            raise ValueError(f"device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {self.device!r}")
        if self.labels is not None and (
            not isinstance(self.labels, (list, tuple)) or not all(isinstance(x, str) for x in self.labels)
        ):
            raise ValueError(f"labels must be a list of class names (str), got {self.labels!r:.80}")
        for name in ("mean", "std"):
            if getattr(self, name) is not None:
                check_channels(name, getattr(self, name))
        if self.dtype is not None and self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {DTYPES}, got {self.dtype!r}")
        if self.staging_slots < 2:
            raise ValueError(f"staging_slots must be >= 2, got {self.staging_slots}")
        if self.max_batch_size > MAX_BATCH_SIZE:  # (each staging slot holds a batch of crops: ~150 kB each)
            raise ValueError(
                f"max_batch_size (--batch-size) must be at most {MAX_BATCH_SIZE} images, got {self.max_batch_size} "
                "(its staging buffers and crop pool are allocated up front)"
            )
        if self.preprocess not in ("auto", "threads", "processes"):
            raise ValueError(f"preprocess must be 'auto', 'threads' or 'processes', got {self.preprocess!r}")
        if self.threads is not None and (
            not isinstance(self.threads, int) or isinstance(self.threads, bool) or not 1 <= self.threads <= 512
        ):
            raise ValueError(f"threads must be an integer in 1..512, got {self.threads!r}")
        for name in ("resize_size", "crop_size"):
            v = getattr(self, name)
            if v is not None and not (is_int(v) and v >= 1):
                raise ValueError(f"{name} must be None (the model's) or an integer >= 1, got {v!r}")
        if self.resize_size is not None and self.crop_size is not None and self.crop_size > self.resize_size:
            raise ValueError(
                f"need crop_size <= resize_size, got crop_size={self.crop_size!r}, "
                f"resize_size={self.resize_size!r} (set resize_size too)"
            )
        if self.interpolation is not None and self.interpolation not in INTERPOLATIONS:
            raise ValueError(
                f"interpolation must be None (the model's) or one of {INTERPOLATIONS}, got {self.interpolation!r}"
            )
        if self.gpu_decoder not in GPU_DECODERS:
            names = ", ".join(map(repr, GPU_DECODERS[:-1])) + f" or {GPU_DECODERS[-1]!r}"
            raise ValueError(f"gpu_decoder must be {names}, got {self.gpu_decoder!r}")
        if self.gpu_decode_processes is not None and not (
            is_int(self.gpu_decode_processes) and 0 <= self.gpu_decode_processes <= 16
        ):
            raise ValueError(
                f"gpu_decode_processes must be None (the default) or an integer in 0..16, "
                f"got {self.gpu_decode_processes!r}"
            )
        v = self.decode_timeout_s
        if not (isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0):  # (inf: no limit)
            raise ValueError(f"decode_timeout_s must be a number > 0 (seconds; inf for no limit), got {v!r}")
        for f in fields(self):
            if f.type in ("bool", bool) and not isinstance(getattr(self, f.name), bool):
                raise ValueError(f"{f.name} must be True or False, got {getattr(self, f.name)!r}")
        if self.buckets is None:
            self.buckets = default_buckets(self.max_batch_size)
        else:
            try:
                b = tuple(sorted(set(self.buckets)))
            except TypeError:
                b = ()
            if not b or not all(is_int(x) for x in b) or b[0] < 1:
                raise ValueError(f"buckets must be positive integer batch sizes, got {self.buckets!r}")
            self.buckets = b
            # the batcher never forms more than the largest bucket holds
            self.max_batch_size = min(self.max_batch_size, b[-1]) if self.max_batch_size else b[-1]

    def for_model(self, model: Any = None) -> Config:
        """This config with the input transform filled in from ``model``'s declaration (``model``:
        the module a :class:`~fullthrottle.Pipeline` was given, else :attr:`model`) where a field is
        ``None``; fields already set stay. The result's :attr:`transform` is then complete.

        Raises:
            ValueError: an unknown model name, or a transform that does not hold together.
        """
        decl = transform_of(self.model if model is None else model)
        filled = {f: getattr(decl, d) for f, d in _TRANSFORM.items() if getattr(self, f) is None}
        out = replace(self, **filled) if filled else self
        out.transform  # noqa: B018 - checks crop <= resize and the rest now, not in a stage
        return out

    @property
    def transform(self) -> Transform:
        """The input transform as a :class:`~fullthrottle.workloads.classify.transform.Transform` (after :meth:`for_model`).

        Raises:
            ValueError: a field still ``None`` (call :meth:`for_model` first) or a bad combination.
        """
        missing = [f for f in _TRANSFORM if getattr(self, f) is None]
        if missing:
            raise ValueError(f"{', '.join(missing)} not resolved: call Config.for_model() first")
        return Transform(self.resize_size, self.crop_size, tuple(self.mean), tuple(self.std), self.interpolation)

    @property
    def runtime(self) -> Runtime:
        """The :class:`Runtime` part of this config."""
        return Runtime(self.device, self.dtype, self.graphs, self.max_batch_size, self.max_wait_ms)

    @property
    def num_threads(self) -> int:
        return self.threads or usable_cores()

    @property
    def in_flight_limit(self) -> int:

        # batches out at the GPU decoder processes, and as many again queued for their next sends: with
        # one batch less, a process waits on the window, not on work (see docs/performance.md)
        n = self.gpu_decode_processes
        if n is None and self.gpu_decode:  # (what a Pipeline made now would start)
            from .mps import default_processes

            n = default_processes(cores=usable_cores())
        gpu = 2 * n * GPU_PROCESS_DEPTH if self.gpu_decode else 0
        return self.max_in_flight or ((4 + gpu) * self.max_batch_size + 2 * self.num_threads)

    def decoder_processes(self) -> int:
        """How many CPU decoder processes a pipeline with decoder processes starts: ``threads``, capped
        at the usable cores; by default one per usable core but one, left to the main process's
        dispatcher, batcher, compute and decode threads, which use about one (one decoder process per
        core slows the pipeline: see docs/performance.md)."""
        cores = usable_cores()
        return min(self.threads, cores) if self.threads else max(1, cores - 1)

    def crop_rows(self, decoders: int, gpu_processes: int) -> int:
        """Rows of the shared crop pool for ``decoders`` CPU and ``gpu_processes`` GPU decoder processes:
        one per item the window (:attr:`in_flight_limit`) lets in, capped at twice what every batch in
        flight, forming, and out at the GPU decoder processes needs (a larger ``max_in_flight`` keeps
        more items queued ahead of the decoders, not more pinned memory than that)."""
        need = (self.staging_slots + 3 + gpu_processes * GPU_PROCESS_DEPTH) * self.max_batch_size + 2 * decoders
        return min(self.in_flight_limit, 2 * need)
