"""Carries out a plan: lays out the output (a torch zip or a safetensors file), streams every tensor's bytes into a
temporary file beside it, reads it back, and renames it into place. A DCP folder is handed to torch's own writer."""

from __future__ import annotations

import os
import re
from collections import OrderedDict
from pathlib import Path

from ..dtypes import element_size
from ..errors import WriteError
from ..readers.source import is_remote
from ..records import Assembly, OutTensor, span_elements
from ..safepickle.unpickler import SizeValue
from ..tree import run_nested
from ..writers.atomic import StagedFiles, atomic_output, check_destination
from .dcp_output import write_dcp
from ..writers.pickler import TensorOut, dumps
from ..writers.safetensors_writer import TensorBytes, write_safetensors
from ..writers.stream import Progress, WrittenRanges, deflated_producer
from ..writers.torch_writer import StorageOut, write_torch_zip
from .options import OutputFormat
from .produce import Sources, assembly_producer, contiguous_producer, convert_producer
from .rebuild import PlainState
from .readback import verify_safetensors_structure, verify_torch_structure
from .results import FixPlan, FixResult, converted_nbytes

TYPE_CHECKING = False
if TYPE_CHECKING:  # names for annotations only
    from typing import Any, Callable, Generator


def execute(plan: FixPlan, progress_callback: Callable[[int, int], None] | None = None,
            verify: bool = True, force: bool = False, staged: StagedFiles | None = None) -> FixResult:
    """Write the planned output atomically and, unless told not to, re-read it and compare every tensor. With
    `staged` (one shard of several), it is renamed into place with the others, once all are written."""
    if plan.format is OutputFormat.DCP:
        size = write_dcp(plan, verify, force)
        return FixResult(plan, size, verify)
    check_destination(plan.output, plan.inputs, force=True)
    sources = Sources()
    progress = Progress(plan.nbytes * (2 if verify else 1), progress_callback)
    unknown: list[str] = []
    classes: list[str] = []
    reads: list[tuple[Any, int, int]] = []  # (source, offset, nbytes) of tensor data, in the order it is read
    try:
        with atomic_output(plan.output, plan.nbytes, staged) as (fd, tmp):
            written = WrittenRanges(fd, str(tmp), verify, progress)
            try:
                if plan.format is OutputFormat.TORCH:
                    archive = _source_names(plan)
                    storages, expected = _torch_layout(plan, sources, archive, reads)
                    pickle_bytes, unknown, classes = dumps(_to_pickle_tree(plan.tree, expected), plan.policy)
                    _announce(reads)
                    write_torch_zip(fd, archive or _archive_name(plan.output), pickle_bytes, storages, progress,
                                    written)
                else:
                    entries = _safetensors_layout(plan, sources, reads)
                    _announce(reads)
                    write_safetensors(fd, entries, plan.metadata, progress, written)
                if verify:
                    failed = written.failures()
                    if failed:
                        raise WriteError(f"{plan.output}: verification failed: {failed[0]} does not match its "
                                         f"source{f' (and {len(failed) - 1} more)' if len(failed) > 1 else ''}; "
                                         "the input may be corrupt; nothing written")
                    if plan.format is OutputFormat.TORCH:
                        verify_torch_structure(tmp, plan, expected)
                    else:
                        verify_safetensors_structure(tmp, entries)
            finally:
                written.close()
            size = os.fstat(fd).st_size
    finally:
        for src in {id(src): src for src, _, _ in reads if is_remote(src)}.values():
            src.end_stream()
        sources.close()
    return FixResult(plan, size, verify, tuple(unknown), dtype_classes=tuple(classes))


def _announce(reads: list[tuple[Any, int, int]]) -> None:
    """Tell each remote source which tensor data the writer will read, in order: it streams them in as few requests
    as their layout allows (one for a file copied front to back) instead of fetching as each read comes
    (readers/source.py, RemoteSource.expect). A local file is read as it is."""
    planned: dict[int, tuple[Any, list[tuple[int, int]]]] = {}
    for src, at, n in reads:
        if is_remote(src):
            planned.setdefault(id(src), (src, []))[1].append((at, n))
    for src, ranges in planned.values():
        src.expect(ranges)


def _assembly_reads(assembly: Assembly, sources: Sources, reads: list[tuple[Any, int, int]]) -> None:
    """The bytes of a tensor's pieces (DCP chunks, ZeRO slices), each piece's whole span, in the order the output
    takes them (row-major by where each sits in the tensor): a remote rank file streams the pieces it holds
    instead of fetching a window around each."""
    elsize = element_size(assembly.dtype)
    for piece in sorted(assembly.pieces, key=lambda p: p.offsets):
        reads.append((sources.fd(piece.file), piece.offset, (span_elements(piece.sizes, piece.stride) or 0) * elsize))


def _archive_name(output: Path) -> str:
    stem = output.name.split(".")[0] or "archive"
    return re.sub(r"[^A-Za-z0-9_-]", "_", stem)


_STORAGE_ENTRY = re.compile(r"([^/]+)/data/([^/]+)")


