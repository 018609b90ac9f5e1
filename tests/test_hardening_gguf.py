"""Hostile GGUF metadata (issue 43, items 2 and 4): head counts and sizes are validated (> 0,
divisible) before anything divides by them, and every array length and tensor size is checked
against the file's size before anything is allocated or iterated (models/gguf_layout.py). Each
case is a one-line error (CLI: exit 2) or a success; never a traceback, never a hang. A fuzz test
(hypothesis, bounded) mutates metadata values and raw header bytes."""
from __future__ import annotations

import struct
import time
from pathlib import Path

import numpy as np
import pytest

gguf = pytest.importorskip("gguf")
hypothesis = pytest.importorskip("hypothesis", reason="the fuzz tests need hypothesis (pip install 'edgespec[test]')")
from gguf import GGUFReader, GGUFValueType, GGUFWriter  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from edgespec.bundle import load_bundle  # noqa: E402
from edgespec.errors import EdgespecError, ExportError  # noqa: E402
from edgespec.models.gguf_layout import GGML_BLOCKS, GGUFLayoutError, check_gguf_layout  # noqa: E402
from tests.test_hardening import cli, one_line_error  # noqa: E402

U32, F32, STR, ARR = GGUFValueType.UINT32, GGUFValueType.FLOAT32, GGUFValueType.STRING, GGUFValueType.ARRAY


def tiny_gguf(zoo) -> Path:
    """A tiny random Llama as an fp32 GGUF (edgespec's own writer)."""
    bundle = zoo.bundle("llama", None, formats=("gguf",))
    return bundle / load_bundle(bundle).manifest.target.formats["gguf"].file


