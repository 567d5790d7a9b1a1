"""Every environment variable fullthrottle reads, with its meaning: the one place they are declared.

Read them through :func:`get`, which refuses a name not declared here. NVIDIA's and the libraries'
own variables (``CUDA_MPS_PIPE_DIRECTORY``, ``TRITON_INTERPRET``, ``OMP_NUM_THREADS``, ...) keep the
meaning their owners give them and are not listed.
"""

from __future__ import annotations

import os
from dataclasses import dataclass


@dataclass(frozen=True)
class Var:
    name: str
    default: str
    meaning: str
    #: the values it takes, described (checked by :func:`check`); "" leaves it unchecked here (its
    #: reader checks it, or any text goes)
    form: str = ""


#: the checks of :attr:`Var.form`: a value is valid when the check returns True ("" is always valid: unset)
_FORMS = {
    "0 or 1": lambda v: v in ("0", "1"),
    "mapped": lambda v: v == "mapped",
    "an integer >= 0": lambda v: v.isdigit(),
    "WARPS,PER,SUB: three positive integers": lambda v: (
        len(v.split(",")) == 3 and all(p.strip().isdigit() and int(p) > 0 for p in v.split(","))
    ),
}


API_KEY = "FULLTHROTTLE_API_KEY"
EMBED_MODEL = "FULLTHROTTLE_EMBED_MODEL"
LLM_MODEL = "FULLTHROTTLE_LLM_MODEL"
TRITON = "FULLTHROTTLE_TRITON"
POOL_GATHER = "FULLTHROTTLE_POOL_GATHER"
NVIMGCODEC_THREADS = "FULLTHROTTLE_NVIMGCODEC_THREADS"
NVIMGCODEC_BACKENDS = "FULLTHROTTLE_NVIMGCODEC_BACKENDS"
WORKER_STATS = "FULLTHROTTLE_WORKER_STATS"
CPU_JPEG_WORKERS = "FULLTHROTTLE_CPU_JPEG_WORKERS"
PAGED_ATTENTION = "FULLTHROTTLE_PAGED_ATTENTION"

VARS: dict[str, Var] = {
    v.name: v
    for v in (
        Var(
            API_KEY,
            "",
            "serve: API keys, comma-separated (as --api-key); every route but /healthz then "
            "needs Authorization: Bearer KEY",
        ),
        Var(
            EMBED_MODEL,
            "",
            "the sentence-transformers folder fullthrottle embed and serve --embed-model "
            "default load (empty: the bundled all-MiniLM-L6-v2)",
        ),
        Var(
            LLM_MODEL,
            "",
            "the Llama folder the completions workload (fullthrottle.workloads.llm.api:Completions) loads "
            "when none is given",
        ),
        Var(TRITON, "1", "0: no Triton kernels (the plain-PyTorch references run instead), for comparisons", "0 or 1"),
        Var(
            POOL_GATHER,
            "",
            "mapped: the compute stage gathers a batch's crops from the pinned pool in place "
            "(zero-copy over PCIe) instead of copying them to the device first",
            "mapped",
        ),
        Var(
            NVIMGCODEC_THREADS,
            "0",
            "--gpu-decoder hardware: nvImageCodec's CPU threads per decoder (0: one per core)",
            "an integer >= 0",
        ),
        Var(
            NVIMGCODEC_BACKENDS,
            "",
            "--gpu-decoder hardware: nvImageCodec backends and load hints, e.g. "
            "hw:0.7+hybrid (empty: the hardware engines alone)",
        ),
        Var(
            CPU_JPEG_WORKERS,
            "",
            "with GPU decoder processes: how many CPU decoder processes JPEGs may keep busy (empty: "
            "the cores left by the GPU decoder processes and the main process, at least 1; 0: none), for trials",
            "an integer >= 0",
        ),
        Var(
            PAGED_ATTENTION,
            "",
            "LLM decode steps over paged KV memory: WARPS,PER,SUB of the attention kernel "
            "(kernels.paged_decode_attention; empty: its defaults), for trials",
            "WARPS,PER,SUB: three positive integers",
        ),
        Var(
            WORKER_STATS,
            "",
            "a path prefix: each CPU decoder process writes where its time went to "
            "PREFIX.PID.json when it exits (benchmarks)",
        ),
    )
}


def get(name: str) -> str:
    """The value of the declared variable ``name``, or its default when unset.

    Raises:
        KeyError: ``name`` is not declared in :data:`VARS`.
    """
    return os.environ.get(name, VARS[name].default)


def check(*names: str) -> None:
    """The declared variables ``names`` (none: every one) that are set, checked against their
    :attr:`Var.form` (the CLI checks them all at start, each reader its own: a mistyped value is one
    clear line, not a setting silently taken as another).

    Raises:
        ValueError: the first variable whose value does not fit, named with the values it takes."""
    for v in [VARS[n] for n in names] if names else VARS.values():
        given = os.environ.get(v.name, "")
        if v.form and given and not _FORMS[v.form](given):
            raise ValueError(f"{v.name} must be {v.form} (or unset), got {given!r}")


def describe() -> str:
    """One line per variable: its name and meaning (for ``--help``)."""
    import textwrap

    return "\n".join(
        textwrap.fill(f"{v.name}: {v.meaning}", 100, initial_indent="  ", subsequent_indent="      ")
        for v in VARS.values()
    )
