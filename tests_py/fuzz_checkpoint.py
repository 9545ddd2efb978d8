"""Coverage-guided fuzz of the checkpoint loader (cpumoe.checkpoint) with atheris.

Each input replaces one file of a small valid W8A8 checkpoint (one MoE layer, 2 experts, H=16,
I=8; sharded with an index, or a single file, plus config.json) and then opens and loads it:
  mode 0  the single .safetensors file, raw bytes (truncated headers, bad JSON, lying offsets)
  mode 1  one shard of the sharded checkpoint, raw bytes
  mode 2  the index (model.safetensors.index.json), raw bytes (wrong index files)
  mode 3  config.json, raw bytes (malformed quantization configs)
  mode 4  structured: the single file rebuilt with one tensor's dtype, shape, offsets, fields or
          the file's length chosen by the input (huge shapes, wrong dtypes, offsets that lie)
Every input must end in a result or in UnsupportedCheckpoint / FileNotFoundError: any other
exception is a finding, and so are a crash, a hang (-timeout) and a memory blow-up
(-rss_limit_mb). When the safetensors package is installed, a file the loader accepts must also be
one the package reads, with the same tensors (the loader is at least as strict as the format).

CI (30 s):        python3 tests_py/fuzz_checkpoint.py -max_total_time=30
Nightly (10 min): python3 tests_py/fuzz_checkpoint.py -max_total_time=600 -timeout=10 \
                    -rss_limit_mb=1024 build/fuzz-corpus
(libFuzzer options; a corpus directory, created if missing, keeps what was found between runs.)
The package under test is the importable cpumoe (installed, or PYTHONPATH=<staged package>).
"""

from __future__ import annotations

import json
import os
import shutil
import struct
import sys
import tempfile
from pathlib import Path

import numpy as np

try:
    import atheris
except ImportError:
    print("fuzz_checkpoint: atheris is not installed (pip install atheris); skipped")
    sys.exit(0)

with atheris.instrument_imports(include=["cpumoe.checkpoint"]):
    from cpumoe import checkpoint as ck

try:
    from safetensors import safe_open
except ImportError:
    safe_open = None
try:
    import ml_dtypes  # noqa: F401 - registers bfloat16, which the package's numpy reader needs
except ImportError:
    ml_dtypes = None

