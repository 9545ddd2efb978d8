"""Bad input raises ValueError or TypeError whose message names the argument; nothing crashes.

Every case mutates one argument of a valid call (T=4, E=4, k=2, H=I=16) and checks the exception
type and that the message names the argument (messages start with it).
"""

from __future__ import annotations

import numpy as np
import pytest

import cpumoe
from conftest import make_problem

T, E, K, H, I = 4, 4, 2, 16, 16


@pytest.fixture()
def prob(backend):
    return make_problem(backend, T=T, E=E, k=K, H=H, I=I, dtype="float32", bias=True)


@pytest.fixture()
def packed(prob):
    return prob.prepack()


def _arr(backend, a):
    return backend.asarray(np.asarray(a))


# ---------------------------------------------------------------------------- fused_moe_int8
# Each entry: id -> (function (backend, problem) -> dict of call overrides, exception, name).
def _ids(b, rows):
    return _arr(b, np.array(rows, np.int32))


CALL_CASES = {
    # x
    "x-float64": (lambda b, p: dict(x=b.cast(p.x, "float64")), TypeError, "x"),
    "x-int32": (lambda b, p: dict(x=b.cast(p.x, "int32")), TypeError, "x"),
    "x-int8": (lambda b, p: dict(x=b.cast(p.x, "int8")), TypeError, "x"),
    "x-rank1": (lambda b, p: dict(x=p.x[0]), ValueError, "x"),
    "x-rank3": (lambda b, p: dict(x=p.x[None]), ValueError, "x"),
    "x-H-mismatch": (lambda b, p: dict(x=_arr(b, np.zeros((T, H + 8), np.float32))),
                     ValueError, "x"),
    "x-transposed": (lambda b, p: dict(x=_arr(b, np.zeros((H, H), np.float32)).T,
                                       topk_ids=_arr(b, np.zeros((H, K), np.int32)),
                                       topk_weights=_arr(b, np.ones((H, K), np.float32))),
                     ValueError, "x"),
    "x-every-other-column": (lambda b, p: dict(x=_arr(b, np.zeros((T, 2 * H), np.float32))[:, ::2]),
                             ValueError, "x"),
    "x-list": (lambda b, p: dict(x=[[0.0] * H] * T), TypeError, "x"),
    "x-none": (lambda b, p: dict(x=None), TypeError, "x"),
    # topk_ids
    "ids-float32": (lambda b, p: dict(topk_ids=b.cast(p.topk_ids, "float32")), TypeError,
                    "topk_ids"),
    "ids-int16": (lambda b, p: dict(topk_ids=b.cast(p.topk_ids, "int16")), TypeError, "topk_ids"),
    "ids-uint8": (lambda b, p: dict(topk_ids=b.cast(p.topk_ids, "uint8")), TypeError, "topk_ids"),
    "ids-rank1": (lambda b, p: dict(topk_ids=p.topk_ids[:, 0]), ValueError, "topk_ids"),
    "ids-T-mismatch": (lambda b, p: dict(topk_ids=p.topk_ids[:T - 1]), ValueError, "topk_ids"),
    "ids-negative": (lambda b, p: dict(topk_ids=_ids(b, [[0, 1], [2, -1], [0, 1], [0, 1]])),
                     ValueError, "topk_ids"),
    "ids-equal-E": (lambda b, p: dict(topk_ids=_ids(b, [[0, 1], [0, 1], [0, 1], [E, 1]])),
                    ValueError, "topk_ids"),
    "ids-int64-2^32": (lambda b, p: dict(topk_ids=_arr(b, np.full((T, K), 2**32, np.int64))),
                       ValueError, "topk_ids"),  # would alias expert 0 if truncated to 32 bits
    "ids-int64-negative": (lambda b, p: dict(topk_ids=_arr(b, np.full((T, K), -2**40, np.int64))),
                           ValueError, "topk_ids"),
    "ids-every-other-column": (
        lambda b, p: dict(topk_ids=_arr(b, np.zeros((T, 2 * K), np.int32))[:, ::2]),
        ValueError, "topk_ids"),
    "k-zero": (lambda b, p: dict(topk_ids=_arr(b, np.zeros((T, 0), np.int32)),
                                 topk_weights=_arr(b, np.zeros((T, 0), np.float32))),
               ValueError, "topk_ids"),
    "ids-list": (lambda b, p: dict(topk_ids=[[0, 1]] * T), TypeError, "topk_ids"),
    # topk_weights
    "weights-shape": (lambda b, p: dict(topk_weights=_arr(b, np.ones((T, K + 1), np.float32))),
                      ValueError, "topk_weights"),
    "weights-T-mismatch": (lambda b, p: dict(topk_weights=p.topk_weights[:T - 1]), ValueError,
                           "topk_weights"),
    "weights-float64": (lambda b, p: dict(topk_weights=b.cast(p.topk_weights, "float64")),
                        TypeError, "topk_weights"),
    "weights-float16": (lambda b, p: dict(topk_weights=b.cast(p.topk_weights, "float16")),
                        TypeError, "topk_weights"),
    "weights-int32": (lambda b, p: dict(topk_weights=b.cast(p.topk_weights, "int32")),
                      TypeError, "topk_weights"),
    "weights-list": (lambda b, p: dict(topk_weights=[[0.5, 0.5]] * T), TypeError,
                     "topk_weights"),
    # activation / skip_weighted / threads
    "activation-unknown": (lambda b, p: dict(activation="relu"), ValueError, "activation"),
    "activation-case": (lambda b, p: dict(activation="SiLU"), ValueError, "activation"),
    "activation-not-str": (lambda b, p: dict(activation=1), TypeError, "activation"),
    "skip-weighted-k2": (lambda b, p: dict(skip_weighted=True), ValueError, "skip_weighted"),
    "num-threads-zero": (lambda b, p: dict(num_threads=0), ValueError, "num_threads"),
    "num-threads-str": (lambda b, p: dict(num_threads="2"), (TypeError, ValueError),
                        "num_threads"),
    # out
    "out-shape": (lambda b, p: dict(out=b.empty((T, H + 8), "float32")), ValueError, "out"),
    "out-T": (lambda b, p: dict(out=b.empty((T + 1, H), "float32")), ValueError, "out"),
    "out-rank1": (lambda b, p: dict(out=b.empty((T * H,), "float32")), ValueError, "out"),
    "out-dtype": (lambda b, p: dict(out=b.empty((T, H), "float16")), TypeError, "out"),
    "out-float64": (lambda b, p: dict(out=b.empty((T, H), "float64")), TypeError, "out"),
    "out-every-other-column": (lambda b, p: dict(out=b.empty((T, 2 * H), "float32")[:, ::2]),
                               ValueError, "out"),
    "out-list": (lambda b, p: dict(out=[[0.0] * H] * T), TypeError, "out"),
    "out-is-x": (lambda b, p: dict(out=p.x), ValueError, "out"),
}


