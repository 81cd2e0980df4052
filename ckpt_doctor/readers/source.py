"""Where a reader's bytes come from: a local file, or an object behind an `https://` or `s3://` URL.

The readers take a *source* where they used to take a descriptor: an int (a local file, read with os.pread: the
fastest read there is, and one that cannot SIGBUS when another process cuts the file short: it returns fewer
bytes) or a RemoteSource (an object read by HTTP range requests through fsspec, s3fs for S3). `pread(src, n, at)`
reads from either; nothing else in the readers asks which it is, except where a remote read must plan its
requests (zipindex: the local headers of storages it need not fetch).

A RemoteSource reads as little as it can in as few requests as it can: its first request takes the object's first
HEAD_BLOCK + TAIL_BLOCK bytes (and learns the size and the ETag from the answer: an object that small is read in
that one request); a read near the end takes the last TAIL_BLOCK bytes at once (a zip's end records and central
directory; not again what the first request holds); any other small read takes at least MIN_FETCH bytes. Tensor
data (fix, diff, verify, inspect --stats) is read by data(), never kept in the cache: what fix announces with
expect() (every read it will make, in order) is streamed, one request per stretch of the file read front to back
(one for a whole checkpoint), handed on in STREAM_BLOCK pieces as it arrives; anything else comes in windows of
DATA_SPAN bytes, the next one fetched while the last is used.
What was fetched is kept (the readers ask for the same bytes more than once), up to CACHE_BYTES. Every answer is
checked: a 206 with the Content-Range asked for, no byte more, no byte fewer, the same ETag (or Last-Modified) as
the first, within a time limit; anything else is one RemoteError naming what the server did (exit 2).
"""

from __future__ import annotations

import os
import time

from ..errors import ReadError

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import Any

SCHEMES = ("https://", "http://", "s3://")
HEAD_BLOCK = 64 << 10
TAIL_BLOCK = 192 << 10
MIN_FETCH = 64 << 10
CACHE_BYTES = 256 << 20  # small reads kept; a streamed span of tensor data is never kept
STREAM_SPAN = 64 << 20  # RemoteSource.spans: requests of at most this many bytes
DATA_SPAN = 32 << 20  # tensor data: one request fetches this much from where it is asked, the next is prefetched
STREAM_BLOCK = 4 << 20  # planned tensor data (expect()): one request per span, handed on this much at a time
STREAM_AHEAD = 4  # blocks a planned stream reads ahead of the reader, at most
PLAN_GAP = 1 << 20  # planned reads this close together are one span (the bytes between are read and dropped)
INSTALL = "pip install 'ckpt-doctor[remote]'"


class RemoteError(ReadError):
    """A remote object that could not be read as asked: one line naming what the server did."""


def is_url(text: object) -> bool:
    return isinstance(text, (str, RemotePath)) and str(text).startswith(SCHEMES)


def pread(src: Any, n: int, at: int) -> bytes:
    """`n` bytes at `at` of a local descriptor or a RemoteSource (fewer at the end)."""
    if src.__class__ is int:
        return os.pread(src, n, at)
    return src.pread(n, at)


def is_remote(src: Any) -> bool:
    return src.__class__ is not int


def read_data(src: Any, n: int, at: int) -> bytes | bytearray:
    """`n` bytes of tensor data at `at` (fewer at the end): os.pread of a descriptor, the data windows of a remote
    object (large sequential requests, see RemoteSource.data)."""
    if src.__class__ is int:
        return os.pread(src, n, at)
    return src.read_data(n, at)


# --- URLs as paths -------------------------------------------------------------------------------------------------

_REAL: dict[str, str] = {}  # the URL shown -> the URL fetched (with its user, password and query, never printed)


def redact(url: str) -> str:
    """The URL without user, password, query or fragment: what may be printed."""
    scheme, rest = url.split("://", 1)
    rest = rest.split("#", 1)[0].split("?", 1)[0]
    host, slash, tail = rest.partition("/")
    return f"{scheme}://{host.rsplit('@', 1)[-1]}{slash}{tail}"


