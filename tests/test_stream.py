"""The byte-moving parts of the writers: copies on and off the 64 KB grid, the read-back check, zip padding."""

from __future__ import annotations

import mmap
import os
import struct
import sys
import zlib

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from ckpt_doctor.errors import WriteError
from ckpt_doctor.writers import stream
from ckpt_doctor.writers.stream import FOLIO, WrittenRanges, copy_range, crc_range, preallocate
from ckpt_doctor.writers.torch_writer import ALIGN, _local_header

PAGE = 4096

SOURCE = os.urandom(3 * FOLIO + 4321)
# The same monkeypatching holds for every example, so a function-scoped fixture is what is wanted.
SAME_PATCH = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    path = tmp_path_factory.mktemp("stream") / "source.bin"
    path.write_bytes(SOURCE)
    fd = os.open(path, os.O_RDONLY)
    yield fd
    os.close(fd)


@pytest.mark.parametrize("kernel", [True, False], ids=["copy_file_range", "read-write"])
@settings(max_examples=60, **SAME_PATCH)
@given(src_offset=st.integers(0, 2 * FOLIO), dst_offset=st.integers(0, 2 * FOLIO), nbytes=st.integers(0, FOLIO + 99),
       phase_matched=st.booleans(), known=st.booleans())
def test_copy_range_copies_exactly(source, tmp_path_factory, monkeypatch, kernel, src_offset, dst_offset, nbytes,
                                   phase_matched, known):
    # Same phase on the 64 KB grid takes the kernel's copy (when there is one), any other the buffer; both exact.
    if phase_matched:
        dst_offset = dst_offset - dst_offset % FOLIO + src_offset % FOLIO
    monkeypatch.setattr(stream, "COPY_BUFFER", 3000)  # several rounds through the buffer
    if not kernel:
        monkeypatch.delattr(os, "copy_file_range", raising=False)
    data = SOURCE[src_offset:src_offset + nbytes]
    out = tmp_path_factory.mktemp("copy") / "out.bin"
    fd = os.open(out, os.O_RDWR | os.O_CREAT)
    try:
        crc = copy_range(source, src_offset, nbytes, fd, dst_offset, known_crc=zlib.crc32(data) if known else None)
    finally:
        os.close(fd)
    assert crc == zlib.crc32(data)
    assert out.read_bytes()[dst_offset:] == data


def test_copy_of_a_short_source_says_so(source, tmp_path):
    fd = os.open(tmp_path / "out.bin", os.O_RDWR | os.O_CREAT)
    try:
        with pytest.raises(EOFError, match="early"):
            copy_range(source, len(SOURCE) - 10, 20, fd, 0)
    finally:
        os.close(fd)


@settings(max_examples=40, **SAME_PATCH)
@given(offset=st.integers(0, len(SOURCE)), nbytes=st.integers(0, len(SOURCE)))
def test_read_back_crc_across_windows(source, monkeypatch, offset, nbytes):
    # The read-back reads a buffer at a time; a buffer of 1,000 bytes makes every range cross several.
    monkeypatch.setattr(stream, "COPY_BUFFER", 1000)
    nbytes = min(nbytes, len(SOURCE) - offset)
    assert crc_range(source, offset, nbytes) == zlib.crc32(SOURCE[offset:offset + nbytes])


def test_read_back_reads_by_pread_never_a_map(source, monkeypatch):
    """The output is read back with pread, a chunk at a time: a map of a file another process cuts short would end
    this one with SIGBUS."""
    def no_mmap(*args, **kwargs):
        raise AssertionError("the read-back mapped the output")

    monkeypatch.setattr(mmap, "mmap", no_mmap)
    monkeypatch.setattr(stream, "COPY_BUFFER", 1000)
    for offset, nbytes in ((0, len(SOURCE)), (5000, 70001), (123, 0)):
        assert crc_range(source, offset, nbytes) == zlib.crc32(SOURCE[offset:offset + nbytes])


def test_an_output_cut_short_while_read_back_is_a_write_error(tmp_path):
    path = tmp_path / "out.bin"
    path.write_bytes(SOURCE[:5000])  # what the read-back finds once another process truncated the output
    fd = os.open(path, os.O_RDWR)
    try:
        written = WrittenRanges(fd, str(path), verify=True)
        written.done(0, len(SOURCE), zlib.crc32(SOURCE), "w0")
        with pytest.raises(WriteError, match="^w0: the output was cut short while it was read back"):
            written.failures()
    finally:
        os.close(fd)


