"""The image input's kernels: uint8 crops normalised in one pass, and the batched antialiased resize +
center crop of decoded images of any sizes, with their references."""

from __future__ import annotations

import torch

from .common import _FLOATS, _check, _same_device, tl, triton, use_triton


def normalize_u8_ref(x_u8, scale, shift, dtype):
    # shift + x * scale over the last dim (channels), computed in float32, rounded once to dtype
    return torch.addcmul(shift.float(), x_u8.float(), scale.float()).to(dtype)


def normalize_u8(x_u8: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Image normalisation from uint8 in one pass: ``x * scale[c] + shift[c]`` per channel ``c``.

    The image classifier's input step (``(x/255 - mean) / std`` with ``scale = 1/(255*std)``,
    ``shift = -mean/std``): one read of the uint8 batch and one write of the result, computed in
    float32 and rounded once. PyTorch's ``addcmul`` on a uint8 tensor and half-precision scalars goes
    through its dynamic-casting elementwise path instead, which is slower (see docs/performance.md).

    Args:
        x_u8: ``(..., C)`` uint8, channels last (NHWC images).
        scale, shift: ``(C,)`` float tensors on the same device.
        dtype: the output's float dtype.

    Returns:
        ``(..., C)`` in ``dtype``, contiguous (``permute(0, 3, 1, 2)`` of an NHWC result is the
        channels_last NCHW tensor a convolution wants).

    Raises:
        ValueError: ``x_u8`` not uint8, scale/shift not ``(C,)``, or a non-float ``dtype``.
    """
    _check(x_u8.dtype == torch.uint8 and x_u8.dim() >= 1, f"normalize_u8: x must be uint8 (..., C), got {x_u8.dtype}")
    C = x_u8.shape[-1]
    _check(
        scale.shape == (C,) and shift.shape == (C,),
        f"normalize_u8: scale and shift must be ({C},), got {tuple(scale.shape)} and {tuple(shift.shape)}",
    )
    _check(dtype in _FLOATS, f"normalize_u8: dtype must be float32/float16/bfloat16, got {dtype}")
    _check(
        scale.dtype in _FLOATS and shift.dtype in _FLOATS,
        f"normalize_u8: scale and shift must be float tensors, got {scale.dtype} and {shift.dtype}",
    )
    _same_device("normalize_u8", x=x_u8, scale=scale, shift=shift)
    if not use_triton(x_u8):
        return normalize_u8_ref(x_u8, scale, shift, dtype)
    x = x_u8.contiguous()
    y = torch.empty(x.shape, dtype=dtype, device=x.device)
    BLOCK = 4096
    _normalize_u8_kernel[(triton.cdiv(x.numel(), BLOCK),)](
        x, scale.contiguous(), shift.contiguous(), y, x.numel(), C=C, BLOCK=BLOCK, num_warps=8
    )
    return y


_RESIZE_META = 16  # int64 columns per image in resize_crop_u8's table (15 used)


def resize_crop_u8(images, out: torch.Tensor, resize: int = 256, crop: int = 224) -> None:
    """Resize (antialiased bilinear, shorter side to ``resize``) + center crop (``crop``) of a batch of
    decoded images of any mix of sizes into ``out``, in two Triton launches whatever the batch holds.

    The filter is PyTorch's (and Pillow's) antialias triangle (``aten/src/ATen/native/UpSample.h``,
    ``_compute_weights_aa``), applied separably: pass 1 filters along the width, one program per
    source row that the crop needs, into a float32 scratch of ``crop x 3`` values per row; pass 2
    filters the scratch along the height, one program per output row, and rounds to uint8. Only the
    kept rows and columns are computed, the weights are computed in the kernels, images are read in
    place through a table of pointers and strides (CHW from nvJPEG or HWC from the hardware decoder),
    and nothing is padded: the cost follows each image's own size (the matrix-product path pads a
    mixed batch to its largest image). The reference is
    :func:`fullthrottle.data.gpu_resize.resize_crop_matmul`, which runs without Triton.

    Args:
        images: ``(3, H, W)`` uint8 tensors on one device, any sizes and strides (each a dense block:
            contiguous, or a ``permute(2, 0, 1)`` view of a contiguous ``(H, W, 3)`` image).
        out: ``(len(images), crop, crop, 3)`` uint8 on that device, last dim contiguous.
        resize, crop: Resize(resize) then CenterCrop(crop), ``crop <= resize``.

    The images must stay alive until the work queued on the current stream has run (the caching
    allocator, or a stream-ordered free, guarantees that when they are freed after this call).

    Raises:
        ValueError: images not 3-channel uint8 on ``out``'s device, ``out`` of the wrong shape or dtype,
            or ``crop > resize``.
    """
    import numpy as np

    n = len(images)
    _check(0 < crop <= resize, f"resize_crop_u8: need 0 < crop <= resize, got crop={crop}, resize={resize}")
    _check(
        out.dtype == torch.uint8 and tuple(out.shape) == (n, crop, crop, 3) and out.stride(-1) == 1,
        f"resize_crop_u8: out must be uint8 ({n}, {crop}, {crop}, 3) with a contiguous last dim, "
        f"got {out.dtype} {tuple(out.shape)}",
    )
    if n == 0:
        return
    dev = out.device
    for k, im in enumerate(images):  # (a few attribute reads per image: this runs for every batch)
        if im.dtype != torch.uint8 or im.dim() != 3 or im.shape[0] != 3 or im.device != dev:
            raise ValueError(
                f"resize_crop_u8: image {k} must be a (3, H, W) uint8 tensor on {dev}, "
                f"got {im.dtype} {tuple(im.shape)} on {im.device}"
            )
    shape = np.array([im.shape for im in images], dtype=np.int64)  # (n, 3): 3, H, W
    stride = np.array([im.stride() for im in images], dtype=np.int64)  # (n, 3): c, h, w
    H, W = shape[:, 1], shape[:, 2]
    dense = ((stride[:, 2] == 1) & (stride[:, 1] == W) & (stride[:, 0] == H * W)) | (  # CHW
        (stride[:, 0] == 1) & (stride[:, 2] == 3) & (stride[:, 1] == 3 * W)
    )  # HWC viewed as CHW
    if not dense.all():
        k = int(np.argmin(dense))
        raise ValueError(f"resize_crop_u8: image {k} is not a dense CHW or HWC block (strides {images[k].stride()})")
    meta = np.zeros((n, _RESIZE_META), dtype=np.int64)
    meta[:, 0] = [im.data_ptr() for im in images]
    meta[:, 1:4] = stride
    meta[:, 4], meta[:, 5] = H, W
    H, W = H.astype(np.float64), W.astype(np.float64)
    # gpu_resize._resize_and_crop_at for the whole batch at once (the tests hold the two equal)
    tall = H > W  # torchvision Resize(int): shorter side
    nh = np.where(tall, (resize * H / W).astype(np.int64), resize)
    nw = np.where(tall, resize, (resize * W / H).astype(np.int64))
    top, left = np.round((nh - crop) / 2.0).astype(np.int64), np.round((nw - crop) / 2.0).astype(np.int64)
    sy, sx = H / nh, W / nw
    suy, sux = np.maximum(sy, 1.0), np.maximum(sx, 1.0)
    lo = np.floor(sy * (top + 0.5) - suy + 0.5) - 1  # the rows pass 2 reads (+1 each side:
    hi = np.floor(sy * (top + crop - 0.5) + suy + 0.5) + 1  # the kernels compute in float32)
    row0 = np.maximum(lo, 0).astype(np.int64)
    nrows = np.minimum(hi, H).astype(np.int64) - row0
    meta[:, 6], meta[:, 7], meta[:, 8], meta[:, 9], meta[:, 10], meta[:, 11] = nh, nw, top, left, row0, nrows
    meta[:, 12] = np.concatenate([[0], np.cumsum(nrows * crop * 3)[:-1]])
    meta[:, 13] = np.ceil(2 * sux).astype(np.int64) + 2  # taps per output, an upper bound
    meta[:, 14] = np.ceil(2 * suy).astype(np.int64) + 2
    prog = (np.repeat(np.arange(n, dtype=np.int64), nrows) << 32) | (
        np.arange(int(nrows.sum()), dtype=np.int64) - np.repeat(meta[:, 12] // (crop * 3), nrows)
    )
    table = torch.from_numpy(np.concatenate([meta.reshape(-1), prog]))
    if out.is_cuda:  # from pinned memory the copy is queued; from pageable memory it would wait for the stream
        table = table.pin_memory().to(out.device, non_blocking=True)
    tmp = torch.empty(int(nrows.sum()) * crop * 3, dtype=torch.float32, device=out.device)
    block = triton.next_power_of_2(crop)
    _resize_h_kernel[(len(prog),)](
        table, table[n * _RESIZE_META :], tmp, CROP=crop, BLOCK_C=block, NMETA=_RESIZE_META, num_warps=4
    )
    _resize_v_kernel[(n, crop)](
        table,
        tmp,
        out,
        out.stride(0),
        out.stride(1),
        out.stride(2),
        CROP=crop,
        BLOCK_C=block,
        NMETA=_RESIZE_META,
        num_warps=4,
    )


if triton is not None:

    @triton.jit
    def _normalize_u8_kernel(x_ptr, scale_ptr, shift_ptr, y_ptr, n, C: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)  # flat (..., C) index
        m = offs < n
        x = tl.load(x_ptr + offs, mask=m, other=0).to(tl.float32)
        c = offs % C  # the channel
        sc = tl.load(scale_ptr + c).to(tl.float32)
        sh = tl.load(shift_ptr + c).to(tl.float32)
        tl.store(y_ptr + offs, (x * sc + sh).to(y_ptr.dtype.element_ty), mask=m)

    # -- resize + center crop of a batch of decoded images of any sizes (two separable passes) ----
    # meta, int64 per image (_RESIZE_META columns): pointer, strides (c, h, w), H, W, resized (nh, nw),
    # crop offsets (top, left), the first source row kept and how many (row0, nrows), the image's
    # offset in the float32 scratch, taps per output (kx, ky).
    @triton.jit
    def _resize_h_kernel(meta_ptr, prog_ptr, tmp_ptr, CROP: tl.constexpr, BLOCK_C: tl.constexpr, NMETA: tl.constexpr):
        # pass 1, one program per kept source row: CROP output columns x 3 channels into the scratch
        p = tl.load(prog_ptr + tl.program_id(0))  # image << 32 | kept row
        i = p >> 32
        t = p & 0xFFFFFFFF
        m = meta_ptr + i * NMETA
        x = tl.load(m).to(tl.pointer_type(tl.uint8))
        sc, sh, sw = tl.load(m + 1), tl.load(m + 2), tl.load(m + 3)
        W, nw, left = tl.load(m + 5), tl.load(m + 7), tl.load(m + 9)
        row = x + (tl.load(m + 10) + t) * sh
        kx = tl.load(m + 13)
        scale = W.to(tl.float32) / nw.to(tl.float32)
        support = tl.maximum(scale, 1.0)  # antialias when downscaling
        inv = 1.0 / support
        c = tl.arange(0, BLOCK_C)  # output columns
        ch = tl.arange(0, 4)
        cm = c < CROP
        center = scale * ((left + c).to(tl.float32) + 0.5)  # (BLOCK_C,)
        lo = tl.maximum(tl.floor(center - support + 0.5), 0.0).to(tl.int32)
        hi = tl.minimum(tl.floor(center + support + 0.5), W.to(tl.float32)).to(tl.int32)
        acc = tl.zeros((BLOCK_C, 4), tl.float32)
        wsum = tl.zeros((BLOCK_C,), tl.float32)
        for k in range(0, kx):
            j = lo + k
            ok = (j < hi) & cm
            w = tl.where(ok, tl.maximum(1.0 - tl.abs((j.to(tl.float32) - center + 0.5) * inv), 0.0), 0.0)
            v = tl.load(row + j[:, None] * sw + ch[None, :] * sc, mask=ok[:, None] & (ch[None, :] < 3), other=0)
            acc += w[:, None] * v.to(tl.float32)
            wsum += w
        acc = acc / tl.where(wsum > 0, wsum, 1.0)[:, None]
        dst = tmp_ptr + tl.load(m + 12) + t * (CROP * 3) + c[:, None] * 3 + ch[None, :]
        tl.store(dst, acc, mask=cm[:, None] & (ch[None, :] < 3))

    @triton.jit
    def _resize_v_kernel(
        meta_ptr, tmp_ptr, out_ptr, s_on, s_or, s_oc, CROP: tl.constexpr, BLOCK_C: tl.constexpr, NMETA: tl.constexpr
    ):
        # pass 2, one program per (image, output row): the scratch rows' weighted sum, rounded to uint8
        i = tl.program_id(0)
        r = tl.program_id(1)
        m = meta_ptr + i * NMETA
        H, nh, top = tl.load(m + 4), tl.load(m + 6), tl.load(m + 8)
        row0, nrows = tl.load(m + 10), tl.load(m + 11)
        tmp = tmp_ptr + tl.load(m + 12)
        ky = tl.load(m + 14)
        scale = H.to(tl.float32) / nh.to(tl.float32)
        support = tl.maximum(scale, 1.0)
        inv = 1.0 / support
        center = scale * ((top + r).to(tl.float32) + 0.5)  # scalar
        lo = tl.maximum(tl.floor(center - support + 0.5), 0.0).to(tl.int32)
        hi = tl.minimum(tl.floor(center + support + 0.5), H.to(tl.float32)).to(tl.int32)
        c = tl.arange(0, BLOCK_C)
        ch = tl.arange(0, 4)
        cm = (c < CROP)[:, None] & (ch[None, :] < 3)
        acc = tl.zeros((BLOCK_C, 4), tl.float32)
        wsum = 0.0
        for k in range(0, ky):
            j = lo + k
            ok = (j < hi) & (j >= row0) & (j < row0 + nrows)
            w = tl.where(ok, tl.maximum(1.0 - tl.abs((j.to(tl.float32) - center + 0.5) * inv), 0.0), 0.0)
            v = tl.load(tmp + (j - row0) * (CROP * 3) + c[:, None] * 3 + ch[None, :], mask=cm & ok, other=0.0)
            acc += w * v
            wsum += w
        y = tl.minimum(tl.maximum(tl.floor(acc / wsum + 0.5), 0.0), 255.0)
        tl.store(out_ptr + i * s_on + r * s_or + c[:, None] * s_oc + ch[None, :], y.to(tl.uint8), mask=cm)
