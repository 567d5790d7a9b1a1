"""Inference rewrites of a model, done once before capture: BatchNorm folded into the convolution
before it, then each conv -> ReLU and conv -> residual add -> ReLU as one cuDNN call (the bias, the
add and the clamp in the convolution's epilogue). The standard rewrites that TensorRT and ONNX
Runtime also do (``torch.fx.experimental.optimization.fuse``; ``torch.cudnn_convolution_relu`` and
``torch.cudnn_convolution_add_relu``)."""

from __future__ import annotations

import copy

import torch
import torch.nn.functional as F
from torch import nn


def fold_batchnorm(model: nn.Module) -> tuple[nn.Module, bool]:
    """Fold eval-mode ``BatchNorm2d`` layers into the preceding ``Conv2d`` (weights rescaled, bias added).

    Returns ``(model, folded)``: a ``torch.fx`` GraphModule computing the same function (fp32 within
    ~1e-6 relative) with fewer kernels, and True; or the model itself and False when it has no
    BatchNorm or ``torch.fx`` cannot trace it (data-dependent control flow): never an error.
    """
    if not any(isinstance(m, nn.BatchNorm2d) for m in model.modules()):
        return model, False
    try:
        from torch.fx.experimental.optimization import fuse

        # on a float32 copy: the caller's model is untouched, and the rescaled weights are
        # computed in fp32 before the cast to the compute dtype
        fused = fuse(copy.deepcopy(model).eval().float(), inplace=True)
    except Exception:  # noqa: BLE001 - an untraceable model simply runs as it is
        return model, False
    folded = sum(isinstance(m, nn.BatchNorm2d) for m in fused.modules()) < sum(
        isinstance(m, nn.BatchNorm2d) for m in model.modules()
    )
    return (fused, True) if folded else (model, False)


def conv_relu(x, weight, bias, stride, padding, dilation, groups):
    """``relu(conv2d(x))`` as one cuDNN call on CUDA (``torch.cudnn_convolution_relu``: the
    convolution's epilogue adds the bias and clamps), plain PyTorch elsewhere. Shapes as ``F.conv2d``."""
    if x.is_cuda:
        return torch.cudnn_convolution_relu(x, weight, bias, stride, padding, dilation, groups)
    return F.relu(F.conv2d(x, weight, bias, stride, padding, dilation, groups))


def _conv2d_out_shape(x, weight, stride, padding, dilation) -> tuple[int, ...]:
    """``(N, C_out, H_out, W_out)`` of ``F.conv2d`` (PyTorch's Conv2d output-size formula)."""
    hw = [
        (x.shape[2 + i] + 2 * padding[i] - dilation[i] * (weight.shape[2 + i] - 1) - 1) // stride[i] + 1
        for i in range(2)
    ]
    return (x.shape[0], weight.shape[0], *hw)


def conv_add_relu(x, weight, z, bias, stride, padding, dilation, groups):
    """``relu(conv2d(x) + z)`` (a residual block's tail) as one cuDNN call on CUDA
    (``torch.cudnn_convolution_add_relu``) when ``z`` is a tensor of the conv output's exact shape and
    dtype; plain PyTorch otherwise (a broadcast ``z``, CPU)."""
    if (
        x.is_cuda
        and isinstance(z, torch.Tensor)
        and z.dtype == x.dtype
        and tuple(z.shape) == _conv2d_out_shape(x, weight, stride, padding, dilation)
    ):
        return torch.cudnn_convolution_add_relu(x, weight, z, 1.0, bias, stride, padding, dilation, groups)
    return F.relu(F.conv2d(x, weight, bias, stride, padding, dilation, groups) + z)