@pytest.mark.parametrize("case", list(CALL_CASES), ids=list(CALL_CASES))
def test_call_errors(backend, prob, packed, case):
    make, exc, name = CALL_CASES[case]
    overrides = make(backend, prob)
    with pytest.raises(exc, match=rf"^{name}\b") as info:
        prob.run(packed, **overrides)
    assert name in str(info.value)


def test_valid_call_first(backend, prob, packed):
    """The unmutated call works (so each error above is the mutation's)."""
    out = prob.run(packed)
    assert tuple(out.shape) == (T, H)


def test_packed_not_packed(backend, prob):
    with pytest.raises(TypeError, match="^packed"):
        cpumoe.fused_moe_int8(prob.x, "weights", prob.topk_weights, prob.topk_ids)
    with pytest.raises(TypeError, match="^packed"):
        cpumoe.fused_moe_int8(prob.x, None, prob.topk_weights, prob.topk_ids)


def test_out_read_only_numpy(backend, prob, packed):
    if backend.name != "numpy":
        pytest.skip("numpy arrays only")
    out = np.empty((T, H), np.float32)
    out.setflags(write=False)
    with pytest.raises(ValueError, match="^out"):
        prob.run(packed, out=out)


@pytest.mark.parametrize("arg", ["x", "topk_weights", "topk_ids", "out"])
def test_non_native_byte_order_rejected(backend, prob, packed, arg):
    """A byte-swapped numpy array ('>f4' on a little-endian CPU) has the right dtype name but
    would be read as garbage: it must be refused, not silently misread."""
    if backend.name != "numpy":
        pytest.skip("numpy arrays only")
    kw = dict(x=prob.x, topk_weights=prob.topk_weights, topk_ids=prob.topk_ids,
              out=np.empty((T, H), np.float32))
    kw[arg] = kw[arg].astype(kw[arg].dtype.newbyteorder())
    with pytest.raises((TypeError, ValueError), match=f"^{arg}"):
        prob.run(packed, **kw)


