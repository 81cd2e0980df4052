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
data (fix, diff, verify, inspect --stats) is read by data(): windows of DATA_SPAN bytes, the next one fetched while
the last is used, never kept in the cache.
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
        self.requests += 1
        self.bytes += len(data)
        if total != self.size or (self.tag is not None and tag != self.tag):
            raise RemoteError(f"{self.shown}: the object changed while it was read (its "
                              f"{'size' if total != self.size else 'ETag'} differs between requests); run the "
                              "command again once it is written")
        if keep:
            self._keep(start, data)
            return self.blocks[-1][1]
        return data

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

    def data(self, n: int, at: int) -> memoryview:
        """Tensor data: up to `n` bytes at `at` (fewer where a window ends or the object does; ask again for the rest),
        from the window of DATA_SPAN bytes fetched from where a read first falls outside it. A read that continues
        where the window ends finds the next window already on its way (fetched by a helper thread while the bytes of
        this one are written), so a fix or a diff reads a file front to back in size / DATA_SPAN requests and holds
        two windows at the most."""
        if n <= 0 or at >= self.size:
            return memoryview(b"")
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


class _Client:
    def __init__(self, url: str, shown: str) -> None:
        self.url, self.shown = url, shown

    def get(self, start: int, end: int, tag: str | None) -> tuple[bytes, int, str | None]:
        """Bytes [start, end) (fewer at the object's end), the object's size and its version tag."""
        import asyncio

        from fsspec.asyn import sync

        limit = _timeout() + (end - start) / (4 << 20)  # a trickle is bounded: the base, plus 4 MB/s at the least
        began = time.monotonic()
        try:
            return sync(self.loop, asyncio.wait_for, self._get(start, end, tag), limit)
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

    async def _body(self, read: Any, want: int, start: int) -> bytearray:
        """Exactly `want` bytes from `read(n)`, into one buffer: more is an error (never read past want + 1), fewer
        is truncation."""
        out, have = bytearray(want), 0
        while True:
            chunk = await read(min(1 << 20, want + 1 - have))
            if not chunk:
                break
            if have + len(chunk) > want:
                raise RemoteError(f"{self.shown}: the server sent more than the {want:,} bytes asked at byte {start}")
            out[have:have + len(chunk)] = chunk
            have += len(chunk)
        if have < want:
            raise RemoteError(f"{self.shown}: the answer for bytes {start}-{start + want - 1} ends after {have:,} of "
                              f"{want:,} bytes (truncated)")
        return out


class _HTTP(_Client):
    def __init__(self, url: str, shown: str) -> None:
        super().__init__(url, shown)
        import fsspec
        from fsspec.asyn import sync

        self.fs = fsspec.filesystem("http")
        self.loop = self.fs.loop
        self.session = sync(self.loop, self.fs.set_session)

    async def _get(self, start: int, end: int, tag: str | None) -> tuple[bytes, int, str | None]:
        headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
        if tag is not None and tag.startswith(("W/", '"')):
            headers["If-Match"] = tag
        async with self.session.get(self.url, headers=headers) as r:
            if r.status in (404, 410):
                raise FileNotFoundError
            if r.status in (401, 403):
                raise PermissionError
            if r.status == 412:
                raise RemoteError(f"{self.shown}: the object changed while it was read (its ETag differs between "
                                  "requests); run the command again once it is written")
            if r.status == 416 and start == 0:  # an empty object
                return b"", 0, r.headers.get("ETag") or r.headers.get("Last-Modified")
            if r.status not in (200, 206):
                raise RemoteError(f"{self.shown}: the server answered HTTP {r.status} {r.reason or ''}".rstrip())
            got = _content_range(r.headers.get("Content-Range")) if r.status == 206 else None
            want = self._check(r.status, got, start, end)
            data = await self._body(r.content.read, want, start)
            return data, got[2], r.headers.get("ETag") or r.headers.get("Last-Modified")


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

    async def _get(self, start: int, end: int, tag: str | None) -> tuple[bytes, int, str | None]:
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
                return b"", 0, None
            raise
        body = resp["Body"]
        try:
            got = _content_range(resp.get("ContentRange"))
            want = self._check(206 if got else 200, got, start, end)
            data = await self._body(body.read, want, start)
        finally:
            body.close()
        return data, got[2], resp.get("ETag")


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