class RemotePath(type(__import__("pathlib").Path())):  # type: ignore[misc]
    """A URL that the code paths made for local paths can carry: `.name`, `.suffix`, `.parent` and `/` work as on a
    path; str() is the URL as it may be printed (no credentials, no query); the URL fetched is looked up from it.
    It is no file on this machine: os.stat of it fails, `is_dir()` is False (folders are read through fsspec)."""

    __slots__ = ()

    def __str__(self) -> str:
        parts = self.parts
        return parts[0] + "//" + "/".join(parts[1:])

    def __fspath__(self) -> str:  # what opens a local file: a URL is read through open_source, never opened so
        raise RemoteError(f"{self}: is a URL, not a file on this machine")

    def __repr__(self) -> str:
        return f"RemotePath({str(self)!r})"

    def __truediv__(self, name: str) -> RemotePath:  # type: ignore[override]
        """The object `name` under this URL's folder (a DCP folder's item file), fetched with the same user and
        password, without the query (a presigned URL's signature is for one object)."""
        child = super().__truediv__(name)
        real = _REAL.get(str(self))
        if real is not None:
            _REAL.setdefault(str(child), f"{real.split('#', 1)[0].split('?', 1)[0].rstrip('/')}/{name}")
        return child

    def is_dir(self) -> bool:  # type: ignore[override]
        return False

    def is_file(self) -> bool:  # type: ignore[override]
        return True

    def exists(self) -> bool:  # type: ignore[override]
        return True


def remote_path(url: str | RemotePath) -> RemotePath:
    if isinstance(url, RemotePath):
        return url
    shown = redact(url)
    path = RemotePath(shown)
    _REAL[str(path)] = url
    return path


def real_url(path: RemotePath | str) -> str:
    text = str(path)
    return _REAL.get(text, text)


def sibling(path: RemotePath, name: str) -> RemotePath:
    """The object `name` beside `path` (a shard beside its index): fetched with the same user and password, without
    the query (a presigned URL's signature is for one object)."""
    real = real_url(path).split("#", 1)[0].split("?", 1)[0]
    return remote_path(f"{real.rsplit('/', 1)[0]}/{name}")


_LISTED: list[int] = []  # one entry per listing request (s3:// folders) or 404 probe, counted with the reads


def list_folder(url: str) -> list[str]:
    """The names of the objects directly under an `s3://bucket/prefix/` folder (one LIST request; sub-prefixes are
    not listed); [] when none.
    HTTP has no listing: an https:// folder is refused with the way out."""
    shown = redact(url)
    if not url.startswith("s3://"):
        raise RemoteError(f"{shown}: a folder cannot be listed over HTTP: give the URL of its shard index "
                          f"({shown.rstrip('/')}/model.safetensors.index.json or pytorch_model.bin.index.json), of "
                          f"a torch.distributed.checkpoint folder's metadata ({shown.rstrip('/')}/.metadata), of "
                          f"a DeepSpeed folder's latest ({shown.rstrip('/')}/latest) or of one checkpoint file")
    prefix = url[len("s3://"):].split("?", 1)[0].strip("/")
    if not prefix:
        raise RemoteError("s3:// names no bucket: give s3://BUCKET/KEY")
    client = _client(f"s3://{prefix}/x", shown)  # the fsspec and s3fs checks

    def listing() -> list[dict]:
        try:
            return client.fs.ls(prefix, detail=True, refresh=True)
        except FileNotFoundError:
            return []

    _LISTED.append(1)
    try:
        entries = listing()
    except PermissionError:
        raise RemoteError(f"{shown}: access denied (403): check the credentials (environment, "
                          "~/.aws/credentials)") from None
    except Exception as exc:  # a connection refused, a DNS failure: one line saying which
        if os.environ.get("CKPT_DOCTOR_DEBUG") == "1":
            raise
        raise RemoteError(f"{shown}: cannot be listed: {_in_words(exc, url, shown)}") from None
    # objects only: a sub-prefix ("folder") is no object, and reading it as one ended in a 404 line of its own
    names = [e["name"].rstrip("/") for e in entries if e.get("type") != "directory"]
    return sorted(n.rsplit("/", 1)[-1] for n in names if n != prefix)


# --- the remote source ---------------------------------------------------------------------------------------------

_OPEN: dict[str, RemoteSource] = {}  # one source per URL for the process: its blocks, ETag and counts are shared


def open_source(path: Any) -> Any:
    """A source for `path`: a RemoteSource for a URL (one per URL for the process), else an open descriptor."""
    if isinstance(path, RemotePath) or is_url(path):
        shown = str(path)
        src = _OPEN.get(shown)
        if src is None:
            src = _OPEN[shown] = RemoteSource(real_url(path), shown)
        return src
    return os.open(path, os.O_RDONLY)