@pytest.mark.parametrize("arg", ["s13", "b13"])
def test_non_native_byte_order_prepack(backend, prob, arg):
    """Scales are converted (fine); a byte-swapped bias must be converted or refused."""
    if backend.name != "numpy":
        pytest.skip("numpy arrays only")
    args = _prepack_args(backend, prob)
    args[arg] = args[arg].astype(args[arg].dtype.newbyteorder())
    try:
        packed = cpumoe.prepack(**args)
    except (TypeError, ValueError) as e:
        assert str(e).startswith(arg)
        return
    out = prob.run(packed)
    assert np.array_equal(out, prob.run()), f"byte-swapped {arg} was misread"


def test_out_other_framework(backend, prob, packed):
    if backend.name != "torch":
        pytest.skip("needs torch")
    with pytest.raises(TypeError, match="^out"):
        prob.run(packed, out=np.empty((T, H), np.float32))


def test_nothing_written_on_error(backend, prob, packed):
    out = backend.full((T, H), 7.0, "float32")
    with pytest.raises(ValueError, match="^topk_ids"):
        prob.run(packed, out=out, topk_ids=_ids(backend, [[0, 1], [0, 1], [0, 1], [0, E]]))
    assert (backend.numpy(out) == 7.0).all()


# ---------------------------------------------------------------------------- prepack
def _prepack_args(b, p):
    return dict(w13=p.w13, w2=p.w2, s13=p.s13, s2=p.s2, b13=p.b13, b2=p.b2)


def _with_value(b, t, index, value):
    a = b.numpy(t).copy()
    a[index] = value
    return _arr(b, a)


def _quantized(b, E_, N, K_, seed=0):
    rng = np.random.default_rng(seed)
    return (_arr(b, rng.integers(-127, 128, (E_, N, K_), dtype=np.int8)),
            _arr(b, np.full((E_, N), 0.01, np.float32)))


def _dims(b, H_, I_):
    w13, s13 = _quantized(b, E, 2 * I_, H_)
    w2, s2 = _quantized(b, E, H_, I_)
    return dict(w13=w13, w2=w2, s13=s13, s2=s2, b13=None, b2=None)


PREPACK_CASES = {
    "w13-float32": (lambda b, p: dict(w13=b.cast(p.w13, "float32")), TypeError, "w13"),
    "w13-uint8": (lambda b, p: dict(w13=b.cast(p.w13, "uint8")), TypeError, "w13"),
    "w2-float32": (lambda b, p: dict(w2=b.cast(p.w2, "float32")), TypeError, "w2"),
    "w2-int32": (lambda b, p: dict(w2=b.cast(p.w2, "int32")), TypeError, "w2"),
    "w13-rank2": (lambda b, p: dict(w13=p.w13[0]), ValueError, "w13"),
    "w13-odd-rows": (lambda b, p: dict(w13=p.w13[:, :2 * I - 1]), ValueError, "w13"),
    "w13-no-experts": (lambda b, p: dict(w13=p.w13[:0], w2=p.w2[:0], s13=p.s13[:0],
                                         s2=p.s2[:0], b13=None, b2=None), ValueError, "w13"),
    "w2-E-mismatch": (lambda b, p: dict(w2=p.w2[:E - 1]), ValueError, "w2"),
    "w2-H-mismatch": (lambda b, p: dict(w2=p.w2[:, :H - 8]), ValueError, "w2"),
    "w2-I-mismatch": (lambda b, p: dict(w2=p.w2[:, :, :I - 8]), ValueError, "w2"),
    "w2-rank2": (lambda b, p: dict(w2=p.w2[0]), ValueError, "w2"),
    "w13-list": (lambda b, p: dict(w13=[[[0] * H] * (2 * I)] * E), TypeError, "w13"),
    "s13-shape": (lambda b, p: dict(s13=p.s13[:, :I]), ValueError, "s13"),
    "s13-rank1": (lambda b, p: dict(s13=p.s13[0]), ValueError, "s13"),
    "s13-E": (lambda b, p: dict(s13=p.s13[:E - 1]), ValueError, "s13"),
    "s2-shape": (lambda b, p: dict(s2=p.s2[:, :H - 8]), ValueError, "s2"),
    "s13-int": (lambda b, p: dict(s13=b.cast(p.s13, "int32")), TypeError, "s13"),
    "s13-zero": (lambda b, p: dict(s13=_with_value(b, p.s13, (1, 3), 0.0)), ValueError, "s13"),
    "s13-negative": (lambda b, p: dict(s13=_with_value(b, p.s13, (0, 0), -0.5)), ValueError,
                     "s13"),
    "s13-nan": (lambda b, p: dict(s13=_with_value(b, p.s13, (2, 5), np.nan)), ValueError, "s13"),
    "s2-zero": (lambda b, p: dict(s2=_with_value(b, p.s2, (3, 15), 0.0)), ValueError, "s2"),
    "s2-inf": (lambda b, p: dict(s2=_with_value(b, p.s2, (0, 1), np.inf)), ValueError, "s2"),
    "s2-list": (lambda b, p: dict(s2=[[0.1] * H] * E), TypeError, "s2"),
    "b13-shape": (lambda b, p: dict(b13=p.b13[:, :I]), ValueError, "b13"),
    "b13-int": (lambda b, p: dict(b13=b.cast(p.b13, "int32")), TypeError, "b13"),
    "b2-shape": (lambda b, p: dict(b2=p.b2[:E - 1]), ValueError, "b2"),
    "b2-list": (lambda b, p: dict(b2=[[0.0] * H] * E), TypeError, "b2"),
    "H-not-multiple-of-8": (lambda b, p: _dims(b, 12, 16), ValueError, "w13"),
    "I-not-multiple-of-8": (lambda b, p: _dims(b, 16, 12), ValueError, "w2"),
    "H-4": (lambda b, p: _dims(b, 4, 16), ValueError, "w13"),
    "isa-unknown": (lambda b, p: dict(isa="sse9"), ValueError, "isa"),
    "isa-not-str": (lambda b, p: dict(isa=3), TypeError, "isa"),
    "num-threads-negative": (lambda b, p: dict(num_threads=-1), ValueError, "num_threads"),
}


