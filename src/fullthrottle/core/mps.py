"""A private CUDA MPS server for one command, so that the GPU decoder processes and the model share the GPU.

Without MPS every process that uses the GPU has its own CUDA context and the GPU time-slices between
them: the GPU decoder processes' kernels and the model's never run at once. Under an MPS server their
kernels run side by side. :func:`private_mps` starts a control daemon (``nvidia-cuda-mps-control -d``)
with its own pipe and log folders, exports them (``CUDA_MPS_PIPE_DIRECTORY``,
``CUDA_MPS_LOG_DIRECTORY``: NVIDIA's variables) to this process and its children, and asks the daemon
to quit when the block ends; the daemon and its server exit once the last client has. It must be
entered before this process's first CUDA call, and changes nothing when a server already runs, when
there is no NVIDIA driver, when the daemon does not start, or when its server takes no client (a
fresh process tries first: :func:`client_refused`); the run then time-slices, as it says.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
from collections.abc import Iterator

#: the prefix of the folder a private server lives in (how the report tells it from a user's server)
PREFIX = "fullthrottle-mps-"


def control_binary() -> str | None:
    """The path of ``nvidia-cuda-mps-control`` (PATH, then the driver's usual folders), or None."""
    return shutil.which("nvidia-cuda-mps-control") or next(
        (
            p
            for p in (
                "/usr/bin/nvidia-cuda-mps-control",
                "/usr/local/cuda/bin/nvidia-cuda-mps-control",
                "/usr/local/nvidia/bin/nvidia-cuda-mps-control",
            )
            if os.path.exists(p)
        ),
        None,
    )


def driver_present() -> bool:
    """Whether this machine has an NVIDIA driver's control device (``/dev/nvidiactl``)."""
    return os.path.exists("/dev/nvidiactl")


def started_here() -> bool:
    """Whether this process's CUDA talks to a server :func:`private_mps` started."""
    return os.path.basename(os.path.dirname(os.environ.get("CUDA_MPS_PIPE_DIRECTORY", ""))).startswith(PREFIX)


@contextlib.contextmanager
def private_mps(enabled: bool = True) -> Iterator[str]:
    """``with private_mps() as how:`` CUDA in the block (this process and the processes it starts)
    runs as clients of a private MPS server; ``how`` says what was done (for a note): ``"started"``,
    or why not (``"off"``, ``"a server is running"``, ``"no NVIDIA driver"``, ``"... did not start: ..."``,
    ``"the MPS server took no client: ..."``)."""
    if not enabled:
        yield "off"
        return
    if mps_server_running():
        yield "a server is running"
        return
    exe = control_binary()
    if exe is None or not driver_present():
        yield "no NVIDIA driver (nvidia-cuda-mps-control, /dev/nvidiactl)"
        return
    root = tempfile.mkdtemp(prefix=PREFIX)
    env = {"CUDA_MPS_PIPE_DIRECTORY": os.path.join(root, "pipe"), "CUDA_MPS_LOG_DIRECTORY": os.path.join(root, "log")}
    for d in env.values():
        os.makedirs(d)
    try:
        r = subprocess.run([exe, "-d"], env=dict(os.environ, **env), capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        r = subprocess.CompletedProcess([exe], -1, "", str(e))
    if r.returncode != 0:
        shutil.rmtree(root, ignore_errors=True)
        yield f"nvidia-cuda-mps-control -d did not start ({r.returncode}): {(r.stderr or r.stdout).strip()[:200]}"
        return
    try:
        refused = client_refused(env)
    except BaseException:  # (Ctrl-C while the check runs: the daemon must not outlive the command)
        _quit(exe, root, env)
        raise
    if refused:  # (a GPU in exclusive mode, another user's server, ...): the run goes on without MPS
        _quit(exe, root, env)
        yield f"the MPS server took no client: {refused}"
        return
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield "started"
    finally:
        _quit(exe, root, env)
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


#: a CUDA client in a fresh process: the driver API only (no torch import), device 0 of those visible
_CLIENT = """
import ctypes, sys
cu = ctypes.CDLL("libcuda.so.1")
def check(rc, what):
    if rc:
        name = ctypes.c_char_p()
        cu.cuGetErrorName(rc, ctypes.byref(name))
        sys.exit(f"{what}: {(name.value or b'error').decode()} ({rc})")
check(cu.cuInit(0), "cuInit")
dev, ctx = ctypes.c_int(), ctypes.c_void_p()
check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "a context")
"""


def client_refused(env: dict[str, str], timeout_s: float = 60.0) -> str | None:
    """Why a CUDA client cannot run under the MPS daemon of ``env`` (its pipe and log folders), or
    None when one can: a fresh process opens a context on the first visible GPU, which starts the
    daemon's MPS server (exclusive-process compute mode, a server of another user or a GPU that MPS
    does not support refuse it). Checked before this process's own CUDA depends on it."""
    try:
        r = subprocess.run(
            [sys.executable, "-c", _CLIENT],
            env=dict(os.environ, **env),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"{type(e).__name__}: {e}"
    return None if r.returncode == 0 else (r.stderr.strip().splitlines() or [f"exit {r.returncode}"])[-1][:200]


def _quit(exe: str, root: str, env: dict[str, str]) -> None:
    """Ask the daemon of ``env`` to quit; it finishes once its clients (this process among them) have
    exited. Sent from a detached shell, which then removes the folders under ``root``."""
    subprocess.Popen(
        ["sh", "-c", 'echo quit | "$0"; sleep 1; rm -rf "$1"', exe, root],
        env=dict(os.environ, **env),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


#: GPU decoder processes by default: as MPS clients, and time-slicing the GPU (Config.gpu_decode_processes).
#: As MPS clients each process's decode call waits on the GPU beside the model's kernels, so more
#: processes keep more batches in flight (12 decoded faster than 8 and 16); time-sliced, every context
#: costs the GPU a slice (6). See docs/performance.md.
PROCESSES_MPS, PROCESSES_TIME_SLICED = 12, 6


def default_processes(mps: bool | None = None, cores: int | None = None) -> int:
    """How many GPU decoder processes ``Config.gpu_decode_processes=None`` means:
    :data:`PROCESSES_MPS` (12) when a CUDA MPS server is running (``mps=None``: ask
    :func:`mps_server_running`), :data:`PROCESSES_TIME_SLICED` (6) otherwise. Under MPS their kernels
    run at once and more processes decode faster; time-sliced, more contexts slow the GPU down (see
    docs/performance.md). Under MPS, on a machine of fewer than 16 ``cores`` (the caller's usable
    cores; None: not capped), one process per core beyond four, at least two: each process reads its
    files and drives its decoder on a core of its own (12 was measured on 16 cores)."""
    if mps is None:
        mps = mps_server_running()
    if not mps:
        return PROCESSES_TIME_SLICED
    return PROCESSES_MPS if cores is None else min(PROCESSES_MPS, max(2, cores - 4))


def mps_server_running() -> bool:
    """Whether a CUDA MPS control daemon serves the folder where this process's CUDA would look for it
    (``$CUDA_MPS_PIPE_DIRECTORY``, default ``/tmp/nvidia-mps``). Then the GPU decoder processes
    started now share the GPU as MPS clients, their kernels running at once, instead of
    time-slicing it between one CUDA context each. Never raises.

    The daemon writes ``nvidia-cuda-mps-control.pid`` there: a live process of that id means yes (a
    file left by a killed daemon, no). Without that file, its ``control`` socket must accept a
    connection (stream or seqpacket; a socket file nobody listens on does not count)."""
    folder = os.environ.get("CUDA_MPS_PIPE_DIRECTORY") or "/tmp/nvidia-mps"
    pid_path = os.path.join(folder, "nvidia-cuda-mps-control.pid")
    try:
        # a regular file only (opening a FIFO would wait for a writer), read without blocking
        fd = os.open(pid_path, os.O_RDONLY | os.O_NONBLOCK)
        try:
            pid = int(os.read(fd, 64).strip() or 0) if stat.S_ISREG(os.fstat(fd).st_mode) else 0
        finally:
            os.close(fd)
    except (OSError, ValueError):
        pid = 0
    if 0 < pid < 1 << 31:  # (os.kill takes a C int: anything larger is not a process id)
        try:
            os.kill(pid, 0)  # (signal 0: only asks whether it exists)
        except PermissionError:
            return True  # another user's daemon, alive
        except (OSError, OverflowError):
            return False
        return True
    path = os.path.join(folder, "control")
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return False
    if stat.S_ISFIFO(mode):  # (a named pipe: nothing to probe without talking to the daemon)
        return True
    if not stat.S_ISSOCK(mode):
        return False
    for kind in (socket.SOCK_STREAM, socket.SOCK_SEQPACKET):
        s = socket.socket(socket.AF_UNIX, kind)
        s.settimeout(1.0)
        try:
            s.connect(path)
            return True
        except OSError:
            pass
        finally:
            s.close()
    return False
