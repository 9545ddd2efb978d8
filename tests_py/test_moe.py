"""cpumoe.fused_moe_int8 against the naive reference (cpumoe.reference), and its contract.

The shape/dtype space is covered by design rather than by the full cross product:
- every dtype x activation x bias combination once, each with a rotating (T, E, k, H, I);
- sweeps of T, k and E around a fixed problem; a gpt-oss sized case (H = I = 2880);
- skip_weighted (k == 1).
Then the contract: identical bits on every path and thread count, T = 0, out=, int64 ids, strided
rows, duplicate ids, idle experts, more tokens than one internal chunk.
"""

from __future__ import annotations

import itertools
import os
import re

import numpy as np
import pytest

import cpumoe
from cpumoe import reference
from conftest import activation_specs, assert_moe_close, make_problem

DTYPES = ("float32", "float16", "bfloat16")
ACTIVATIONS = activation_specs()

# (T, E, k, H, I) rotated through the dtype x activation x bias combinations: every T in
# {1, 7, 64, 256}, E in {8, 16}, k in {1, 2, 4}, H and I in {128, 256} appear with every dtype.
ROTATING_SHAPES = (
    (1, 8, 1, 128, 128),
    (7, 16, 2, 256, 128),
    (64, 8, 4, 128, 256),
    (256, 16, 2, 256, 256),
    (7, 8, 4, 128, 128),
    (64, 16, 1, 256, 256),
    (1, 16, 4, 256, 128),
)

CASES = []
for _i, (_dt, _act, _bias) in enumerate(itertools.product(DTYPES, ACTIVATIONS, (False, True))):
    _T, _E, _k, _H, _I = ROTATING_SHAPES[_i % len(ROTATING_SHAPES)]
    CASES.append(pytest.param(
        dict(T=_T, E=_E, k=_k, H=_H, I=_I, dtype=_dt, activation=_act, bias=_bias),
        id=f"{_dt}-{_act}-{'bias' if _bias else 'nobias'}-T{_T}E{_E}k{_k}H{_H}I{_I}"))

# Sweeps around one problem, one parameter at a time.
SWEEPS = (
    [dict(T=T, E=16, k=2, H=128, I=128, dtype="bfloat16", activation="silu", bias=False)
     for T in (1, 7, 64, 256)]
    + [dict(T=64, E=8, k=k, H=256, I=128, dtype="float16", activation="gelu_tanh", bias=True)
       for k in (1, 2, 4)]
    + [dict(T=64, E=E, k=4, H=128, I=256, dtype="float32", activation="swigluoai", bias=True)
       for E in (8, 16)]
    # gpt-oss-20b's layer shape (H = I = 2880, not a multiple of 16 or 64 blocks).
    + [dict(T=7, E=8, k=4, H=2880, I=2880, dtype="bfloat16", activation="swigluoai", bias=True)]
)
# Under qemu-user (the cross-python stage) the gpt-oss case's 200 M random weights take 45 s to
# draw; the aarch64 ctest covers that width (test_moe.cpp, gpt-oss widths) on every path.
UNDER_QEMU = bool(os.environ.get("QEMU_CPU"))


def _id(c):
    return (f"T{c['T']}E{c['E']}k{c['k']}H{c['H']}I{c['I']}-{c['dtype']}-{c['activation']}"
            f"{'-bias' if c['bias'] else ''}")


def _check_against_reference(backend, case):
    """Runs the case on every path this CPU has; each matches the reference and all agree
    bit for bit. Returns the problem and the default path's output."""
    p = make_problem(backend, **case)
    ref = p.reference()
    out = p.run()
    assert backend.is_tensor(out)
    assert tuple(out.shape) == (p.T, p.H)
    assert backend.dtype_name(out) == case["dtype"]
    assert_moe_close(backend, out, ref)
    for path in cpumoe.available_paths()[1:]:
        other = p.run(p.prepack(isa=path))
        assert np.array_equal(backend.bits(other), backend.bits(out)), \
            f"path {path} differs from {cpumoe.selected_path()}"
    return p, out


@pytest.mark.parametrize("case", CASES)
def test_matches_reference(backend, case):
    _check_against_reference(backend, case)


@pytest.mark.parametrize("case", [pytest.param(c, id=_id(c), marks=pytest.mark.skipif(
    UNDER_QEMU and c["H"] * c["I"] > 2**20, reason="under qemu-user: ctest covers this width"))
    for c in SWEEPS])
