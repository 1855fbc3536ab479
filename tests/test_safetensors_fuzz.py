"""Hypothesis fuzz of the safetensors readers against safetensors.safe_open: mutated headers and
bytes of a valid file (offsets shifted, swapped, overlapping, gapped; sizes, shapes and dtypes
wrong; header length, padding and JSON broken; files truncated or extended). load_model's header
reader and load_checkpoint accept no file that safe_open rejects, and where both accept, they
return safe_open's tensors byte for byte; a refused load_checkpoint leaves the model as it was.

Bounded in CI (derandomized: a fixed seed, EXAMPLES examples per test); `pytest -m nightly` runs
the nightly test, NIGHTLY_EXAMPLES examples through both readers."""

from __future__ import annotations

import json
import os
import re
import struct

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
safetensors = pytest.importorskip("safetensors")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import ramstream  # noqa: E402
from ramstream._tensorfile import _DTYPES  # noqa: E402
from ramstream.integrations.safetensors_files import read_header  # noqa: E402
from ramstream.integrations.tensor_reads import read_into  # noqa: E402

EXAMPLES = 150  # per test in CI: about 2 s each on a 2-core machine
NIGHTLY_EXAMPLES = 5000  # `pytest -m nightly tests/test_safetensors_fuzz.py`: 20-50 s


def _settings(n: int):
    return settings(
        max_examples=n,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=[
            HealthCheck.too_slow,
            HealthCheck.data_too_large,
            HealthCheck.function_scoped_fixture,
        ],
    )


