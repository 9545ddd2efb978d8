"""A transformers model of a GGUF file with its experts packed as the file stores them
(:func:`load_gguf`): the experts never exist in float; every other tensor is dequantized by the
``gguf`` package and mapped to the model's names by transformers' own GGUF tables."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Dict, Optional

import numpy as np
import torch

from .. import checkpoint as _ck
from .. import checkpoint_gguf as _ckg
from .checkpoints import _experts_of_checkpoint, fill_model, packed_model

#: The routed experts' tensors (cpumoe.checkpoint_gguf reads them); the rest is dequantized.
_EXPERT_TENSOR = re.compile(r"blk\.\d+\.ffn_(gate|up|down)_exps\.(weight|bias)$")


def load_gguf(path, *, dtype: torch.dtype = torch.bfloat16, model_class: Any = None,
              requantize: Optional[str] = None):
    """The model of the GGUF file ``path`` with every MoE layer's experts packed from the
    file's blocks as :func:`cpumoe.load_experts` reads them (Q4_0 -> int4, Q4_1 / Q4_K ->
    int4_affine, Q8_0 / Q5_0 / Q5_1 / Q5_K -> int8_affine, MXFP4 -> mxfp4, BF16 -> bf16; other
    types refused naming them, or with ``requantize="int8_affine"`` re-quantized to 8-bit groups
    of 32, e.g. the Q6_K down projections of llama.cpp's Q4_K_M files), running on the cpumoe
    backend of that format (W4A8: int8 activations per token; a file whose layers mix these
    integer formats runs them all in the widest, the same weights).

    The config comes from the file's metadata through transformers
    (``AutoConfig.from_pretrained(folder, gguf_file=name)``), with ``moe_intermediate_size``
    taken from the expert tensors (transformers 5.23 leaves Qwen3-MoE's at its default). The
    other tensors (embeddings, attention, norms, router, output) are dequantized with
    ``gguf.quants.dequantize``, passed through transformers' tensor processor of the
    architecture (e.g. llama's q / k permutation undone) and named by its GGUF-to-HF map, then
    stored in ``dtype``. Needs ``gguf`` and transformers' GGUF support for the architecture
    (qwen3moe, qwen2moe, gpt-oss, llama / mixtral, ...).

    Raises UnsupportedCheckpoint for a file that is not GGUF, expert types cpumoe does not run,
    layers whose formats no one backend runs, a model tensor the file lacks or whose shape
    differs; UnsupportedExperts for experts cpumoe cannot take."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import (TENSOR_PROCESSORS, TensorProcessor,
                                                          get_gguf_hf_weights_map)
    gguf = _ckg._gguf()  # a clear ImportError without the package
    p = Path(path)
    if not p.exists():
        raise FileNotFoundError(f"{p}: no such file")
    if not p.is_file() or _magic(p) != b"GGUF":
        raise _ck.UnsupportedCheckpoint(f"{p}: not a GGUF file (load_gguf); "
                                        f"cpumoe.transformers.load_quantized reads GPTQ / AWQ "
                                        f"folders, load_w4a8 / load_w8a8 / load_w8a16 the others")
    reader = _ckg._open(p)
    arch = _ckg._field(reader, "general.architecture")
    config = AutoConfig.from_pretrained(str(p.parent), gguf_file=p.name)
    kind = _expert_format(reader, config, p, requantize)
    model, skip = packed_model(
        config, kind, dtype, model_class,
        lambda layer, lay, name: _experts_of_checkpoint(p, "gguf", layer, lay, name,
                                                        requantize=requantize))
    processor = TENSOR_PROCESSORS.get(arch, TensorProcessor)(config=config.to_dict())
    names = get_gguf_hf_weights_map(model, processor)
    tensors: Dict[str, np.ndarray] = {}
    for t in reader.tensors:
        if _EXPERT_TENSOR.match(t.name):
            continue
        w = gguf.quants.dequantize(t.data, t.tensor_type)
        res = processor.process(weights=w, name=t.name, tensor_key_mapping=names,
                                parsed_parameters={"tensors": {}})
        if res.name is not None and res.name in names:
            tensors[names[res.name]] = np.array(res.weights, dtype=np.float32)  # a copy: the
            # reader maps the file read-only
    return fill_model(model, skip, tensors.get)


def _magic(p: Path) -> bytes:
    with p.open("rb") as f:
        return f.read(4)


def _expert_format(reader, config: Any, path: Path, requantize: Optional[str] = None) -> str:
    """The cpumoe format of the first MoE layer's gate experts (the likely one: the layers read
    decide), after setting ``config.moe_intermediate_size`` from that tensor where the config
    has one."""
    for t in reader.tensors:
        m = re.fullmatch(r"blk\.\d+\.ffn_gate_exps\.weight", t.name)
        if m is None:
            continue
        qtype = _ckg._type_name(t)
        if hasattr(config, "moe_intermediate_size"):
            config.moe_intermediate_size = int(_ckg._np_shape(t)[1])  # [E, I, H]
        fmt = _ckg.GGUF_FORMATS.get(qtype, requantize)
        if fmt is None:
            raise _ckg.GgufUnsupported(f"{path}: {t.name}: GGUF type {qtype}: "
                                       f"{_ckg._why_not(qtype)} (requantize='int8_affine' "
                                       f"reads it re-quantized to 8-bit groups of 32)")
        return fmt
    raise _ck.UnsupportedCheckpoint(f"{path}: no blk.N.ffn_gate_exps.weight tensor: not a MoE "
                                    f"model cpumoe runs (fused experts per layer)")
