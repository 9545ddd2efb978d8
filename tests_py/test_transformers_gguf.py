"""cpumoe.transformers.load_gguf: a transformers model of a GGUF file, its experts packed from
the stored blocks. The files are written with ``gguf.GGUFWriter`` from a tiny random Qwen3-MoE
(llama.cpp's tensor names from ``gguf.get_tensor_name_map``, the experts quantized by
``gguf.quants``); the reference is that model with its experts set to ``gguf.quants.dequantize``
of the same blocks. Needs the torch backend, transformers and gguf (skipped otherwise)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from conftest import BACKEND_NAME

if BACKEND_NAME != "torch":
    pytest.skip("the transformers backends need the torch backend", allow_module_level=True)
pytest.importorskip("transformers")
gguf = pytest.importorskip("gguf")

import torch  # noqa: E402

import cpumoe.transformers as cmt  # noqa: E402
from cpumoe.checkpoint import UnsupportedCheckpoint  # noqa: E402
from test_transformers import TOL, VOCAB, _model, _rel  # noqa: E402

Q = gguf.GGMLQuantizationType
_EXPERTS = re.compile(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up_proj|down_proj)")


def _save_gguf(model, path, qtypes):
    """Writes ``model`` (a Qwen3-MoE) as a GGUF file of architecture qwen3moe: its config as
    metadata, every tensor but the experts F32, layer L's experts (ffn_{gate,up,down}_exps)
    quantized to ``qtypes[L]``. Sets the model's experts to the blocks' dequantization (the
    reference) and returns the path."""
    cfg = model.config
    L = cfg.num_hidden_layers
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3MOE, L)
    w = gguf.GGUFWriter(str(path), "qwen3moe")
    w.add_block_count(L)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_expert_feed_forward_length(cfg.moe_intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(cfg.head_dim)
    w.add_value_length(cfg.head_dim)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_freq_base(float(cfg.rope_parameters["rope_theta"]))
    w.add_expert_count(cfg.num_experts)
    w.add_expert_used_count(cfg.num_experts_per_tok)
    w.add_vocab_size(cfg.vocab_size)
    with torch.no_grad():
        for key, t in model.state_dict().items():
            a = t.detach().float().numpy()
            m = _EXPERTS.fullmatch(key)
            if m is None:
                w.add_tensor(names.get_name(key, try_suffixes=(".weight", ".bias")), a)
                continue
            layer, qt = int(m[1]), qtypes[int(m[1])]
            if m[2] == "gate_up_proj":
                i = a.shape[1] // 2
                parts = (("ffn_gate_exps", 0, a[:, :i]), ("ffn_up_exps", i, a[:, i:]))
            else:
                parts = (("ffn_down_exps", 0, a),)
            for gname, row0, arr in parts:
                raw = gguf.quants.quantize(np.ascontiguousarray(arr), qt)
                w.add_tensor(f"blk.{layer}.{gname}.weight", raw, raw_dtype=qt)
                deq = torch.from_numpy(gguf.quants.dequantize(raw, qt)).reshape(arr.shape)
                t[:, row0:row0 + arr.shape[1]] = deq
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("qtypes, fmt", [((Q.Q4_0, Q.Q4_0), "int4"),
                                         ((Q.Q4_1, Q.Q4_1), "int4_affine"),
                                         ((Q.Q4_0, Q.Q4_1), "int4_affine"),
                                         ((Q.MXFP4, Q.MXFP4), "mxfp4"),
                                         ((Q.Q8_0, Q.Q8_0), "int8_affine"),
                                         ((Q.Q4_1, Q.Q5_0), "int8_affine")])
def test_load_gguf_runs_the_stored_experts(tmp_path, qtypes, fmt):
    """The experts packed from the file's blocks on the backend of their format (Q4_0 beside
    Q4_1 layers: all int4_affine; Q4_1 beside Q5_0: all int8_affine), the rest exactly the
    model's (F32 in the file); the logits are the reference's but for the int8 activations; the
    model generates."""
    eager = _model("qwen3_moe", num_hidden_layers=2)
    path = _save_gguf(eager, tmp_path / "tiny.gguf", qtypes)
    model = cmt.load_gguf(path, dtype=torch.float32)
    assert model.config._experts_implementation == f"cpumoe_{fmt}"
    assert model.config.moe_intermediate_size == eager.config.moe_intermediate_size
    mods = cmt.experts_modules(model)
    assert len(mods) == 2
    for _, m in mods:
        assert set(m._cpumoe_state) == {fmt} and m.gate_up_proj.numel() == 0
        assert m._cpumoe_state[fmt].packed.weight_format == fmt
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        ours = getattr(model.model.layers[1].self_attn, name).weight
        assert torch.equal(ours, getattr(eager.model.layers[1].self_attn, name).weight), name
    assert torch.equal(model.lm_head.weight, eager.lm_head.weight)
    assert torch.equal(model.model.layers[0].mlp.gate.weight, eager.model.layers[0].mlp.gate.weight)
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        err = _rel(model(ids).logits, eager(ids).logits)
        seq = model.generate(ids[:1, :6], max_new_tokens=4, min_new_tokens=4, do_sample=False,
                             pad_token_id=0)
    assert err <= TOL["cpumoe"], err  # only the int8 activations differ
    assert seq.shape == (1, 10)
    bf16 = cmt.load_gguf(path)  # the default dtype
    assert bf16.model.layers[0].self_attn.q_proj.weight.dtype == torch.bfloat16


def test_load_gguf_requantizes_on_request(tmp_path):
    """F16 experts (no cpumoe format holds them): refused by default; with
    requantize="int8_affine" packed as 8-bit groups of 32 of gguf's weights, the logits within
    the int8 tolerance of the model on the file's weights."""
    eager = _model("qwen3_moe", num_hidden_layers=2)
    path = _save_gguf(eager, tmp_path / "f16.gguf", (Q.F16, Q.Q4_0))
    with pytest.raises(UnsupportedCheckpoint, match="F16.*requantize='int8_affine'"):
        cmt.load_gguf(path)
    model = cmt.load_gguf(path, dtype=torch.float32, requantize="int8_affine")
    assert model.config._experts_implementation == "cpumoe_int8_affine"
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        err = _rel(model(ids).logits, eager(ids).logits)
    assert err <= TOL["cpumoe"], err


def test_load_gguf_refuses_what_it_cannot_run(tmp_path):
    eager = _model("qwen3_moe", num_hidden_layers=2)
    # F16 experts: no cpumoe format holds them; named with the tensor.
    path = _save_gguf(eager, tmp_path / "f16.gguf", (Q.F16, Q.F16))
    with pytest.raises(UnsupportedCheckpoint, match=r"blk\.0\.ffn_gate_exps\.weight.*F16"):
        cmt.load_gguf(path)
    # MXFP4 beside Q4_0: no one backend runs both.
    path = _save_gguf(eager, tmp_path / "mixed.gguf", (Q.Q4_0, Q.MXFP4))
    with pytest.raises(UnsupportedCheckpoint, match=r"formats \['int4', 'mxfp4'\]"):
        cmt.load_gguf(path)
    # Not a GGUF file: named, with the loaders that read the others.
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "config.json").write_text("{}")
    with pytest.raises(UnsupportedCheckpoint, match="folder: not a GGUF file.*load_quantized"):
        cmt.load_gguf(tmp_path / "folder")
    with pytest.raises(FileNotFoundError):
        cmt.load_gguf(tmp_path / "absent.gguf")
