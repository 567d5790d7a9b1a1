"""A workload of a user's own for the server tests: sums of number lists, by a torch model."""

import torch

from fullthrottle import ItemError, Workload


class Summer(Workload):
    name = "sum"
    max_batch = 64
    max_wait_ms = 20.0
    max_items_per_request = 8

    def __init__(self):
        self.calls: list[int] = []  # items per predict() call

    def setup(self, device):
        self.device = torch.device(device)
        self.model = torch.nn.Linear(4, 1, bias=False).to(self.device)
        with torch.no_grad():
            self.model.weight.fill_(1.0)

    def decode_request(self, body):
        xs = body.get("inputs")
        if not isinstance(xs, list):
            raise ValueError("'inputs' must be a list of 4-number lists")
        return xs

    def predict(self, items):
        self.calls.append(len(items))
        good = [i for i, x in enumerate(items) if isinstance(x, list) and len(x) == 4]
        out = [ItemError(f"item {i}: not 4 numbers") for i in range(len(items))]
        if good:
            x = torch.tensor([items[i] for i in good], dtype=torch.float32, device=self.device)
            with torch.inference_mode():
                for i, v in zip(good, self.model(x)[:, 0].tolist()):
                    out[i] = v
        return out


class BadSetup(Summer):
    name = "badsetup"

    def setup(self, device):
        raise FileNotFoundError("/nonexistent/weights.pt")


class Hanging(Summer):
    """predict() blocks until ``release`` is set."""

    name = "hanging"

    def __init__(self):
        super().__init__()
        import threading

        self.entered, self.release = threading.Event(), threading.Event()

    def predict(self, items):
        self.entered.set()
        self.release.wait(60)
        return super().predict(items)


class Exiter(Summer):
    """predict() raises SystemExit for the item "exit"."""

    name = "exiter"

    def predict(self, items):
        if "exit" in items:
            raise SystemExit(3)
        return super().predict(items)


class Broken:
    name = "Bad Name"


class Fragile(Summer):
    """Batches of at most 4 items, a cost budget; 'boom' breaks cost(), 'tensor' makes predict()
    return what JSON cannot hold."""

    name = "fragile"
    max_batch = 4
    max_batch_cost = 100
    max_items_per_request = 16

    def cost(self, item):
        if item == "boom":
            raise KeyError("boom")
        return 1

    def predict(self, items):
        if "tensor" in items:
            self.calls.append(len(items))
            return [torch.zeros(1)] * len(items)
        return super().predict(items)


class NoPredict(Workload):
    name = "nopredict"

    def decode_request(self, body):
        return [body]


class Unlucky(Summer):
    """predict() raises on any batch holding the item [13, 13, 13, 13]."""

    name = "unlucky"

    def predict(self, items):
        if [13, 13, 13, 13] in items:
            self.calls.append(len(items))
            raise RuntimeError("unlucky 13")
        return super().predict(items)


class Slow(Summer):
    """``delay_s`` (0.3 s) per predict() call, 4 items a call."""

    name = "slow"
    max_batch = 4
    delay_s = 0.3

    def predict(self, items):
        import time

        time.sleep(self.delay_s)
        return super().predict(items)


class ExitInSetup(Summer):
    name = "exitinsetup"

    def setup(self, device):
        raise SystemExit(5)


class BadStats(Summer):
    """Keeps a number where its stats should hold StageStats."""

    name = "badstats"

    def setup(self, device):
        self.stats = {"x": 5}


class NeedsArgs(Summer):
    name = "needsargs"

    def __init__(self, scale):  # --workload builds a class with no arguments
        super().__init__()


class Chatty(Summer):
    """Prints from its own code, as a user's workload may (debugging)."""

    name = "chatty"

    def setup(self, device):
        print("setting up")
        super().setup(device)

    def predict(self, items):
        print("predicting", len(items))
        return super().predict(items)


class DiesOnNine(Summer):
    """One item a call; the process ends at once (``os._exit(7)``) on an item whose first number is 9."""

    name = "dies"
    max_batch = 1

    def predict(self, items):
        import os

        if items[0][0] == 9:
            os._exit(7)
        return super().predict(items)