def exists(path: RemotePath) -> bool:
    """Whether the object at a URL exists, asked by its first request (kept: its source is open_source's); a 404
    is False, and counts as a request (a DeepSpeed folder over HTTP: which of two names its files have)."""
    try:
        open_source(path)
    except RemoteError as exc:
        if "not found (404)" not in str(exc):
            raise
        _LISTED.append(1)
        return False
    return True


def close_source(src: Any) -> None:
    if src.__class__ is int:
        os.close(src)


def same_bytes(path_a: Any, at_a: int, path_b: Any, at_b: int, n: int, cut_short: str = "") -> bool:
    """Whether `n` bytes at `at_a` of one file (or URL) are those at `at_b` of another, read a megabyte at a time.
    A read cut short is a difference, or, given `cut_short` (what is read, for the message), a ReadError."""
    fa = open_source(path_a)
    try:
        fb = open_source(path_b)
        try:
            done = 0
            while done < n:
                step = min(1 << 20, n - done)
                x, y = read_data(fa, step, at_a + done), read_data(fb, step, at_b + done)
                if (len(x) != step or len(y) != step) and cut_short:
                    raise ReadError(f"{cut_short} is cut short")
                if x != y or len(x) != step:
                    return False
                done += step
        finally:
            close_source(fb)
    finally:
        close_source(fa)
    return True


def usage() -> dict[str, int] | None:
    """Bytes and requests of every remote read this process made, and the objects' sizes; None when none."""
    if not _OPEN and not _LISTED:
        return None
    return {"bytes": sum(s.bytes for s in _OPEN.values()),
            "requests": sum(s.requests for s in _OPEN.values()) + len(_LISTED),
            "size": sum(s.size for s in _OPEN.values())}


def usage_line() -> str | None:
    used = usage()
    if used is None:
        return None
    share = f" ({used['bytes'] / used['size']:.3%} of {human(used['size'])})" if used["size"] else ""
    return (f"read {human(used['bytes'])} in {used['requests']} request{'s' if used['requests'] != 1 else ''}"
            f"{share} over the network")


