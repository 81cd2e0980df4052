"""Tensors made of pieces (a DCP chunk per rank, a ZeRO partition per rank), streamed in the output's order.

An Assembly lays its pieces in a grid; the output is the grid in row-major order. Each piece is cut into runs, the
longest stretches that are contiguous both in the piece's saved bytes and in the output (a dim-0 shard is one run,
a dim-1 shard one run per row), and the runs of all pieces are merged by output position. Merging checks the
tiling: a run that does not start where the previous ended is a gap or an overlap, named, and nothing is written.
"""

from __future__ import annotations

import heapq
import itertools
from collections import Counter
from collections.abc import Callable, Iterator
from itertools import compress
from math import prod
from operator import add, attrgetter

from .dtypes import contiguous_strides, element_size, tensor_bytes  # noqa: F401  (contiguous_strides: re-exported)
from .errors import ReadError
from .readers.source import close_source, open_source, read_data
from .records import Assembly, Piece

Run = tuple[int, int, Piece, int]  # (output element, piece element, piece, elements)
_OFFSETS, _SIZES, _STRIDE = attrgetter("offsets"), attrgetter("sizes"), attrgetter("stride")


def is_contiguous(piece: Piece) -> bool:
    expected = contiguous_strides(piece.sizes)
    return all(size == 1 or a == b for size, a, b in zip(piece.sizes, piece.stride, expected))


def _runs(grid: tuple[int, ...], piece: Piece) -> Iterator[Run]:
    """A piece's runs in output order (its saved bytes taken as contiguous: see `read_piece` otherwise)."""
    sizes, offsets = piece.sizes, piece.offsets
    if not grid:
        yield 0, 0, piece, 1
        return
    if 0 in sizes:
        return
    k = len(grid) - 1
    while k > 0 and sizes[k] == grid[k]:
        k -= 1  # the dims after k are whole: one run spans them
    out_strides = contiguous_strides(grid)
    src_strides = contiguous_strides(sizes)
    length = sizes[k] * prod(grid[k + 1:])
    base = offsets[k] * out_strides[k]
    for index in itertools.product(*(range(sizes[d]) for d in range(k))):
        out = base + sum((offsets[d] + i) * out_strides[d] for d, i in enumerate(index))
        src = sum(i * src_strides[d] for d, i in enumerate(index))
        yield out, src, piece, length


def coverage_problem(assembly: Assembly) -> str | None:
    """Why the pieces cannot tile the grid, from their shapes alone (what inspect can say without reading)."""
    grid = assembly.grid
    rank = len(grid)
    pieces = assembly.pieces
    # Column by column at C speed first (inspect checks every chunk: a million of them); a chunk it does not pass is
    # named by the loop below, chunk by chunk, as it always was
    offsets, sizes = list(map(_OFFSETS, pieces)), list(map(_SIZES, pieces))
    total = chunks_total(grid, offsets, sizes, set(map(len, map(_STRIDE, pieces))))
    if total is None:
        total = 0
        for p in pieces:
            if len(p.offsets) != rank or len(p.sizes) != rank or len(p.stride) != rank:
                return f"a chunk whose offsets {list(p.offsets)} and sizes {list(p.sizes)} are not both of the " \
                       f"tensor's rank, {rank} ({p.label})"
            if any(o < 0 or s < 0 or o + s > g for o, s, g in zip(p.offsets, p.sizes, grid)):
                return f"chunk at {list(p.offsets)} of size {list(p.sizes)} lies outside the shape {list(grid)} " \
                       f"({p.label})"
            total += prod(p.sizes)
    return count_problem(total, grid) or overlap_problem(grid, offsets, sizes)


