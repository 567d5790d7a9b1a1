"""Rules of the codebase that a test can hold: environment variables declared once, no import circles."""

import ast
import re
from pathlib import Path

import pytest

import fullthrottle
from fullthrottle.core import env

SRC = Path(fullthrottle.__file__).parent


def parse(p: Path) -> ast.Module:
    """``p``'s syntax tree. CPython 3.11 keeps the AST constructor's recursion count in state that all
    threads share (python/cpython#106905): another thread compiling at the same moment (a server a test
    left stopping, a Jinja2 template) makes ``ast.parse`` raise a spurious SystemError; it is parsed again."""
    for _ in range(4):
        try:
            return ast.parse(p.read_text())
        except SystemError as e:
            if "recursion depth mismatch" not in str(e):
                raise
    return ast.parse(p.read_text())


def test_every_environment_variable_is_declared_once(monkeypatch):
    """fullthrottle.core.env declares every FULLTHROTTLE_* variable the package names; get() refuses others."""
    import re

    named = {m for p in SRC.rglob("*.py") for m in re.findall(r"FULLTHROTTLE_[A-Z_]+", p.read_text())}
    assert named == set(env.VARS), named ^ set(env.VARS)
    monkeypatch.delenv(env.TRITON, raising=False)
    assert env.get(env.TRITON) == "1"  # its default
    monkeypatch.setenv(env.TRITON, "0")
    assert env.get(env.TRITON) == "0"
    with pytest.raises(KeyError):
        env.get("FULLTHROTTLE_NOT_DECLARED")
    assert all(name in env.describe() for name in env.VARS)


def test_a_mistyped_environment_variable_is_one_line_before_anything_runs(monkeypatch, capsys):
    """A declared variable with a form (env.Var.form) refuses other values: the CLI says so in one line
    and exits 2 before starting (a mistyped FULLTHROTTLE_TRITON ran as 1, silently)."""
    from fullthrottle.cli import main

    for name, good in ((env.TRITON, "0"), (env.POOL_GATHER, "mapped"), (env.CPU_JPEG_WORKERS, "0")):
        monkeypatch.setenv(name, good)
        env.check()
    for name, bad, form in (
        (env.TRITON, "banana", "0 or 1"),
        (env.POOL_GATHER, "Mapped", "mapped"),
        (env.CPU_JPEG_WORKERS, "-3", "an integer >= 0"),
        (env.NVIMGCODEC_THREADS, "two", "an integer >= 0"),
        (env.PAGED_ATTENTION, "1,2", "WARPS,PER,SUB: three positive integers"),
    ):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=re.escape(f"{name} must be {form} (or unset), got {bad!r}")):
            env.check()
        assert main(["classify", "no-such-file.jpg", "--device", "cpu"]) == 2
        err = capsys.readouterr().err
        assert err == f"fullthrottle: error: {name} must be {form} (or unset), got {bad!r}\n", err
        monkeypatch.delenv(name)
    env.check()


def test_no_import_circles():
    """No module of the package imports, at its top or inside a function, one that leads back to it."""

    def module_of(p):
        parts = p.relative_to(SRC).with_suffix("").parts
        return ".".join(["fullthrottle", *(parts[:-1] if parts[-1] == "__init__" else parts)])

    files = {module_of(p): p for p in SRC.rglob("*.py")}
    deps = {}
    for name, p in files.items():
        pkg = name if p.name == "__init__.py" else name.rsplit(".", 1)[0]
        mods = set()
        for node in ast.walk(parse(p)):
            if isinstance(node, ast.ImportFrom) and node.level:
                base = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
                targets = [f"{base}.{node.module}"] if node.module else []
                targets += [f"{base}.{node.module}.{a.name}" if node.module else f"{base}.{a.name}" for a in node.names]
                mods |= {t for t in targets if t in files and t != name and not name.startswith(t + ".")}
        deps[name] = mods
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