def human(n: float) -> str:
    for unit in ("bytes", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:,.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


DEFAULT_TIMEOUT = 20.0  # seconds a request may take (plus one per 4 MB asked): a stalled server ends a run in 30 s


def _timeout() -> float:
    try:
        return max(float(os.environ.get("CKPT_DOCTOR_REMOTE_TIMEOUT", DEFAULT_TIMEOUT)), 0.1)
    except ValueError:
        return DEFAULT_TIMEOUT


class RemoteSource:
    """An object at a URL read by byte ranges (see the module's docstring)."""

    def __init__(self, url: str, shown: str) -> None:
        self.url, self.shown = url, shown
        self.bytes = self.requests = 0
        self.size = 0
        self.tag: str | None = None
        self.blocks: list[tuple[int, bytes]] = []  # (offset, bytes) fetched and kept, newest last
        self.kept = 0
        self._window: tuple[int, bytearray] | None = None  # tensor data: the window read from (see data())
        self._prefetch: tuple[int, _Fetch] | None = None  # the window after it, on its way
        self._stream: _Stream | None = None  # tensor data announced by expect(), streamed
        self._lock = __import__("threading").Lock()  # the counts, kept by the helper threads too
        self._client = _client(url, shown)
        self._first()

    # The first request: the head block, which also says how big the object is and which version it is.
    def _first(self) -> None:
        data, total, tag = self._client.get(0, HEAD_BLOCK + TAIL_BLOCK, None)  # a file this small: one request
        self.requests += 1
        self.bytes += len(data)
        self.size, self.tag = total, tag
        if data:
            self._keep(0, data)

    def _fetch(self, start: int, end: int, keep: bool = True) -> bytes:
        data, total, tag = self._client.get(start, end, self.tag)
        self._answered(total, tag)
        self._count(len(data))
        if keep:
            self._keep(start, data)
            return self.blocks[-1][1]
        return data

    def _answered(self, total: int, tag: str | None) -> None:
        """One more request answered: the same object (size and version) as the first answer, or RemoteError."""
        with self._lock:
            self.requests += 1
        if total != self.size or (self.tag is not None and tag != self.tag):
            raise RemoteError(f"{self.shown}: the object changed while it was read (its "
                              f"{'size' if total != self.size else 'ETag'} differs between requests); run the "
                              "command again once it is written")

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self.bytes += nbytes

    def _keep(self, start: int, data: bytes) -> None:
        data = bytes(data)  # what the readers are handed: bytes, as os.pread gives
        self.blocks.append((start, data))
        self.kept += len(data)
        while self.kept > CACHE_BYTES and len(self.blocks) > 1:
            self.kept -= len(self.blocks.pop(0)[1])

    def cached(self, n: int, at: int) -> bytes | None:
        """The bytes when a block already fetched holds them all; None otherwise (nothing is fetched)."""
        end = min(at + n, self.size)
        for start, data in reversed(self.blocks):
            if start <= at and end <= start + len(data):
                return data[at - start:end - start]
        return None

    def pread(self, n: int, at: int) -> bytes:
        if n <= 0 or at >= self.size:
            return b""
        hit = self.cached(n, at)
        if hit is not None:
            return hit
        end = min(at + n, self.size)
        if end > self.size - TAIL_BLOCK and end - at <= TAIL_BLOCK:  # end records, directory: the whole tail at once
            start, stop = max(self.size - TAIL_BLOCK, 0), self.size
            if self.blocks and self.blocks[0][0] == 0 and start < len(self.blocks[0][1]) <= at:
                start = len(self.blocks[0][1])  # not again what the first request fetched
        elif end - at < MIN_FETCH:
            start, stop = at, min(at + MIN_FETCH, self.size)
        else:
            start, stop = at, end
        data = self._fetch(start, stop, keep=stop - start <= STREAM_SPAN)
        return data[at - start:end - start]

    # --- tensor data: large sequential requests, one window kept and the next one fetched beside the work --------

    def expect(self, reads: list[tuple[int, int]]) -> None:
        """Announce the tensor data about to be read: (offset, nbytes) in the order data() will be asked for them. The
        reads are joined into spans (each next read that starts at most PLAN_GAP past the last one's end), and a
        helper thread reads each span by one request, its answer handed on STREAM_BLOCK bytes at a time as it
        arrives, at most STREAM_AHEAD blocks ahead of the reader; the next span's request is sent as soon as the last
        one's bytes are in. A checkpoint copied front to back is one request, whatever its number of tensors, none
        past the last byte asked, and memory holds a few blocks. A read outside the plan (or behind
        it) is served as before; one further on skips the planned bytes before it. Replaces an earlier plan;
        expect([]) ends it (its thread, its open request)."""
        self.end_stream()
        spans: list[list[int]] = []
        for at, n in reads:
            end = min(at + n, self.size)
            if at >= end or self.cached(end - at, at) is not None:  # nothing to read, or read with the structure
                continue
            if spans and 0 <= at - spans[-1][1] <= PLAN_GAP:
                spans[-1][1] = end
            else:
                spans.append([at, end])
        if spans:
            self._stream = _Stream(self, [(a, b) for a, b in spans])

    def end_stream(self) -> None:
        if self._stream is not None:
            self._stream.stop()
            self._stream = None

    def data(self, n: int, at: int) -> memoryview:
        """Tensor data: up to `n` bytes at `at` (fewer where a block or window ends or the object does; ask again for
        the rest). From the stream expect() started when the read is part of its plan; otherwise from the window of
        DATA_SPAN bytes fetched from where a read first falls outside it. A read that continues where the window
        ends finds the next window already on its way (fetched by a helper thread while the bytes of this one are
        written), so a diff reads a file front to back in size / DATA_SPAN requests and holds two windows at the
        most."""
        if n <= 0 or at >= self.size:
            return memoryview(b"")
        if self._stream is not None:
            part = self._stream.serve(n, at)
            if part is not None:
                return part
        win = self._window
        if win is None or not win[0] <= at < win[0] + len(win[1]):
            hit = self.cached(n, at)  # already fetched with the structure (a small file: all of it)
            if hit is not None:
                return memoryview(hit)
            win = self._window = self._next_window(at)
            nxt = win[0] + len(win[1])
            if nxt < self.size:
                self._prefetch = (nxt, _Fetch(self, nxt, min(nxt + DATA_SPAN, self.size)))
        start, buf = win
        return memoryview(buf)[at - start:min(at + n, start + len(buf)) - start]

    def read_data(self, n: int, at: int) -> bytes | bytearray:
        """Exactly the bytes [at, at + n) of tensor data (fewer only at the object's end), in one buffer."""
        first = self.data(n, at)
        if len(first) >= n or not first:
            return bytes(first)
        out = bytearray(n)
        done = 0
        while done < n:
            part = self.data(n - done, at + done)
            if not part:
                return out[:done]
            out[done:done + len(part)] = part
            done += len(part)
        return out

    def data_blocks(self, at: int, n: int) -> Any:
        """The bytes [at, at + n) in order, as views of the data windows; raises at the object's end."""
        end = at + n
        while at < end:
            part = self.data(end - at, at)
            if not part:
                raise RemoteError(f"{self.shown}: ends at byte {self.size:,}, before the tensor data at {at:,}")
            yield part
            at += len(part)

    def _next_window(self, at: int) -> tuple[int, bytearray]:
        pending, self._prefetch = self._prefetch, None
        if pending is not None:
            got = pending[1].result()  # a failed prefetch raises its error here
            if pending[0] == at:
                return at, got
        stop = min(at + DATA_SPAN, self.size)
        return at, self._fetch(at, stop, keep=False)

    def spans(self, at: int, n: int, span: int = STREAM_SPAN) -> Any:
        """The bytes [at, at + n) in order, as blocks of at most `span` bytes, each one request (never kept)."""
        end = min(at + n, self.size)
        while at < end:
            stop = min(at + span, end)
            hit = self.cached(stop - at, at)
            yield hit if hit is not None else self._fetch(at, stop, keep=False)
            at = stop


class _Block:
    """A block of a stream: the bytes [start, end) of its plan's span number `span`, as the pieces the answer came in
    (not joined into one buffer: a copy of every byte less, about 0.3 s per GB here)."""

    __slots__ = ("span", "start", "end", "pieces", "ends")

    def __init__(self, span: int, start: int, pieces: list[bytes]) -> None:
        from itertools import accumulate

        self.span, self.start, self.pieces = span, start, pieces
        self.ends = list(accumulate(map(len, pieces), initial=start))[1:]  # where each piece ends
        self.end = self.ends[-1] if pieces else start

    def view(self, n: int, at: int) -> memoryview:
        """Up to `n` bytes at `at` (start <= at < end), to the end of the piece that holds `at`."""
        from bisect import bisect_right

        k = bisect_right(self.ends, at)
        first = self.ends[k - 1] if k else self.start
        piece = self.pieces[k]
        return memoryview(piece)[at - first:min(at + n, first + len(piece)) - first]


class _Stream:
    """The spans of a plan (RemoteSource.expect), each read by one request in a helper thread and handed to the reader
    in blocks, in order, through a queue of at most STREAM_AHEAD blocks."""

    def __init__(self, src: RemoteSource, spans: list[tuple[int, int]]) -> None:
        import queue

        self.src, self.spans = src, spans
        self.queue: queue.Queue = queue.Queue(STREAM_AHEAD)
        self.started = self.stopped = False
        self.block: _Block | None = None  # the block the reader is at
        self.error: BaseException | None = None

    def _start(self) -> None:
        """The helper thread, started by the first read of the plan: the shards of a checkpoint, each planned at
        once, are then streamed one after another, as the writer reaches each, not all at the same time."""
        import threading

        self.started = True
        threading.Thread(target=self._run, daemon=True, name="ckpt-doctor-stream").start()

    def _run(self) -> None:
        src = self.src
        try:
            for i, (start, end) in enumerate(self.spans):
                blocks = src._client.blocks(start, end, src.tag, src._answered)
                try:
                    at = start
                    for pieces in blocks:
                        block = _Block(i, at, pieces)
                        src._count(block.end - at)
                        if not self._put(block):
                            return
                        at = block.end
                finally:
                    blocks.close()  # an answer not read to its end: its connection closed
        except BaseException as exc:  # handed to the reader where it would have read the bytes
            self._put(exc)

    def _put(self, item: Any) -> bool:
        import queue

        while not self.stopped:
            try:
                self.queue.put(item, timeout=0.2)
                return True
            except queue.Full:
                pass
        return False

    def _span_of(self, at: int) -> int | None:
        """The span of the plan still to come that holds `at`; None when the read is not part of what remains."""
        block = self.block
        first = 0 if block is None else block.span
        for j in range(first, len(self.spans)):
            start, end = self.spans[j]
            if start <= at < end and (block is None or j > block.span or at >= block.end):
                return j
        return None

    def serve(self, n: int, at: int) -> memoryview | None:
        """Up to `n` bytes at `at` from the stream's blocks (to the end of the block that holds `at`); None when `at`
        is not in what remains of the plan."""
        if self.error is not None:
            raise self.error
        block = self.block
        if block is None or not block.start <= at < block.end:
            j = self._span_of(at)
            if j is None:
                return None
            if not self.started:
                self._start()
            self.block = None  # the last block let go before the next one is taken
            while True:
                item = self.queue.get()
                if isinstance(item, BaseException):
                    self.error = item
                    raise item
                if item.span == j and at < item.end:
                    break
            self.block = block = item
        view = block.view(n, at)
        if at + len(view) == block.end == self.spans[-1][1] and block.span == len(self.spans) - 1:
            self.block = None  # the plan's last byte: nothing of it kept while other sources are read
        return view

    def stop(self) -> None:
        import queue

        self.stopped = True
        self.block = None
        try:
            while True:
                self.queue.get_nowait()
        except queue.Empty:
            pass


class _Fetch:
    """One range fetched by a helper thread; result() waits for it (and raises what the fetch raised)."""

    def __init__(self, src: RemoteSource, start: int, stop: int) -> None:
        import threading

        self.value: Any = None
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(src, start, stop), daemon=True,
                                       name="ckpt-doctor-prefetch")
        self.thread.start()

    def _run(self, src: RemoteSource, start: int, stop: int) -> None:
        try:
            self.value = src._fetch(start, stop, keep=False)
        except BaseException as exc:  # handed to whoever asks for the bytes
            self.error = exc

    def result(self) -> Any:
        self.thread.join()
        if self.error is not None:
            raise self.error
        return self.value