def chunks_total(grid: tuple[int, ...], offsets: list, sizes: list, stride_ranks: set[int]) -> int | None:
    """The elements chunks hold in all when every one (its offsets, sizes and the rank of its stride, taken column
    by column) has the grid's rank and lies inside it; None when some chunk does not (coverage_problem names it)."""
    rank = len(grid)
    if not ({rank} == set(map(len, offsets)) == set(map(len, sizes)) == stride_ranks
            and all(min(o) >= 0 and min(s) >= 0 and max(map(add, o, s)) <= g
                    for o, s, g in zip(zip(*offsets), zip(*sizes), grid))):
        return None
    return sum(map(prod, sizes)) if len(set(sizes)) > 1 else prod(sizes[0]) * len(sizes)


def count_problem(total: int, grid: tuple[int, ...]) -> str | None:
    """What is wrong with chunks inside the grid that hold `total` elements in all: too few, or overlapping."""
    want = prod(grid)
    if total < want:
        return f"the chunks cover {total:,} of its {want:,} elements"
    if total > want:
        return f"the chunks hold {total:,} elements for its {want:,}: some overlap"
    return None


_SWEEP = 1 << 22  # chunk pairs compared, at most, for a layout whose dimensions are not each cut into parts


def overlap_problem(grid: tuple[int, ...], offsets: list, sizes: list) -> str | None:
    """Why chunks inside the grid that hold as many elements as it has do not tile it: two overlap (and leave as many
    elements in no chunk). Proved where no two chunks share offsets and each dimension's extents cut it into parts
    (every layout a writer makes: Shard(d), 2-D splits, uneven ones); any other layout is swept along dim 0, up to
    _SWEEP pairs (past that, the merge of `fix` still checks every run)."""
    full = list(map(all, sizes))
    if not all(full):  # (a chunk with a dimension of 0 holds nothing, and overlaps nothing)
        offsets, sizes = list(compress(offsets, full)), list(compress(sizes, full))
    if len(set(offsets)) != len(offsets):
        twice = next(o for o, n in Counter(offsets).items() if n > 1)
        return f"two chunks lie at {list(twice)}: they overlap, and leave as many of its elements in no chunk"
    if all(map(_cut_into_parts, grid, zip(*offsets), zip(*sizes))):
        return None
    order = sorted(range(len(offsets)), key=offsets.__getitem__)
    active: list[int] = []
    pairs = 0
    for i in order:
        at, extent = offsets[i], sizes[i]
        active = [j for j in active if offsets[j][0] + sizes[j][0] > at[0]]
        for j in active:
            if all(a < b + t and b < a + u for a, u, b, t in zip(at, extent, offsets[j], sizes[j])):
                return (f"the chunks at {list(offsets[j])} and {list(at)} overlap, and leave as many of its elements "
                        "in no chunk")
        pairs += len(active)
        if pairs > _SWEEP:
            return None
        active.append(i)
    return None


def _cut_into_parts(extent: int, starts: tuple[int, ...], lengths: tuple[int, ...]) -> bool:
    """Whether the distinct spans chunks have along one dimension cut it into consecutive parts."""
    at = 0
    for start, length in sorted(set(zip(starts, lengths))):
        if start != at:
            return False
        at = start + length
    return at == extent


def ordered_runs(assembly: Assembly, what: str) -> Iterator[Run]:
    """Every run of every piece by output position, adjacent runs of one piece merged; raises on a gap or overlap."""
    if len(assembly.grid) == 1:  # a flat grid (ZeRO's partitions, 1-D shards): each piece is one run, sorted alike
        merged: Iterator[Run] = iter(sorted(((p.offsets[0], 0, p, p.sizes[0]) for p in assembly.pieces
                                             if 0 not in p.sizes), key=lambda r: r[0]))
    else:
        merged = heapq.merge(*(_runs(assembly.grid, p) for p in assembly.pieces), key=lambda r: r[0])
    expected = 0
    pending: Run | None = None
    for run in merged:
        out, src, piece, length = run
        if out != expected:
            where = "an overlap" if out < expected else f"a gap of {out - expected:,} elements"
            raise ReadError(f"{what}: its chunks leave {where} at element {min(out, expected):,} of "
                            f"{prod(assembly.grid):,}; nothing written")
        expected = out + length
        if pending is not None and pending[2] is piece and pending[1] + pending[3] == src:
            pending = (pending[0], pending[1], piece, pending[3] + length)
            continue
        if pending is not None:
            yield pending
        pending = run
    if pending is not None:
        yield pending
    if expected != prod(assembly.grid):
        raise ReadError(f"{what}: its chunks cover {expected:,} of its {prod(assembly.grid):,} elements; nothing "
                        "written")