@pytest.mark.parametrize("case", list(PREPACK_CASES), ids=list(PREPACK_CASES))
def test_prepack_errors(backend, prob, case):
    make, exc, name = PREPACK_CASES[case]
    args = _prepack_args(backend, prob)
    args.update(make(backend, prob))
    w13, w2, s13, s2 = args.pop("w13"), args.pop("w2"), args.pop("s13"), args.pop("s2")
    with pytest.raises(exc, match=rf"^{name}\b") as info:
        cpumoe.prepack(w13, w2, s13, s2, **args)
    assert name in str(info.value)


def test_valid_prepack_first(backend, prob):
    args = _prepack_args(backend, prob)
    assert cpumoe.prepack(**args).num_experts == E
    d = _dims(backend, 24, 40)  # multiples of 8 that are not multiples of 16
    assert cpumoe.prepack(**d).intermediate == 40


def test_isa_portable_always_accepted(backend, prob):
    assert prob.prepack(isa="portable").path == "portable"


def test_reference_rejects_bad_input(backend, prob):
    from cpumoe.reference import ref_fused_moe_int8
    with pytest.raises(ValueError, match="activation"):
        prob.reference(activation="relu")
    with pytest.raises(ValueError, match="topk_ids"):
        prob.reference(topk_ids=_ids(backend, [[0, 1], [0, 1], [0, 1], [0, E]]))
    with pytest.raises(ValueError, match="skip_weighted"):
        prob.reference(skip_weighted=True)
    with pytest.raises(TypeError, match="x"):
        ref_fused_moe_int8(backend.cast(prob.x, "int32"), prob.w13, prob.w2, prob.s13, prob.s2,
                           prob.topk_weights, prob.topk_ids)


# --------------------------------------------------------------------------- the rest of the matrix
# Layouts (broadcast, negative strides, misaligned), aliasing of out with any input, other devices,
# expert_map, and the packed object itself. A case only one backend can express (negative strides
# and misaligned data: numpy; other devices and lazy views: torch) skips on the other.
def _numpy_only(b):
    if b.torch is not None:
        pytest.skip("numpy arrays only (torch has no negative strides / misaligned tensors)")


def _torch_only(b):
    if b.torch is None:
        pytest.skip("torch tensors only")


def _bcast_rows(b, t):
    """Every row the same memory (row stride 0)."""
    if b.torch is not None:
        return t[:1].expand(t.shape[0], -1)
    return np.broadcast_to(t[:1], t.shape)


def _reversed(b, t, axis):
    _numpy_only(b)
    return t[::-1] if axis == 0 else t[:, ::-1]


def _misaligned(b, t):
    """A copy of numpy array t whose data starts one byte off its element alignment."""
    _numpy_only(b)
    raw = np.zeros(t.nbytes + t.itemsize, np.uint8)
    m = raw[1:1 + t.nbytes].view(t.dtype).reshape(t.shape)
    m[...] = t
    assert not m.flags.aligned
    return m