def _client(url: str, shown: str) -> Any:
    try:
        import fsspec  # noqa: F401
    except ImportError:
        raise ReadError(f"{shown}: reading a URL needs fsspec: {INSTALL}") from None
    if url.startswith("s3://"):
        try:
            import s3fs  # noqa: F401
        except ImportError:
            raise ReadError(f"{shown}: reading s3:// needs s3fs: {INSTALL}") from None
        return _S3(url, shown)
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        raise ReadError(f"{shown}: reading https:// needs aiohttp: {INSTALL}") from None
    return _HTTP(url, shown)


def _in_words(exc: BaseException, url: str, shown: str) -> str:
    """What went wrong, said in words (never a library's class name)."""
    import ssl

    host = shown.split("://", 1)[1].split("/", 1)[0]
    names = {c.__name__ for c in type(exc).__mro__}
    cause = exc.__cause__ or exc.__context__
    if names & {"ClientConnectorDNSError"} or isinstance(exc, __import__("socket").gaierror) or \
            isinstance(cause, __import__("socket").gaierror):
        return f"the host name {host.rsplit(':', 1)[0]} cannot be resolved (DNS): check the URL and the network"
    if isinstance(exc, ssl.SSLError) or names & {"ClientSSLError", "ClientConnectorCertificateError", "SSLError"}:
        return f"the TLS handshake with {host} failed (certificate or protocol)"
    if names & {"ClientConnectorError", "EndpointConnectionError", "ConnectTimeoutError"} or \
            isinstance(exc, ConnectionError):
        return f"cannot connect to {host} (nothing answers there, or the connection was refused)"
    if names & {"NoCredentialsError", "PartialCredentialsError"}:
        return "no credentials were found (set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY, or ~/.aws/credentials)"
    if names & {"ParamValidationError"}:
        return "the bucket or key is not a valid S3 name"
    text = " ".join(str(exc).replace(url, shown).split())
    return text[:200] or "the request failed without saying why"


