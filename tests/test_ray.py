"""The offline job on a real local Ray cluster with two worker nodes (loopback only, bounded)."""

import os

import pytest
import torch

ray = pytest.importorskip("ray")
pytestmark = pytest.mark.xdist_group("ray")  # (one test process starts the one cluster they share)


@pytest.fixture(scope="module")
def cluster():
    from ray.cluster_utils import Cluster

    c = Cluster(initialize_head=True, head_node_args={"num_cpus": 0})  # all work on the two workers
    c.add_node(num_cpus=1)
    c.add_node(num_cpus=1)
    ray.init(address=c.address, log_to_driver=False)
    yield c
    ray.shutdown()
    c.shutdown()


def test_offline_job_one_result_per_item_across_two_nodes(cluster, tmp_path, samples, bad_dir, monkeypatch):
    """classify --ray writes the lines a local run writes (ids as typed, errors with their stage
    and kind), each with the node that ran it, and both worker nodes take part."""
    import json

    import torchvision
    from safetensors.torch import save_file

    from fullthrottle import Config, Pipeline
    from fullthrottle.cli import main

    torch.manual_seed(0)
    save_file(torchvision.models.resnet18().state_dict(), str(tmp_path / "w.safetensors"))
    cfg = {
        "model": "resnet18",
        "weights": str(tmp_path / "w.safetensors"),
        "device": "cpu",
        "threads": 1,
        "max_batch_size": 8,
    }
    photos = tmp_path / "photos"  # 24 of the sample photos, and the bad inputs
    photos.mkdir()
    for p in samples[:24]:
        (photos / p.name).symlink_to(p)
    with open(os.fsencode(photos) + b"/h\xffn.jpg", "wb") as f:  # (a name that is not UTF-8)
        f.write(samples[24].read_bytes())
    monkeypatch.chdir(tmp_path)
    inputs = ["photos", str(bad_dir)]  # (a relative folder: its ids stay relative, as in a local run)
    # (both actors up before the first batch: started one by one, under load the first could take all)
    monkeypatch.setattr(ray.data.DataContext.get_current(), "wait_for_min_actors_s", 300)
    args = ["--model", "resnet18", "--weights", cfg["weights"], "--device", "cpu", "--threads", "1"]
    code = main(["classify", *inputs, *args, "--batch-size", "8", "--ray", "--ray-actors", "2", "--out", "r.jsonl"])
    rows = [json.loads(x) for x in (tmp_path / "r.jsonl").read_text().splitlines()]
    ref = [r.to_dict() for r in Pipeline(Config(**cfg)).classify(inputs)]
    assert code == 1 and len(rows) == len(ref) == 39  # (1: some items failed)
    assert "photos/h\\xffn.jpg" in [r["id"] for r in rows]
    for row, r in zip(rows, ref):
        got = {k: v for k, v in row.items() if k not in ("top_k", "node")}
        assert got == {k: v for k, v in r.items() if k != "top_k"}
        assert [(t["class_id"], t["label"]) for t in row.get("top_k", [])] == [
            (t["class_id"], t["label"]) for t in r.get("top_k", [])
        ]
        assert [t["prob"] for t in row.get("top_k", [])] == pytest.approx(
            [t["prob"] for t in r.get("top_k", [])], abs=1e-5
        )
    assert len({r["node"] for r in rows if r["node"]}) == 2  # both worker nodes did work


def test_any_workload_offline_on_ray_answers_as_in_one_process(cluster):
    """The embeddings workload (its contract: decode, token-budget batches, predict, encode) in two Ray
    actors gives the vectors the Embedder gives here; a bad request gets its own error."""
    import numpy as np

    from fullthrottle.ray_jobs import workload_on_ray
    from fullthrottle.workloads.embed import Embedder

    texts = [f"sentence number {i} about {w}" for i, w in enumerate(["cats", "GPUs", "rain", "tea"] * 6)]
    reqs = [{"input": texts[i : i + 3]} for i in range(0, len(texts), 3)] + [{"input": 5}]
    rows = list(workload_on_ray("fullthrottle.workloads.embed_api:EmbeddingsAPI", reqs, batch_size=3, device="cpu"))
    assert len(rows) == len(reqs)
    assert rows[-1]["response"] is None and "bad request" in rows[-1]["error"]
    got = np.array([d["embedding"] for r in rows[:-1] for d in r["response"]["data"]])
    ref = Embedder(device="cpu").embed(texts).vectors
    np.testing.assert_allclose(got, ref, atol=1e-5)
    assert all(r["node"] for r in rows)  # answered in Ray actors (which of the two nodes: Ray's choice)
    with pytest.raises(ValueError, match="cannot import"):
        list(workload_on_ray("no_such_module_x:Y", reqs))
    from fullthrottle.ray_jobs import SetupFailed

    with pytest.raises(SetupFailed) as e:  # the user's setup() failing in the actors: its message, not Ray's
        list(workload_on_ray("toy_workload:BadSetup", reqs[:1], device="cpu"))
    msg = str(e.value)
    assert msg.startswith("workload 'badsetup': setup() failed:") and "/nonexistent/weights.pt" in msg, msg
    assert "ray" not in msg.lower(), msg


