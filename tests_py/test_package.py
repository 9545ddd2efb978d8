"""The package around the extension: its version (one source, CMakeLists.txt's project line) and
the type stub _C.pyi (the names, classes and signatures of the real cpumoe._C)."""

from __future__ import annotations

import ast
import importlib.metadata
import re
from pathlib import Path

import pytest

import cpumoe
from conftest import REPO_ROOT


def test_version_is_the_cmake_project_version():
    text = (REPO_ROOT / "CMakeLists.txt").read_text()
    m = re.search(r"^project\(cpumoe\s+VERSION\s+([0-9][0-9.]*)", text, re.M)
    assert m, "no project(cpumoe VERSION x.y.z) line"
    assert cpumoe.__version__ == m.group(1)


def test_installed_metadata_has_the_same_version():
    try:
        dist = importlib.metadata.distribution("cpumoe")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("cpumoe is not installed (a package staged from a build directory)")
    here = Path(cpumoe.__file__).resolve()
    if Path(dist.locate_file("cpumoe/__init__.py")).resolve() != here:
        pytest.skip("the installed cpumoe is not the one under test")
    assert dist.version == cpumoe.__version__


def _runtime_params(fn):
    """(names, number with a default) from pybind11's signature line ``name(a: T, b: U = x)``."""
    head = fn.__doc__.splitlines()[0]
    inner = head[head.index("(") + 1:head.rindex(") ->")]
    names = re.findall(r"(?:^|, )(\w+): ", inner)
    return names, len(re.findall(r" = ", inner))


def _stub_params(node: ast.FunctionDef):
    a = node.args
    return [p.arg for p in a.posonlyargs + a.args], len(a.defaults), len(a.posonlyargs)


def test_stub_matches_the_module():
    C = cpumoe._C
    tree = ast.parse(Path(cpumoe.__file__).with_name("_C.pyi").read_text())
    defs = {n.name: n for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    assert sorted(defs) == sorted(n for n in dir(C) if not n.startswith("_"))
    for name, node in defs.items():
        obj = getattr(C, name)
        if isinstance(node, ast.ClassDef):
            bases = [b.__name__ for b in obj.__bases__
                     if b is not object and b.__module__ != "pybind11_builtins"]
            assert [ast.unparse(b) for b in node.bases] == bases, name
            props = {f.name for f in node.body if isinstance(f, ast.FunctionDef)}
            assert props == {k for k, v in vars(obj).items() if isinstance(v, property)}, name
            continue
        names, n_defaults = _runtime_params(obj)
        stub_names, stub_defaults, n_posonly = _stub_params(node)
        if all(re.fullmatch(r"arg\d+", n) for n in names):  # no py::arg names: positional only
            assert n_posonly == len(stub_names) == len(names), name
        else:
            assert stub_names == names, name
        assert stub_defaults == n_defaults, name


def test_the_two_packed_classes_are_unrelated_at_run_time():
    # What the stub says (it once declared PackedMoeBf16 a subclass of PackedMoe).
    assert not issubclass(cpumoe._C.PackedMoeBf16, cpumoe._C.PackedMoe)
    assert not issubclass(cpumoe._C.PackedMoe, cpumoe._C.PackedMoeBf16)