def _content_range(value: str | None) -> tuple[int, int, int] | None:
    """(first, last, total) of `bytes a-b/total`; None when it is not that."""
    if not value or not value.startswith("bytes "):
        return None
    try:
        span, total = value[6:].split("/", 1)
        first, last = span.split("-", 1)
        return int(first), int(last), int(total)
    except ValueError:
        return None


class _Answer:
    """An answer whose headers were checked: its body is `want` bytes read by `read(n)`; finish(complete) lets it go
    (back to the connection pool when its body was read to the end, else the connection closed). Runs in the loop."""

    def __init__(self, read: Any, want: int, total: int, tag: str | None, finish: Any) -> None:
        self.read, self.want, self.total, self.tag, self.finish = read, want, total, tag, finish


class _Client:
    def __init__(self, url: str, shown: str) -> None:
        self.url, self.shown = url, shown

    def get(self, start: int, end: int, tag: str | None) -> tuple[bytes, int, str | None]:
        """Bytes [start, end) (fewer at the object's end), the object's size and its version tag."""
        # a trickle is bounded: the base, plus 4 MB/s at the least
        return self._call(self._get(start, end, tag), _timeout() + (end - start) / (4 << 20), start, end)

    async def _get(self, start: int, end: int, tag: str | None) -> tuple[bytes, int, str | None]:
        answer = await self._open(start, end, tag)
        complete = False
        try:
            data = await self._body(answer.read, answer.want, start) if answer.want else b""
            complete = True
        finally:
            answer.finish(complete)
        return data, answer.total, answer.tag

    def blocks(self, start: int, end: int, tag: str | None, answered: Any) -> Any:
        """Bytes [start, end) by one request, in blocks of STREAM_BLOCK bytes (the last one shorter; each a list of the
        pieces it came in), each read as it arrives and held to the time limit of a request of its size;
        answered(total, tag) is told what the answer says about the object before any block is read. Closing the
        generator early closes the request."""
        answer = self._call(self._open(start, end, tag), _timeout(), start, end)
        complete = False
        try:
            answered(answer.total, answer.tag)
            at, stop = start, start + answer.want
            while at < stop:
                n = min(STREAM_BLOCK, stop - at)
                body = self._body(answer.read, n, at, last=at + n == stop, pieces=True)
                yield self._call(body, _timeout() + n / (4 << 20), at, at + n)
                at += n
            complete = True
        finally:
            self.loop.call_soon_threadsafe(answer.finish, complete)

    def _call(self, coro: Any, limit: float, start: int, end: int) -> Any:
        """Runs a request's coroutine in fsspec's loop, within `limit` seconds; every failure one RemoteError."""
        import asyncio

        from fsspec.asyn import sync

        began = time.monotonic()
        try:
            return sync(self.loop, asyncio.wait_for, coro, limit)
        except RemoteError:
            raise
        except (asyncio.TimeoutError, TimeoutError):
            raise RemoteError(f"{self.shown}: no complete answer within {time.monotonic() - began:.0f} s for bytes "
                              f"{start}-{end - 1} (the server is too slow or stalled; CKPT_DOCTOR_REMOTE_TIMEOUT "
                              "sets the limit in seconds)") from None
        except FileNotFoundError:
            raise RemoteError(f"{self.shown}: not found (404)") from None
        except PermissionError:
            raise RemoteError(f"{self.shown}: access denied (403): check the credentials (environment, "
                              "~/.aws/credentials)") from None
        except Exception as exc:  # a connection refused, a DNS failure, a TLS error: one line saying which
            if os.environ.get("CKPT_DOCTOR_DEBUG") == "1":
                raise
            if type(exc).__name__ in ("ClientPayloadError", "IncompleteReadError", "ResponseStreamingError"):
                raise RemoteError(f"{self.shown}: the answer for bytes {start}-{end - 1} ended before its "
                                  "Content-Length (truncated: the connection closed early)") from None
            raise RemoteError(f"{self.shown}: cannot be read: {_in_words(exc, self.url, self.shown)}") from None

    def _check(self, status: int, got: tuple[int, int, int] | None, start: int, end: int) -> int:
        if status == 200:
            raise RemoteError(f"{self.shown}: the server does not answer range requests (it sent the whole object); "
                              "ckpt-doctor reads only the bytes it needs: download the file and inspect the copy")
        if got is None or got[0] != start or got[1] != min(end, got[2]) - 1:
            raise RemoteError(f"{self.shown}: the server answered bytes {start}-{end - 1} with another range "
                              f"({got[0]}-{got[1]} of {got[2]})" if got else
                              f"{self.shown}: the server answered a range request without a valid Content-Range")
        return got[1] - got[0] + 1

    async def _body(self, read: Any, want: int, start: int, last: bool = True, pieces: bool = False) -> Any:
        """Exactly `want` bytes from `read(n)`, in one buffer: fewer is truncation. `last`: the answer must end
        there, and more is an error (never read past want + 1); else its next bytes are left for the next call.
        `pieces`: the list of the pieces as they came (a block of a stream: no byte copied, no buffer zeroed);
        else one buffer of `want` bytes."""
        out = None if pieces else bytearray(want)
        parts, have = [], 0
        extra = 1 if last else 0
        while have < want + extra:
            chunk = await read(min(1 << 20, want + extra - have))
            if not chunk:
                break
            if have + len(chunk) > want:
                raise RemoteError(f"{self.shown}: the server sent more than the {want:,} bytes asked at byte {start}")
            if out is None:
                parts.append(chunk)
            else:
                out[have:have + len(chunk)] = chunk
            have += len(chunk)
        if have < want:
            raise RemoteError(f"{self.shown}: the answer for bytes {start}-{start + want - 1} ends after {have:,} of "
                              f"{want:,} bytes (truncated)")
        return out if out is not None else parts


