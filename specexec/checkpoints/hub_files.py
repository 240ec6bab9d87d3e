"""One file from the Hugging Face Hub into huggingface_hub's cache layout: a resumable download into
blobs/<etag>.part that hashes every byte it writes (sha256 for LFS files, git's blob id otherwise) and publishes
the blob only when the hash matches its etag; the snapshot link to it; the ref of a revision; and the byte
counter that reports progress over all the files of a fetch.

Does not know: which files a checkpoint needs, listing a repo, errors as the user reads them (hub.py).
"""
from __future__ import annotations

import hashlib
import inspect
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path

from specexec.options import ConfigError

PART = ".part"                                                 # suffix of a blob still being downloaded
COMMIT = re.compile(r"^[0-9a-f]{40}$")
SHA256 = re.compile(r"^[0-9a-f]{64}$")

Progress = Callable[[int, int, str], None]                     # (bytes done, bytes in all, file being fetched)


def download(url: str, blob: Path, etag: str, size: int | None, ticker: Ticker) -> None:
    """url -> blob, through blob.part: continue from its length, check the etag, then rename."""
    from huggingface_hub.file_download import http_get
    from huggingface_hub.utils import build_hf_headers

    part = blob.with_name(blob.name + PART)
    part.parent.mkdir(parents=True, exist_ok=True)
    have = part.stat().st_size if part.exists() else 0
    if size is not None and have > size:
        have = 0
    with open(part, "r+b" if part.exists() else "wb") as raw:
        raw.truncate(have)
        raw.seek(have)
        out = CheckedWriter(raw, etag, size)
        out.absorb(part, have)
        ticker.start_file(have)
        bar = {"tqdm_class": ticker.bar_class()} if "tqdm_class" in inspect.signature(http_get).parameters \
            else {"_tqdm_bar": ticker.bar_class()(initial=have)}          # huggingface_hub releases before it
        http_get(url, out, resume_size=have, headers=build_hf_headers(), expected_size=size, **bar)
        out.verify(part)
        raw.flush()
        os.fsync(raw.fileno())
    os.replace(part, blob)


class CheckedWriter:
    """A write-only file that hashes what it is given: sha256 for LFS etags, git's blob id otherwise. Supports
    the rewind-to-0 + truncate http_get does when a server ignores Range."""

    def __init__(self, f, etag: str, size: int | None) -> None:
        self.f, self.etag, self.size = f, etag, size
        self.lfs = bool(SHA256.match(etag))
        self._restart()

    def _restart(self) -> None:
        self.hash = hashlib.sha256() if self.lfs else hashlib.sha1()
        if not self.lfs and self.size is not None:
            self.hash.update(b"blob %d\0" % self.size)

    def absorb(self, path: Path, n: int) -> None:
        """Hash the first n bytes already in `path` (a resumed download)."""
        with open(path, "rb") as f:
            while n > 0:
                chunk = f.read(min(n, 8 << 20))
                if not chunk:
                    break
                self.hash.update(chunk)
                n -= len(chunk)

    def write(self, data: bytes) -> int:
        self.hash.update(data)
        return self.f.write(data)

    def tell(self) -> int:
        return self.f.tell()

    def seek(self, offset: int, whence: int = 0) -> int:
        return self.f.seek(offset, whence)

    def truncate(self, size: int | None = None) -> int:
        end = self.f.truncate(size)
        if end != 0:
            raise OSError(f"unexpected truncate to {end} bytes during a download")
        self._restart()
        return end

    def verify(self, part: Path) -> None:
        known = bool(SHA256.match(self.etag)) or (COMMIT.match(self.etag) and self.size is not None)
        if known and self.hash.hexdigest() != self.etag:
            self.f.close()
            part.unlink(missing_ok=True)
            raise ConfigError(f"the downloaded {part.name[:12]}... does not match its checksum (etag {self.etag}); "
                              "it was removed: run again to download it afresh")


class Ticker:
    """Bytes done over all files, reported to the Progress callback (a tqdm stand-in for http_get)."""

    def __init__(self, progress: Progress | None) -> None:
        self.progress = progress or (lambda done, total, name: None)
        self.done = self.total = 0
        self.file = ""
        self._file_start = 0

    def advance(self, n: int) -> None:
        self.done += n
        self.progress(self.done, self.total, self.file)

    def start_file(self, have: int) -> None:
        self._file_start = self.done
        self.advance(have)

    def bar_class(self):
        ticker = self

        class Bar:
            """What http_get asks of a tqdm class: created with initial=bytes already there, update(n)."""

            def __init__(self, *args, initial: int = 0, **kwargs) -> None:
                ticker.done = ticker._file_start         # a server that ignored Range restarted the file
                ticker.advance(initial)

            def __enter__(self) -> "Bar":
                return self

            def __exit__(self, *exc) -> None:
                return None

            def update(self, n: int = 1) -> None:
                ticker.advance(int(n or 0))

            def close(self) -> None:
                return None

        return Bar


def link_blob(blob: Path, pointer: Path) -> None:
    """snapshots/<commit>/<file> -> blobs/<etag>: a relative symlink, else (no symlinks, e.g. Windows without
    developer mode) a hard link, else a copy."""
    pointer.parent.mkdir(parents=True, exist_ok=True)
    tmp = pointer.with_name(f".{pointer.name}.{os.getpid()}.tmp")
    tmp.unlink(missing_ok=True)
    try:
        os.symlink(os.path.relpath(blob, pointer.parent), tmp)
    except OSError:
        try:
            os.link(blob, tmp)
        except OSError:
            shutil.copyfile(blob, tmp)
    os.replace(tmp, pointer)


def write_ref(storage: Path, revision: str, commit: str) -> None:
    if revision == commit:
        return
    ref = storage / "refs" / revision
    ref.parent.mkdir(parents=True, exist_ok=True)
    if not ref.is_file() or ref.read_text().strip() != commit:
        tmp = ref.with_name(f".{ref.name}.{os.getpid()}.tmp")
        tmp.write_text(commit)
        os.replace(tmp, ref)
