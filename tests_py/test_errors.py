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
