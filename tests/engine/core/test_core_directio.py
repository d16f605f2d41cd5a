"""Real O_DIRECT reads: alignment, correctness at odd offsets, errors, page cache never grows."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest

from engine.errors import ReadError
from engine.core.directio import (
    ALIGN,
    DirectFile,
    FileTable,
    Layout,
    ReadPool,
    TensorSpec,
    aligned_buffer,
)


def _cached_bytes(path: Path) -> int:
    out = subprocess.run(["fincore", "-b", "-n", "-o", "RES", str(path)],
                         capture_output=True, text=True, check=True).stdout
    return int(out.strip() or 0)


@pytest.fixture
def data_file(tmp_path) -> tuple[Path, bytes]:
    rng = np.random.default_rng(1)
    data = rng.integers(0, 256, 6 * 1024 * 1024 + 123, dtype=np.uint8).tobytes()
    path = tmp_path / "blob.bin"
    with open(path, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    fd = os.open(path, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    os.close(fd)
    return path, data


def test_stream_aligned_buffer_is_page_aligned():
    for n in (1, 4095, 4097, 3 << 20):
        buf = aligned_buffer(n)
        assert buf.ctypes.data % ALIGN == 0
        assert buf.nbytes >= n and buf.nbytes % ALIGN == 0


def test_stream_layout_reads_odd_offsets_exactly(data_file):
    path, data = data_file
    # Tensors at unaligned offsets, two adjacent (one run) and one apart, one near EOF.
    specs = [
        TensorSpec("a", path, 5, 4000, np.dtype("u1"), (4000,)),
        TensorSpec("b", path, 4005, 8192, np.dtype("<u2"), (4096,)),
        TensorSpec("c", path, 1_000_001, 40_000, np.dtype("<f4"), (100, 100)),
        TensorSpec("d", path, len(data) - 123, 120, np.dtype("u1"), (120,)),
    ]
    lay = Layout(specs)
    assert len(lay.runs) == 3  # a+b coalesced
    files = FileTable()
    pool = ReadPool(4, chunk=ALIGN * 4)  # tiny chunks: many concurrent pieces
    buf = aligned_buffer(lay.nbytes)
    pool.submit(lay.reads(files, buf)).wait()
    views = lay.views(buf)
    for s in specs:
        assert views[s.name].dtype == s.dtype and views[s.name].shape == s.shape
        assert views[s.name].tobytes() == data[s.offset:s.offset + s.nbytes], s.name
    assert files.get(path).direct  # ext4 here: the real O_DIRECT path was used
    pool.close()
    files.close()


def test_stream_direct_reads_leave_no_page_cache(data_file):
    path, data = data_file
    f = DirectFile(path)
    assert f.direct
    buf = aligned_buffer(len(data))
    f.read_into(buf[: 4 << 20], 0, 4 << 20)
    assert _cached_bytes(path) == 0
    # The buffered fallback (filesystems without O_DIRECT) drops what it read.
    f.fall_back_to_buffered()
    f.read_into(buf[: 4 << 20], ALIGN, 4 << 20)
    assert bytes(buf[: 4 << 20]) == data[ALIGN:ALIGN + (4 << 20)]
    assert _cached_bytes(path) == 0
    f.close()


def test_stream_short_read_is_a_clear_error(data_file, tmp_path):
    path, data = data_file
    short = tmp_path / "short.bin"
    shutil.copy(path, short)
    spec = TensorSpec("x", short, len(data) - 1000, 900, np.dtype("u1"), (900,))
    lay = Layout([spec])
    os.truncate(short, len(data) - 2000)  # the file shrank after it was indexed
    files = FileTable()
    pool = ReadPool(2)
    batch = pool.submit(lay.reads(files, aligned_buffer(lay.nbytes)))
    with pytest.raises(ReadError, match="short read.*truncated"):
        batch.wait()
    pool.close()


def test_stream_pool_error_in_one_job_fails_the_batch(data_file, tmp_path):
    path, data = data_file
    files = FileTable()
    pool = ReadPool(3, chunk=ALIGN)
    good = Layout([TensorSpec("g", path, 0, 3 * ALIGN, np.dtype("u1"), (3 * ALIGN,))])
    bad = Layout([TensorSpec("b", path, len(data) + ALIGN, 10, np.dtype("u1"), (10,))])
    buf = aligned_buffer(good.nbytes + bad.nbytes)
    reads = good.reads(files, buf[: good.nbytes]) + bad.reads(files, buf[good.nbytes:])
    with pytest.raises(ReadError):
        pool.submit(reads).wait()
    ok = pool.submit(good.reads(files, buf[: good.nbytes]))
    ok.wait()  # the pool survives an error
    assert bytes(buf[: 3 * ALIGN]) == data[: 3 * ALIGN]
    assert pool.bytes_read >= 3 * ALIGN
    pool.close()


def test_stream_batch_check_runs_once_every_read_landed_and_can_fail_it(data_file):
    """`then` sees the whole batch's bytes (it runs after the last chunk, on a reader); a
    ReadError from it fails the batch, and it never runs for a read that failed."""
    path, data = data_file
    files, pool = FileTable(), ReadPool(3, chunk=1 << 20)
    try:
        lay = Layout([TensorSpec("x", path, 0, 4 << 20, np.dtype("u1"), (4 << 20,))])
        seen = []
        buf = aligned_buffer(lay.nbytes)
        pool.submit(lay.reads(files, buf), (1,), then=lambda: seen.append(bytes(buf[:4 << 20]))
                    ).wait()
        assert seen == [data[:4 << 20]]

        def refuse():
            raise ReadError("these bytes do not match")

        with pytest.raises(ReadError, match="do not match"):
            pool.submit(lay.reads(files, aligned_buffer(lay.nbytes)), (1,), then=refuse).wait()
        past = Layout([TensorSpec("y", path, len(data) - 10, 4096, np.dtype("u1"), (4096,))])
        ran = []
        with pytest.raises(ReadError, match="short read"):
            pool.submit(past.reads(files, aligned_buffer(past.nbytes)), (1,),
                        then=lambda: ran.append(1)).wait()
        assert ran == []
    finally:
        pool.close()
        files.close()