def test_read_back_reports_each_range_that_differs(tmp_path):
    path = tmp_path / "out.bin"
    path.write_bytes(SOURCE)
    fd = os.open(path, os.O_RDWR)
    try:
        written = WrittenRanges(fd, str(path), verify=True)
        written.done(0, 1000, zlib.crc32(SOURCE[:1000]), "first")
        written.done(1000, 5000, zlib.crc32(b"something else"), "second")
        written.done(6000, FOLIO, zlib.crc32(SOURCE[6000:6000 + FOLIO]), "third")
        failures = written.failures()
    finally:
        os.close(fd)
    assert len(failures) == 1 and failures[0].startswith("second (crc ")


@settings(max_examples=30, **SAME_PATCH)
@given(cuts=st.lists(st.integers(1, len(SOURCE) - 1), max_size=4), bad=st.sampled_from([None, "piece", "rest"]))
def test_read_back_in_pieces_checks_the_whole_range(tmp_path_factory, cuts, bad):
    """A range read back piece by piece as it is written (partial()) is checked as a whole: equal to the source, no
    failure; a byte changed in a piece already read back, or in the rest, is the range's failure."""
    data = bytearray(SOURCE)
    cuts = sorted(set(cuts))
    if bad == "piece" and cuts:
        data[cuts[0] - 1] ^= 1
    elif bad == "rest":
        data[-1] ^= 1
    path = tmp_path_factory.mktemp("pieces") / "out.bin"
    path.write_bytes(b"head" + data)
    fd = os.open(path, os.O_RDWR)
    try:
        written = WrittenRanges(fd, str(path), verify=True)
        written.done(0, 4, zlib.crc32(b"head"), "head")
        for cut in cuts:
            written.partial(4, cut)
        written.done(4, len(SOURCE), zlib.crc32(SOURCE), "range")
        failures = written.failures()
    finally:
        os.close(fd)
    wrong = bad == "rest" or bad == "piece" and bool(cuts)
    assert [f.split(" ")[0] for f in failures] == (["range"] if wrong else [])


def test_a_buffered_copy_is_read_back_as_it_goes(source, tmp_path, monkeypatch):
    """copy_range tells the read-back how far a range copied through its buffer is written; the checks then agree
    with the source's crc."""
    monkeypatch.setattr(stream, "COPY_BUFFER", 3000)
    monkeypatch.setattr(stream, "WINDOW", 10000)
    monkeypatch.delattr(os, "copy_file_range", raising=False)
    told = []
    fd = os.open(tmp_path / "out.bin", os.O_RDWR | os.O_CREAT)
    try:
        written = WrittenRanges(fd, str(tmp_path / "out.bin"), verify=True)
        real = written.partial
        monkeypatch.setattr(written, "partial", lambda offset, n: (told.append(n), real(offset, n)))
        crc = copy_range(source, 5, len(SOURCE) - 5, fd, 7, written=written)
        written.done(7, len(SOURCE) - 5, crc, "copied")
        assert written.failures() == []
    finally:
        os.close(fd)
    assert crc == zlib.crc32(SOURCE[5:]) and len(told) >= 10 and told == sorted(told)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="fallocate is Linux's")
def test_preallocate_sets_the_size_the_writer_then_trims(tmp_path):
    path = tmp_path / "out.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT)
    try:
        preallocate(fd, 5 * FOLIO)
        assert os.fstat(fd).st_size == 5 * FOLIO
    finally:
        os.close(fd)


@pytest.mark.parametrize("align", [ALIGN, FOLIO])
@pytest.mark.parametrize("zip64", [False, True])
def test_local_header_puts_the_data_at_the_asked_phase(align, zip64):
    name = b"archive/data/12"
    size = 2**32 + 5 if zip64 else 1000
    for at in (0, 1, 63, 4095, 70000, 123457):
        for phase in (0, 64, 4032, align - 64):
            phase %= align
            header = _local_header(name, size, 0x1234, at, phase, align)
            extra_len = struct.unpack("<H", header[28:30])[0]
            assert extra_len == len(header) - 30 - len(name) <= 0xFFFF
            data_at = at + len(header)
            # Where a 64 KB pad would overflow the extra field, torch's 64-byte alignment is kept instead.
            assert data_at % align == phase or (align == FOLIO and data_at % ALIGN == phase % ALIGN)
