"""Finding dataset files on disk, and downloading them with SHA-256 verification.

Each file is looked for, in this order, in:

1. ``data_dir``, when given explicitly;
2. ``$POSTERIORZOO_DATA/<name>/``;
3. ``/usr/share/datasets/<name>/`` (Debian's ``dataset-*`` packages; the root is
   :data:`DEBIAN_ROOT`), unless ``$POSTERIORZOO_SYSTEM_DATA`` is ``0`` (``1`` or unset:
   searched), so that a test or a user can see what a machine without them sees;
4. the cache, ``<cache root>/<name>/``, with the cache root
   ``$POSTERIORZOO_CACHE``, else ``$XDG_CACHE_HOME/posteriorzoo``, else
   ``~/.cache/posteriorzoo``;
5. the files shipped inside the package, ``<BUNDLED_ROOT>/<name>/``: Fashion-MNIST's
   test split only (the official files, 4.4 MB, MIT licence), so the shipped reference
   zoo is evaluated with no dataset installed and no network;

and, failing all of these, downloaded from its official URL into the cache:
streamed to a temporary file next to the destination, checked against the
published SHA-256, then renamed into place, so a partial or wrong download is
never visible under the real name.

A file found on disk is checked before use too (``verify=True``, the default):
against the published SHA-256 of the file as served, else (a distribution's
re-compressed copy, or a decompressed one) against the digest of its decompressed
content, decompressed as a stream that stops at the known content size. A file that
matches neither is refused; a decompressed copy whose content digest is not known is
used with a warning. A check that passed is remembered for the process (by path,
size, modification time and inode), so loading several splits hashes a file once.

``$POSTERIORZOO_URL_BASE`` (or ``url_base=``) replaces the official URLs by
``<url_base>/<filename>``, for a local mirror or a test server;
``$POSTERIORZOO_DOWNLOAD_TIMEOUT`` (or ``timeout=``) sets the socket timeout in
seconds.
"""

from __future__ import annotations

import gzip
import hashlib
import http.client
import os
import tempfile
import urllib.error
import urllib.request
import warnings
import zlib
from collections.abc import Iterable
from pathlib import Path

from tqdm import tqdm

from posteriorzoo._api import public
from posteriorzoo.data.sources import DatasetSource, DownloadFile, dataset_source
from posteriorzoo.errors import ChecksumError, DataNotFoundError, InvalidOptionError
from posteriorzoo.hashing import sha256_file as file_sha256
from posteriorzoo.options import check_choice, check_number

__all__ = [
    "BUNDLED_ROOT",
    "DEBIAN_ROOT",
    "DEFAULT_TIMEOUT",
    "SYSTEM_DATA_VARIABLE",
    "cache_root",
    "dataset_files",
    "download_file",
    "file_sha256",
    "search_dirs",
]

#: Root of Debian's dataset packages; a module attribute so tests can move it.
DEBIAN_ROOT = Path("/usr/share/datasets")
#: Files shipped with the package (``<root>/<name>/``), searched after every other folder:
#: Fashion-MNIST's test split, which the report on the shipped reference zoo needs. A module
#: attribute so tests can move it.
BUNDLED_ROOT = Path(__file__).resolve().parent / "bundled"
#: ``0`` turns off the search of :data:`DEBIAN_ROOT`; ``1`` (or unset) keeps it.
SYSTEM_DATA_VARIABLE = "POSTERIORZOO_SYSTEM_DATA"
#: Socket timeout in seconds for connecting and for each read while downloading.
DEFAULT_TIMEOUT = 10.0
_CHUNK = 1 << 20


@public
def cache_root() -> Path:
    """Root of the download cache (datasets go in ``<root>/<name>/``).

    Returns
    -------
    pathlib.Path
        ``$POSTERIORZOO_CACHE`` if set, else ``$XDG_CACHE_HOME/posteriorzoo``,
        else ``~/.cache/posteriorzoo``. Not created here.
    """
    if os.environ.get("POSTERIORZOO_CACHE"):
        return Path(os.environ["POSTERIORZOO_CACHE"]).expanduser()
    if os.environ.get("XDG_CACHE_HOME"):
        return Path(os.environ["XDG_CACHE_HOME"]).expanduser() / "posteriorzoo"
    return Path.home() / ".cache" / "posteriorzoo"


def _system_data_searched() -> bool:
    """Whether :data:`DEBIAN_ROOT` is searched (``$POSTERIORZOO_SYSTEM_DATA``)."""
    value = os.environ.get(SYSTEM_DATA_VARIABLE, "").strip()
    return not value or check_choice(f"${SYSTEM_DATA_VARIABLE}", value, ("0", "1")) == "1"