def _meta(b, t):
    _torch_only(b)
    return t.to("meta")


def _out_shifted_over_x(b, p):
    """x and out one row apart in one buffer."""
    big = b.asarray(np.zeros((T + 1, H), np.float32))
    big[:T] = p.x
    return dict(x=big[:T], out=big[1:])


def _out_over_weights(b, p):
    buf = b.full((T, H), 0.25, "float32")
    return dict(out=buf, topk_weights=buf.reshape(-1)[:T * K].reshape(T, K))


def _out_over_ids(b, p):
    out = b.empty((T, H), "float32")
    ids = out.view(b.dtype("int32"))[:, :K]
    ids[...] = p.topk_ids
    return dict(out=out, topk_ids=ids)


def _out_over_expert_map(b, p):
    out = b.empty((T, H), "float32")
    emap = out.view(b.dtype("int32")).reshape(-1)[:E]
    emap[...] = _arr(b, np.arange(E, dtype=np.int32))
    return dict(out=out, expert_map=emap)


def _emap(b, values, dtype=np.int32):
    return _arr(b, np.array(values, dtype))


def _other_arch_isa():
    return "avx2" if cpumoe.cpu_features()["arch"] == "aarch64" else "neon_i8mm"


MORE_CALL_CASES = {
    # layouts
    "x-rows-broadcast": (lambda b, p: dict(x=_bcast_rows(b, p.x)), ValueError, "x"),
    "ids-rows-broadcast": (lambda b, p: dict(topk_ids=_bcast_rows(b, p.topk_ids)), ValueError,
                           "topk_ids"),
    "weights-rows-broadcast": (lambda b, p: dict(topk_weights=_bcast_rows(b, p.topk_weights)),
                               ValueError, "topk_weights"),
    "out-rows-broadcast": (lambda b, p: dict(out=_bcast_rows(b, b.empty((T, H), "float32"))),
                           ValueError, "out"),
    "x-rows-reversed": (lambda b, p: dict(x=_reversed(b, p.x, 0)), ValueError, "x"),
    "x-columns-reversed": (lambda b, p: dict(x=_reversed(b, p.x, 1)), ValueError, "x"),
    "ids-rows-reversed": (lambda b, p: dict(topk_ids=_reversed(b, p.topk_ids, 0)), ValueError,
                          "topk_ids"),
    "weights-columns-reversed": (lambda b, p: dict(topk_weights=_reversed(b, p.topk_weights, 1)),
                                 ValueError, "topk_weights"),
    "out-rows-reversed": (lambda b, p: dict(out=_reversed(b, b.empty((T, H), "float32"), 0)),
                          ValueError, "out"),
    "x-misaligned": (lambda b, p: dict(x=_misaligned(b, p.x)), ValueError, "x"),
    "ids-misaligned": (lambda b, p: dict(topk_ids=_misaligned(b, p.topk_ids)), ValueError,
                       "topk_ids"),
    "out-misaligned": (lambda b, p: dict(out=_misaligned(b, b.empty((T, H), "float32"))),
                       ValueError, "out"),
    # ranks and types
    "ids-rank3": (lambda b, p: dict(topk_ids=p.topk_ids[:, :, None]), ValueError, "topk_ids"),
    "weights-rank1": (lambda b, p: dict(topk_weights=p.topk_weights[:, 0]), ValueError,
                      "topk_weights"),
    "x-bool": (lambda b, p: dict(x=b.cast(p.x, "bool")), TypeError, "x"),
    "skip-weighted-int": (lambda b, p: dict(skip_weighted=1), TypeError, "skip_weighted"),
    "num-threads-bool": (lambda b, p: dict(num_threads=True), ValueError, "num_threads"),
    "num-threads-float": (lambda b, p: dict(num_threads=2.0), ValueError, "num_threads"),
    # aliasing: out is written while later chunks still read every input
    "out-overlaps-x-shifted": (_out_shifted_over_x, ValueError, "out"),
    "out-aliases-topk_weights": (_out_over_weights, ValueError, "out"),
    "out-aliases-topk_ids": (_out_over_ids, ValueError, "out"),
    "out-aliases-expert_map": (_out_over_expert_map, ValueError, "out"),
    # expert_map
    "expert_map-int64": (lambda b, p: dict(expert_map=_emap(b, range(E), np.int64)), TypeError,
                         "expert_map"),
    "expert_map-2d": (lambda b, p: dict(expert_map=_emap(b, [[0, 1], [2, 3]])), ValueError,
                      "expert_map"),
    "expert_map-empty": (lambda b, p: dict(expert_map=_emap(b, [])), ValueError, "expert_map"),
    "expert_map-entry-E": (lambda b, p: dict(expert_map=_emap(b, [0, 1, 2, E])), ValueError,
                           "expert_map"),
    "expert_map-entry-minus-2": (lambda b, p: dict(expert_map=_emap(b, [0, -2, 2, 3])),
                                 ValueError, "expert_map"),
    "expert_map-ids-beyond-global": (
        lambda b, p: dict(expert_map=_emap(b, [0, 1, 2, 3, -1, -1]),
                          topk_ids=_ids(b, [[0, 1], [5, 6], [0, 1], [0, 1]])),
        ValueError, "topk_ids"),
    "expert_map-list": (lambda b, p: dict(expert_map=[0, 1, 2, 3]), TypeError, "expert_map"),
    # other devices and lazy views (torch)
    "x-meta": (lambda b, p: dict(x=_meta(b, p.x)), ValueError, "x"),
    "ids-meta": (lambda b, p: dict(topk_ids=_meta(b, p.topk_ids)), ValueError, "topk_ids"),
    "weights-meta": (lambda b, p: dict(topk_weights=_meta(b, p.topk_weights)), ValueError,
                     "topk_weights"),
    "out-meta": (lambda b, p: dict(out=_meta(b, b.empty((T, H), "float32"))), ValueError, "out"),
    "expert_map-meta": (lambda b, p: dict(expert_map=_meta(b, _emap(b, range(E)))), ValueError,
                        "expert_map"),
    "x-neg-view": (lambda b, p: (_torch_only(b), dict(x=b.torch._neg_view(p.x)))[1], ValueError,
                   "x"),
}