def test_ray_serve_same_answers_and_survives_a_killed_replica(cluster, tmp_path, samples):
    import concurrent.futures as cf
    import socket
    import time

    import httpx
    import torchvision
    from ray import serve
    from safetensors.torch import save_file

    from fullthrottle import Config, Pipeline
    from fullthrottle.ray_jobs import serve_on_ray

    torch.manual_seed(1)
    save_file(torchvision.models.resnet18().state_dict(), str(tmp_path / "w.safetensors"))
    cfg = Config(model="resnet18", weights=str(tmp_path / "w.safetensors"), device="cpu", threads=1, max_batch_size=8)
    ref = {r.id: r for r in Pipeline(cfg).classify([(p.name, p.read_bytes()) for p in samples[:12]])}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from toy_workload import Summer

    from fullthrottle.server.options import ServeOptions

    serve_on_ray(cfg, ServeOptions(workloads=(Summer(),)), replicas=2, port=port, blocking=False)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.time() + 120
        while time.time() < deadline:
            try:
                if httpx.get(url + "/readyz", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)

        def ask(p):
            r = httpx.post(
                url + "/v1/classify", content=p.read_bytes(), headers={"content-type": "image/jpeg"}, timeout=60
            )
            return p.name, r

        def check(results):
            for name, r in results:
                if r.status_code != 200:
                    continue
                top = r.json()["results"][0]["top_k"]
                assert [t["class_id"] for t in top] == ref[name].class_ids  # never a wrong answer

        with cf.ThreadPoolExecutor(6) as ex:
            first = list(ex.map(ask, samples[:12]))
        assert all(r.status_code == 200 for _, r in first)
        check(first)
        r = httpx.post(url + "/v1/sum", json={"inputs": [[1, 2, 3, 4]]}, timeout=60)  # a workload of one's own
        assert r.status_code == 200 and r.json()["results"] == [{"output": 10.0}]
        from ray.util.state import list_actors

        replicas = [a for a in list_actors(filters=[("state", "=", "ALIVE")]) if "ServeReplica" in a.class_name]
        assert len(replicas) == 2
        ray.kill(ray.get_actor(replicas[0].name, namespace="serve"))
        with cf.ThreadPoolExecutor(6) as ex:
            during = list(ex.map(ask, samples[:12]))
        check(during)
        time.sleep(5)  # recovery: Serve restarts the replica
        with cf.ThreadPoolExecutor(6) as ex:
            after = list(ex.map(ask, samples[:12]))
        assert all(r.status_code == 200 for _, r in after)
        check(after)
    finally:
        serve.shutdown()


def test_classify_ray_checks_its_outputs_as_a_local_run_before_ray_starts(tmp_path, samples, capsys):
    """--ray refuses what a local run refuses, with exit 2 and no file touched: an output that is an
    input (it overwrote the image), a missing folder (a traceback); --report-json is refused (it
    was ignored)."""
    from fullthrottle.cli import main

    img = tmp_path / "a.jpg"
    img.write_bytes(samples[0].read_bytes())
    before = img.read_bytes()
    for extra, want in (
        (["--out", str(img)], f"the output {img} is one of the inputs: writing it would destroy it"),
        (["--out", str(tmp_path / "no" / "x.jsonl")], "its folder does not exist"),
        (["--report-json", str(tmp_path / "r.json")], "--report-json is not written for a --ray job"),
    ):
        assert main(["classify", str(img), "--ray", "--device", "cpu", *extra]) == 2
        assert want in capsys.readouterr().err
    assert img.read_bytes() == before and not (tmp_path / "r.json").exists()


