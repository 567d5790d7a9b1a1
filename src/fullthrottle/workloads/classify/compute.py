"""Stage 4, compute: pinned staging ring, H2D on a copy stream, normalise + model on a compute stream.

One batch on CUDA goes like this (``n`` images, ``S`` = crop size, ``k`` = top-k)::

    host numpy crops --memcpy--> pinned slot (n,S,S,3) u8 --H2D, copy stream--> device slot (n,S,S,3) u8
        --event--> compute stream: NHWC->NCHW view (= channels_last), float, normalise, model -> (n,C)
        -> softmax, top-k (n,k) --D2H into pinned--> event "done"

Crops from decoder processes skip the memcpy: they are already in pinned shared memory (the
:class:`~fullthrottle.data.crop_pool.CropPool`), so their rows go H2D in a few span copies into a
device mirror of the pool and are gathered on the compute stream. A batch of such rows alone (every
batch of ``serve`` and of ``classify`` on files) goes H2D on the compute stream too and is gathered
straight into the graph's static input (:meth:`Engine._submit_pool`). Crops the GPU decoder made are
copied device to device.

The ring has ``staging_slots`` (>= 2) slots; a slot is reused only after the decode stage has read
its results, so at most that many batches are in flight and host memory stays flat. On CPU the same
code runs with plain tensors, no streams and no events.
"""

from __future__ import annotations

import contextlib
import threading
import time

import numpy as np
import torch
from torch import nn

from ...core.config import Config, resolve_dtype, torch_dtype
from ...core.device import resolve_device
from ...core.graphs import GraphRunner
from ...core.kernels import normalize_u8, use_triton
from ...data.device_copy import PoolOnDevice, copy_all
from ...data.gpu_decode import RateSplitter, crop_runs
from ...data.gpu_decoders import make_gpu_decoder
from .decode import topk_probs
from .labels import ClassLabels, ModelOutputError, check_logits, compute_failed
from .model_forms import inference_forms
from .models import MODELS, load_model, load_weights
from .slot import Slot