class Tiny(torch.nn.Module):
    """Tensors of every width, two of the same byte size (so that swapped offsets make a valid
    file), a scalar and an empty one."""

    def __init__(self, seed: int = 0) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(seed)
        self.a = torch.nn.Parameter(torch.randn(3, 4, generator=g))
        self.b = torch.nn.Parameter(torch.randn(4, 3, generator=g))
        self.h = torch.nn.Parameter(torch.randn(5, generator=g).to(torch.bfloat16))
        self.register_buffer("f", torch.randn(3, generator=g).to(torch.float16))
        self.register_buffer("i", torch.arange(6, dtype=torch.int64) * (seed + 1))
        self.register_buffer("m", torch.tensor([True, False, seed % 2 == 0]))
        self.register_buffer("e", torch.zeros(0, 2))
        self.register_buffer("s", torch.tensor(2.5 + seed, dtype=torch.float64))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(checkpoint folder of Tiny(seed=1), [its model file's bytes, the same tensors written by
    safetensors.torch.save_file])."""
    from safetensors.torch import save_file

    folder = str(tmp_path_factory.mktemp("fuzz") / "ck")
    ramstream.save_checkpoint(folder, Tiny(seed=1))
    other = os.path.join(os.path.dirname(folder), "save_file.safetensors")
    save_file(Tiny(seed=1).state_dict(), other, metadata={"format": "pt"})
    blobs = []
    for path in (os.path.join(folder, "model.safetensors"), other):
        with open(path, "rb") as f:
            blobs.append(f.read())
    return folder, blobs


def _split(blob: bytes) -> tuple[dict, bytes, bytes]:
    (n,) = struct.unpack("<Q", blob[:8])
    raw = blob[8 : 8 + n]
    return json.loads(raw), raw[len(raw.rstrip(b" ")) :], blob[8 + n :]


# ---- mutations -----------------------------------------------------------------------------------
WEIRD_INT = st.one_of(
    st.integers(-4, 120),
    st.sampled_from([-1, 2**31, 2**63, 2**64 - 1, 2**64, 10**30, 1.0, 8.0, "8", None, True, False]),
)
DTYPES = st.one_of(
    st.sampled_from(list(_DTYPES)),
    st.sampled_from(["f32", "U16", "U32", "U64", "F8_E4M3", "F8_E5M2", "C64", "", "FLOAT", 5, None, ["F32"]]),
)
WEIRD_VALUE = st.sampled_from([None, [], {}, "x", 3, 2.5, True, [0], [0, 1, 2], "0,8", {"a": 1}])
TOKENS = ["-0", "1e1", "8.0", "NaN", "Infinity", "-1", "01", "1" + "0" * 25, '"8"', "true", "null", "[]"]
JSON = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**65), 2**65)
    | st.floats(allow_nan=False)
    | st.text(max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8,
)


@st.composite
def mutated(draw, blobs: list[bytes]) -> bytes:
    header, pad, data = _split(draw(st.sampled_from(blobs)))
    data = bytearray(data)
    names = [k for k in header if k != "__metadata__"]
    text_ops, byte_ops = [], []
    for _ in range(draw(st.integers(1, 3))):
        op = draw(
            st.sampled_from(
                [
                    "shift", "swap", "overlap", "offset", "offsets", "shape", "dtype", "field",
                    "entry", "drop", "add", "rename", "metadata", "flip", "truncate", "append",
                    "length", "pad", "junk", "token", "dup",
                ]
            )
        )  # fmt: skip
        names = [k for k in header if k != "__metadata__"] or names
        name = draw(st.sampled_from(names))
        info = header.get(name)
        ok = isinstance(info, dict)
        if op == "shift" and ok and isinstance(info.get("data_offsets"), list):
            d = draw(st.integers(-16, 16).filter(bool))
            which = draw(st.sampled_from([(0,), (1,), (0, 1)]))
            info["data_offsets"] = [
                o + d if i in which and isinstance(o, int) else o for i, o in enumerate(info["data_offsets"])
            ]
        elif op == "swap" and ok:
            other = header.get(draw(st.sampled_from(names)))
            if isinstance(other, dict) and "data_offsets" in other and "data_offsets" in info:
                info["data_offsets"], other["data_offsets"] = other["data_offsets"], info["data_offsets"]
        elif op == "overlap" and ok:
            other = header.get(draw(st.sampled_from(names)))
            if isinstance(other, dict) and "data_offsets" in other:
                v = other["data_offsets"]
                info["data_offsets"] = list(v) if isinstance(v, list) else v
        elif op == "offset" and ok and isinstance(info.get("data_offsets"), list) and info["data_offsets"]:
            info["data_offsets"][draw(st.integers(0, len(info["data_offsets"]) - 1))] = draw(WEIRD_INT)
        elif op == "offsets" and ok:
            info["data_offsets"] = draw(WEIRD_VALUE)
        elif op == "shape" and ok and isinstance(info.get("shape"), list):
            shape = info["shape"]
            how = draw(st.sampled_from(["append", "drop", "set", "replace"]))
            if how == "append":
                shape.append(draw(st.sampled_from([0, 1, 2])))
            elif how == "drop" and shape:
                shape.pop()
            elif how == "set" and shape:
                shape[draw(st.integers(0, len(shape) - 1))] = draw(WEIRD_INT)
            else:
                info["shape"] = draw(WEIRD_VALUE)
        elif op == "dtype" and ok:
            info["dtype"] = draw(DTYPES)
        elif op == "field" and ok:
            if draw(st.booleans()) and info:
                del info[draw(st.sampled_from(sorted(info)))]
            else:
                info[draw(st.sampled_from(["foo", "dtype", "shape"]))] = draw(JSON)
        elif op == "entry":
            header[name] = draw(st.one_of(WEIRD_VALUE, JSON))
        elif op == "drop":
            header.pop(name, None)
        elif op == "add":
            k = draw(st.integers(0, 9))
            begin = draw(st.sampled_from([len(data), 0, max(0, len(data) - k)]))
            header[draw(st.sampled_from(["new", "a", "__metadata__x"]))] = {
                "dtype": "U8",
                "shape": [k],
                "data_offsets": [begin, begin + k],
            }
            data += bytes(draw(st.integers(0, k)))
        elif op == "rename":
            header[draw(st.sampled_from(["z", "a.b", "", "b"]))] = header.pop(name, None)
        elif op == "metadata":
            header["__metadata__"] = draw(
                st.one_of(
                    WEIRD_VALUE,
                    st.dictionaries(st.text(max_size=3), st.text(max_size=3), max_size=2),
                    st.sampled_from(
                        [{"format": "pt"}, {"ramstream_ties": "{"}, {"ramstream_ties": '{"a": "zz"}'}]
                    ),
                )
            )
        elif op == "flip" and data:
            i = draw(st.integers(0, len(data) - 1))
            data[i] ^= draw(st.integers(1, 255))
        elif op in ("truncate", "append", "length", "pad", "junk", "token", "dup"):
            (text_ops if op in ("token", "dup", "junk", "pad") else byte_ops).append(
                (op, draw(st.integers(0, 1 << 16)), draw(st.integers(-9, 9)), draw(st.sampled_from(TOKENS)))
            )
    text = json.dumps(header, separators=(",", ":"))
    raw = text.encode() + pad
    for op, r, d, token in text_ops:
        if op == "token":
            spots = [m.span() for m in re.finditer(r"\d+", text)]
            if spots:
                a, b = spots[r % len(spots)]
                text = text[:a] + token + text[b:]
                raw = text.encode() + pad
        elif op == "dup" and names:
            k = names[r % len(names)]
            text = text[:1] + json.dumps(k) + ':{"dtype":"U8","shape":[0],"data_offsets":[0,0]},' + text[1:]
            raw = text.encode() + pad
        elif op == "pad":
            raw = text.encode() + [b" " * (r % 9), b"\n\t\r ", b"\0", b" x", b"  }"][r % 5]
            raw = (b" " + raw) if d > 0 else raw
        elif op == "junk":
            raw = [b"", b"{", b"[]", b"\xef\xbb\xbf" + raw, b"\xff" + raw[1:], raw[: r % max(1, len(raw))]][
                r % 6
            ]
    n = len(raw)
    out = bytearray(struct.pack("<Q", n) + raw + bytes(data))
    for op, r, d, _ in byte_ops:
        if op == "truncate":
            del out[r % max(1, len(out)) :]
        elif op == "append":
            out += bytes(1 + r % 9)
        elif op == "length" and len(out) >= 8:
            n2 = [n + d, n + d * 8, 2**64 - 1, 100_000_001, len(out)][r % 5]
            out[:8] = struct.pack("<Q", max(0, n2) % 2**64)
    return bytes(out)


# ---- the oracle and the readers -------------------------------------------------------------------
def _safe_open(path: str) -> dict | None:
    """safe_open's tensors, or None when it refuses the file."""
    try:
        with safetensors.safe_open(path, framework="pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}
    except Exception:  # its verdict, whatever its error type
        return None


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit; a bool byte other than 0 and 1 (a flipped byte) counts as True, as a copy
    (load_state_dict) makes it 1."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.bool:
        return torch.equal(_bytes(a) != 0, _bytes(b) != 0)
    return torch.equal(_bytes(a), _bytes(b))


def _load_model_reader(path: str) -> dict:
    """What load_model reads: the checked header, then each tensor's bytes (pread)."""
    header, start = read_header(path)
    out = {}
    for name, info in header.items():
        t = torch.empty(info["shape"], dtype=_DTYPES[info["dtype"]])
        read_into(path, start + info["data_offsets"][0], t.view(-1))
        out[name] = t
    return out


# where safe_open accepts a file and we refuse it, the refusal is one of these stricter rules
_STRICTER = re.compile(r"is not supported; accepted|appears twice|the header entry has fields")


def _write(tmp: str, blob: bytes) -> str:
    with open(tmp, "wb") as f:
        f.write(blob)
    return tmp


def _check_load_model_reader(blob: bytes, path: str) -> None:
    ref = _safe_open(_write(path, blob))
    try:
        got = _load_model_reader(path)
    except ValueError as e:
        assert ref is None or _STRICTER.search(str(e)), f"safe_open accepts it: {e}"
        assert path in str(e)
        return
    assert ref is not None, "load_model's reader accepted a file safe_open refuses"
    assert got.keys() == ref.keys()
    for k in ref:
        assert _same(got[k], ref[k]), k


def _state(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _check_load_checkpoint(blob: bytes, folder: str) -> None:
    path = os.path.join(folder, "model.safetensors")
    ref = _safe_open(_write(path, blob))
    model = Tiny(seed=0)
    before = _state(model)
    try:
        ramstream.load_checkpoint(folder, model)
    except ValueError as e:
        assert path in str(e), e
        after = model.state_dict()
        assert all(_same(before[k], after[k]) for k in before), "a refused load changed the model"
        return
    assert ref is not None, "load_checkpoint accepted a model file safe_open refuses"
    sd = model.state_dict()
    for k, v in sd.items():
        want = ref[k] if ref[k].dtype == v.dtype else ref[k].to(v.dtype)
        assert _same(v, want), k


# ---- the tests -----------------------------------------------------------------------------------
def test_the_base_files_load_and_a_swap_of_equal_sizes_is_a_valid_file(base, tmp_path):
    folder, (blob, other) = base
    _check_load_model_reader(blob, str(tmp_path / "x.safetensors"))
    _check_load_model_reader(other, str(tmp_path / "x.safetensors"))
    _check_load_checkpoint(other, folder)
    model = Tiny(seed=0)
    _check_load_checkpoint(blob, folder)  # leaves the folder as it was
    ramstream.load_checkpoint(folder, model)
    assert all(_same(a, b) for a, b in zip(model.state_dict().values(), Tiny(seed=1).state_dict().values()))
    header, pad, data = _split(blob)
    assert pad.strip() == b"" and len(pad) > 0  # the writer pads its header with spaces
    header["a"]["data_offsets"], header["b"]["data_offsets"] = (
        header["b"]["data_offsets"],
        header["a"]["data_offsets"],
    )
    raw = json.dumps(header).encode()
    swapped = struct.pack("<Q", len(raw)) + raw + data
    _check_load_model_reader(swapped, str(tmp_path / "x.safetensors"))  # valid: both accept
    assert _safe_open(str(tmp_path / "x.safetensors")) is not None


@_settings(EXAMPLES)
@given(data=st.data())
def test_load_model_reader_accepts_nothing_safe_open_refuses(base, tmp_path_factory, data):
    _, blobs = base
    _check_load_model_reader(
        data.draw(mutated(blobs)), str(tmp_path_factory.getbasetemp() / "lm.safetensors")
    )


@_settings(EXAMPLES)
@given(data=st.data())
def test_load_checkpoint_accepts_no_model_file_safe_open_refuses(base, data):
    folder, blobs = base
    _check_load_checkpoint(data.draw(mutated(blobs)), folder)


@pytest.fixture
def nightly(request):
    if "nightly" not in (request.config.getoption("markexpr") or ""):
        pytest.skip("the nightly count runs with -m nightly")


@pytest.mark.nightly
@_settings(NIGHTLY_EXAMPLES)
@given(data=st.data())
def test_nightly_both_readers_against_safe_open(base, tmp_path_factory, nightly, data):
    folder, blobs = base
    b = data.draw(mutated(blobs))
    _check_load_model_reader(b, str(tmp_path_factory.getbasetemp() / "lm.safetensors"))
    _check_load_checkpoint(b, folder)