def test_sweeps_match_reference(backend, case):
    _check_against_reference(backend, case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True], ids=["nobias", "bias"])
def test_skip_weighted(backend, dtype, bias):
    case = dict(T=33, E=8, k=1, H=128, I=128, dtype=dtype, activation="gelu", bias=bias,
                skip_weighted=True)
    p, out = _check_against_reference(backend, case)
    # The router weight is ignored: any weights give the same result.
    other = backend.asarray(np.full((p.T, 1), 0.25, np.float32))
    assert np.array_equal(backend.bits(p.run(topk_weights=other)), backend.bits(out))


# ---------------------------------------------------------------------------- paths & threads
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_same_bits_on_every_path_and_thread_count(backend, activation):
    p = make_problem(backend, T=37, E=8, k=2, H=128, I=256, dtype="bfloat16",
                     activation=activation, bias=True)
    results = {}
    for path in cpumoe.available_paths():
        packed = p.prepack(isa=path)
        assert packed.path == path
        for threads in (1, 2):
            results[(path, threads)] = backend.bits(p.run(packed, num_threads=threads))
    (first_key, first), *rest = results.items()
    for key, bits in rest:
        assert np.array_equal(bits, first), f"{key} differs from {first_key}"
    assert_moe_close(backend, p.run(), p.reference())


def test_packed_reports_its_path(backend):
    p = make_problem(backend, T=1, E=8, k=2, H=128, I=128, bias=True)
    packed = p.prepack()
    assert packed.path in cpumoe.available_paths()
    assert packed.path == cpumoe.selected_path()
    assert isinstance(packed.kernel, str) and packed.kernel
    assert (packed.num_experts, packed.hidden, packed.intermediate) == (8, 128, 128)
    assert packed.has_bias13 and packed.has_bias2
    assert packed.packed_bytes >= 8 * 3 * 128 * 128  # at least the int8 weights
    assert packed.rowops.startswith("rowops_")
    portable = p.prepack(isa="portable")
    assert portable.path == "portable"
    assert portable.rowops == "rowops_portable"  # a cap on the kernel caps the row operations
    no_bias = cpumoe.prepack(p.w13, p.w2, p.s13, p.s2)
    assert not no_bias.has_bias13 and not no_bias.has_bias2


# ---------------------------------------------------------------------------- call contract
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("source", ["from_numpy", "empty", "slice"])
def test_zero_tokens(backend, dtype, source):
    p = make_problem(backend, T=0, E=8, k=2, H=128, I=128, dtype=dtype)
    if source == "empty":  # e.g. torch.empty((0, H)): strides (H, 1)
        p.x = backend.empty((0, 128), dtype)
        p.topk_ids = backend.empty((0, 2), "int32")
        p.topk_weights = backend.empty((0, 2), "float32")
    elif source == "slice":  # an empty slice of a real batch
        q = make_problem(backend, T=5, E=8, k=2, H=128, I=128, dtype=dtype)
        p.x, p.topk_ids, p.topk_weights = q.x[:0], q.topk_ids[:0], q.topk_weights[:0]
    # "from_numpy": torch.from_numpy of an empty array has strides (0, 0).
    out = p.run()
    assert tuple(out.shape) == (0, 128)
    assert backend.dtype_name(out) == dtype
    ref = p.reference()
    assert tuple(ref.shape) == (0, 128)
    given = backend.empty((0, 128), dtype)
    assert p.run(out=given) is given


@pytest.mark.parametrize("dtype", DTYPES)
def test_out_written_in_place(backend, dtype):
    p = make_problem(backend, T=9, E=8, k=2, H=128, I=128, dtype=dtype, bias=True)
    expected = backend.bits(p.run())
    out = backend.full((9, 128), float("nan"), dtype)
    assert p.run(out=out) is out
    assert np.array_equal(backend.bits(out), expected)
    # A row-strided out (a column slice of a wider buffer): the other columns stay untouched.
    big = backend.full((9, 160), 3.0, dtype)
    view = big[:, 16:144]
    assert p.run(out=view) is view
    assert np.array_equal(backend.bits(view), expected)
    rest = backend.numpy(big)
    assert (rest[:, :16] == 3.0).all() and (rest[:, 144:] == 3.0).all()


def test_int64_topk_ids(backend):
    p = make_problem(backend, T=20, E=16, k=4, H=128, I=128, dtype="float16")
    ids64 = backend.cast(p.topk_ids, "int64")
    assert np.array_equal(backend.bits(p.run(topk_ids=ids64)), backend.bits(p.run()))