def _source_names(plan: FixPlan) -> str | None:
    """The archive name of the one torch zip all storages come from, when its storage keys can be kept.

    Keeping the source's names makes each copied storage's local header byte-for-byte the one the output
    needs, so storages that lie back to back in the source are copied as one range (see ZipOut.add_run).
    torch.load does not care what the archive folder is called."""
    prefixes = set()
    files = set()
    for t in plan.tensors:
        st = t.source.storage
        match = _STORAGE_ENTRY.fullmatch(st.entry) if st is not None else None
        if match is None:
            return None
        prefixes.add(match.group(1))
        files.add(st.file)
    return prefixes.pop() if len(prefixes) == 1 and len(files) == 1 else None


def _torch_layout(plan: FixPlan, sources: Sources, archive: str | None,
                  reads: list[tuple[Any, int, int]]) -> tuple[list[StorageOut], dict[str, TensorOut]]:
    storages: dict[tuple[str, str], StorageOut] = {}
    expected: dict[str, TensorOut] = {}
    for t in plan.tensors:
        rec = t.source
        st = rec.storage
        assert st is not None
        ident = st.ident
        out = storages.get(ident)
        if out is None:
            nbytes = converted_nbytes(st.nbytes, rec.dtype, t.dtype)
            key = st.entry.rsplit("/", 1)[1] if archive is not None else str(len(storages))
            if st.assembly is not None:
                _assembly_reads(st.assembly, sources, reads)
                produce = assembly_producer(st.assembly, rec.key, t.dtype, sources, t.key)
                storages[ident] = out = StorageOut(key, nbytes, produce=produce)
                expected[t.key] = TensorOut(rec, out.key, t.device, t.dtype, out.nbytes // element_size(t.dtype))
                continue
            fd = sources.fd(st.file)
            reads.append((fd, st.offset, st.deflated or st.nbytes))  # (a deflated member: its compressed bytes)
            if st.deflated:  # a deflated member (a re-zipped file): inflated into the output as it is written
                convert = (rec.dtype, t.dtype, t.key) if t.dtype != rec.dtype else None
                out = StorageOut(key, nbytes, produce=deflated_producer(fd, st, 0, st.nbytes, rec.key, convert))
            elif t.dtype != rec.dtype:
                produce = convert_producer(fd, st.offset, st.nbytes, rec.dtype, t.dtype, t.key)
                out = StorageOut(key, nbytes, produce=produce)
            else:
                out = StorageOut(key, nbytes, fd, st.offset, st.crc)
            storages[ident] = out
        numel = out.nbytes // element_size(t.dtype)
        expected[t.key] = TensorOut(rec, out.key, t.device, t.dtype, numel)  # rec's layout; key, dtype as planned
    return list(storages.values()), expected


def _to_pickle_tree(tree: Any, expected: dict[str, TensorOut]) -> Any:
    def converted(tree: Any) -> Generator:  # yields the conversion of each child, sent its result
        if isinstance(tree, OutTensor):
            return expected[tree.key]
        if isinstance(tree, dict):
            pairs = []
            for k, v in tree.items():
                pairs.append((k, (yield converted(v))))
            if not isinstance(tree, OrderedDict) or isinstance(tree, PlainState):
                return dict(pairs)
            out = OrderedDict(pairs)
            if getattr(tree, "_metadata", None) is not None:  # a state_dict keeps its module versions
                out._metadata = tree._metadata  # type: ignore[attr-defined]
            return out
        if isinstance(tree, (list, tuple)) and type(tree) is not SizeValue:
            values = []
            for v in tree:
                values.append((yield converted(v)))
            return values if isinstance(tree, list) else tuple(values)
        return tree

    return run_nested(converted(tree))


def _safetensors_layout(plan: FixPlan, sources: Sources, reads: list[tuple[Any, int, int]]) -> list[TensorBytes]:
    entries = []
    for t in plan.tensors:
        if t.key in plan.tied:
            continue
        rec = t.source
        st = rec.storage
        assert st is not None
        nbytes = rec.numel * element_size(t.dtype)
        if st.assembly is not None:
            _assembly_reads(st.assembly, sources, reads)
        else:  # the bytes read (a deflated member: its compressed bytes; a view: its span)
            reads.append((sources.fd(st.file), st.offset, st.deflated) if st.deflated else
                         (sources.fd(st.file), rec.file_offset or 0, rec.span_bytes))
        if st.assembly is not None:
            entries.append(TensorBytes(t.key, t.dtype, rec.shape, nbytes,
                                       produce=assembly_producer(st.assembly, rec.key, t.dtype, sources, t.key)))
        elif st.deflated and rec.is_contiguous:
            convert = (rec.dtype, t.dtype, t.key) if t.dtype != rec.dtype else None
            entries.append(TensorBytes(t.key, t.dtype, rec.shape, nbytes, produce=deflated_producer(
                sources.fd(st.file), st, rec.storage_offset * element_size(rec.dtype), rec.nbytes, rec.key, convert)))
        elif rec.is_contiguous and t.dtype == rec.dtype:
            whole = rec.storage_offset == 0 and nbytes == st.nbytes
            entries.append(TensorBytes(t.key, t.dtype, rec.shape, nbytes, sources.fd(st.file), rec.file_offset or 0,
                                       st.crc if whole else None))
        else:
            entries.append(TensorBytes(t.key, t.dtype, rec.shape, nbytes,
                                       produce=contiguous_producer(rec, t.dtype, t.key)))
    return entries