def test_ray_gets_the_command_line_as_utf8(monkeypatch):
    """A file name that is not UTF-8 on the command line reaches Ray's C++ core as \\xNN (the whole
    job failed in ray.init with a UnicodeEncodeError); the caller's SIGTERM handler outlives ray.init."""
    import signal
    import sys

    import ray._private.utils as utils

    from fullthrottle import ray_jobs

    seen = []

    def init(**kw):  # (as ray.init: its own SIGTERM handler, which exits 15)
        seen.append(utils.get_entrypoint_name().encode("utf-8"))
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(signum))

    def ours(signum, frame):  # (the CLI's, which exits 143)
        pass

    monkeypatch.setattr(utils, "get_entrypoint_name", lambda: "python3 -m fullthrottle.cli classify bad\udcffname.jpg")
    monkeypatch.setattr(ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray, "init", init)
    before = signal.signal(signal.SIGTERM, ours)
    try:
        ray_jobs._init_ray(None)
        assert signal.getsignal(signal.SIGTERM) is ours  # (a SIGTERM mid-job exited 15, not 143)
    finally:
        signal.signal(signal.SIGTERM, before)
    assert seen == [b"python3 -m fullthrottle.cli classify bad\\xffname.jpg"]
    assert utils.get_entrypoint_name().endswith("bad\udcffname.jpg")  # (Ray's own, put back)


def test_classify_ray_names_why_its_actors_could_not_start(cluster, samples, tmp_path, capsys):
    """A job whose actors cannot start (weights missing on the nodes) exits 2 with the cause's own
    line (it ended in Ray's traceback)."""
    from fullthrottle.cli import main

    weights = str(tmp_path / "none.safetensors")  # (not there: the check is the actors')
    args = ["--device", "cpu", "--threads", "1", "--weights", weights, "--ray", "--ray-actors", "1"]
    assert main(["classify", str(samples[0]), *args]) == 2
    assert f"fullthrottle: error: the Ray job failed: FileNotFoundError: weights file not found: {weights}" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "argv,said",
    [
        (["classify", "--ray", "127.0.0.1:1", "--device", "cpu"], "cannot reach the Ray cluster at 127.0.0.1:1: "),
        (["classify", "--ray", "127.0.0.1:WEB", "--device", "cpu"], "at 127.0.0.1:WEB: no Ray cluster answers"),
        (
            ["run", "LINES", "--workload", "tests.toy_workload:Summer", "--ray", "--ray-address", "head-node"],
            "Ray cluster address 'head-node': not HOST:PORT or auto",
        ),
        (  # (Ray Data's jobs fail inside Ray through Ray Client: AttributeError 'core_worker')
            ["classify", "--ray", "ray://127.0.0.1:WEB", "--device", "cpu"],
            "a Ray Data job does not run through Ray Client (ray://); run it on a node of the cluster",
        ),
    ],
)
def test_a_cluster_address_that_does_not_answer_is_one_line_and_exit_2(argv, said, tmp_path):
    """(In a process of its own: no cluster of this module's is joined there.)"""
    import http.server
    import subprocess
    import sys
    import threading

    # (a web server: it accepts the connection, and ray.init would wait on it without end)
    web = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
    threading.Thread(target=web.serve_forever, daemon=True).start()
    said = said.replace("WEB", str(web.server_port))
    lines = tmp_path / "l.jsonl"
    lines.write_text('{"values": [1, 2]}\n')
    argv = [str(lines) if a == "LINES" else a.replace("WEB", str(web.server_port)) for a in argv]
    p = subprocess.run(
        [sys.executable, "-m", "fullthrottle", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=os.path.dirname(os.path.dirname(__file__)),
    )
    web.shutdown()
    assert p.returncode == 2 and said in p.stderr and "Traceback" not in p.stderr, p.stderr


def test_serve_on_ray_stops_on_sigterm_with_exit_0(tmp_path, samples):
    """``serve --ray`` (its own local cluster, in a process of its own): answers, then SIGTERM shuts
    the deployment and the cluster down and exits 0, as the plain server does."""
    import signal
    import socket
    import subprocess
    import sys
    import time

    import httpx

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "fullthrottle", "serve", "--ray", "--device", "cpu", "--model", "resnet18"]
    log = open(tmp_path / "serve.log", "w+")
    p = subprocess.Popen([*cmd, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.time() + 180
        while time.time() < deadline and p.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/readyz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        log.seek(0)
        assert p.poll() is None, f"serve --ray exited with {p.returncode} before it was ready:\n{log.read()[-3000:]}"
        r = httpx.post(f"http://127.0.0.1:{port}/v1/classify", content=samples[0].read_bytes(), timeout=60)
        assert r.status_code == 200 and r.json()["results"][0]["top_k"], r.text
        p.send_signal(signal.SIGTERM)
        rc = p.wait(timeout=120)
    finally:
        if p.poll() is None:
            p.kill()
    log.seek(0)
    out = log.read()
    assert rc == 0 and "terminated: stopping" in out and "SIGTERM received" not in out, out[-3000:]