@pytest.mark.parametrize("case", list(MORE_CALL_CASES), ids=list(MORE_CALL_CASES))
def test_more_call_errors(backend, prob, packed, case):
    make, exc, name = MORE_CALL_CASES[case]
    overrides = make(backend, prob)
    sentinel = backend.full((T, H), 7.0, "float32")
    overrides.setdefault("out", sentinel)
    with pytest.raises(exc, match=rf"^{name}\b") as info:
        prob.run(packed, **overrides)
    assert name in str(info.value)
    assert (backend.numpy(sentinel) == 7.0).all(), "out written before the error"


MORE_PREPACK_CASES = {
    "s2-int": (lambda b, p: dict(s2=b.cast(p.s2, "int32")), TypeError, "s2"),
    "b2-int": (lambda b, p: dict(b2=b.cast(p.b2, "int32")), TypeError, "b2"),
    "b13-rank1": (lambda b, p: dict(b13=p.b13[0]), ValueError, "b13"),
    "s2-rank3-not-1": (lambda b, p: dict(s2=_arr(b, np.repeat(b.numpy(p.s2)[:, :, None], 2, 2))),
                       ValueError, "s2"),
    "w13-meta": (lambda b, p: dict(w13=_meta(b, p.w13)), ValueError, "w13"),
    "w2-meta": (lambda b, p: dict(w2=_meta(b, p.w2)), ValueError, "w2"),
    "s13-meta": (lambda b, p: dict(s13=_meta(b, p.s13)), ValueError, "s13"),
    "s2-meta": (lambda b, p: dict(s2=_meta(b, p.s2)), ValueError, "s2"),
    "b13-meta": (lambda b, p: dict(b13=_meta(b, p.b13)), ValueError, "b13"),
    "b2-meta": (lambda b, p: dict(b2=_meta(b, p.b2)), ValueError, "b2"),
    "isa-other-arch": (lambda b, p: dict(isa=_other_arch_isa()), ValueError, "isa"),
    "num-threads-bool": (lambda b, p: dict(num_threads=True), ValueError, "num_threads"),
}


@pytest.mark.parametrize("case", list(MORE_PREPACK_CASES), ids=list(MORE_PREPACK_CASES))
def test_more_prepack_errors(backend, prob, case):
    make, exc, name = MORE_PREPACK_CASES[case]
    args = _prepack_args(backend, prob)
    args.update(make(backend, prob))
    with pytest.raises(exc, match=rf"^{name}\b") as info:
        cpumoe.prepack(**args)
    assert name in str(info.value)


