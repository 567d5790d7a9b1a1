"""The private CUDA MPS server of ``--mps`` (fullthrottle.core.mps), with a stand-in for nvidia-cuda-mps-control."""

import os
import time

from fullthrottle.core import mps


def _fake_control(tmp_path, monkeypatch, rc=0):
    """An nvidia-cuda-mps-control on PATH that logs its arguments, its pipe folder and its stdin."""
    log = tmp_path / "calls.log"
    exe = tmp_path / "bin" / "nvidia-cuda-mps-control"
    exe.parent.mkdir()
    exe.write_text(
        f'#!/bin/sh\necho "args:$* pipe:$CUDA_MPS_PIPE_DIRECTORY" >> {log}\n'
        f'if [ -z "$1" ]; then cat >> {log}; fi\nexit {rc}\n'
    )
    exe.chmod(0o755)
    monkeypatch.setenv("PATH", f"{exe.parent}:{os.environ['PATH']}")
    monkeypatch.setattr(mps, "driver_present", lambda: True)
    monkeypatch.setattr(mps, "client_refused", lambda env: None)  # (no GPU here to be its client)
    monkeypatch.delenv("CUDA_MPS_PIPE_DIRECTORY", raising=False)
    monkeypatch.delenv("CUDA_MPS_LOG_DIRECTORY", raising=False)
    return log


def test_private_server_is_started_exported_and_asked_to_quit(tmp_path, monkeypatch):
    log = _fake_control(tmp_path, monkeypatch)
    with mps.private_mps() as how:
        assert how == "started"
        pipe = os.environ["CUDA_MPS_PIPE_DIRECTORY"]
        assert os.path.isdir(pipe) and os.path.isdir(os.environ["CUDA_MPS_LOG_DIRECTORY"])
        assert mps.started_here()
        assert log.read_text().splitlines() == [f"args:-d pipe:{pipe}"]
    assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ and not mps.started_here()
    deadline = time.time() + 10
    while os.path.exists(os.path.dirname(pipe)) and time.time() < deadline:
        time.sleep(0.2)
    assert not os.path.exists(os.path.dirname(pipe)), "the server's folder was left behind"
    assert log.read_text().splitlines()[1:] == [f"args: pipe:{pipe}", "quit"]


def test_nothing_is_started_when_off_unavailable_or_failing(tmp_path, monkeypatch):
    with mps.private_mps(False) as how:
        assert how == "off"
    log = _fake_control(tmp_path, monkeypatch, rc=3)
    with mps.private_mps() as how:  # the daemon does not start: the run goes on, time-sliced, and says why
        assert how.startswith("nvidia-cuda-mps-control -d did not start (3)")
        assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    assert log.read_text().count("args:-d") == 1
    monkeypatch.setattr(mps, "driver_present", lambda: False)
    with mps.private_mps() as how:
        assert how.startswith("no NVIDIA driver")
    monkeypatch.setattr(mps, "driver_present", lambda: True)
    (tmp_path / "live").mkdir()
    (tmp_path / "live" / "nvidia-cuda-mps-control.pid").write_text(f"{os.getpid()}\n")
    monkeypatch.setenv("CUDA_MPS_PIPE_DIRECTORY", str(tmp_path / "live"))
    with mps.private_mps() as how:  # a user's server runs: it is used as it is
        assert how == "a server is running" and os.environ["CUDA_MPS_PIPE_DIRECTORY"] == str(tmp_path / "live")


def test_classify_starts_a_private_server_by_default_serve_only_when_asked():
    """classify may decode on the GPU: --mps is on by default (--no-mps, --device cpu, --no-gpu-decode
    and --ray turn it off); serve starts one only with --mps."""
    from fullthrottle.cli import build_parser, mps_wanted

    def wanted(*argv):
        return mps_wanted(build_parser().parse_args(list(argv)))

    assert wanted("classify", "photos/")
    assert wanted("classify", "photos/", "--device", "cuda:1")
    assert not wanted("classify", "photos/", "--no-mps")
    assert not wanted("classify", "photos/", "--device", "cpu")
    assert not wanted("classify", "photos/", "--device", "cpu:0")
    assert not wanted("classify", "photos/", "--no-gpu-decode")
    assert not wanted("classify", "photos/", "--ray", "auto")
    assert not wanted("serve")
    assert wanted("serve", "--mps")
    assert not wanted("serve", "--mps", "--no-gpu-decode")


def test_a_server_that_takes_no_client_is_asked_to_quit_and_not_used(tmp_path, monkeypatch):
    """The daemon starts but a CUDA client cannot connect (exclusive-process mode, another user's
    server): the daemon is asked to quit, nothing is exported, and the reason is given; without a
    GPU the client check itself names why."""
    log = _fake_control(tmp_path, monkeypatch)
    seen = []
    monkeypatch.setattr(
        mps, "client_refused", lambda env: seen.append(env) or "cuInit: CUDA_ERROR_MPS_CONNECTION_FAILED"
    )
    with mps.private_mps() as how:
        assert how == "the MPS server took no client: cuInit: CUDA_ERROR_MPS_CONNECTION_FAILED"
        assert "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
    pipe = seen[0]["CUDA_MPS_PIPE_DIRECTORY"]
    deadline = time.time() + 10
    while "quit" not in log.read_text() and time.time() < deadline:
        time.sleep(0.2)
    assert log.read_text().splitlines() == [f"args:-d pipe:{pipe}", f"args: pipe:{pipe}", "quit"]
    if not os.path.exists("/dev/nvidiactl"):  # the real check on a machine without a GPU driver
        why = mps.client_refused({"CUDA_MPS_PIPE_DIRECTORY": str(tmp_path / "none")})
        assert why and ("libcuda" in why or "cuInit" in why), why


def test_mps_asked_where_it_cannot_apply_says_why(capsys):
    """--mps on a CPU run names why nothing was started, in one note, and the run goes on."""
    from pathlib import Path

    from fullthrottle.cli import main

    photo = Path(__file__).parent / "data" / "imagenet-sample" / "n01514859_hen.JPEG"
    args = ["classify", str(photo), "--device", "cpu", "--mps", "--model", "resnet18", "--threads", "1"]
    assert main([*args, "--no-progress", "--out", "-"]) == 0
    err = capsys.readouterr().err
    assert "note: --mps is for GPU decoding on CUDA, not with --device cpu: no MPS server started" in err, err


def test_a_ctrl_c_during_the_client_check_still_asks_the_daemon_to_quit(tmp_path, monkeypatch):
    import pytest

    log = _fake_control(tmp_path, monkeypatch)

    def interrupted(env):
        raise KeyboardInterrupt

    monkeypatch.setattr(mps, "client_refused", interrupted)
    with pytest.raises(KeyboardInterrupt):
        with mps.private_mps():
            pass
    deadline = time.time() + 10
    while "quit" not in log.read_text() and time.time() < deadline:
        time.sleep(0.2)
    assert log.read_text().splitlines()[-1] == "quit" and "CUDA_MPS_PIPE_DIRECTORY" not in os.environ
