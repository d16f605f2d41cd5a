"""GGUF headers that lie, written byte by byte: each is one sentence naming the file and the
field (before, an alignment of 0.5 was a ZeroDivisionError, a string of 2^64-1 bytes an
OverflowError, 2^40 a MemoryError, arrays nested thousands deep a RecursionError)."""

from __future__ import annotations

import os
import struct

import pytest

from k3tui.backends.llama.gguf import GGUFError, check_shards, read_gguf_header
from k3tui.errors import K3Error

U8, U32, F32, BOOL, STR, ARR, U64 = 0, 4, 6, 7, 8, 9, 10


def s(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str, kind: int, payload: bytes) -> bytes:
    return s(key) + struct.pack("<I", kind) + payload


def tensor(name: str, dims: list[int], ggml_type: int = 0, offset: int = 0) -> bytes:
    return (s(name) + struct.pack("<I", len(dims)) + b"".join(struct.pack("<Q", d) for d in dims)
            + struct.pack("<IQ", ggml_type, offset))


def gguf(kvs: list[bytes], tensors: list[bytes] = (), *, n_kv: int | None = None,
         n_tensors: int | None = None, tail: bytes = b"") -> bytes:
    head = b"GGUF" + struct.pack("<IQQ", 3, len(tensors) if n_tensors is None else n_tensors,
                                 len(kvs) if n_kv is None else n_kv)
    return head + b"".join(kvs) + b"".join(tensors) + tail


def nested(depth: int) -> bytes:
    """An array of one array of one array … `depth` deep, of one uint8."""
    inner = struct.pack("<IQ", U8, 1) + b"\x07"
    for _ in range(depth - 1):
        inner = struct.pack("<IQ", ARR, 1) + inner
    return inner


NAME = kv("general.name", STR, s("tiny"))

CASES = {
    "alignment-half": ([NAME, kv("general.alignment", F32, struct.pack("<f", 0.5))],
                       "general.alignment is the float32 0.5, not an integer"),
    "alignment-inf": ([kv("general.alignment", F32, struct.pack("<f", float("inf")))],
                      "general.alignment is the float32 inf, not an integer"),
    "alignment-zero": ([kv("general.alignment", U32, struct.pack("<I", 0))],
                       "general.alignment is the uint32 0, not an integer from 1"),
    "alignment-48": ([kv("general.alignment", U32, struct.pack("<I", 48))],
                     "general.alignment is 48, not a power of two"),
    "alignment-string": ([kv("general.alignment", STR, s("32"))],
                         "general.alignment is a string, not an integer"),
    "key-2^64-1": ([struct.pack("<Q", 2**64 - 1) + b"general.name"],
                   "key 0 is 18,446,744,073,709,551,615 bytes long, more than the 65,535"),
    "string-2^40": ([kv("general.name", STR, struct.pack("<Q", 2**40) + b"x" * 64)],
                    "'general.name' is 1,099,511,627,776 bytes long, more than the "
                    "67,108,864 a GGUF header allows"),
    "string-past-the-end": ([kv("general.name", STR, struct.pack("<Q", 5000) + b"x" * 64)],
                            "is 5,000 bytes long, more than the 64 left in the file"),
    "nested-5000": ([kv("tokenizer.ggml.merges", ARR, nested(5000))],
                    "'tokenizer.ggml.merges' nests arrays more than 4 deep"),
    "array-2^62": ([kv("tokenizer.ggml.scores", ARR, struct.pack("<IQ", F32, 2**62))],
                   "the length of the array 'tokenizer.ggml.scores' is "
                   "4,611,686,018,427,387,904, more than"),
    "strings-2^40": ([kv("tokenizer.ggml.tokens", ARR, struct.pack("<IQ", STR, 2**40))],
                     "the length of the array 'tokenizer.ggml.tokens' is "
                     "1,099,511,627,776, more than the 4,"),   # bytes left in the file
    "strings-2^24+1": ([kv("tokenizer.ggml.tokens", ARR, struct.pack("<IQ", STR, 2**24 + 1))],
                       "the length of the array 'tokenizer.ggml.tokens' is 16,777,217, more "
                       "than the 16,777,216 k3tui reads"),
    "keys-2^63": ([NAME], "the number of keys is 9,223,372,036,854,775,808"),
    "value-type-13": ([kv("general.x", 13, b"\0" * 8)],
                      "'general.x' has value type 13, which GGUF does not define"),
    "array-of-type-99": ([kv("general.x", ARR, struct.pack("<IQ", 99, 1))],
                         "'general.x' is an array of type 99, which GGUF does not define"),
    "split-count-float": ([kv("split.count", F32, struct.pack("<f", 3.0))],
                          "split.count is the float32 3.0, not an integer from 0 to 65,535"),
    "split-no-bool": ([kv("split.no", BOOL, b"\x01")],
                      "split.no is the bool True, not an integer"),
    "dims-2^32-1": ([NAME], "tensor 'blk.0.w' has 4,294,967,295 dimensions"),
    "cut-in-a-key": ([struct.pack("<Q", 20) + b"gen"],
                     "the number of keys is 1, more than the 11 bytes left in the file"),
    "cut-in-a-count": ([kv("general.x", ARR, struct.pack("<I", U8) + b"\1\0")],
                       "the file ends inside the length of the array 'general.x'"),
    "escape-in-a-key": ([kv("x\x1b]52;c;aGk=\x07", 13, b"")], r"'x\x1b]52;c;aGk=\x07'"),
}