def fuse_conv_relu(gm: torch.fx.GraphModule) -> int:
    """Rewrite ``conv -> relu`` and ``conv -> add(.., z) -> relu`` in a traced model (after
    :func:`fold_batchnorm`) into :func:`conv_relu` / :func:`conv_add_relu`, in place.

    Only plain ``nn.Conv2d`` modules (zero padding given as integers, no hooks, no
    parametrizations) called with a positional input, whose output feeds nothing else, are fused; and
    only when nothing between the convolution and the ReLU may change a tensor in place (the fused
    call runs where the ReLU was). Returns the number of rewrites (0: nothing matched).
    """
    import operator

    from torch.nn.utils import parametrize

    mods = dict(gm.named_modules())
    g = gm.graph
    inplace_ops = {
        "iadd",
        "isub",
        "imul",
        "itruediv",
        "ifloordiv",
        "imod",
        "ipow",
        "iand",
        "ior",
        "ixor",
        "ilshift",
        "irshift",
        "imatmul",
        "setitem",
    }

    def conv_of(n):
        if (
            n.op == "call_module"
            and type(mods.get(n.target)) is nn.Conv2d
            and len(n.users) == 1
            and len(n.args) == 1
            and not n.kwargs
        ):
            c = mods[n.target]
            if (
                c.padding_mode == "zeros"
                and not isinstance(c.padding, str)
                and not parametrize.is_parametrized(c)
                and not (c._forward_hooks or c._forward_pre_hooks)
            ):
                return c
        return None

    def is_relu(n):
        return (
            len(n.args) == 1
            and not n.kwargs.get("input")
            and (
                (n.op == "call_module" and isinstance(mods.get(n.target), nn.ReLU))
                or (n.op == "call_function" and n.target in (F.relu, torch.relu))
            )
        )

    def may_mutate(n):
        if n.op == "call_module":
            return bool(getattr(mods.get(n.target), "inplace", False)) or not isinstance(
                mods.get(n.target),
                (
                    nn.Conv2d,
                    nn.ReLU,
                    nn.MaxPool2d,
                    nn.AvgPool2d,
                    nn.AdaptiveAvgPool2d,
                    nn.BatchNorm2d,
                    nn.Identity,
                    nn.Linear,
                    nn.Flatten,
                ),
            )
        if n.op in ("call_function", "call_method"):
            name = n.target if isinstance(n.target, str) else getattr(n.target, "__name__", "")
            return name.endswith("_") or bool(n.kwargs.get("inplace")) or name in inplace_ops
        return False

    count = 0
    for relu in list(g.nodes):
        if not is_relu(relu):
            continue
        src = relu.args[0]
        z = None
        if not isinstance(src, torch.fx.Node):
            continue
        if (
            src.op == "call_function"
            and src.target in (operator.add, torch.add)
            and len(src.users) == 1
            and len(src.args) == 2
            and not src.kwargs
        ):
            for a, b in (src.args, src.args[::-1]):  # the conv on either side; z another node
                if (
                    isinstance(a, torch.fx.Node)
                    and isinstance(b, torch.fx.Node)
                    and a is not b
                    and conv_of(a) is not None
                ):
                    add, src, z = src, a, b
                    break
            else:
                continue
        conv = conv_of(src)
        if conv is None:
            continue
        between, seen = [], False
        for n in g.nodes:  # the nodes run between the conv and the ReLU
            if n is relu:
                break
            if seen:
                between.append(n)
            seen = seen or n is src
        if any(may_mutate(n) for n in between):
            continue
        with g.inserting_before(relu):
            w = g.get_attr(f"{src.target}.weight")
            b = g.get_attr(f"{src.target}.bias") if conv.bias is not None else None
            geo = (list(conv.stride), list(conv.padding), list(conv.dilation), conv.groups)
            if z is None:
                new = g.call_function(conv_relu, (src.args[0], w, b, *geo))
            else:
                new = g.call_function(conv_add_relu, (src.args[0], w, z, b, *geo))
        relu.replace_all_uses_with(new)
        g.erase_node(relu)
        if z is not None:
            g.erase_node(add)
        g.erase_node(src)
        count += 1
    if count:
        g.lint()
        gm.delete_all_unused_submodules()
        gm.recompile()
    return count