def test_prepack_copies_any_layout(backend, prob, packed):
    """Weights are copied at prepack, so any layout is accepted: a negatively strided (numpy) or
    transposed-back (both) copy of the same weights packs to the same results."""
    w13 = prob.w13
    if backend.torch is not None:
        w13_odd = w13.transpose(1, 2).contiguous().transpose(1, 2)  # same values, strides permuted
    else:
        w13_odd = np.ascontiguousarray(w13[:, ::-1])[:, ::-1]  # negative stride on dim 1
    args = _prepack_args(backend, prob)
    args["w13"] = w13_odd
    assert np.array_equal(backend.bits(prob.run(cpumoe.prepack(**args))),
                          backend.bits(prob.run(packed)))


# ---------------------------------------------------------------------------- the packed object
def test_uninitialised_packed_is_refused(backend, prob):
    """PackedMoe.__new__ without prepack has no C++ object: every use is a TypeError naming
    packed, never a read of uninitialised memory."""
    raw = cpumoe.PackedMoe.__new__(cpumoe.PackedMoe)
    with pytest.raises(TypeError, match="^packed"):
        prob.run(raw)
    with pytest.raises(TypeError, match="^packed"):
        raw.hidden
    with pytest.raises(TypeError, match="^packed"):
        repr(raw)
    with pytest.raises(TypeError, match="^packed"):
        cpumoe.scratch_bytes(T, K, raw)
    with pytest.raises(TypeError):
        cpumoe.PackedMoe()


def test_packed_cannot_be_subclassed_or_modified(backend, packed):
    with pytest.raises(TypeError):
        type("MyPacked", (cpumoe.PackedMoe,), {})
    for attr in ("hidden", "num_experts", "intermediate", "kernel", "path", "packed_bytes"):
        with pytest.raises(AttributeError):
            setattr(packed, attr, 1)
    with pytest.raises(AttributeError):
        packed.extra = 1  # no __dict__: nothing can be attached or swapped


def test_packed_copy_shares_and_pickle_refuses(backend, prob, packed):
    import copy
    import pickle
    assert copy.copy(packed) is packed and copy.deepcopy([packed])[0] is packed  # immutable
    with pytest.raises(TypeError):
        pickle.dumps(packed)


def test_packed_independent_of_its_sources(backend, prob):
    """prepack copies: overwriting and dropping the source tensors afterwards changes nothing."""
    import gc
    b = backend
    src = {name: b.asarray(b.numpy(getattr(prob, name))) for name in
           ("w13", "w2", "s13", "s2", "b13", "b2")}
    src["w13"] = b.cast(src["w13"], "int8")
    src["w2"] = b.cast(src["w2"], "int8")
    packed = cpumoe.prepack(**src)
    want = b.bits(prob.run(packed))
    for t in src.values():
        t[...] = 3 if b.dtype_name(t) == "int8" else float("nan")
    del src, t
    gc.collect()
    assert np.array_equal(b.bits(prob.run(packed)), want)


# ---------------------------------------------------------------------------- the BF16 op
# The BF16 op takes the same call arguments: every case of both call matrices, through it.
@pytest.fixture()
def packed16(backend, prob):
    w13 = backend.numpy(prob.w13).astype(np.float32) * backend.numpy(prob.s13)[:, :, None]
    w2 = backend.numpy(prob.w2).astype(np.float32) * backend.numpy(prob.s2)[:, :, None]
    return cpumoe.prepack_bf16(backend.asarray(w13, "bfloat16"), backend.asarray(w2, "bfloat16"),
                               prob.b13, prob.b2)


def _run16(prob, packed16, **kw):
    args = dict(x=prob.x, topk_weights=prob.topk_weights, topk_ids=prob.topk_ids,
                activation=prob.activation)
    args.update(kw)
    return cpumoe.fused_moe_bf16(args.pop("x"), packed16, args.pop("topk_weights"),
                                 args.pop("topk_ids"), **args)


def test_valid_bf16_call_first(backend, prob, packed16):
    assert tuple(_run16(prob, packed16).shape) == (T, H)


@pytest.mark.parametrize("case", list(CALL_CASES) + list(MORE_CALL_CASES),
                         ids=list(CALL_CASES) + list(MORE_CALL_CASES))
def test_bf16_call_errors(backend, prob, packed16, case):
    make, exc, name = {**CALL_CASES, **MORE_CALL_CASES}[case]
    overrides = make(backend, prob)
    sentinel = backend.full((T, H), 7.0, "float32")
    overrides.setdefault("out", sentinel)
    with pytest.raises(exc, match=rf"^{name}\b"):
        _run16(prob, packed16, **overrides)
    assert (backend.numpy(sentinel) == 7.0).all(), "out written before the error"


