"""Device-memory helpers of the compute stage: which spans of crop-pool rows one batch needs
(:func:`row_spans`), the pinned pool seen in place by a kernel (:func:`mapped_on_device`), the pool
as the compute stage reads it (:class:`PoolOnDevice`), and many copies queued as one (:func:`copy_all`)."""

from __future__ import annotations

import torch

from ..core import env


def row_spans(rows, max_gap: int = 16) -> list[tuple[int, int]]:
    """Half-open ``[lo, hi)`` spans covering ``rows`` (ints), merging spans less than ``max_gap`` apart,
    so a batch's crop rows go H2D in a few large copies instead of one per image.

    >>> row_spans([7, 3, 4, 5, 40, 41])
    [(3, 8), (40, 42)]
    """
    out: list[tuple[int, int]] = []
    for r in sorted(rows):
        if out and r < out[-1][1] + max_gap:
            out[-1] = (out[-1][0], max(out[-1][1], r + 1))
        else:
            out.append((r, r + 1))
    return out


#: environment variable: ``mapped`` has the compute thread read the crop pool in place
#: (:func:`mapped_on_device`: one gather kernel per batch); otherwise (the default) the rows go H2D by
#: copy-engine copies into a device mirror, then a gather. The in-place gather lowers the compute
#: stage's busy time but not the end-to-end rate, so it is not the default (see docs/performance.md).
POOL_GATHER_ENV = env.POOL_GATHER

_TYPESTR = {torch.uint8: "|u1", torch.int32: "<i4", torch.int64: "<i8"}


class _CudaArray:
    """Just a ``__cuda_array_interface__`` (version 2: no stream to synchronise with)."""

    def __init__(self, ptr: int, shape: tuple, dtype: torch.dtype):
        self.__cuda_array_interface__ = {
            "data": (ptr, False),
            "shape": shape,
            "typestr": _TYPESTR[dtype],
            "strides": None,
            "version": 2,
        }


