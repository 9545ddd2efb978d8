"""The weight-format table as Python sees it (cpumoe.formats(), cpumoe.FORMATS, read from the
extension's kWeightFormatTable): every prepack function makes a layer of a row, each row's op
takes it, and names outside the table are refused with the table's names."""

from __future__ import annotations

import re

import ml_dtypes
import numpy as np
import pytest

import cpumoe
from cpumoe import _C

E, H, I = 2, 64, 64


def _int8(rng):
    w13 = rng.integers(-127, 128, (E, 2 * I, H), dtype=np.int8)
    w2 = rng.integers(-127, 128, (E, H, I), dtype=np.int8)
    return cpumoe.prepack(w13, w2, np.full((E, 2 * I), 0.01, np.float32),
                          np.full((E, H), 0.01, np.float32))


def _int4(rng):
    w13 = rng.integers(-8, 8, (E, 2 * I, H), dtype=np.int8)
    w2 = rng.integers(-8, 8, (E, H, I), dtype=np.int8)
    return cpumoe.prepack_int4(w13, w2, np.full((E, 2 * I, H // 32), 0.01, np.float32),
                               np.full((E, H, I // 32), 0.01, np.float32), group_size=32)


def _mxfp4(rng):
    return cpumoe.prepack_mxfp4(rng.integers(0, 256, (E, 2 * I, H // 32, 16), dtype=np.uint8),
                                np.full((E, 2 * I, H // 32), 120, np.uint8),
                                rng.integers(0, 256, (E, H, I // 32, 16), dtype=np.uint8),
                                np.full((E, H, I // 32), 120, np.uint8))


def _bf16(rng):
    return cpumoe.prepack_bf16(rng.standard_normal((E, 2 * I, H)).astype(ml_dtypes.bfloat16),
                               rng.standard_normal((E, H, I)).astype(ml_dtypes.bfloat16))


def _fp8(rng):
    codes = rng.integers(0, 0x7F, (2, E, 2 * I, H), dtype=np.uint8)  # no NaN code (0x7F, 0xFF)
    codes |= rng.integers(0, 2, codes.shape, dtype=np.uint8) << 7
    return cpumoe.prepack_fp8(codes[0], codes[1, :, :H, :I].copy(),
                              np.full((E, 1, 1), 0.01, np.float32),
                              np.full((E, 1, 1), 0.01, np.float32), block_size=(128, 128))


def _affine(prepack, top, mid):
    """A maker of an affine layer: codes in [0, top], scale 0.01 * 15 / top, min -mid scales."""
    def make(rng):
        s = 0.15 / top
        pairs = [np.stack([np.full(shape, s, np.float32), np.full(shape, -mid * s, np.float32)],
                          axis=-1) for shape in ((E, 2 * I, H // 32), (E, H, I // 32))]
        return prepack(rng.integers(0, top + 1, (E, 2 * I, H), dtype=np.uint8),
                       rng.integers(0, top + 1, (E, H, I), dtype=np.uint8), *pairs,
                       group_size=32)
    return make


_int4_affine = _affine(cpumoe.prepack_int4_affine, 15, 8)
_int8_affine = _affine(cpumoe.prepack_int8_affine, 255, 128)


# A layer from each prepack function of the table (a new row needs its maker here).
MAKERS = {"prepack": _int8, "prepack_int4": _int4, "prepack_mxfp4": _mxfp4,
          "prepack_bf16": _bf16, "prepack_fp8": _fp8, "prepack_int4_affine": _int4_affine,
          "prepack_int8_affine": _int8_affine}
# The op of each format as the issue states it (int8 activations for W8A8 and W4A8; bf16 for
# BF16 and FP8, W8A16).
OPS = {"int8": "int8", "int4": "int8", "mxfp4": "int8", "bf16": "bf16", "fp8": "bf16",
       "int4_affine": "int8", "int8_affine": "int8"}


def test_formats_are_the_extensions_table():
    rows = cpumoe.formats()
    assert cpumoe.FORMATS == tuple(r["name"] for r in _C.formats()) == tuple(OPS)
    assert len(set(cpumoe.FORMATS)) == len(cpumoe.FORMATS)
    assert "FORMATS" in cpumoe.__all__ and "formats" in cpumoe.__all__
    for r in rows:
        assert set(r) == {"name", "bits", "value_code", "scale", "scale_bytes", "group",
                          "group_size", "group_max", "zero_point", "family", "activations",
                          "prepack"}
        assert r["activations"] == OPS[r["name"]]
        assert callable(getattr(cpumoe, r["prepack"])) and r["prepack"] in cpumoe.__all__
    rows[0]["name"] = "changed"  # a copy: the table is not
    assert cpumoe.formats()[0]["name"] == cpumoe.FORMATS[0]


@pytest.mark.parametrize("row", _C.formats(), ids=lambda r: r["name"])
def test_each_prepack_makes_a_layer_of_its_row(row):
    assert {r["prepack"] for r in _C.formats()} == set(MAKERS)
    packed = MAKERS[row["prepack"]](np.random.default_rng(0))
    assert packed.weight_format == row["name"] and packed.weight_format in cpumoe.FORMATS
    assert f"weight_format={row['name']}," in repr(packed)
    if row["family"] == "q4gemm":
        assert packed.group_size == row["group_size"]
    rng = np.random.default_rng(1)
    x = rng.standard_normal((3, H)).astype(np.float32)
    ids = rng.integers(0, E, (3, 2)).astype(np.int32)
    tw = np.full((3, 2), 0.5, np.float32)
    # The row's activation type names the op that runs it; the other op refuses the layer.
    ops = {"int8": cpumoe.fused_moe_int8, "bf16": cpumoe.fused_moe_bf16}
    out = ops[row["activations"]](x, packed, tw, ids)
    assert np.array_equal(out, cpumoe.fused_moe(x, packed, tw, ids))
    other = next(op for act, op in ops.items() if act != row["activations"])
    with pytest.raises(TypeError, match="packed"):
        other(x, packed, tw, ids)


def test_type_errors_list_the_tables_prepack_functions():
    with pytest.raises(TypeError) as err:
        cpumoe.scratch_bytes(1, 1, object())
    for r in cpumoe.formats():
        assert f"{r['prepack']}() ({r['name']})" in str(err.value)


def test_an_unknown_format_name_lists_the_tables_names():
    q4 = [r["name"] for r in cpumoe.formats() if r["family"] == "q4gemm"]
    assert q4 == ["int4", "mxfp4", "int4_affine", "int8_affine"]
    for bad in ("int3", "INT4", "bf16", ""):
        with pytest.raises(ValueError, match="format: must be one of " +
                           re.escape(", ".join(q4)) + f", got '{re.escape(bad)}'"):
            _C.prepack_w4(E, H, I, bad, 32, 0, 0, 0, 0, 0, "float32", 0, "float32", None, 1)


def test_paths_take_the_format_names():
    """available_paths / selected_path name the layers by weight format (the one vocabulary);
    "w4" stays int4's earlier name; anything else lists the formats."""
    for fmt in cpumoe.FORMATS:
        paths = cpumoe.available_paths(fmt)
        assert paths and paths[-1] == "portable"
        assert cpumoe.selected_path(op=fmt) in paths
    assert cpumoe.available_paths("w4") == cpumoe.available_paths("int4")
    with pytest.raises(ValueError, match="one of " + ", ".join(cpumoe.FORMATS)):
        cpumoe.available_paths("fp4")