class _HTTP(_Client):
    def __init__(self, url: str, shown: str) -> None:
        super().__init__(url, shown)
        import fsspec
        from fsspec.asyn import sync

        self.fs = fsspec.filesystem("http")
        self.loop = self.fs.loop
        self.session = sync(self.loop, self.fs.set_session)

    async def _open(self, start: int, end: int, tag: str | None) -> _Answer:
        headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
        if tag is not None and tag.startswith(("W/", '"')):
            headers["If-Match"] = tag
        r = await self.session.get(self.url, headers=headers)

        def finish(complete: bool) -> None:
            r.release() if complete else r.close()

        try:
            version = r.headers.get("ETag") or r.headers.get("Last-Modified")
            if r.status in (404, 410):
                raise FileNotFoundError
            if r.status in (401, 403):
                raise PermissionError
            if r.status == 412:
                raise RemoteError(f"{self.shown}: the object changed while it was read (its ETag differs between "
                                  "requests); run the command again once it is written")
            if r.status == 416 and start == 0:  # an empty object
                r.release()
                return _Answer(None, 0, 0, version, lambda complete: None)
            if r.status not in (200, 206):
                raise RemoteError(f"{self.shown}: the server answered HTTP {r.status} {r.reason or ''}".rstrip())
            got = _content_range(r.headers.get("Content-Range")) if r.status == 206 else None
            want = self._check(r.status, got, start, end)
        except BaseException:
            r.close()
            raise
        return _Answer(r.content.read, want, got[2], version, finish)  # type: ignore[index]