def mapped_on_device(host: torch.Tensor, device: torch.device, wide: bool = True) -> torch.Tensor | None:
    """A CUDA tensor over the same bytes as ``host``, page-locked host memory (``cudaHostAlloc`` /
    ``cudaHostRegister``): with unified addressing its host pointer is valid in kernels, which then
    read it over PCIe themselves (zero-copy; CUDA C Programming Guide, "Unified Virtual Address
    Space" and "Mapped Memory").

    Why: the compute thread gathers a batch's crop-pool rows with one kernel reading host memory
    instead of one H2D copy per run of rows, a mirror on the device and a gather there: one PyTorch
    call instead of ~15, each of which gives up the GIL and must wait to take it back.

    Args:
        host: contiguous, uint8/int32/int64, pinned or registered. 2-D ``(rows, bytes)`` uint8 with
            ``wide`` is viewed as int64 (or int32) columns when the row length allows (8-byte loads).
        device: the CUDA device that reads it.
    Returns:
        the view (same shape, or ``(rows, bytes / 8)`` int64 when widened), checked against a copy
        of the first and last rows; ``None`` where that fails (no unified addressing, not pinned),
        and the caller keeps its copies.
    """
    if not host.is_contiguous() or host.dtype not in _TYPESTR or host.numel() == 0:
        return None
    shape, dtype = tuple(host.shape), host.dtype
    if wide and host.dim() == 2 and dtype == torch.uint8:
        for d in (torch.int64, torch.int32):
            if shape[1] % d.itemsize == 0 and host.data_ptr() % d.itemsize == 0:
                shape, dtype = (shape[0], shape[1] // d.itemsize), d
                break
    try:
        view = torch.as_tensor(_CudaArray(host.data_ptr(), shape, dtype), device=device)
        if view.data_ptr() != host.data_ptr():  # a copy (the memory belongs to another device), no alias
            return None
        ref = host.view(dtype).view(shape)
        idx = torch.tensor([0, shape[0] - 1], device=device)
        if not torch.equal(view.index_select(0, idx).cpu(), ref[[0, shape[0] - 1]]):
            return None
        return view
    except (RuntimeError, TypeError, ValueError):
        return None


def copy_all(dst: list[torch.Tensor], src: list[torch.Tensor]) -> None:
    """``dst[i].copy_(src[i], non_blocking=True)`` for every ``i``, in one call into PyTorch
    (``torch._foreach_copy_``, a loop over ``copy_`` where it is missing).

    Every PyTorch op releases the GIL and must take it back, and the compute thread, taking it back
    while the decoder-feeding threads run Python, can wait up to the interpreter's switch interval
    (5 ms) each time, and a batch's crop-pool rows take about a dozen H2D copies
    (``compute_pool_copies_per_batch``). One call takes the GIL back once. Shapes and dtypes pair up
    as for ``copy_``; pinned sources copy asynchronously.

    Raises:
        ValueError: the lists differ in length; RuntimeError (PyTorch's): a pair that ``copy_`` refuses.
    """
    if len(dst) != len(src):
        raise ValueError(f"copy_all: {len(dst)} destinations for {len(src)} sources")
    if not dst:
        return
    foreach = getattr(torch, "_foreach_copy_", None)
    if foreach is None:
        for d, s in zip(dst, src):
            d.copy_(s, non_blocking=True)
    else:
        foreach(dst, src, non_blocking=True)


class PoolOnDevice:
    """The decoder processes' crop pool (a :class:`~fullthrottle.data.crop_pool.CropPool`) as the
    compute stage reads it on CUDA: registered as pinned memory, then either read in place by one
    gather kernel (:data:`POOL_GATHER_ENV` ``=mapped``, where :func:`mapped_on_device` works for the
    pool and every slot's ``host_rows``), or mirrored on the device (a batch's runs of rows H2D in
    place by the copy engines, then one gather there).

    ``slots``: the staging ring's slots (each with ``host_rows``, ``(maxB,)`` int64 pinned, and
    ``dev_rows`` on the device); mapped, each gets ``mapped_rows``."""

    def __init__(self, crops, device: torch.device, slots):
        self.crops, self.mapped, self.mirror = crops, None, None
        self.copies = 0  # H2D copies (or mapped gathers) made, for the batches' count
        if crops.pin() and env.get(env.POOL_GATHER) == "mapped":
            self.mapped = mapped_on_device(crops.tensor[: crops.rows].view(crops.rows, -1), device)
            for slot in slots:
                slot.mapped_rows = mapped_on_device(slot.host_rows, device) if self.mapped is not None else None
            if any(slot.mapped_rows is None for slot in slots):
                self.mapped = None
        if self.mapped is None:
            self.mirror = torch.empty_like(crops.tensor[: crops.rows], device=device)

    def h2d(self, slot, rows: list[int], dst: list, src: list) -> None:
        """Append to ``dst``/``src`` the H2D copies a batch of pool ``rows`` needs before :meth:`gather`
        (mirrored: each run of rows in place, and the row numbers; mapped: none)."""
        if self.mapped is None:
            spans = row_spans(rows)
            self.copies += len(spans)
            dst += [self.mirror[lo:hi] for lo, hi in spans] + [slot.dev_rows[: len(rows)]]
            src += [self.crops.tensor[lo:hi] for lo, hi in spans] + [slot.host_rows[: len(rows)]]

    def gather(self, slot, m: int, out: torch.Tensor) -> None:
        """``out`` (``(m, S, S, 3)`` uint8 on the device, current stream) <- the batch's ``m`` rows, one
        kernel (after :meth:`h2d`'s copies, on this stream or one it waited for)."""
        if self.mapped is None:
            torch.index_select(self.mirror, 0, slot.dev_rows[:m], out=out)
        else:
            self.copies += 1
            torch.index_select(self.mapped, 0, slot.mapped_rows[:m], out=out.view(m, -1).view(self.mapped.dtype))