@pytest.mark.parametrize("dtype", DTYPES)
def test_row_strided_x(backend, dtype):
    p = make_problem(backend, T=13, E=8, k=2, H=128, I=128, dtype=dtype)
    big = backend.full((13, 200), 1e4, dtype)
    big[:, :128] = p.x
    strided = big[:, :128]
    assert np.array_equal(backend.bits(p.run(x=strided)), backend.bits(p.run()))
    # A view that starts mid-row, too.
    big[:, 40:168] = p.x
    assert np.array_equal(backend.bits(p.run(x=big[:, 40:168])), backend.bits(p.run()))


def test_row_strided_topk(backend):
    p = make_problem(backend, T=11, E=8, k=2, H=128, I=128)
    ids_big = backend.asarray(np.zeros((11, 5), np.int32))
    w_big = backend.asarray(np.zeros((11, 3), np.float32))
    ids_big[:, 1:3] = p.topk_ids
    w_big[:, 0:2] = p.topk_weights
    out = p.run(topk_ids=ids_big[:, 1:3], topk_weights=w_big[:, 0:2])
    assert np.array_equal(backend.bits(out), backend.bits(p.run()))


def test_duplicate_expert_ids_count_twice(backend):
    p = make_problem(backend, T=6, E=8, k=3, H=128, I=128, dtype="float32", bias=True)
    ids = np.array([[2, 2, 5], [0, 0, 0], [7, 1, 7], [3, 4, 5], [6, 6, 1], [1, 1, 1]], np.int32)
    ids_t = backend.asarray(ids)
    out = p.run(topk_ids=ids_t)
    ref = p.reference(topk_ids=ids_t)
    assert_moe_close(backend, out, ref)
    # Row 1 uses expert 0 three times: the same as expert 0 once with the summed weight.
    w = backend.numpy(p.topk_weights)
    single = make_problem(backend, T=6, E=8, k=1, H=128, I=128, dtype="float32", bias=True)
    y0 = backend.numpy(single.reference(
        x=p.x, topk_ids=backend.asarray(np.zeros((6, 1), np.int32)),
        topk_weights=backend.asarray(np.ones((6, 1), np.float32))))
    np.testing.assert_allclose(backend.numpy(out)[1], w[1].sum() * y0[1], rtol=1e-5,
                               atol=1e-5 * np.abs(y0[1]).max())


def test_experts_without_tokens(backend):
    p = make_problem(backend, T=40, E=16, k=2, H=128, I=256, dtype="bfloat16", bias=True)
    rng = np.random.default_rng(5)
    ids = np.stack([rng.permutation([3, 11])[:2] for _ in range(40)]).astype(np.int32)
    ids_t = backend.asarray(ids)
    assert_moe_close(backend, p.run(topk_ids=ids_t), p.reference(topk_ids=ids_t))


def test_more_slots_than_one_chunk(backend):
    # T * k above the dispatcher's chunk of 16384 slots: the call is split internally.
    p = make_problem(backend, T=4200, E=8, k=4, H=16, I=16, dtype="float16", bias=True)
    out = p.run()
    assert_moe_close(backend, out, p.reference())
    assert np.array_equal(backend.bits(out), backend.bits(p.run(num_threads=1)))


def test_zero_rows_quantize_to_zeros(backend):
    # An all-zero token hits the amax floor: output is the biases' contribution, finite.
    p = make_problem(backend, T=4, E=8, k=2, H=128, I=128, dtype="bfloat16", bias=True)
    x = backend.asarray(np.zeros((4, 128), np.float32), "bfloat16")
    out = p.run(x=x)
    assert np.isfinite(backend.numpy(out)).all()
    assert_moe_close(backend, out, p.reference(x=x))


