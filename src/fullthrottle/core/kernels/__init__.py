"""Fused kernels for the LLM decode step and the image input (Triton on CUDA; the plain PyTorch
reference everywhere else).

A Llama-2-7B decode step at batch 1 is ~660 kernels, and the small ones cost as much as their
launch: in plain PyTorch RMSNorm, RoPE (five elementwise kernels on q and k) and the KV-cache write
(two scatters) take a sizeable share of the step next to the matrix products (see
docs/performance.md). Three kernels here replace them:

- :func:`rms_norm` — RMSNorm of each row, optionally after adding a residual (one read, one write);
- :func:`rope_qkv_into_cache` — RoPE on q and k straight from the fused qkv projection, q written out
  as ``(B, H, S, D)`` for attention, k and v written into the static KV cache at their positions
  (:func:`rope_qkv_into_pages`: into paged KV memory, through the block table, float8 pages included);
- :func:`silu_mul` — SwiGLU's ``silu(gate) * up`` from the fused gate/up projection.

then attention over the KV cache: :func:`decode_attention` and :func:`paged_decode_attention` (one new
token per row, split along the cache) and :func:`prefill_attention` (prompts of any lengths packed
end to end, each over its own cache row);

and, for the image classifier, :func:`normalize_u8`: uint8 NHWC crops to the normalised half-precision
input in one pass; and :func:`resize_crop_u8`: the GPU decode stage's resize + center crop of a batch
of decoded images of any sizes, in two launches.

Each has a reference in plain PyTorch (the ``*_ref`` functions, the same math as Hugging Face's
Llama; for the resize, :func:`fullthrottle.data.gpu_resize.resize_crop_matmul`), used on the CPU, without
Triton, or with ``FULLTHROTTLE_TRITON=0``. The Triton kernels compute
in float32 and round once, so they agree with the references (which round bf16 intermediates) to
bf16 rounding, not bit for bit. With ``TRITON_INTERPRET=1`` Triton's interpreter runs them on CPU
tensors (how CI checks their indexing without a GPU).
"""

from .attention import decode_attention, decode_attention_ref, gather_pages, paged_decode_attention
from .common import paged_setting, use_triton
from .gemv import linear, linear_ref, linear_rope_qkv_into_cache, linear_silu_mul
from .image import normalize_u8, normalize_u8_ref, resize_crop_u8
from .layout import PAIRED_LAYOUT, deinterleave_pairs, interleave_pairs
from .norm_rope import (
    rms_norm,
    rms_norm_ref,
    rope_qkv_into_cache,
    rope_qkv_into_cache_ref,
    rope_qkv_into_pages,
    rope_qkv_into_pages_ref,
    silu_mul,
    silu_mul_ref,
    write_pages,
)
from .varlen import prefill_attention, prefill_attention_ref, prefill_kernel_fits

__all__ = [
    "rms_norm",
    "rope_qkv_into_cache",
    "rope_qkv_into_pages",
    "write_pages",
    "silu_mul",
    "linear",
    "linear_silu_mul",
    "linear_rope_qkv_into_cache",
    "decode_attention",
    "paged_decode_attention",
    "paged_setting",
    "gather_pages",
    "prefill_attention",
    "prefill_attention_ref",
    "prefill_kernel_fits",
    "normalize_u8",
    "resize_crop_u8",
    "use_triton",
    "PAIRED_LAYOUT",
    "interleave_pairs",
    "deinterleave_pairs",
    "rms_norm_ref",
    "rope_qkv_into_cache_ref",
    "rope_qkv_into_pages_ref",
    "silu_mul_ref",
    "linear_ref",
    "decode_attention_ref",
    "normalize_u8_ref",
]
