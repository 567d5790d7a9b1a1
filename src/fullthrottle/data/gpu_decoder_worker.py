"""What runs in a GPU decoder process (its parent's side is :mod:`~fullthrottle.data.gpu_decode_procs`):
batches of JPEGs (bytes in the request arena, or file paths it reads itself) decoded, resized and
cropped on the GPU (:func:`~fullthrottle.data.gpu_decode.decode_crops`), each crop copied D2H into its row
of the shared pinned crop pool; one reply per batch with each item's status and the time it took.
"""

from __future__ import annotations

import mmap
import os
import signal
import time
from multiprocessing import BufferTooShort
from multiprocessing.connection import Connection

from .gpu_wire import decode_request, encode_reply
from .load import LoadError, read_local
from .worker_procs import PATH_BIT


def gpu_worker_main(argv: list[str]) -> None:
    """A GPU decoder process's main (``argv``: its socket, the crop pool's fd, the device, the transform,
    the pool's rows, the decoder kind, the file size limit and the request arena, as
    :class:`~fullthrottle.data.gpu_decode_procs.GpuDecoderProcess` starts it)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's; we end on EOF
    fd, pool_fd, device_index, resize_size, crop_size, max_pixels, pool_rows = (int(a) for a in argv[:7])
    kind, max_file_bytes, arena_fd, arena_bytes = argv[7], int(argv[8]), int(argv[9]), int(argv[10])
    arena = mmap.mmap(arena_fd, arena_bytes) if arena_fd >= 0 else None
    from ..core.device import sleep_while_waiting

    # (before any CUDA call: nvJPEG's stream synchronisations would spin this process's core for the
    # whole decode, and a dozen such processes leave the machine's other work no cores)
    sleep_while_waiting()
    import torch

    torch.set_num_threads(1)
    from .crop_pool import clear_cuda_error
    from .gpu_decode import decode_crops
    from .gpu_decoders import _test_jpeg, make_gpu_decoder
    from .preprocess import ImageError, allow_pillow_pixels  # (importing it silenced OpenCV's log lines)

    allow_pillow_pixels(max_pixels)
    dev = torch.device("cuda", device_index)
    torch.cuda.set_device(dev)
    size = pool_rows * crop_size * crop_size * 3
    mm = mmap.mmap(pool_fd, size)
    host = torch.frombuffer(mm, dtype=torch.uint8).view(pool_rows, crop_size, crop_size, 3)
    err = torch.cuda.cudart().cudaHostRegister(host.data_ptr(), size, 0)  # pinned: D2H copies run async
    if int(err[0] if isinstance(err, tuple) else err) != 0:
        clear_cuda_error()
    stream = torch.cuda.Stream(dev)
    done = torch.cuda.Event(blocking=True)
    with torch.cuda.stream(stream), torch.inference_mode():  # set-up here, before the first real batch:
        decoder = make_gpu_decoder(dev, kind)  # "hardware" fails loudly here: the pool reports it
        # the decoder's state, and the resize kernels' JIT compile (Triton: seconds on a cold cache,
        # which would otherwise stall the first batches of every process at once)
        decode_crops(decoder, [_test_jpeg()], resize_size, crop_size, max_pixels, dev)
    stream.synchronize()
    conn = Connection(fd)
    buf = bytearray(1 << 20)  # requests land here: the decoder reads the images in place, no copy
    while True:
        try:
            n = conn.recv_bytes_into(buf)
        except BufferTooShort as e:  # a larger batch than ever before: keep a buffer that fits it
            buf = bytearray(e.args[0])
            n = len(buf)
        except (EOFError, OSError):
            return
        t0 = time.perf_counter()
        items, statuses = _read_paths(decode_request(memoryview(buf)[:n], arena), max_file_bytes)
        t1, cpu_decoded = t0, 0
        todo = [j for j, s in enumerate(statuses) if s is None]  # (not the files that could not be read)
        try:
            with torch.cuda.stream(stream), torch.inference_mode():
                # check=True: the main process only looked at the JPEG signature (its GIL is the pipeline's
                # bottleneck); what nvJPEG would not decode like the CPU path is decoded here, on the CPU
                out = [None] * len(items)
                for j, o in zip(
                    todo,
                    decode_crops(
                        decoder, [items[j][0] for j in todo], resize_size, crop_size, max_pixels, dev, check=True
                    ),
                ):
                    out[j] = o
                cpu_decoded = sum(1 for o in out if o is not None and not isinstance(o, tuple))
                run = None  # (rows, r0, pool row0, length): consecutive crops copied with one D2H
                for j, (o, (_, row)) in enumerate(zip(out, items)):
                    if o is None:  # its file's read error
                        continue
                    if isinstance(o, tuple):
                        rows, r = o
                        if run and run[0] is rows and run[1] + run[3] == r and run[2] + run[3] == row:
                            run[3] += 1
                            continue
                        if run:
                            host[run[2] : run[2] + run[3]].copy_(run[0][run[1] : run[1] + run[3]], non_blocking=True)
                        run = [rows, r, row, 1]
                    elif isinstance(o, ImageError):
                        statuses[j] = str(o)
                    else:  # nvJPEG refused it: the CPU path's crop
                        host[row].copy_(torch.from_numpy(o))
                if run:
                    host[run[2] : run[2] + run[3]].copy_(run[0][run[1] : run[1] + run[3]], non_blocking=True)
            t1 = time.perf_counter()
            done.record(stream)
            done.synchronize()  # every crop is in the pool before the answer goes out (sleeping, not spinning)
        except Exception as e:  # noqa: BLE001 - a failed batch fails its items, not the process
            for j in todo:
                statuses[j] = f"GPU decode failed: {type(e).__name__}: {e}"
        try:
            conn.send_bytes(encode_reply(statuses, t1 - t0, time.perf_counter() - t0, cpu_decoded))
        except (EOFError, OSError):
            return


def _read_paths(items: list, max_file_bytes: int) -> tuple[list, list]:
    """A request's items with each path item's file read: ``([(bytes, pool row), ...], statuses)``,
    the status of an item whose file cannot be read its :class:`~fullthrottle.data.load.LoadError`."""
    statuses: list = [None] * len(items)
    out = []
    for j, (d, row) in enumerate(items):
        if row & PATH_BIT:
            row &= ~PATH_BIT
            try:
                d = read_local(os.fsdecode(bytes(d)), max_file_bytes)
            except LoadError as e:
                statuses[j], d = e, b""
        out.append((d, row))
    return out, statuses