def whole_piece_runs(assembly: Assembly, what: str) -> list[Run] | None:
    """The runs in output order when each is a whole piece whose crc32 its archive records (a dim-0 shard, a
    replicated tensor): such a tensor is copied by the kernel and its crc combined, not summed. None otherwise."""
    runs = []
    for run in ordered_runs(assembly, what):
        _out, src, piece, length = run
        if src or piece.crc is None or length != prod(piece.sizes) or not is_contiguous(piece):
            return None
        runs.append(run)
    return runs


def read_piece(piece: Piece, dtype: str, fd: int) -> bytes:
    """A piece's elements in row-major order, honouring the stride it was saved with."""
    import torch

    elsize = element_size(dtype)
    span = sum((s - 1) * st for s, st in zip(piece.sizes, piece.stride)) + 1 if prod(piece.sizes) else 0
    data = bytearray(read_data(fd, span * elsize, piece.offset))
    if len(data) != span * elsize:
        raise ReadError(f"{piece.file}: {piece.label} is cut short ({len(data)} of {span * elsize} bytes)")
    flat = torch.frombuffer(data, dtype=getattr(torch, dtype)) if data else torch.empty(0)
    return tensor_bytes(flat.as_strided(piece.sizes, piece.stride))


def stream(assembly: Assembly, what: str, fd_of: Callable[[object], int], sink: Callable[[bytes], None],
           block: int) -> None:
    """Hand the assembled bytes to `sink` in output order, in blocks of about `block` bytes."""
    elsize = element_size(assembly.dtype)
    loaded: dict[int, bytes] = {}  # non-contiguous pieces, read whole once (bounded by one chunk)
    buf = bytearray()
    for _out, src, piece, length in ordered_runs(assembly, what):
        nbytes = length * elsize
        if not is_contiguous(piece):
            data = loaded.get(id(piece))
            if data is None:
                data = loaded[id(piece)] = read_piece(piece, assembly.dtype, fd_of(piece.file))
            buf += data[src * elsize:src * elsize + nbytes]
        else:
            at = piece.offset + src * elsize
            done = 0
            while done < nbytes:
                step = min(nbytes - done, max(block - len(buf), elsize))
                got = read_data(fd_of(piece.file), step, at + done)
                if len(got) != step:
                    raise ReadError(f"{piece.file}: {piece.label} is cut short (the file ends at byte "
                                    f"{at + done + len(got):,}); nothing written")
                buf += got
                done += step
                if len(buf) >= block:
                    sink(bytes(buf))
                    buf.clear()
            continue
        if len(buf) >= block:
            sink(bytes(buf))
            buf.clear()
    if buf:
        sink(bytes(buf))


def assembled_bytes(assembly: Assembly, what: str) -> bytes:
    """The whole tensor in memory (inspect --values, verify): the pieces read once each."""
    fds: dict[str, int] = {}
    out = bytearray()

    def fd_of(path: object) -> int:
        key = str(path)
        if key not in fds:
            fds[key] = open_source(path)  # a descriptor, or a remote object's source (readers/source.py)
        return fds[key]

    try:
        stream(assembly, what, fd_of, out.extend, 8 << 20)
    except FileNotFoundError as exc:
        raise ReadError(f"{what}: {exc.filename} is missing") from None
    finally:
        for fd in fds.values():
            close_source(fd)
    return bytes(out)
