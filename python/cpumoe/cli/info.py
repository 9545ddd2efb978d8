"""``cpumoe info``: CPU features, paths, kernels and build of cpumoe."""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import platform
import sys
from typing import Any, Dict

import numpy as np

from . import problem


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="cpumoe info",
                                description="CPU features, paths, kernels and build of cpumoe.")
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    return p


def info_dict() -> Dict[str, Any]:
    """What ``cpumoe info`` prints, as a dict."""
    import cpumoe
    from .. import _C

    cap = _C.env_isa_cap()
    try:
        selected = cpumoe.selected_path()
        selected_kernel = _C.select_kernel(None)
    except ValueError as e:  # a bad CPUMOE_ISA
        selected, selected_kernel = f"error: {e}", None
    kernels = cpumoe.kernels()
    for k in kernels:
        k["selected"] = k["name"] == selected_kernel
    build: Dict[str, Any] = {
        "target_arch": _C.target_arch(),
        "isa_ladder": _C.isa_ladder(),
        "paths_compiled": list(dict.fromkeys(k["isa"] for k in kernels)),
        "extension": getattr(_C, "__file__", None),
    }
    if hasattr(_C, "build_info"):  # newer extensions report their compile-time settings
        build.update(dict(_C.build_info()))
    versions = {"python": platform.python_version(), "numpy": np.__version__}
    for dist in ("torch", "ml_dtypes", "safetensors", "tqdm", "matplotlib"):
        try:  # the installed version, without importing the package
            versions[dist] = importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            versions[dist] = None
    return {
        "cpumoe": cpumoe.__version__,
        "cpu": {"machine": platform.machine(), "features": cpumoe.cpu_features()},
        "paths": {"available": cpumoe.available_paths(), "selected": selected,
                  "CPUMOE_ISA": cap},
        "kernels": kernels,
        "build": build,
        "threads_default": problem.default_threads(None),
        "versions": versions,
    }


def run(args: argparse.Namespace) -> int:
    d = info_dict()
    if args.json:
        print(json.dumps(d, indent=1))
        return 0
    out = sys.stdout
    f = d["cpu"]["features"]
    print(f"cpumoe {d['cpumoe']}", file=out)
    print(f"cpu        {d['cpu']['machine']}; features used by cpumoe: "
          f"{' '.join(k for k, v in f.items() if v is True) or '(none)'}", file=out)
    off = [k for k, v in f.items() if v is False]
    print(f"           absent: {' '.join(off) or '(none)'}", file=out)
    p = d["paths"]
    print(f"paths      available: {', '.join(p['available'])}; selected: {p['selected']}"
          f"{'; capped by CPUMOE_ISA=' + p['CPUMOE_ISA'] if p['CPUMOE_ISA'] else ''}", file=out)
    print(f"           ladder (best first): {' > '.join(d['build']['isa_ladder'])}", file=out)
    print("kernels    (compiled in, best first)", file=out)
    print(f"  {'name':<44} {'path':<12} {'mr':>3} {'nr':>3} {'kr':>3}  runs here  selected",
          file=out)
    for k in d["kernels"]:
        print(f"  {k['name']:<44} {k['isa']:<12} {k['mr']:>3} {k['nr']:>3} {k['kr']:>3}  "
              f"{'yes' if k['supported'] else 'no':<9}  {'*' if k['selected'] else ''}", file=out)
    b = d["build"]
    print(f"build      target {b['target_arch']}; paths compiled: "
          f"{', '.join(b['paths_compiled'])}", file=out)
    for key, value in b.items():
        if key not in ("target_arch", "isa_ladder", "paths_compiled", "extension"):
            print(f"           {key}: {value}", file=out)
    print(f"           extension {b['extension']}", file=out)
    v = d["versions"]
    print("versions   " + ", ".join(f"{k} {val or '(not installed)'}" for k, val in v.items()),
          file=out)
    print(f"threads    {d['threads_default']} by default (OMP_NUM_THREADS or the CPUs this "
          f"process may use)", file=out)
    return 0
