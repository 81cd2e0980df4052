"""The bytes of each output tensor, produced straight into the output: copied as they lie, inflated, converted to
another dtype, assembled from a distributed checkpoint's pieces, or made contiguous. Each producer returns the crc32
of what it wrote, so the output is verified against its source without reading it twice."""

from __future__ import annotations

from pathlib import Path

from ..assemble import stream, whole_piece_runs
from ..dtypes import Cast, element_size
from ..errors import WriteError
from ..readers.source import close_source, open_source, read_data
from ..records import Assembly, TensorRecord
from ..tensordata import load_tensor, tensor_bytes
from ..writers.stream import CHUNK, Progress, copy_range, crc32, crc32_combine, write_bytes

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only
    from typing import Any, Callable


def _raise_open_files_limit() -> None:
    """A distributed checkpoint can hold thousands of files, each kept open once opened: lift the soft limit on open
    descriptors to the hard one (as `ulimit -n` would), which a process may always do."""
    try:
        import resource  # POSIX only: elsewhere the default limit stays

        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))
    except (ImportError, ValueError, OSError):
        pass  # not POSIX, or not allowed: the default limit stays


class Sources:
    """Open read-only descriptors of the input files (or, for a URL, its remote source: readers/source.py), closed
    together."""

    def __init__(self) -> None:
        self.fds: dict[str, Any] = {}
        _raise_open_files_limit()

    def fd(self, path: Path) -> Any:
        key = str(path)
        if key not in self.fds:
            self.fds[key] = open_source(path)
        return self.fds[key]

    def close(self) -> None:
        for fd in self.fds.values():
            close_source(fd)


def convert_producer(src_fd: Any, offset: int, nbytes: int, src: str, dst: str, key: str) -> Callable:
    """Converted bytes of a storage, chunk by chunk (floating storages only); returns their crc. A value the cast
    makes infinite refuses the write (Cast.done), named by `key`, the output's name of its tensor."""

    def produce(fd: int, at: int, progress: Progress | None) -> int:
        cast = Cast(src, dst, key)
        elsize = element_size(src)
        step = CHUNK // elsize * elsize
        crc, done, written = 0, 0, 0
        while done < nbytes:
            chunk = read_data(src_fd, min(step, nbytes - done), offset + done)
            if not chunk:
                raise WriteError("input ended early while converting")
            data = cast.block(chunk)
            write_bytes(fd, at + written, data)
            crc = crc32(data, crc)
            done += len(chunk)
            written += len(data)
            if progress:
                progress.advance(len(chunk))
        cast.done()
        return crc

    return produce


def assembly_producer(assembly: Assembly, what: str, dtype: str, sources: Sources, key: str) -> Callable:
    """A tensor of several files' pieces (DCP, ZeRO), assembled straight into the output in CHUNK-sized blocks and
    converted on the way when asked (as convert_producer: `key` names it in a refusal); the tiling of its pieces is
    checked as it goes (a gap: nothing written)."""

    def produce(fd: int, at: int, progress: Progress | None) -> int:
        whole = whole_piece_runs(assembly, what) if dtype == assembly.dtype and crc32_combine is not None else None
        if whole is not None:  # each chunk a whole archived storage: kernel copies, crcs combined (see stream.py)
            crc, elsize = 0, element_size(dtype)
            for out, _src, piece, length in whole:
                nbytes = length * elsize
                copy_range(sources.fd(piece.file), piece.offset, nbytes, fd, at + out * elsize, progress,
                           known_crc=piece.crc)
                crc = crc32_combine(crc, piece.crc, nbytes)
            return crc
        state = [0, at]  # crc, where the next block goes
        cast = Cast(assembly.dtype, dtype, key) if dtype != assembly.dtype else None

        def sink(block: bytes) -> None:
            if cast is not None:
                block = cast.block(block)
            write_bytes(fd, state[1], block)
            state[0] = crc32(block, state[0])
            state[1] += len(block)
            if progress:
                progress.advance(len(block))

        stream(assembly, what, sources.fd, sink, CHUNK)
        if cast is not None:
            cast.done()
        return state[0]

    return produce


def contiguous_producer(record: TensorRecord, dtype: str, key: str) -> Callable:
    """A tensor loaded whole and written contiguous (a view, a strided tensor), converted as convert_producer."""

    def produce(fd: int, at: int, progress: Progress | None) -> int:
        tensor = load_tensor(record)
        if dtype != record.dtype:
            cast = Cast(record.dtype, dtype, key)
            tensor = cast.tensor(tensor)
            cast.done()
        data = tensor_bytes(tensor.contiguous()) if tensor.numel() else b""
        write_bytes(fd, at, data)
        if progress:
            progress.advance(record.nbytes)
        return crc32(data)

    return produce

