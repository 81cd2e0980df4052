"""`hf://org/name[@revision][/file]`: a model in the local Hugging Face cache, resolved to its snapshot folder (or a
file in it) offline, without huggingface_hub and without the network.

The cache is where huggingface_hub puts it: HF_HUB_CACHE, else HF_HOME/hub, else ~/.cache/huggingface/hub (and the
older HUGGINGFACE_HUB_CACHE and XDG_CACHE_HOME that huggingface_hub still honours). A repository's folder
`models--org--name/` holds `refs/<revision>` (a file naming the commit), `snapshots/<commit>/` (the files, as links
into `blobs/`) and `blobs/`. A revision that is itself a commit hash names its snapshot directly.

A snapshot is read like any folder (the folder walker follows its file links into `blobs/`), once every link in it
was checked to stay inside the repository's cache folder: a snapshot whose link leads elsewhere is refused. The
local path is shown as the reference the user gave, wherever a command is printed (advice.show_as), so a printed
command names `hf://org/name` and writes its output in the current folder, never into the cache.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from ..advice import show_as
from ..errors import ReadError
from ..safepickle import limits

PREFIX = "hf://"
_KINDS = {"models": "models", "datasets": "datasets", "spaces": "spaces"}  # hf://datasets/org/name
_PART = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*")
_REVISION = re.compile(r"[A-Za-z0-9][A-Za-z0-9._/-]*")
_COMMIT = re.compile(r"[0-9a-f]{40}")


class NotCached(ReadError):
    """A Hugging Face reference the local cache does not hold: nothing is downloaded, the message says how to."""


def is_hf_ref(text: object) -> bool:
    return isinstance(text, str) and text.startswith(PREFIX)


def cache_dir() -> Path:
    """The hub cache folder, found as huggingface_hub finds it."""
    for name in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if os.environ.get(name):
            return Path(os.path.expanduser(os.environ[name]))
    if os.environ.get("HF_HOME"):
        return Path(os.path.expanduser(os.environ["HF_HOME"])) / "hub"
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join("~", ".cache")
    return Path(os.path.expanduser(base)) / "huggingface" / "hub"


def _parse(ref: str) -> tuple[str, str, str | None, str]:
    """(repository kind, repo id, revision or None, file path inside the snapshot or '') of `hf://…`."""
    rest = ref[len(PREFIX):].strip("/")
    parts = rest.split("/") if rest else []
    kind = "models"
    if parts and parts[0] in _KINDS and len(parts) > 1:
        kind = _KINDS[parts.pop(0)]
    if not parts:
        raise ReadError(f"{ref}: names no repository: give hf://org/name (or hf://org/name@revision/file)")
    # org/name, or a repository without an organisation (gpt2): the revision goes after the name
    take = 1 if "@" in parts[0] or len(parts) == 1 else 2
    repo, revision = "/".join(parts[:take]), None
    if "@" in repo:
        repo, _, revision = repo.partition("@")
        if not revision or not _REVISION.fullmatch(revision) or ".." in revision:
            raise ReadError(f"{ref}: {revision!r} is not a revision (a branch, a tag or a commit hash)")
    file_parts = parts[take:]
    if not all(_PART.fullmatch(p) for p in repo.split("/")):
        raise ReadError(f"{ref}: {repo!r} is not a repository name (org/name)")
    if any(p in ("", ".", "..") for p in file_parts):
        raise ReadError(f"{ref}: the file part {'/'.join(file_parts)!r} is not a path inside the repository")
    return kind, repo, revision, "/".join(file_parts)


def _download_hint(kind: str, repo: str, revision: str | None, file: str) -> str:
    args = [repo, *([file] if file else [])]
    if revision is not None:
        args += ["--revision", revision]
    if kind != "models":
        args += ["--repo-type", kind[:-1]]
    line = " ".join(args)
    return f"get it with `huggingface-cli download {line}` (or `hf download {line}`) and run this again"


def _repo_folder(cache: Path, kind: str, repo: str) -> Path:
    return cache / f"{kind}--{repo.replace('/', '--')}"


def resolve(ref: str) -> Path:
    """The local path `hf://…` names in the cache: the snapshot folder, or the file in it. Raises NotCached (exit 2)
    when the cache lacks the repository, the revision or the file, and ReadError when a link of the snapshot leads
    out of the repository's cache folder."""
    kind, repo, revision, file = _parse(ref)
    cache = cache_dir()
    folder = _repo_folder(cache, kind, repo)
    if not folder.is_dir() and "/" in repo:  # hf://gpt2/model.safetensors: a repository without an organisation
        org, _, first = repo.partition("/")
        single = _repo_folder(cache, kind, org)
        if single.is_dir() and revision is None:
            repo, folder, file = org, single, "/".join(p for p in (first, file) if p)
    if not folder.is_dir():
        raise NotCached(f"{ref}: not in the local Hugging Face cache ({folder} does not exist); nothing was "
                        f"downloaded (ckpt-doctor reads the cache only): {_download_hint(kind, repo, revision, file)}")
    snapshot = _snapshot(ref, folder, kind, repo, revision, file)
    target = snapshot / file if file else snapshot
    if not os.path.lexists(target):
        raise NotCached(f"{ref}: {file} is not in the local cache's snapshot {snapshot.name} (only some of the "
                        f"repository's files were downloaded); nothing was downloaded: "
                        f"{_download_hint(kind, repo, revision, file)}")
    _check_links(ref, folder, target)
    show_as(str(target), ref)
    return target