class Engine:
    """The model on its device, fed through the staging ring.

    Args:
        config: the run's :class:`~fullthrottle.core.config.Config`.
        model: an ``nn.Module`` mapping float ``(B, 3, S, S)`` to logits ``(B, C)``; when ``None`` it
            is built from ``config.model`` (a name of :data:`~fullthrottle.workloads.classify.models.MODELS`) and
            ``config.weights`` or the model's bundled weights. Fields of the input transform left
            ``None`` in ``config`` come from the model's declaration (:meth:`Config.for_model`).

        capture: capture the CUDA graphs here; False: :meth:`capture` does (the caller starts
            other work, e.g. decoder processes, first).

    Raises:
        ValueError: unknown model name, bad dtype; WeightsError: weights that do not fit.
    """

    def __init__(self, config: Config, model: nn.Module | None = None, capture: bool = True):
        if model is None and isinstance(config.model, nn.Module):
            model = config.model
        config = config.for_model(model)  # the model's own resize, crop and normalisation
        self.config = config
        self.device = resolve_device(config.device)
        self.cuda = self.device.type == "cuda"
        self.dtype = torch_dtype(resolve_dtype(config.dtype, self.device)) if self.cuda else torch.float32
        self.channels_last = config.channels_last and self.cuda
        self.model_name = type(model).__name__ if model is not None else config.model  # (a module given: its class)
        #: the weights file the model was loaded from (``None``: random, seeded; or a module as given)
        self.weights_path = config.weights
        by_name = model is None
        if by_name:
            model, self.weights_path = load_model(config.model, config.weights)
        elif config.weights is not None:
            load_weights(model, config.weights)
        #: a model of the registry without weights: randomly initialised (seeded), its labels meaningless
        #: (a MODULE:CLASS of the user's brings its weights as it builds itself)
        self.random_weights = by_name and self.weights_path is None and config.model in MODELS
        forms = inference_forms(model.eval(), config, self.device, self.dtype, self.channels_last)
        self.model, self.model_unfolded, self.model_fused = forms.model, forms.unfolded, forms.fused
        self.bn_folded, self.conv_relu_fused = forms.bn_folded, forms.conv_relu_fused
        #: the config's labels, else the module's own ``labels`` (a sequence of str), else ImageNet's
        #: (for a model of another number of classes: each class named by its id)
        self.class_labels = ClassLabels(config.labels, getattr(model, "labels", None), type(model).__name__)
        mean, std = (torch.tensor(v, device=self.device).view(1, 3, 1, 1) for v in (config.mean, config.std))
        self.mean, self.inv_std = mean * 255.0, 1.0 / (std * 255.0)
        # half precision: x * scale + shift in one pass over the half tensor (opmath is fp32 inside)
        self.scale_h, self.shift_h = self.inv_std.to(self.dtype), (-mean / std).to(self.dtype)
        self.max_batch = max(config.buckets)
        s = config.crop_size
        if self.cuda:
            self.copy_stream = torch.cuda.Stream(self.device)
            self.compute_stream = torch.cuda.Stream(self.device)
        self.slots = []
        for i in range(config.staging_slots):
            host_in = torch.empty((self.max_batch, s, s, 3), dtype=torch.uint8, pin_memory=self.cuda)
            slot = Slot(
                index=i,
                host_in=host_in,
                host_np=host_in.numpy(),
                dev_in=torch.empty_like(host_in, device=self.device) if self.cuda else host_in,
                host_rows=torch.empty((self.max_batch,), dtype=torch.int64, pin_memory=self.cuda),
            )
            slot.dev_rows = slot.host_rows.to(self.device) if self.cuda else slot.host_rows
            if self.cuda:
                # done: waited on by the decode thread, which sleeps instead of spinning on a core
                slot.copied, slot.done = torch.cuda.Event(), torch.cuda.Event(blocking=True)
            self.slots.append(slot)
        self._free: list[Slot] = []
        self._cv = threading.Condition()
        self.crops = None  # the decoder processes' CropPool (attach_crops)
        self.pool: PoolOnDevice | None = None  # how the device reads it (CUDA)
        self.runner: GraphRunner | None = None
        # the GPU JPEG decoder (its .kind: "hardware" or "nvjpeg"); decoder processes make their own
        self.gpu_decoder = (
            make_gpu_decoder(self.device, config.gpu_decoder) if config.gpu_decode and self.cuda else None
        )
        self.decode_stream = torch.cuda.Stream(self.device) if self.cuda else None  # the GPU decode thread's
        self.splitter = RateSplitter(config.num_threads)
        self.staging_s = 0.0  # host time copying crops into pinned memory (s)
        self.launch_s = 0.0  # host time issuing copies, model/graph replay, top-k (s)
        self.batches = 0  # batches submitted
        self._forms = forms
        self._probe()
        self._fit_outputs(1)  # (the top-k outputs: as wide as the model's classes, once it has run)
        if capture:
            self.capture()
        self.reset()

    @property
    def labels(self) -> list[str]:
        """The class names (:class:`~fullthrottle.workloads.classify.labels.ClassLabels`)."""
        return self.class_labels.names

    @property
    def num_classes(self) -> int | None:
        """Classes of the model's output (known after the first forward: at start-up, see _probe)."""
        return self.class_labels.num_classes

    def _probe(self) -> None:
        """One forward of two mid-grey images at start-up, as capture's warm-up on CUDA: learns the
        model's classes (:attr:`num_classes`). A model that raises here is left to fail the batches it
        fails. Raises ModelOutputError: the output breaks the contract, or the labels name another
        number of classes (every batch would fail alike: a configuration error)."""
        if self.cuda and (self.config.graphs or self.config.compile):  # (capture does it; no extra compile)
            return
        s = self.config.crop_size
        x = torch.full((2, s, s, 3), 128, dtype=torch.uint8, device=self.device)  # (mid-grey)
        try:
            with torch.inference_mode():
                logits = self.model(self.normalize(x))
        except (Exception, SystemExit):  # noqa: BLE001 - see the docstring (a Ctrl-C here is the user's)
            return
        self.checked(logits, 2)

    def capture(self) -> None:
        """Capture the CUDA graphs (with ``config.graphs`` on CUDA; once): normalise + model +
        softmax + top-k, one graph per bucket, each bucket keeping the form that replays fastest."""
        if self.runner is not None or not (self.config.graphs and self.cuda):
            return
        k, s = self.config.top_k, self.config.crop_size
        fns = {
            name: (lambda x, m=m: topk_probs(self.checked(m(self.normalize(x)), x.shape[0]), k))
            for name, m in self._forms.candidates()
        }
        self.runner = GraphRunner(fns, (s, s, 3), torch.uint8, self.config.buckets, self.device)
        self._fit_outputs(1)

    def _fit_outputs(self, k: int) -> None:
        """Every slot's top-k outputs at least ``min(top_k, C)`` wide when the model's classes ``C`` are
        known (:meth:`_probe`, capture's warm-up), else ``k`` wide (a batch widens its slot's: submit)."""
        k = min(self.config.top_k, self.num_classes) if self.num_classes else k
        for slot in self.slots:
            slot.fit_outputs(k, self.cuda)

    def reset(self) -> None:
        """Wait for outstanding device work and mark every slot free (start of a run)."""
        if self.cuda:
            torch.cuda.synchronize(self.device)
        with self._cv:
            self._free = list(self.slots)
            self._cv.notify_all()

    # -- the math -------------------------------------------------------------------------------
    def normalize(self, x_u8: torch.Tensor) -> torch.Tensor:
        """``(B, S, S, 3)`` uint8 NHWC on the device -> ``(B, 3, S, S)`` in the compute dtype.

        The NCHW result of permuting NHWC memory *is* a channels_last tensor, so no copy is made
        for the layout. float32: ``(x - 255*mean) / (255*std)``. bf16/fp16: ``x * scale + shift`` with
        ``scale = 1/(255*std)`` and ``shift = -mean/std`` rounded to the half type, computed in float32
        inside one kernel and rounded once (uint8 values are exact in bf16 and fp16); on CUDA that
        kernel is :func:`~fullthrottle.core.kernels.normalize_u8` (Triton), elsewhere ``addcmul``.
        """
        x = x_u8.permute(0, 3, 1, 2)
        if self.dtype == torch.float32:
            x = (x.float() - self.mean) * self.inv_std
        elif use_triton(x_u8):  # one Triton pass over the NHWC bytes (kernels.normalize_u8)
            x = normalize_u8(x_u8, self.scale_h.view(-1), self.shift_h.view(-1), self.dtype).permute(0, 3, 1, 2)
        else:  # one pass: uint8 in, half type out (addcmul promotes), instead of 4 over 4-byte data
            x = torch.addcmul(self.shift_h, x, self.scale_h)
        return x if self.channels_last else x.contiguous()

    @torch.inference_mode()
    def forward(self, x_u8: torch.Tensor) -> torch.Tensor:
        """Logits for a uint8 batch: ``(B, S, S, 3)`` uint8 on the device -> ``(B, C)`` float32."""
        return self.checked(self.model(self.normalize(x_u8)), x_u8.shape[0]).float()

    def checked(self, logits, batch: int) -> torch.Tensor:
        """``logits`` if they answer ``batch`` images (:func:`check_logits`: host-side, safe in capture)."""
        return check_logits(logits, batch, self.class_labels)

    # -- the staging ring -----------------------------------------------------------------------
    def acquire(self, stopped=lambda: False) -> Slot | None:
        """A free slot, blocking until the decode stage releases one (``None`` if ``stopped()``)."""
        with self._cv:
            while not self._free:
                if stopped():
                    return None
                self._cv.wait(0.05)
            return self._free.pop(0)

    def in_flight(self) -> int:
        """Batches submitted and not yet collected by the decode stage."""
        return len(self.slots) - len(self._free)

    def attach_crops(self, crops) -> None:
        """Read CPU-decoded crops from ``crops`` (a :class:`~fullthrottle.data.crop_pool.CropPool`); on
        CUDA through :class:`~fullthrottle.data.device_copy.PoolOnDevice` (pinned; mirrored on the
        device, ``crops.rows * S * S * 3`` bytes, or read in place)."""
        self.crops = crops
        if self.cuda:
            self.pool = PoolOnDevice(crops, self.device, self.slots)

    def release(self, slot: Slot) -> None:
        """Give ``slot`` (and the crop-pool rows its batch read) back for the next batch."""
        if slot.pool_rows:
            self.crops.release(slot.pool_rows)
            slot.pool_rows = None
        with self._cv:
            self._free.append(slot)
            self._cv.notify()

    def _copy_gpu_crops(self, slot: Slot, k: int, gpu_crops) -> None:
        """Rows ``k..`` of ``slot.dev_in`` <- the GPU decoder's crops (current stream)."""
        seen = set()
        for t, r0, r1 in crop_runs(gpu_crops):
            if self.cuda and id(t) not in seen:  # allocated on the decode stream, read on this one
                t.record_stream(torch.cuda.current_stream(self.device))
                seen.add(id(t))
            slot.dev_in[k : k + r1 - r0].copy_(t[r0:r1])
            k += r1 - r0

    def submit(
        self,
        slot: Slot,
        arrays: list[np.ndarray] | None,
        n: int | None = None,
        gpu_crops: list[tuple[torch.Tensor, int]] = (),
        pool_rows: list[int] = (),
    ) -> Slot:
        """Stage ``arrays`` (each ``(S, S, 3)`` uint8) in ``slot`` and launch copy, model and top-k.

        With ``arrays=None`` the first ``n`` rows of ``slot.host_in`` are taken as already filled.
        ``pool_rows`` name crops already in the attached crop pool (:meth:`attach_crops`): they become
        the batch rows after the arrays, copied H2D straight from the pool (no host copy) and gathered
        on the device; the slot gives them back to the pool when released.
        ``gpu_crops`` (``(rows, r)``: row ``r`` of a ``(m, S, S, 3)`` uint8 device tensor decoded on the
        GPU and complete, the GPU decode thread having synchronised) are the rows after those,
        copied on the compute stream, one copy per run of consecutive rows.

        Returns at once on CUDA (the work is queued on the streams; ``slot.done`` marks its end);
        on CPU it returns when the results are in ``slot.out_probs`` / ``slot.out_idx``.
        A failure of the model is stored in ``slot.error`` (it belongs to this batch's items).
        """
        k_arr = len(arrays) if arrays is not None else int(n)
        m = len(pool_rows)
        k_cpu = k_arr + m
        n = k_cpu + len(gpu_crops)
        if n > self.max_batch:
            raise ValueError(f"batch of {n} exceeds the staging capacity {self.max_batch}")
        if m and self.crops is None:
            raise ValueError("pool_rows given but no crop pool is attached (attach_crops)")
        slot.n, slot.error, slot.k, slot.row_errors = n, None, 0, None
        self.batches += 1
        slot.pool_rows = list(pool_rows) if m else None
        t0 = time.perf_counter()
        if arrays:  # one copy op into pinned memory: one GIL hand-off per batch, not one per image
            torch.stack([torch.from_numpy(a) for a in arrays], out=slot.host_in[:k_arr])
        if m:
            slot.host_rows.numpy()[:m] = pool_rows
            if not self.cuda:  # the gather is the one copy
                torch.index_select(self.crops.tensor, 0, slot.host_rows[:m], out=slot.host_in[k_arr:k_cpu])
        t1 = time.perf_counter()
        self.staging_s += t1 - t0
        k, staged = self.config.top_k, False  # (staged: every row is in dev_in, the model alone may fail)
        try:
            if not self.cuda:
                self._copy_gpu_crops(slot, k_cpu, gpu_crops)
                staged = True
                probs, idx = topk_probs(self.forward(slot.dev_in[:n]), k)
                slot.k = probs.shape[1]
                slot.fit_outputs(slot.k, pinned=False)
                slot.out_probs[:n, : probs.shape[1]] = probs
                slot.out_idx[:n, : idx.shape[1]] = idx
                return slot
            if self.runner is not None and m == n:  # crop-pool rows alone: see _submit_pool
                self._submit_pool(slot, pool_rows)
                self.launch_s += time.perf_counter() - t1
                return slot
            with torch.cuda.stream(self.copy_stream):  # every H2D copy of the batch in one call
                dst, src = ([slot.dev_in[:k_arr]], [slot.host_in[:k_arr]]) if k_arr else ([], [])
                if m:
                    self.pool.h2d(slot, pool_rows, dst, src)
                copy_all(dst, src)
                slot.copied.record(self.copy_stream)
            with torch.cuda.stream(self.compute_stream):
                self.compute_stream.wait_event(slot.copied)
                if m:
                    self.pool.gather(slot, m, slot.dev_in[k_arr:k_cpu])
                self._copy_gpu_crops(slot, k_cpu, gpu_crops)
                staged = True
                if self.runner is not None:  # one replay; outputs consumed below, in stream order
                    _, (probs, idx) = self.runner.replay(slot.dev_in[:n])
                    probs, idx = probs[:n], idx[:n]
                else:
                    probs, idx = topk_probs(self.forward(slot.dev_in[:n]), k)
                self._results_d2h(slot, probs, idx, n)
        except (Exception, SystemExit, KeyboardInterrupt) as e:  # noqa: BLE001 - this batch's items', not the run's
            # (a model's own sys.exit or KeyboardInterrupt too: raised in this thread, never a signal)
            slot.error = compute_failed(e)
            if staged and n > 1 and self.runner is None and not isinstance(e, ModelOutputError):
                self._rows_one_by_one(slot, n, k)
        self.launch_s += time.perf_counter() - t1
        return slot

    @torch.inference_mode()
    def _submit_pool(self, slot: Slot, pool_rows: list[int]) -> None:
        """A batch of crop-pool rows alone (the decoder processes' crops), all on the compute stream:
        the H2D copies, the gather straight into the graph's static input, the replay, the results
        D2H. Each call into PyTorch gives up the GIL and waits to take it back behind the process's
        other threads: four here against eight on the general path (the copy stream's event, the copy
        into the static input). The H2D no longer overlaps the previous batch's model; the GPU, far
        from busy at these rates, does not miss it."""
        n = len(pool_rows)
        with torch.cuda.stream(self.compute_stream):
            x, dst, src = self.runner.staged(n), [], []
            self.pool.h2d(slot, pool_rows, dst, src)
            copy_all(dst, src)
            self.pool.gather(slot, n, x)
            _, (probs, idx) = self.runner.replay_staged(n)
            self._results_d2h(slot, probs[:n], idx[:n], n)

    def _results_d2h(self, slot: Slot, probs: torch.Tensor, idx: torch.Tensor, n: int) -> None:
        """(On the compute stream.) The batch's top-k ``(n, k)`` D2H into the slot's pinned outputs, then
        its ``done`` event."""
        slot.k = probs.shape[1]
        slot.fit_outputs(slot.k, pinned=True)
        copy_all([slot.out_probs[:n, : slot.k], slot.out_idx[:n, : idx.shape[1]]], [probs, idx])
        slot.done.record(self.compute_stream)

    def _rows_one_by_one(self, slot: Slot, n: int, k: int) -> None:
        """The model raised on a batch whose ``n`` rows were all staged (eager: no graphs): each row runs
        alone, so an image the model fails on costs itself only, with its own error (:attr:`Slot.row_errors`;
        never another's, perhaps another client's). A failure before staging fails the batch instead."""
        errors = {}
        with torch.cuda.stream(self.compute_stream) if self.cuda else contextlib.nullcontext():
            for i in range(n):
                try:
                    probs, idx = topk_probs(self.forward(slot.dev_in[i : i + 1]), k)
                    c = probs.shape[1]
                    slot.fit_outputs(c, self.cuda)
                    copy_all([slot.out_probs[i : i + 1, :c], slot.out_idx[i : i + 1, :c]], [probs, idx])
                    slot.k = c
                except (Exception, SystemExit, KeyboardInterrupt) as e:  # noqa: BLE001 - this row's
                    errors[i] = compute_failed(e)
                    slot.out_probs[i], slot.out_idx[i] = 0.0, 0  # (no stale ids read for it)
            slot.error, slot.row_errors = None, errors
            if self.cuda:
                slot.done.record(self.compute_stream)

    def collect(self, slot: Slot) -> tuple[np.ndarray, np.ndarray]:
        """Wait for ``slot``'s batch and copy out its results: ``(n, k)`` float32 probs, int64 ids.

        The caller releases the slot afterwards (:meth:`release`).
        """
        if self.cuda and slot.error is None:
            slot.done.synchronize()
        n, k = slot.n, slot.k
        return slot.out_probs[:n, :k].numpy().copy(), slot.out_idx[:n, :k].numpy().copy()