def write_case(tmp_path, case: str):
    kvs, _ = CASES[case]
    path = tmp_path / "model.gguf"
    if case == "keys-2^63":
        data = gguf(kvs, n_kv=2**63)
    elif case == "dims-2^32-1":
        bad = s("blk.0.w") + struct.pack("<I", 2**32 - 1) + struct.pack("<Q", 4) * 16
        data = gguf(kvs, [bad])
    else:
        data = gguf(kvs, [tensor("blk.0.w", [8, 8])], tail=b"\0" * 4096)
        if case in ("key-2^64-1", "cut-in-a-key", "string-past-the-end", "cut-in-a-count"):
            data = gguf(kvs)
    path.write_bytes(data)
    if case == "strings-2^24+1":
        os.truncate(path, len(data) + 8 * (2**24 + 1))   # sparse: room for that many strings
    return path


@pytest.mark.parametrize("case", list(CASES))
def test_gguf_a_lying_header_is_one_sentence_naming_file_and_field(tmp_path, case):
    path = write_case(tmp_path, case)
    with pytest.raises(GGUFError) as raw:
        read_gguf_header(path)
    assert CASES[case][1] in str(raw.value), str(raw.value)
    with pytest.raises(K3Error) as info:
        check_shards(path)
    message = info.value.message
    assert message.startswith("The GGUF model is incomplete or damaged: model.gguf has an "
                              "unreadable header (") and CASES[case][1] in message, message
    assert message.count(". ") == 0 and message.endswith(".") and "\n" not in message
    assert "\x1b" not in message and "k3tui download" in info.value.next_step


def test_gguf_an_honest_header_is_still_read(tmp_path):
    """The bounds leave real files alone: a tokenizer array of strings, a nested array, an
    alignment of 64, split keys, a tensor whose data ends the file."""
    kvs = [NAME, kv("general.alignment", U32, struct.pack("<I", 64)),
           kv("tokenizer.ggml.tokens", ARR, struct.pack("<IQ", STR, 3) + s("a") + s("bc")
              + s("")),
           kv("tokenizer.ggml.scores", ARR, struct.pack("<IQ", F32, 3) + b"\0" * 12),
           kv("x.nested", ARR, nested(3)),
           kv("split.no", 2, struct.pack("<H", 0)), kv("split.count", 2, struct.pack("<H", 1)),
           kv("general.file_type", U64, struct.pack("<Q", 7))]
    head = gguf(kvs, [tensor("blk.0.w", [8, 8], ggml_type=0, offset=0)])
    start = -(-len(head) // 64) * 64
    path = tmp_path / "model.gguf"
    path.write_bytes(head + b"\0" * (start - len(head)) + b"\0" * (8 * 8 * 4))
    h = read_gguf_header(path)
    assert (h.split_no, h.split_count, h.n_tensors) == (0, 1, 1)
    assert h.expected_size == path.stat().st_size
    assert check_shards(path) == [path]
