"""``python -m cpumoe`` / ``cpumoe``: check, time and describe the fused W8A8 MoE op on this CPU.

Subcommands:

- ``cpumoe check``: correctness of every path this CPU runs against cpumoe.reference: a matrix
  of small cases (dtypes x activations x bias, expert_map, skip_weighted, int64 ids, strided
  rows, T = 0), a layer in each other weight format of ``cpumoe.formats()`` on every path of
  its kernel family, then the preset layer; exit code 1 on a failure.
- ``cpumoe bench`` (cpumoe/cli/bench/): times preset layers for each path and T, and side by side
  cpumoe's bf16 op and vLLM's CPU kernels (``--contenders``), cold and warm weights, against a
  read-bandwidth probe (tqdm progress bar, tables and ratios on stdout, ``--json out.json``,
  ``--plot out.png`` with matplotlib, ``--targets`` for issue 4's matrix and verdicts).
- ``cpumoe info``: CPU features, paths, kernels, build (``--json`` for a machine-readable form).
- ``cpumoe accuracy``: relative error of each weight format's layer (at group sizes 32 / 64 /
  128) against the fp32 layer, on real-looking weights (cpumoe/cli/accuracy.py).

With no subcommand (the original command line, all its flags kept) it runs the Qwen3-30B-A3B MoE
layer (H=2048, I=768, E=128, top-8, silu) with random int8 experts at T = 1, 16, 128: each result
on every path against the reference, then a short timing table of the selected path.
"""

from __future__ import annotations

import importlib
import sys
from typing import List, Optional

SUBCOMMANDS = ("check", "bench", "info", "accuracy")  # modules of this package; without one: run


def main(argv: Optional[List[str]] = None) -> int:
    """The ``cpumoe`` command on ``argv`` (default: sys.argv[1:]); returns the exit code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    name = argv.pop(0) if argv and argv[0] in SUBCOMMANDS else "run"
    command = importlib.import_module(f"{__name__}.{name}")  # each: parser() and run(args)
    return command.run(command.parser().parse_args(argv))
