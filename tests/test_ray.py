"""The offline job on a real local Ray cluster with two worker nodes (loopback only, bounded)."""

import pytest
import torch

ray = pytest.importorskip("ray")


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


def test_offline_job_one_result_per_item_across_two_nodes(cluster, tmp_path, samples, bad_dir):
    import torchvision
    from safetensors.torch import save_file

    from fullthrottle import Config, Pipeline
    from fullthrottle.ray_jobs import classify_on_ray

    torch.manual_seed(0)
    save_file(torchvision.models.resnet18().state_dict(), str(tmp_path / "w.safetensors"))
    cfg = {"model": "resnet18", "weights": str(tmp_path / "w.safetensors"), "device": "cpu", "threads": 1,
           "max_batch_size": 16}
    inputs = [str(samples[0].parent), str(bad_dir)]
    rows = list(classify_on_ray(inputs, cfg, concurrency=2, batch_size=16))
    ref = Pipeline(Config(**cfg)).classify(inputs)
    assert len(rows) == len(ref) == 214
    assert [r["id"].rsplit("/", 1)[-1] for r in rows] == [r.id.rsplit("/", 1)[-1] for r in ref]
    for row, r in zip(rows, ref):
        assert (row["error"] is None) == r.ok, (row["id"], row["error"], r.error)
        if r.ok:
            assert row["class_ids"] == r.class_ids
            assert row["probs"] == pytest.approx(r.probs, abs=1e-5)
        else:
            assert row["error"].split(": ", 1)[1] == r.error.split(": ", 1)[1]
    assert len({r["node"] for r in rows if r["node"]}) == 2  # both worker nodes did work