# ---------------------------------------------------------------------------- the reference
@pytest.mark.parametrize("dtype", DTYPES)
def test_quantize_per_token_matches_the_op(backend, dtype):
    """The reference's step 1 is bit-identical to the op's own quantizer (through the test-only
    module cpumoe._C_testing)."""
    from cpumoe._tensors import view

    rng = np.random.default_rng(3)
    x_np = rng.standard_normal((33, 96)).astype(np.float32) * np.float32(3)
    x_np[5] = 0.0  # the floor
    x_np[6] = 0.5  # a constant row
    x_np[7] = np.arange(96, dtype=np.float32) / 4 - 12  # quarters
    x_np[8] = (np.arange(96, dtype=np.float32) - 48) + 0.5  # ties of round-half-even: s = 1
    x_np[8, 0] = 127.0
    x = backend.asarray(x_np, dtype)
    q_ref, s_ref = reference.quantize_per_token(x)
    q = np.empty((33, 96), np.int8)
    s = np.empty(33, np.float32)
    testing = pytest.importorskip("cpumoe._C_testing", reason="the test-only module is built for "
                                  "the test stages, not installed by pip install .")
    xv = view("x", x)
    testing.quantize_rows(xv.address, xv.dtype, 33, 96, xv.strides[0],
                          q.__array_interface__["data"][0], s.__array_interface__["data"][0])
    assert np.array_equal(backend.numpy(q_ref), q)
    assert np.array_equal(backend.numpy(s_ref).view(np.uint32), s.view(np.uint32))


def test_reference_quantizers(backend):
    x = backend.asarray(np.array([[1.0, -2.0, 0.5, 0.0], [0.0, 0.0, 0.0, 0.0]], np.float32))
    q, s = reference.quantize_per_token(x)
    assert backend.numpy(q).tolist() == [[64, -127, 32, 0], [0, 0, 0, 0]]  # 63.5 -> 64 (even)
    assert np.allclose(backend.numpy(s), [2.0 / 127, 1e-7 / 127])
    w = backend.asarray(np.array([[[127.0, 0.5, -1.5]], [[-2.54, 1.0, 0.0]]], np.float32))
    qw, sw = reference.quantize_per_channel(w)
    assert tuple(qw.shape) == (2, 1, 3) and tuple(sw.shape) == (2, 1)
    assert backend.numpy(qw).tolist() == [[[127, 0, -2]], [[-127, 50, 0]]]  # 0.5 -> 0, 1.5 -> 2


def test_reference_torch_and_numpy_agree(backend):
    """The reference gives the same bits on torch tensors and on numpy arrays."""
    if backend.name != "torch":
        pytest.skip("needs the torch backend (the numpy backend never imports torch)")
    torch = pytest.importorskip("torch")
    pytest.importorskip("ml_dtypes")
    from conftest import Backend
    tb, nb = Backend("torch"), Backend("numpy")
    for dtype in DTYPES:
        kw = dict(T=16, E=8, k=2, H=128, I=128, dtype=dtype, activation="gelu", bias=True)
        rt, rn = make_problem(tb, **kw).reference(), make_problem(nb, **kw).reference()
        assert isinstance(rt, torch.Tensor) and isinstance(rn, np.ndarray)
        assert np.array_equal(tb.bits(rt), nb.bits(rn)), dtype


# ---------------------------------------------------------------------------- activation specs
def test_activation_specs_parse_print_and_refuse():
    assert cpumoe.ACTIVATIONS == tuple(a["name"] for a in cpumoe.activations())
    assert {"silu_clamp", "silu_clamp_post"} <= set(cpumoe.ACTIVATIONS)
    assert cpumoe.activation_spec("silu_clamp", limit=10) == "silu_clamp(limit=10)"
    assert cpumoe.activation_spec("swigluoai", limit=7, alpha=1.702) == "swigluoai"
    assert cpumoe.parse_activation("swigluoai(alpha=1.5, limit=2.5)")[1:] == (
        "swigluoai(limit=2.5,alpha=1.5)", 2.5, 1.5)
    assert cpumoe.parse_activation("silu_clamp_post(limit=inf)")[2] == float("inf")
    for bad, msg in (("silu_clamp", "needs limit"), ("silu_clamp(limit=0)", "must be > 0"),
                     ("relu", "unknown activation 'relu'"), ("gelu(limit=10)", "no parameters"),
                     ("silu_clamp(alpha=1)", "takes limit, not alpha")):
        with pytest.raises(ValueError, match=re.escape(msg)):
            cpumoe.parse_activation(bad)
    with pytest.raises(ValueError, match="silu takes no parameters"):
        cpumoe.activation_spec("silu", limit=10)
    with pytest.raises(TypeError):
        cpumoe.activation_spec("silu_clamp", limit="10")