def test_bf16_op_refuses_int8_packed_and_back(backend, prob, packed, packed16):
    with pytest.raises(TypeError, match="^packed"):
        cpumoe.fused_moe_bf16(prob.x, packed, prob.topk_weights, prob.topk_ids)
    with pytest.raises(TypeError, match="^packed"):
        cpumoe.fused_moe_int8(prob.x, packed16, prob.topk_weights, prob.topk_ids)


def _bf16_weights(b, p):
    return (b.asarray(b.numpy(p.w13).astype(np.float32), "bfloat16"),
            b.asarray(b.numpy(p.w2).astype(np.float32), "bfloat16"))


BF16_PREPACK_CASES = {
    "w13-int8": (lambda b, p, w13, w2: dict(w13=p.w13), TypeError, "w13"),
    "w13-float32": (lambda b, p, w13, w2: dict(w13=b.cast(w13, "float32")), TypeError, "w13"),
    "w2-float16": (lambda b, p, w13, w2: dict(w2=b.cast(w2, "float16")), TypeError, "w2"),
    "w13-rank2": (lambda b, p, w13, w2: dict(w13=w13[0]), ValueError, "w13"),
    "w13-odd-2I": (lambda b, p, w13, w2: dict(w13=w13[:, :2 * I - 1]), ValueError, "w13"),
    "w2-E-mismatch": (lambda b, p, w13, w2: dict(w2=w2[:E - 1]), ValueError, "w2"),
    "w2-I-mismatch": (lambda b, p, w13, w2: dict(w2=w2[:, :, :I - 8]), ValueError, "w2"),
    "H-not-multiple-of-8": (lambda b, p, w13, w2: dict(w13=w13[:, :, :H - 4], w2=w2[:, :H - 4],
                                                      b13=None, b2=None), ValueError, "w13"),
    "b13-shape": (lambda b, p, w13, w2: dict(b13=p.b13[:, :I]), ValueError, "b13"),
    "b2-int": (lambda b, p, w13, w2: dict(b2=b.cast(p.b2, "int32")), TypeError, "b2"),
    "isa-unknown": (lambda b, p, w13, w2: dict(isa="avx9000"), ValueError, "isa"),
    "isa-not-str": (lambda b, p, w13, w2: dict(isa=3), TypeError, "isa"),
    "num-threads-zero": (lambda b, p, w13, w2: dict(num_threads=0), ValueError, "num_threads"),
}


@pytest.mark.parametrize("case", list(BF16_PREPACK_CASES), ids=list(BF16_PREPACK_CASES))
def test_bf16_prepack_errors(backend, prob, case):
    make, exc, name = BF16_PREPACK_CASES[case]
    w13, w2 = _bf16_weights(backend, prob)
    args = dict(w13=w13, w2=w2, b13=prob.b13, b2=prob.b2)
    args.update(make(backend, prob, w13, w2))
    with pytest.raises(exc, match=rf"^{name}\b"):
        cpumoe.prepack_bf16(args.pop("w13"), args.pop("w2"), **args)


# ---------------------------------------------------------------------------- size products
# Row strides whose byte spans overflow 64 bits (views of a few bytes through numpy's stride
# tricks, 2^60 elements between rows, so 3 * 2^62 bytes over 4 rows): the native checks refuse
# them by name instead of wrapping the span.
def _huge_stride(b, t, stride_elems):
    _numpy_only(b)
    return np.lib.stride_tricks.as_strided(t, shape=t.shape,
                                           strides=(stride_elems * t.itemsize, t.itemsize))


SPAN_CASES = {
    "x": lambda b, p: dict(x=_huge_stride(b, p.x, 2**60)),
    "out": lambda b, p: dict(out=_huge_stride(b, b.empty((T, H), "float32"), 2**60)),
    "topk_ids": lambda b, p: dict(topk_ids=_huge_stride(b, p.topk_ids, 2**60)),
    "topk_weights": lambda b, p: dict(topk_weights=_huge_stride(b, p.topk_weights, 2**60)),
}


@pytest.mark.parametrize("op", ["int8", "bf16"])
@pytest.mark.parametrize("name", list(SPAN_CASES))
def test_row_stride_spans_that_overflow(backend, prob, packed, packed16, op, name):
    overrides = SPAN_CASES[name](backend, prob)
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        if op == "int8":
            prob.run(packed, **overrides)
        else:
            _run16(prob, packed16, **overrides)