E, H, I = 2, 16, 8
_NAMES = {"int8": "I8", "float32": "F32", "float16": "F16"}
CONFIG = {"quantization_config": {
    "quant_method": "compressed-tensors", "format": "int-quantized",
    "config_groups": {"group_0": {
        "targets": ["Linear"],
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                    "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                              "strategy": "token", "dynamic": True}}},
    "ignore": ["lm_head", "re:.*mlp.gate$"]}}


def _tensors() -> dict:
    rng = np.random.default_rng(0)
    out = {"model.embed_tokens.weight": np.zeros((4, H), np.float32)}
    for e in range(E):
        for proj, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            name = f"model.layers.0.mlp.experts.{e}.{proj}"
            out[name + ".weight"] = rng.integers(-127, 128, shape, dtype=np.int8)
            out[name + ".weight_scale"] = (rng.random((shape[0], 1)) * 0.01 + 1e-3).astype(
                np.float32 if e == 0 else np.float16)
            out[name + ".bias"] = rng.standard_normal(shape[0]).astype(np.float32)
    return out


def _encode(entries: list, data: bytes) -> bytes:
    """A safetensors file from (name, header entry) pairs and the data section."""
    h = json.dumps({"__metadata__": {"format": "pt"}, **dict(entries)}).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def _layout(tensors: dict):
    entries, blobs, off = [], [], 0
    for name, a in tensors.items():
        b = a.tobytes()
        entries.append((name, {"dtype": _NAMES[a.dtype.name], "shape": list(a.shape),
                               "data_offsets": [off, off + len(b)]}))
        blobs.append(b)
        off += len(b)
    return entries, b"".join(blobs)


TENSORS = _tensors()
ENTRIES, DATA = _layout(TENSORS)
SINGLE = _encode(ENTRIES, DATA)
_names = list(TENSORS)
SHARDS = [_encode(*_layout({n: TENSORS[n] for n in _names[i::2]})) for i in range(2)]
SHARD_NAMES = ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
INDEX = json.dumps({"metadata": {"total_size": len(DATA)}, "weight_map": {
    n: SHARD_NAMES[i % 2] for i, n in enumerate(_names)}}).encode()
CONFIG_BYTES = json.dumps(CONFIG).encode()

ROOT = Path(tempfile.mkdtemp(prefix="cpumoe-fuzz-", dir="/dev/shm" if os.path.isdir("/dev/shm")
                             else None))
INTERESTING = [0, 1, 2, 7, 8, 16, 255, 2**31 - 1, 2**31, 2**32, 2**32 + 8, 2**40, 2**53,
               2**63 - 1, 2**63, 2**64 - 1, 2**64, 10**30, -1, -(2**63)]
DTYPES = ["I8", "F32", "F16", "BF16", "F64", "I32", "I64", "U8", "BOOL", "F8_E4M3", "F4",
          "C64", "i8", "", "I8 "]


def _int(fdp) -> int:
    if fdp.ConsumeBool():
        return INTERESTING[fdp.ConsumeIntInRange(0, len(INTERESTING) - 1)]
    return fdp.ConsumeIntInRange(0, 4096)


def _structured(fdp) -> bytes:
    """The single file with one entry (and the file's length) chosen by the input."""
    entries = [(n, dict(e)) for n, e in ENTRIES]
    for _ in range(fdp.ConsumeIntInRange(1, 3)):
        n, e = entries[fdp.ConsumeIntInRange(0, len(entries) - 1)]
        what = fdp.ConsumeIntInRange(0, 6)
        if what == 0:
            e["dtype"] = DTYPES[fdp.ConsumeIntInRange(0, len(DTYPES) - 1)]
        elif what == 1:
            e["shape"] = [_int(fdp) for _ in range(fdp.ConsumeIntInRange(0, 4))]
        elif what == 2:
            e["data_offsets"] = [_int(fdp), _int(fdp)]
        elif what == 3 and isinstance(e.get("data_offsets"), list) and len(e["data_offsets"]) == 2:
            b, end = e["data_offsets"]
            e["data_offsets"] = [b, end + _int(fdp) if isinstance(end, int) else end]
        elif what == 4:
            e.pop(["dtype", "shape", "data_offsets"][fdp.ConsumeIntInRange(0, 2)], None)
        elif what == 5:
            e[["dtype", "shape", "data_offsets"][fdp.ConsumeIntInRange(0, 2)]] = [
                None, 1.5, "x", {}, [[1]], True][fdp.ConsumeIntInRange(0, 5)]
        elif isinstance(e.get("shape"), list) and e["shape"]:
            e["shape"] = e["shape"][::-1]
    raw = _encode(entries, DATA)
    cut = fdp.ConsumeIntInRange(0, 3)
    if cut == 1:
        raw = raw[:fdp.ConsumeIntInRange(0, len(raw))]
    elif cut == 2:
        raw += fdp.ConsumeBytes(fdp.ConsumeIntInRange(0, 64))
    return raw


def _write(folder: Path, files: dict) -> None:
    if folder.exists():
        shutil.rmtree(folder)
    folder.mkdir(parents=True)
    for name, data in files.items():
        (folder / name).write_bytes(data)


def _same_as_the_package(path: Path, c) -> None:
    """A file the loader accepted: the safetensors package must read it, with the same values."""
    if safe_open is None:
        return
    try:
        f = safe_open(str(path), framework="numpy")
        theirs = set(f.keys())
    except Exception as e:  # noqa: BLE001 - a disagreement is the finding
        raise AssertionError(f"cpumoe accepted a file the safetensors package refuses: {e!r}")
    assert theirs == set(c.keys()), (theirs, c.keys())
    for name in theirs:
        st = c.dtype(name)
        if st not in ck._ST_DTYPES or (st == "BF16" and ml_dtypes is None):
            continue
        a, b = c.get(name), f.get_tensor(name)
        assert a.shape == b.shape, name
        assert a.tobytes() == np.ascontiguousarray(b).tobytes(), name


def _exercise(path: Path, single: bool) -> None:
    c = ck.Checkpoint(path)
    c.keys()
    c.moe_layers()
    for name in c.keys():
        if c.dtype(name) in ck._ST_DTYPES:
            c.get(name)
    if single:
        _same_as_the_package(path, c)
    for activation in ("silu", "swigluoai"):
        w = ck.load_moe_layer(c, 0, activation=activation)
        assert w.w13.shape == (w.num_experts, 2 * w.intermediate, w.hidden)
        assert w.w2.shape == (w.num_experts, w.hidden, w.intermediate)
        assert w.s13.shape == (w.num_experts, 2 * w.intermediate)


def one_input(data: bytes) -> None:
    if not data:
        return
    mode, raw = data[0] % 5, data[1:]  # the first byte picks the mode, the rest is its input
    folder = ROOT / "ck"
    if mode == 4:
        files, single = {"model.safetensors": _structured(atheris.FuzzedDataProvider(raw))}, True
    else:
        if mode == 0:
            files, single = {"model.safetensors": raw}, True
        else:
            files = {SHARD_NAMES[0]: SHARDS[0], SHARD_NAMES[1]: SHARDS[1],
                     "model.safetensors.index.json": INDEX}
            files[{1: SHARD_NAMES[0], 2: "model.safetensors.index.json",
                   3: "config.json"}[mode]] = raw
            single = False
    files.setdefault("config.json", CONFIG_BYTES)
    _write(folder, files)
    target = folder / "model.safetensors" if single else folder
    try:
        _exercise(target, single)
    except (ck.UnsupportedCheckpoint, FileNotFoundError):
        pass


def _seed_corpus(corpus: Path) -> None:
    """The valid files, one per mode, so that mutation starts from real checkpoints."""
    corpus.mkdir(parents=True, exist_ok=True)
    for mode, raw in ((0, SINGLE), (1, SHARDS[0]), (2, INDEX), (3, CONFIG_BYTES)):
        (corpus / f"seed-mode{mode}").write_bytes(bytes([mode]) + raw)
    (corpus / "seed-mode4").write_bytes(bytes([4]) + bytes(64))


def main() -> None:
    argv = list(sys.argv)
    dirs = [a for a in argv[1:] if not a.startswith("-")]
    if not dirs:  # no corpus given: a temporary one, seeded
        corpus = ROOT / "corpus"
        argv.append(str(corpus))
    else:
        corpus = Path(dirs[0])
    _seed_corpus(corpus)
    # Sanity: the unmodified checkpoints load (else the fuzz would only ever see refusals).
    for mode in range(4):
        one_input(bytes([mode]) + (SINGLE, SHARDS[0], INDEX, CONFIG_BYTES)[mode])
    _write(ROOT / "ck", {"model.safetensors": SINGLE, "config.json": CONFIG_BYTES})
    _exercise(ROOT / "ck" / "model.safetensors", True)
    try:
        atheris.Setup(argv, one_input)
        atheris.Fuzz()
    finally:
        shutil.rmtree(ROOT, ignore_errors=True)


if __name__ == "__main__":
    main()
