"""SHA-256 of files, shared by dataset downloads and collection manifests."""

from __future__ import annotations

import gzip
import hashlib
import os

from posteriorzoo._api import public

_BLOCK = 1 << 20


@public
def sha256_file(path: str | os.PathLike[str], decompress: bool = False) -> str:
    """Hex SHA-256 digest of a file, read in 1 MiB blocks.

    With ``decompress``, the digest of the gunzipped content instead of the bytes on disk.
    """
    digest = hashlib.sha256()
    opener = gzip.open if decompress else open
    with opener(path, "rb") as handle:
        while block := handle.read(_BLOCK):
            digest.update(block)
    return digest.hexdigest()