def rewrite(src: Path, dst: Path, changes: dict) -> None:
    """`src` written again as `dst` with metadata `changes`: key -> (value, type, array item type),
    a value of None dropping the key."""
    r = GGUFReader(str(src))
    w = GGUFWriter(str(dst), str(r.fields["general.architecture"].contents()))
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture" or key in changes:
            continue
        sub = f.types[-1] if f.types[0] == ARR else None
        w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    for key, (value, kind, sub) in changes.items():
        if value is not None:
            w.add_key_value(key, value, kind, sub_type=sub)
    for t in r.tensors:
        w.add_tensor(t.name, t.data, raw_shape=[int(x) for x in reversed(t.shape)], raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def claim(path: Path, key: str, count: int) -> None:
    """Make the array `key` claim `count` entries, in place (the bytes after it stay)."""
    data = bytearray(path.read_bytes())
    at = data.index(key.encode()) + len(key)
    assert struct.unpack_from("<I", data, at)[0] == 9  # an array
    struct.pack_into("<Q", data, at + 8, count)
    path.write_bytes(bytes(data))


def load(path: Path):
    from edgespec.exporters.sources import load_source

    return load_source(path)


def one_line(e: BaseException) -> str:
    msg = str(e)
    assert msg and "\n" not in msg, msg
    return msg


@pytest.fixture
def src(zoo) -> Path:
    return tiny_gguf(zoo)


@pytest.mark.parametrize("changes, needle", [
    ({"llama.attention.head_count": (0, U32, None)}, "'llama.attention.head_count' must be an integer >= 1, got 0"),
    ({"llama.attention.head_count_kv": (0, U32, None)}, "'llama.attention.head_count_kv' must be an integer >= 1"),
    ({"llama.attention.head_count_kv": (3, U32, None)}, "is not a multiple of 'llama.attention.head_count_kv' (3)"),
    ({"llama.attention.head_count": ("four", STR, None)}, "must be an integer >= 1, got 'four'"),
    ({"llama.attention.head_count": ([4, 4], ARR, U32)}, "must be an integer >= 1, got [4, 4]"),
    ({"llama.attention.key_length": (7, U32, None), "llama.attention.value_length": (7, U32, None)},
     "is not supported: keys and values of one even size"),
    ({"llama.attention.key_length": (None, U32, None), "llama.embedding_length": (30, U32, None)},
     "is not a multiple of 'llama.attention.head_count'"),
    ({"llama.block_count": (0, U32, None)}, "'llama.block_count' must be an integer >= 1"),
    ({"llama.block_count": (1, U32, None)}, "is past the 1 layers its block_count says"),
    ({"llama.block_count": (5, U32, None)}, "has no q_proj weight for layer 2"),
    ({"llama.attention.head_count": (2, U32, None), "llama.attention.head_count_kv": (2, U32, None),
      "llama.attention.key_length": (8, U32, None), "llama.attention.value_length": (8, U32, None),
      "llama.rope.dimension_count": (8, U32, None)}, "but the metadata's head counts give"),
    ({"llama.embedding_length": (None, U32, None)}, "has no 'llama.embedding_length' metadata"),
    ({"llama.block_count": (75_685_787, U32, None)}, "is 75685787, more layers than the file has tensors"),
    ({"llama.attention.layer_norm_rms_epsilon": (float("nan"), F32, None)}, "must be a finite number > 0"),
    ({"llama.rope.freq_base": (-1.0, F32, None)}, "'llama.rope.freq_base' must be a finite number > 0"),
    ({"llama.feed_forward_length": (0, U32, None)}, "'llama.feed_forward_length' must be an integer >= 1"),
    ({"llama.context_length": ("long", STR, None)}, "'llama.context_length' must be an integer >= 1"),
])
def test_bad_head_counts_and_sizes_are_one_line_export_errors(src, tmp_path, changes, needle):
    bad = tmp_path / "bad.gguf"
    rewrite(src, bad, changes)
    with pytest.raises(ExportError) as info:
        load(bad)
    assert needle in one_line(info.value)


def test_head_count_zero_is_exit_2_on_the_cli_and_writes_nothing(src, tmp_path):
    bad = tmp_path / "bad.gguf"
    rewrite(src, bad, {"llama.attention.head_count": (0, U32, None)})
    proc = cli("export", "--target", str(bad), "-o", str(tmp_path / "out"))
    one_line_error(proc, "'llama.attention.head_count' must be an integer >= 1, got 0")
    assert proc.returncode == 2 and sorted(p.name for p in tmp_path.iterdir()) == ["bad.gguf"]


@pytest.mark.parametrize("key, item", [("tokenizer.ggml.scores", F32), ("tokenizer.ggml.tokens", STR)])
def test_an_array_claiming_2_to_the_40_entries_is_refused_at_once(src, tmp_path, key, item):
    """gguf-py would iterate 2^40 entries (days); the layout walk refuses the count first."""
    bad = tmp_path / "big.gguf"
    n = len(GGUFReader(str(src)).fields["tokenizer.ggml.tokens"].contents())
    values = [0.0] * n if item == F32 else None
    rewrite(src, bad, {key: (values, ARR, item)} if values is not None else {})
    claim(bad, key, 1 << 40)
    start = time.monotonic()
    proc = cli("export", "--target", str(bad), "-o", str(tmp_path / "out"))
    one_line_error(proc, f"metadata '{key}' claims 1099511627776 entries")
    assert proc.returncode == 2 and time.monotonic() - start < 120
    assert not (tmp_path / "out").exists()


def test_a_truncated_gguf_is_refused_before_its_tensors_are_read(src, tmp_path):
    bad = tmp_path / "cut.gguf"
    data = src.read_bytes()
    bad.write_bytes(data[:len(data) - 1000])
    with pytest.raises(ExportError, match=r"claims \d+ bytes at offset \d+, past the end of the file"):
        load(bad)
    bad.write_bytes(data[:20])
    with pytest.raises(ExportError, match="too short for a GGUF header"):
        load(bad)
    bad.write_bytes(b"")
    with pytest.raises(ExportError, match="is not a GGUF file"):
        load(bad)


def test_the_layout_walk_agrees_with_gguf_py(src):
    layout = check_gguf_layout(src)
    reader = GGUFReader(str(src))
    assert layout.data_offset == reader.data_offset and layout.n_tensors == len(reader.tensors)
    assert GGML_BLOCKS == {int(k): v for k, v in gguf.GGML_QUANT_SIZES.items()}


# -- fuzz: metadata values of any type, and raw header bytes -----------------------------------

_KEYS = ["llama.attention.head_count", "llama.attention.head_count_kv", "llama.attention.key_length",
         "llama.attention.value_length", "llama.embedding_length", "llama.block_count", "llama.feed_forward_length",
         "llama.context_length", "llama.rope.freq_base", "llama.rope.dimension_count",
         "llama.attention.layer_norm_rms_epsilon", "llama.rope.scaling.factor", "llama.rope.scaling.type",
         "llama.attention.sliding_window", "llama.attention.sliding_window_pattern", "general.alignment",
         "tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.model", "tokenizer.ggml.pre",
         "tokenizer.ggml.add_bos_token", "tokenizer.chat_template", "general.file_type"]
_VALUES = st.one_of(
    st.none().map(lambda _: (None, U32, None)),  # the key dropped
    st.integers(0, 2**32 - 1).map(lambda v: (v, U32, None)),
    st.integers(-2**31, 2**31 - 1).map(lambda v: (v, GGUFValueType.INT32, None)),
    st.floats(width=32).map(lambda v: (v, F32, None)),
    st.booleans().map(lambda v: (v, GGUFValueType.BOOL, None)),
    st.text(max_size=12).map(lambda v: (v, STR, None)),
    st.lists(st.integers(0, 70), max_size=6).map(lambda v: (v, ARR, U32)),
)


def _outcome(path: Path) -> None:
    """Success, or one line of an edgespec error; anything else fails the test."""
    try:
        load(path)
    except EdgespecError as e:
        one_line(e)


@settings(max_examples=40, deadline=20000, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(changes=st.dictionaries(st.sampled_from(_KEYS), _VALUES, min_size=1, max_size=3))
def test_fuzz_gguf_metadata_values(src, tmp_path, changes):
    bad = tmp_path / "fuzz.gguf"
    try:
        rewrite(src, bad, changes)
    except (ValueError, TypeError, OverflowError, struct.error):
        return  # gguf-py's writer refuses the combination itself: no file to read
    _outcome(bad)


@settings(max_examples=40, deadline=20000, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(data=st.data())
def test_fuzz_gguf_header_bytes(src, tmp_path, data):
    """Bytes of the header (counts, lengths, types, names, the tokenizer's strings) overwritten."""
    raw = bytearray(src.read_bytes())
    header = check_gguf_layout(src).data_offset
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, header - 8))
        raw[at:at + 8] = data.draw(st.binary(min_size=1, max_size=8)).ljust(8, b"\xff")[:8]
    bad = tmp_path / "bytes.gguf"
    bad.write_bytes(bytes(raw))
    _outcome(bad)


def test_check_gguf_layout_errors_are_value_errors_of_one_line(tmp_path):
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"GGUF" + struct.pack("<IQQ", 3, 0, 1 << 62) + np.zeros(16, np.uint8).tobytes())
    with pytest.raises(GGUFLayoutError) as info:
        check_gguf_layout(bad)
    assert "the metadata claims 4611686018427387904 entries" in one_line(info.value)