class _S3(_Client):
    def __init__(self, url: str, shown: str) -> None:
        super().__init__(url, shown)
        import fsspec

        self.fs = fsspec.filesystem("s3")  # credentials and endpoint as s3fs finds them (environment, AWS config)
        self.loop = self.fs.loop
        self.bucket, _, self.key = url[len("s3://"):].split("?", 1)[0].partition("/")
        if not self.bucket:
            raise RemoteError("s3:// names no bucket: give s3://BUCKET/KEY")
        if not self.key:
            raise RemoteError(f"{shown}: names a bucket, not an object: give s3://{self.bucket}/KEY")

    async def _open(self, start: int, end: int, tag: str | None) -> _Answer:
        kwargs = {"Bucket": self.bucket, "Key": self.key, "Range": f"bytes={start}-{end - 1}"}
        if tag is not None:
            kwargs["IfMatch"] = tag
        try:
            resp = await self.fs._call_s3("get_object", **kwargs)
        except OSError as exc:
            if "PreconditionFailed" in str(exc) or "412" in str(exc):
                raise RemoteError(f"{self.shown}: the object changed while it was read (its ETag differs between "
                                  "requests); run the command again once it is written") from None
            if "InvalidRange" in str(exc) and start == 0:
                return _Answer(None, 0, 0, None, lambda complete: None)
            raise
        body = resp["Body"]
        try:
            got = _content_range(resp.get("ContentRange"))
            want = self._check(206 if got else 200, got, start, end)
        except BaseException:
            body.close()
            raise
        return _Answer(body.read, want, got[2], resp.get("ETag"), lambda complete: body.close())  # type: ignore


def source_file(src: Any) -> Any:
    """A file object over the source (for Python's zipfile): a duplicate descriptor, or the remote object's reads."""
    if src.__class__ is int:
        return os.fdopen(os.dup(src), "rb")
    import io

    class _Raw(io.RawIOBase):
        def __init__(self) -> None:
            self.at = 0

        def readable(self) -> bool:
            return True

        def seekable(self) -> bool:
            return True

        def seek(self, offset: int, whence: int = 0) -> int:
            self.at = offset if whence == 0 else self.at + offset if whence == 1 else src.size + offset
            return self.at

        def tell(self) -> int:
            return self.at

        def readinto(self, buffer: Any) -> int:
            data = src.pread(len(buffer), self.at)
            buffer[:len(data)] = data
            self.at += len(data)
            return len(data)

    return io.BufferedReader(_Raw(), buffer_size=MIN_FETCH)