@public
def search_dirs(name: str, data_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """Folders searched for dataset ``name``'s files, in priority order.

    The copies shipped with the package (:data:`BUNDLED_ROOT`) are looked at after these,
    and only for the files they hold.

    Parameters
    ----------
    name : str
        Dataset name (the sub-folder under each root).
    data_dir : str or os.PathLike, optional
        Explicit folder, searched first (its files directly, no sub-folder).

    Returns
    -------
    list of pathlib.Path
        Existing or not; the last one is the cache folder downloads go to. The system
        folder (:data:`DEBIAN_ROOT`) is left out when ``$POSTERIORZOO_SYSTEM_DATA`` is
        ``0``.

    Raises
    ------
    InvalidOptionError
        ``$POSTERIORZOO_SYSTEM_DATA`` is neither ``0`` nor ``1``.
    """
    dirs = []
    if data_dir is not None:
        dirs.append(Path(data_dir).expanduser())
    if os.environ.get("POSTERIORZOO_DATA"):
        dirs.append(Path(os.environ["POSTERIORZOO_DATA"]).expanduser() / name)
    if _system_data_searched():
        dirs.append(Path(DEBIAN_ROOT) / name)
    dirs.append(cache_root() / name)
    return dirs


def _bundled_dir(name: str) -> Path:
    return Path(BUNDLED_ROOT) / name


def _bundled_splits(source: DatasetSource) -> list[str]:
    """The splits of ``source`` whose every file the package ships."""
    folder = _bundled_dir(source.name)
    return [split for split, specs in source.splits.items()
            if specs and all((folder / spec.filename).is_file() for spec in specs)]


def _is_gzip(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(2) == b"\x1f\x8b"


#: Local files whose check passed in this process: (path, size, mtime, inode) keys.
_VERIFIED: set[tuple[str, int, int, int]] = set()


def _identity(path: Path) -> tuple[str, int, int, int]:
    stat = path.stat()
    return str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino


def _content_sha256(path: Path, limit: int | None, keep: list[bytes] | None = None
                    ) -> str | None:
    """SHA-256 of ``path``'s content, gunzipped if it is gzip, as a stream; None when the
    content exceeds ``limit`` bytes (it cannot be the published content) or the gzip
    stream is corrupt. ``keep`` receives the content's blocks, if given."""
    digest, total = hashlib.sha256(), 0
    try:
        with open(path, "rb") as raw:
            stream = gzip.GzipFile(fileobj=raw, mode="rb") if _is_gzip(path) else raw
            while block := stream.read(_CHUNK):
                total += len(block)
                if limit is not None and total > limit:
                    return None
                digest.update(block)
                if keep is not None:
                    keep.append(block)
    except (OSError, EOFError, zlib.error):
        return None
    return digest.hexdigest()


#: Gzipped files checked by their content's digest keep that content here, by identity,
#: until :func:`verified_content` takes it: the reader then parses the very bytes that
#: were checked, and the file is decompressed once, not twice (0.3 s of every start of a
#: process that trains on Fashion-MNIST). At most this many are kept, the oldest dropped.
_VERIFIED_CONTENT: dict[str, tuple[tuple[str, int, int, int], bytes]] = {}
_KEEP_CONTENTS = 4


def verified_content(path: Path) -> bytes | None:
    """The decompressed content of gzipped ``path`` as its verification read and checked
    it, if that was the last thing done with it (the file is unchanged since), else None.
    Each content is given out once."""
    try:
        key = _identity(Path(path))
    except OSError:
        return None
    identity, content = _VERIFIED_CONTENT.pop(key[0], (None, None))
    return content if identity == key else None


def _verify_local(path: Path, spec: DownloadFile) -> None:
    """Refuse ``path`` unless its bytes or its content have the published digest.

    The content is decompressed as a stream and never beyond ``spec.content_size``.
    A decompressed copy (an alias) whose content digest is not published cannot be
    checked: it is used with a warning.
    """
    key = _identity(path)
    if key in _VERIFIED:
        return
    if spec.sha256 is None and spec.content_sha256 is None:
        raise ChecksumError(f"{path}: no known SHA-256 for {spec.filename}, cannot verify")
    if spec.sha256 is not None and file_sha256(path) == spec.sha256:
        _VERIFIED.add(key)
        return
    if spec.content_sha256 is not None:
        blocks: list[bytes] | None = [] if _is_gzip(path) else None
        if _content_sha256(path, spec.content_size, blocks) == spec.content_sha256:
            _VERIFIED.add(key)
            if blocks is not None:
                while len(_VERIFIED_CONTENT) >= _KEEP_CONTENTS:
                    del _VERIFIED_CONTENT[next(iter(_VERIFIED_CONTENT))]
                _VERIFIED_CONTENT[key[0]] = key, b"".join(blocks)
            return
    elif path.name != spec.filename and not _is_gzip(path):
        # A decompressed alias (e.g. train-images-idx3-ubyte): only a content digest
        # could vouch for it, and none is published.
        warnings.warn(f"{path}: no published digest of the decompressed "
                      f"{spec.filename.removesuffix('.gz')}, so it is used unverified",
                      stacklevel=3)
        return
    if path.resolve().is_relative_to(Path(BUNDLED_ROOT).resolve()):
        remedy = "the copy shipped with posteriorzoo is damaged: reinstall posteriorzoo"
    else:
        remedy = ("delete the file to download it again, or pass verify=False to use it "
                  "unverified")
    raise ChecksumError(
        f"{path}: SHA-256 does not match the published digest of {spec.filename} "
        f"({spec.sha256}); {remedy}"
    )


@public
def download_file(
    url: str,
    dest: str | os.PathLike[str],
    sha256: str | None,
    timeout: float = DEFAULT_TIMEOUT,
    progress: bool | None = None,
) -> Path:
    """Download ``url`` to ``dest`` atomically, verifying its SHA-256.

    Parameters
    ----------
    url : str
        Source URL (``http``, ``https`` or ``file``).
    dest : str or os.PathLike
        Final path; its folder is created if needed.
    sha256 : str or None
        Expected hex digest. ``None`` is refused: an unverified download could
        silently train models on the wrong data.
    timeout : float
        Socket timeout in seconds, for the connection and each read.
    progress : bool or None
        Show a tqdm bar on stderr; ``None`` shows it only on a terminal.

    Returns
    -------
    pathlib.Path
        ``dest``, which exists only if the digest matched.

    Raises
    ------
    ValueError
        ``sha256`` is ``None``.
    ChecksumError
        The downloaded bytes have another digest; nothing is left on disk.
    urllib.error.URLError, OSError, http.client.HTTPException
        The transfer failed (including timeouts); nothing is left on disk.
    """
    if sha256 is None:
        raise InvalidOptionError(f"refusing to download {url} without a known SHA-256")
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{dest.name}.", suffix=".part", dir=dest.parent)
    tmp = Path(tmp_name)
    try:
        h = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as resp:
            total = resp.headers.get("Content-Length")
            with tqdm(total=int(total) if total else None, unit="B", unit_scale=True,
                      desc=dest.name, disable=None if progress is None else not progress,
                      leave=False) as bar:
                while chunk := resp.read(_CHUNK):
                    out.write(chunk)
                    h.update(chunk)
                    bar.update(len(chunk))
            out.flush()
            os.fsync(out.fileno())
        digest = h.hexdigest()
        if digest != sha256:
            raise ChecksumError(
                f"download of {url} has SHA-256 {digest}, expected {sha256}; discarded"
            )
        os.replace(tmp, dest)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return dest


def _find_local(spec: DownloadFile, dirs: Iterable[Path]) -> Path | None:
    for folder in dirs:
        for filename in (spec.filename, *spec.aliases):
            candidate = folder / filename
            if candidate.is_file():
                return candidate
    return None


def _urls(spec: DownloadFile, url_base: str | None) -> tuple[str, ...]:
    if url_base:
        return (f"{url_base.rstrip('/')}/{spec.filename}",)
    return spec.urls


def _missing_message(
    source: DatasetSource, missing: list[DownloadFile], dirs: list[Path],
    url_base: str | None, reason: str,
) -> str:
    cache = dirs[-1]
    files = []
    for spec in missing:
        where = ", ".join(_urls(spec, url_base)) or "no known URL"
        size = f", {spec.size:,} bytes" if spec.size else ""
        digest = f", sha256 {spec.sha256}" if spec.sha256 else ""
        files.append(f"{spec.filename} (from {where}{size}{digest})")
    searched = ", ".join(str(d) for d in dirs)
    bundled = _bundled_splits(source)
    if bundled:
        searched += (f", then {_bundled_dir(source.name)} (posteriorzoo ships only the "
                     f"{' and '.join(bundled)} split{'s' if len(bundled) > 1 else ''})")
    # One line, however many files: the command line prints errors as one line.
    return (f"dataset {source.name!r}: {reason}. Put these file(s) in {cache}/: "
            f"{'; '.join(files)}. Folders searched, in order: {searched}. Or pass "
            f"data_dir=<folder holding them>, or set POSTERIORZOO_DATA so that "
            f"$POSTERIORZOO_DATA/{source.name}/ holds them.")


def _timeout_from_environment() -> float:
    """``$POSTERIORZOO_DOWNLOAD_TIMEOUT`` in seconds (a positive number), else the default."""
    text = os.environ.get("POSTERIORZOO_DOWNLOAD_TIMEOUT", "").strip()
    if not text:
        return DEFAULT_TIMEOUT
    try:
        value = float(text)
    except ValueError:
        value = text  # refused below, with the value shown
    return check_number("$POSTERIORZOO_DOWNLOAD_TIMEOUT", value, 0, strict=True)


def _download_into_cache(
    spec: DownloadFile, cache: Path, url_base: str | None, timeout: float,
) -> tuple[Path | None, str]:
    """Try each URL; return (path, "") or (None, why the last attempt failed)."""
    if spec.sha256 is None:
        return None, f"no trustworthy SHA-256 is known for {spec.filename}, so it is not " \
                     "downloaded automatically"
    reason = "no URL"
    for url in _urls(spec, url_base):
        try:
            return download_file(url, cache / spec.filename, spec.sha256, timeout=timeout), ""
        # URLError covers HTTP errors, OSError timeouts and resets, HTTPException short reads.
        except (urllib.error.URLError, OSError, http.client.HTTPException) as exc:
            reason = f"download from {url} failed ({exc})"
    return None, reason


@public
def dataset_files(
    name: str,
    split: str | None = None,
    data_dir: str | os.PathLike[str] | None = None,
    download: bool = True,
    *,
    url_base: str | None = None,
    timeout: float | None = None,
    verify: bool = True,
) -> dict[str, Path]:
    """Locate (and if needed download) the files of dataset ``name``.

    Parameters
    ----------
    name : str
        A name from :func:`posteriorzoo.data.available_datasets`.
    split : str, optional
        Only the files this split needs; all of the dataset's files if omitted.
    data_dir : str or os.PathLike, optional
        Folder searched before all others (see the module docstring; the package's
        own copy of Fashion-MNIST's test split is found last).
    download : bool, default True
        Download missing files into the cache; if False, a missing file raises.
    url_base : str, optional
        Download from ``<url_base>/<filename>`` instead of the official URLs;
        default ``$POSTERIORZOO_URL_BASE``.
    timeout : float, optional
        Socket timeout in seconds; default ``$POSTERIORZOO_DOWNLOAD_TIMEOUT``,
        else :data:`DEFAULT_TIMEOUT`.
    verify : bool, default True
        Check the SHA-256 of files found on disk before use (downloads are always
        checked). A gzipped file re-compressed by a distribution, or a decompressed
        copy, passes if its content has the published content digest (decompressed
        as a stream, never beyond the published content size); a decompressed copy
        without a published content digest is used with a warning. ``False`` trusts
        local files (their format is still checked, and decompression still bounded,
        when they are read).

    Returns
    -------
    dict of str to pathlib.Path
        Official file name -> path of the file found or downloaded.

    Raises
    ------
    UnknownNameError
        Unknown dataset name.
    ValueError
        ``split`` is not one of the dataset's splits (InvalidOptionError), or
        ``$POSTERIORZOO_SYSTEM_DATA`` / ``$POSTERIORZOO_DOWNLOAD_TIMEOUT`` has a bad value.
    DataNotFoundError
        Files are missing and could not be downloaded; the message lists each
        file with its URL and the folder to put it in (and, for a dataset the
        package ships in part, which splits it ships).
    ChecksumError
        A download (or, with ``verify=True``, a local file) has the wrong digest.
    """
    source = dataset_source(name)
    if split is None:
        specs = source.files
    elif split in source.splits:
        specs = source.splits[split]
    else:
        raise InvalidOptionError(f"dataset {name!r} has no split {split!r}; "
                         f"splits: {', '.join(source.splits)}")
    if url_base is None:
        url_base = os.environ.get("POSTERIORZOO_URL_BASE") or None
    if timeout is None:
        timeout = _timeout_from_environment()

    dirs = search_dirs(name, data_dir)
    # The package's own copies come last: any other copy (a user's, the system's, the
    # cache's) is preferred, and only files the package ships are found there.
    searched = [*dirs, _bundled_dir(name)]
    found: dict[str, Path] = {}
    missing: list[DownloadFile] = []
    for spec in specs:
        path = _find_local(spec, searched)
        if path is None:
            missing.append(spec)
            continue
        if verify:
            _verify_local(path, spec)
        found[spec.filename] = path

    if missing and not download:
        raise DataNotFoundError(_missing_message(source, missing, dirs, url_base,
                                                 "missing files and download=False"))
    for i, spec in enumerate(missing):
        path, reason = _download_into_cache(spec, dirs[-1], url_base, timeout)
        if path is None:
            # One failure (offline, blocked) predicts the rest: stop rather than wait again.
            raise DataNotFoundError(_missing_message(source, missing[i:], dirs, url_base,
                                                     reason))
        found[spec.filename] = path
    return found