def test_imports_go_down_the_layers():
    """Front ends (cli, server, ray_jobs) -> workloads -> data plane -> core, never back up; the one
    exception: Config asks the model registry for a model's input transform (and checks its own against
    the Transform type beside it). Type-only imports
    (under ``if TYPE_CHECKING:``) do not count."""
    rank = {"core": 0, "data": 1, "workloads": 2, "server": 3, "cli": 3, "ray_jobs": 3}
    allowed = {("core/config.py", "workloads.classify.models"), ("core/config.py", "workloads.classify.transform")}
    upward = []
    for p in SRC.rglob("*.py"):
        rel = p.relative_to(SRC)
        layer, pkg = rel.parts[0].removesuffix(".py"), list(rel.parts[:-1])
        tree = parse(p)
        typing_only = {
            id(n)
            for node in ast.walk(tree)
            if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING"
            for n in ast.walk(node)
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level and id(node) not in typing_only:
                base = pkg[: len(pkg) - (node.level - 1)]
                target = ".".join(base + (node.module.split(".") if node.module else [node.names[0].name]))
                top = target.split(".")[0]
                if rank.get(top, -1) > rank.get(layer, 9) and (str(rel), target) not in allowed:
                    upward.append(f"{rel}:{node.lineno} imports {target}")
    assert not upward, upward


def _missing_names(files, module_of) -> list[str]:
    """``path:line: module.name`` for each ``from module import name`` in ``files`` that names no
    attribute or submodule; ``module_of(path, node)`` gives the absolute module of an ImportFrom
    node, or None to skip it."""
    import importlib

    missing = []
    for p in files:
        for node in ast.walk(parse(p)):
            target = module_of(p, node) if isinstance(node, ast.ImportFrom) else None
            if target is None:
                continue
            mod = importlib.import_module(target)
            for a in node.names:
                if not hasattr(mod, a.name):
                    try:
                        importlib.import_module(f"{target}.{a.name}")
                    except ImportError:
                        missing.append(f"{p}:{node.lineno}: {target}.{a.name}")
    return missing


def test_every_relative_import_names_what_exists():
    """Every ``from .x import y`` in the package, at a module's top or inside a function (the GPU-only
    paths import lazily, and CI has no GPU to run them), names a module and attributes that exist."""

    def module_of(p, node):
        if not node.level:
            return None
        pkg = "fullthrottle" + "".join("." + part for part in p.parent.relative_to(SRC).parts)
        base = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
        return f"{base}.{node.module}" if node.module else base

    missing = _missing_names(sorted(SRC.rglob("*.py")), module_of)
    assert not missing, missing


def test_every_import_of_the_package_in_tests_and_bench_names_what_exists():
    """``from fullthrottle.x import y`` in the tests and benchmarks (the GPU tests and probes do not run
    in CI) names a module and attributes that exist."""
    root = SRC.parent.parent
    files = sorted([*(root / "tests").glob("*.py"), *(root / "bench").rglob("*.py")])
    missing = _missing_names(
        files, lambda p, n: n.module if not n.level and (n.module or "").startswith("fullthrottle") else None
    )
    assert not missing, missing


def test_every_attribute_of_a_package_module_the_tests_and_bench_name_exists():
    """``import fullthrottle.x as m`` then ``m.name`` (a monkeypatch target, say) in the tests and
    benchmarks: each name exists in that module (a function moved to another module would otherwise
    leave the patch, or the probe, pointing at nothing)."""
    import importlib

    root = SRC.parent.parent
    missing = []
    for p in sorted([*(root / "tests").glob("*.py"), *(root / "bench").rglob("*.py")]):
        tree = parse(p)
        aliases = {
            a.asname: a.name
            for n in ast.walk(tree)
            if isinstance(n, ast.Import)
            for a in n.names
            if a.asname and a.name.startswith("fullthrottle.")
        }
        for n in ast.walk(tree):
            named = None  # (alias, attribute): m.name, or setattr(m, "name", ...) as monkeypatch does
            if isinstance(n, ast.Attribute) and isinstance(n.value, ast.Name):
                named = n.value.id, n.attr
            elif (
                isinstance(n, ast.Call)
                and isinstance(n.func, ast.Attribute)
                and n.func.attr == "setattr"
                and len(n.args) >= 2
                and isinstance(n.args[0], ast.Name)
                and isinstance(n.args[1], ast.Constant)
            ):
                named = n.args[0].id, n.args[1].value
            if named and named[0] in aliases and not hasattr(importlib.import_module(aliases[named[0]]), named[1]):
                missing.append(f"{p.relative_to(root)}:{n.lineno}: {aliases[named[0]]}.{named[1]}")
    assert not missing, missing


def test_every_worker_command_names_a_function_that_exists():
    """The decoder processes start from a ``python -c`` line naming a module and its main (the GPU
    decoder process's never runs in CI): both exist."""
    import importlib
    import re

    from fullthrottle.data import gpu_decode_procs, preprocess_procs

    for line in (preprocess_procs._WORKER_CMD, gpu_decode_procs._CMD):
        module, main = re.search(r"from (fullthrottle\.[\w.]+) import (\w+)", line).groups()
        assert callable(getattr(importlib.import_module(module), main)), line