def _snapshot(ref: str, folder: Path, kind: str, repo: str, revision: str | None, file: str) -> Path:
    """The snapshot folder of `revision` (main when None): refs/<revision> names its commit; a commit hash names it
    directly."""
    name = revision or "main"
    snapshots = folder / "snapshots"
    if _COMMIT.fullmatch(name) and (snapshots / name).is_dir():
        return snapshots / name
    commit = None
    try:
        with open(folder / "refs" / name, "rb") as f:
            commit = f.read(256).decode("ascii", "replace").strip()
    except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
        pass
    except OSError as exc:
        raise ReadError(f"{ref}: {folder / 'refs' / name} cannot be read ({exc.strerror})") from None
    if commit is not None and not _PART.fullmatch(commit):
        raise ReadError(f"{ref}: {folder / 'refs' / name} does not name a commit ({commit[:60]!r})")
    if commit is None or not (snapshots / commit).is_dir():
        try:
            cached = sorted(os.listdir(folder / "refs")) if (folder / "refs").is_dir() else []
        except OSError:
            cached = []
        have = f"the cache holds revision(s) {', '.join(cached[:5])}" if cached else "the cache holds no revision of it"
        why = (f"revision {name} names commit {commit}, whose snapshot is missing" if commit is not None else
               f"revision {name} is not in the local cache ({have})")
        raise NotCached(f"{ref}: {why}; nothing was downloaded (ckpt-doctor reads the cache only): "
                        f"{_download_hint(kind, repo, revision, file)}")
    return snapshots / commit


def _inside(path: str, folder: str) -> bool:
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _check_links(ref: str, folder: Path, target: Path) -> None:
    """Every link at or under `target` leads inside the repository's cache folder (its blobs/, another snapshot);
    a snapshot is read through its links, and one that leads out of the cache is refused, not followed."""
    bound = os.path.realpath(folder)
    seen = 0

    def check(path: str) -> None:
        if os.path.islink(path) and not _inside(os.path.realpath(path), bound):
            raise ReadError(f"{ref}: {path} links to {os.readlink(path)}, outside the cache's {folder.name} folder "
                            "(a snapshot's files link into its blobs/): not read")

    check(str(target))
    if not _inside(os.path.realpath(target), bound):
        raise ReadError(f"{ref}: {target} leads outside the cache's {folder.name} folder: not read")
    if not os.path.isdir(target):
        return
    for here, dirs, files in os.walk(target):  # links to folders are not entered here: each is checked as a link
        for name in dirs + files:
            check(os.path.join(here, name))
            seen += 1
            if seen > limits.MAX_FOLDER_FILES:
                return  # the walker stops there too, and says so
