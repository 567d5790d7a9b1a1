"""The servers a user would pick instead of ``fullthrottle serve``, for ``bench/serve_load.py``: each
serves ResNet18 (random weights, bf16 on CUDA, float32 on the CPU) at ``POST /v1/classify`` and says
ready at ``GET /readyz`` (FastAPI) or ``GET /health`` (LitServe's own, once its workers are set up).

- ``fastapi``: plain FastAPI + uvicorn, PIL + torchvision v2 per request, the eager model once per
  request (a 32-image multipart request runs as one batch of 32).
- ``litserve``: LitServe (``litserve`` from PyPI) with its own batching on, as its docs recommend
  (``max_batch_size=64``, ``batch_timeout=0.005``), ``workers_per_device`` and ``num_api_servers``
  given; images arrive as multipart files (field ``content``), LitServe's way for binary inputs.

Usage: python bench/serve_peers.py {fastapi,litserve} --port P --device D [--workers N] [--api-servers N]
"""

import argparse
import asyncio
import io

MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)  # torchvision's ImageNet recipe


def _model(device: str):
    """ResNet18 in eval mode on ``device`` (bf16 channels_last on CUDA), its input transform, and a
    ``run(uint8 (B, 3, 224, 224)) -> (probs (B, 5), ids (B, 5))`` on it."""
    import torch
    import torchvision
    from torchvision.transforms import v2

    dev = torch.device(device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval().to(dev, dtype, memory_format=torch.channels_last)
    tf = v2.Compose([v2.Resize(256, antialias=True), v2.CenterCrop(224), v2.PILToTensor()])
    mean = torch.tensor(MEAN, device=dev).view(1, 3, 1, 1) * 255
    std = torch.tensor(STD, device=dev).view(1, 3, 1, 1) * 255

    def run(x):
        with torch.inference_mode():
            x = (
                ((x.to(dev, non_blocking=True).float() - mean) / std)
                .to(dtype)
                .contiguous(memory_format=torch.channels_last)
            )
            v, i = torch.softmax(model(x).float(), -1).topk(5)
            return v.cpu().tolist(), i.cpu().tolist()

    return tf, run


def _top5(probs, ids) -> list[dict]:
    return [{"top_k": [{"class_id": c, "prob": p} for c, p in zip(i, v)]} for v, i in zip(probs, ids)]


def fastapi_app(device: str):
    # (this module has no `from __future__ import annotations`: FastAPI reads `request: Request` at run time)
    import torch
    from fastapi import FastAPI, Request
    from PIL import Image

    tf, run = _model(device)
    app = FastAPI()

    @app.get("/readyz")
    def ready():
        return {"status": "ready"}

    @app.post("/v1/classify")
    async def classify(request: Request):
        if request.headers.get("content-type", "").startswith("multipart/form-data"):
            form = await request.form()
            blobs = [await f.read() for _, f in form.multi_items()]
        else:
            blobs = [await request.body()]

        def work():
            x = torch.stack([tf(Image.open(io.BytesIO(b)).convert("RGB")) for b in blobs])
            return {"results": _top5(*run(x))}

        return await asyncio.to_thread(work)

    return app


try:  # (module level: LitServe pickles the API into its worker processes)
    import litserve as ls
except ImportError:
    ls = None

if ls is not None:

    class ResNet18API(ls.LitAPI):
        def setup(self, device):
            self.tf, self.run = _model(device)

        def decode_request(self, request):
            from PIL import Image

            return self.tf(Image.open(io.BytesIO(request["content"].file.read())).convert("RGB"))

        def batch(self, inputs):
            import torch

            return torch.stack(inputs)

        def predict(self, x):
            return self.run(x)

        def unbatch(self, output):
            return _top5(*output)

        def encode_response(self, output):
            return {"results": [output]}


def litserve_server(device: str, workers: int):
    if ls is None:
        raise SystemExit("litserve is not installed (pip install litserve)")
    api = ResNet18API(max_batch_size=64, batch_timeout=0.005, api_path="/v1/classify")
    server = ls.LitServer(
        api, accelerator="cuda" if device.startswith("cuda") else "cpu", devices=1, workers_per_device=workers
    )
    return server


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kind", choices=("fastapi", "litserve"))
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--workers", type=int, default=1, help="litserve: workers_per_device")
    ap.add_argument("--api-servers", type=int, default=1, help="litserve: num_api_servers")
    args = ap.parse_args()
    if args.kind == "fastapi":
        import uvicorn

        uvicorn.run(fastapi_app(args.device), host="127.0.0.1", port=args.port, log_level="warning")
    else:
        litserve_server(args.device, args.workers).run(
            host="127.0.0.1",
            port=args.port,
            num_api_servers=args.api_servers,
            log_level="warning",
            generate_client_file=False,
        )


if __name__ == "__main__":
    main()