def test_reference_clamps_match_the_formulas():
    """The reference's clamped forms, spelled out at points past and inside the limit."""
    def silu(v):
        return v / (1.0 + np.exp(-v))
    g = np.array([-30.0, -1.0, 0.5, 9.0, 11.0, 300.0], np.float32)
    u = np.array([-50.0, 3.0, -0.25, 12.0, -11.0, 2.0], np.float32)
    h = np.concatenate([g, u])[None, :]
    L = 10.0
    pre = reference.gated_activation("silu_clamp(limit=10)", h, g.size)[0]
    post = reference.gated_activation("silu_clamp_post(limit=10)", h, g.size)[0]
    uc = np.clip(u.astype(np.float64), -L, L)
    np.testing.assert_allclose(pre, silu(np.minimum(g.astype(np.float64), L)) * uc, rtol=1e-6)
    np.testing.assert_allclose(post, np.minimum(silu(g.astype(np.float64)), L) * uc, rtol=1e-6)
    plain = reference.gated_activation("silu", h, g.size)[0]
    assert np.array_equal(reference.gated_activation("silu_clamp(limit=inf)", h, g.size)[0], plain)


@pytest.mark.parametrize("spec", ["silu_clamp", "silu_clamp(limit=-1)", "relu"])
def test_op_refuses_an_activation_it_cannot_run(backend, spec):
    p = make_problem(backend, T=3, E=8, k=2, H=128, I=128, activation="silu", bias=False)
    packed = p.prepack()
    with pytest.raises(ValueError, match="activation"):
        cpumoe.fused_moe_int8(p.x, packed, p.topk_weights, p.topk_ids, spec)


def test_clamp_limits_are_the_ops_parameter(backend):
    """Values past the limit: the op follows the limit it is given (10 and 50 differ), and each
    matches the reference of that limit."""
    p = make_problem(backend, T=16, E=8, k=2, H=128, I=128, dtype="float32",
                     activation="silu", bias=False)
    x = backend.asarray(backend.numpy(p.x) * 40.0, "float32")  # GEMM1 values to about ±100
    outs = {}
    for spec in ("silu_clamp(limit=10)", "silu_clamp(limit=50)", "silu_clamp_post(limit=10)"):
        got = p.run(x=x, activation=spec)
        assert_moe_close(backend, got, p.reference(x=x, activation=spec))
        outs[spec] = backend.numpy(got)
    assert not np.allclose(outs["silu_clamp(limit=10)"], outs["silu_clamp(limit=50)"], rtol=0.1)


# ---------------------------------------------------------------------------- one public call
def test_fused_moe_runs_every_packed_kind_as_its_alias(backend):
    """cpumoe.fused_moe takes any packed layer (its weight_format decides the op) and gives the
    bits of fused_moe_int8 / fused_moe_bf16; those refuse the other kind."""
    import ml_dtypes

    p = make_problem(backend, T=9, E=8, k=2, H=128, I=128, dtype="bfloat16", bias=True)
    w13f = backend.numpy(p.w13).astype(np.float32) * backend.numpy(p.s13)[..., None]
    w2f = backend.numpy(p.w2).astype(np.float32) * backend.numpy(p.s2)[..., None]
    (v13, g13), (v2, g2) = cpumoe.quantize.quantize_int4(w13f), cpumoe.quantize.quantize_int4(w2f)
    layers = {"int8": (p.prepack(), cpumoe.fused_moe_int8),
              "int4": (cpumoe.prepack_int4(v13, v2, g13, g2, group_size=32),
                       cpumoe.fused_moe_int8),
              "bf16": (cpumoe.prepack_bf16(w13f.astype(ml_dtypes.bfloat16),
                                           w2f.astype(ml_dtypes.bfloat16)), cpumoe.fused_moe_bf16)}
    for fmt, (packed, alias) in layers.items():
        assert packed.weight_format == fmt
        got = cpumoe.fused_moe(p.x, packed, p.topk_weights, p.topk_ids,
                               activation="silu_clamp(limit=1)")
        want = alias(p.x, packed, p.topk_weights, p.topk_ids, "silu_clamp(limit=1)")
        assert np.array_equal(backend.bits(got), backend.bits(want)), fmt
    with pytest.raises(TypeError, match="PackedMoeBf16"):
        cpumoe.fused_moe_bf16(p.x, layers["int8"][0], p.topk_weights, p.topk_ids)
    with pytest.raises(TypeError, match="prepack"):
        cpumoe.fused_moe_int8(p.x, layers["bf16"][0], p.topk_weights, p.topk_ids)
    with pytest.raises(TypeError, match="a packed layer"):
        cpumoe.fused_moe(p.x, object(), p.topk_weights, p.topk_ids)
