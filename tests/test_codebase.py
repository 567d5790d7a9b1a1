"""Rules of the codebase that a test can hold: environment variables declared once, no import circles."""

import ast
from pathlib import Path

import pytest

from fullthrottle import env

SRC = Path(env.__file__).parent


def test_every_environment_variable_is_declared_once(monkeypatch):
    """fullthrottle.env declares every FULLTHROTTLE_* variable the package names; get() refuses others."""
    import re

    named = {m for p in SRC.glob("*.py") for m in re.findall(r"FULLTHROTTLE_[A-Z_]+", p.read_text())}
    assert named == set(env.VARS), named ^ set(env.VARS)
    monkeypatch.delenv(env.TRITON, raising=False)
    assert env.get(env.TRITON) == "1"  # its default
    monkeypatch.setenv(env.TRITON, "0")
    assert env.get(env.TRITON) == "0"
    with pytest.raises(KeyError):
        env.get("FULLTHROTTLE_NOT_DECLARED")
    assert all(name in env.describe() for name in env.VARS)


def test_no_import_circles():
    """No module of the package imports, at its top or inside a function, one that leads back to it."""
    deps = {}
    for p in SRC.glob("*.py"):
        mods = set()
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and node.level == 1:
                mods |= {node.module.split(".")[0]} if node.module else {a.name for a in node.names}
        deps[p.stem] = mods
    circles = []

    def walk(start, node, path):
        for d in sorted(deps.get(node, ())):
            if d == start:
                circles.append(path + [d])
            elif d not in path:
                walk(start, d, path + [d])

    for m in sorted(deps):
        walk(m, m, [m])
    assert not circles, circles[:5]


def test_every_relative_import_names_what_exists():
    """Every ``from .x import y`` in the package, at a module's top or inside a function (the GPU-only
    paths import lazily, and CI has no GPU to run them), names a module and attributes that exist."""
    import importlib

    missing = []
    for p in sorted(SRC.rglob("*.py")):
        pkg = "fullthrottle" + "".join("." + part for part in p.parent.relative_to(SRC).parts)
        for node in ast.walk(ast.parse(p.read_text())):
            if not (isinstance(node, ast.ImportFrom) and node.level):
                continue
            base = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
            target = f"{base}.{node.module}" if node.module else base
            mod = importlib.import_module(target)
            for a in node.names:
                if not hasattr(mod, a.name):
                    try:
                        importlib.import_module(f"{target}.{a.name}")
                    except ImportError:
                        missing.append(f"{p.relative_to(SRC)}:{node.lineno}: {target}.{a.name}")
    assert not missing, missing


def test_every_import_of_the_package_in_tests_and_bench_names_what_exists():
    """``from fullthrottle.x import y`` in the tests and benchmarks (the GPU tests and probes do not run
    in CI) names a module and attributes that exist."""
    import importlib

    root = SRC.parent.parent
    missing = []
    for p in sorted([*(root / "tests").glob("*.py"), *(root / "bench").rglob("*.py")]):
        for node in ast.walk(ast.parse(p.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and (node.module or "").startswith("fullthrottle"):
                mod = importlib.import_module(node.module)
                for a in node.names:
                    if not hasattr(mod, a.name):
                        try:
                            importlib.import_module(f"{node.module}.{a.name}")
                        except ImportError:
                            missing.append(f"{p.relative_to(root)}:{node.lineno}: {node.module}.{a.name}")
    assert not missing, missing
