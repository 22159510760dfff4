"""Moving checkpoints in and out of collections: safetensors files and release archives.

- :func:`export_checkpoint` / :func:`export_all` / :func:`read_checkpoint`: checkpoints as
  safetensors files whose header metadata says what they are (architecture, dataset,
  method, metadata row). Exports follow :mod:`posteriorzoo.outputs`: never onto the
  input, never over an existing output unless asked, built under a temporary name.
- :func:`read_release_archive`: the authors' release format, a ``.tgz`` of float16
  safetensors files, one per model, read member by member without extracting to disk.
- :class:`KeyMap`: renames foreign state keys to this project's model keys.
- :func:`import_checkpoints`: validate every input first, then append them all; inputs
  already stored are skipped, so an interrupted import is finished by running it again.

Inputs are treated as hostile. Nothing here unpickles: safetensors holds raw tensors and
a JSON header only. Formats are told apart by their first bytes, never by trying
decoders. Every size is bounded before it is read (:class:`ReadLimits`): a safetensors
header, a checkpoint file, an archive member (from its tar header, before its data), the
number of archive members and the bytes an archive expands to. Key map patterns that
could backtrack catastrophically are refused when the key map is built.
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import os
import re
import re._parser as sre_parse
import tarfile
import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import torch
from safetensors import SafetensorError
from safetensors.torch import load as load_safetensors_bytes
from safetensors.torch import save as save_safetensors_bytes

from posteriorzoo._faults import fault_point
from posteriorzoo.errors import (
    ChecksumError,
    InvalidOptionError,
    NonFiniteWeightsError,
    PosteriorZooError,
    ZooFormatError,
    ZooSchemaError,
)
from posteriorzoo.outputs import atomic_directory, atomic_file, check_output
from posteriorzoo.zoo import schema
from posteriorzoo.zoo.lifecycle import (
    check_architecture,
    create_zoo,
    normalise_template,
    open_zoo,
)
from posteriorzoo.zoo.store import Zoo, as_numpy

CHECKPOINT_FORMAT = "posteriorzoo-checkpoint"

#: Largest safetensors header read (the JSON that describes tensors and metadata), bytes.
MAX_HEADER_BYTES = 100 * 2**20
#: Largest checkpoint (a safetensors file or archive member) read when the expected
#: size is unknown, bytes. When the architecture is known the bound is
#: ``4 * float64 bytes of one checkpoint + CHECKPOINT_SLACK_BYTES`` instead.
MAX_CHECKPOINT_BYTES = 2**30
#: What a checkpoint file may hold beyond 4x its float64 size (header, metadata).
CHECKPOINT_SLACK_BYTES = 2**20
#: Most entries (files, folders, links) read from one archive.
MAX_ARCHIVE_MEMBERS = 10_000
#: Bytes an archive may hold between two members' data (tar and pax headers, padding).
ARCHIVE_HEADER_BYTES = 2**20
#: Longest state key, in characters (also bounds the work of a key map's patterns).
MAX_KEY_LENGTH = 256
#: Longest key map pattern, in characters.
MAX_PATTERN_LENGTH = 300
#: Most repeats (``*``, ``+``, ``{m,n}``) in one key map pattern: matching time grows
#: like the key length to this power at worst.
MAX_PATTERN_REPEATS = 3
#: Largest key map file, bytes.
MAX_KEY_MAP_BYTES = 2**20

#: safetensors dtypes that can be stored (bfloat16 and float8 have no numpy type).
SUPPORTED_DTYPES = frozenset({"F16", "F32", "F64", "I8", "I16", "I32", "I64", "U8", "BOOL"})

#: Release task names (``models/<task>/<task>-<start>-<end>.tgz``) -> collection attributes.
RELEASE_TASKS: dict[str, dict[str, Any]] = {
    "mnist-optunet": {"architecture": "optunet", "dataset": "mnist", "num_classes": 10},
    "cifar10-resnet18": {"architecture": "resnet18", "dataset": "cifar10", "num_classes": 10},
    "cifar100-resnet18": {"architecture": "resnet18", "dataset": "cifar100", "num_classes": 100},
    "tiny-imagenet-resnet18": {"architecture": "resnet18-tiny", "dataset": "tinyimagenet",
                               "num_classes": 200},
}

_GZIP_MAGIC = b"\x1f\x8b"
_TAR_MAGIC = b"ustar"
_TAR_MAGIC_OFFSET = 257
_TAR_BLOCK = 512
_READ_CHUNK = 2**20


# ---------------------------------------------------------------------- limits
@dataclass
class ReadLimits:
    """Bounds on what reading one input may cost; every one is checked before reading.

    Attributes
    ----------
    header_bytes : int
        Largest safetensors header.
    checkpoint_bytes : int
        Largest safetensors file or archive member (any member: skipped ones are read
        through too).
    archive_members : int
        Most entries in one archive.
    archive_header_bytes : int
        Most bytes an archive may hold between the data of two members (tar headers,
        pax and long-name records, padding, read-ahead).
    archive_bytes : int or None
        Most bytes one archive may expand to; default
        ``archive_members * (checkpoint_bytes + archive_header_bytes)``.
    """

    header_bytes: int = MAX_HEADER_BYTES
    checkpoint_bytes: int = MAX_CHECKPOINT_BYTES
    archive_members: int = MAX_ARCHIVE_MEMBERS
    archive_header_bytes: int = ARCHIVE_HEADER_BYTES
    archive_bytes: int | None = None

    @property
    def total_archive_bytes(self) -> int:
        if self.archive_bytes is not None:
            return self.archive_bytes
        return self.archive_members * (self.checkpoint_bytes + self.archive_header_bytes)

    def for_values(self, values: int) -> ReadLimits:
        """These limits, with checkpoints bounded by ``values`` numbers per checkpoint."""
        bound = 4 * 8 * int(values) + CHECKPOINT_SLACK_BYTES
        return dataclasses.replace(self, checkpoint_bytes=min(self.checkpoint_bytes, bound))


def _limits_for_architecture(limits: ReadLimits, architecture: str | None,
                             num_classes: int | None,
                             model_options: Mapping[str, Any] | None) -> ReadLimits:
    """``limits`` tightened to the architecture's checkpoint size, when it is known."""
    if not architecture:
        return limits
    from posteriorzoo import models

    try:
        shapes = models.expected_state_shapes(architecture, num_classes=num_classes,
                                              **dict(model_options or {}))
    except (PosteriorZooError, TypeError, ValueError):
        return limits  # an unknown name is reported by the architecture check
    return limits.for_values(sum(int(np.prod(shape, dtype=np.int64))
                                 for shape, _ in shapes.values()))


def _load_json(text: bytes | str, what: str) -> Any:
    """Parse JSON; malformed or absurdly nested text raises one ZooFormatError."""
    try:
        return json.loads(text)
    except (ValueError, RecursionError) as error:  # JSONDecodeError, bad UTF-8, depth
        raise ZooFormatError(f"{what} is not valid JSON: {str(error)[:200]}") from None


# ---------------------------------------------------------------------- key maps
def _is_repeat(op: object, av: object) -> bool:
    """A quantifier that may match its body more than once (``*``, ``+``, ``{2,}``...)."""
    if op not in (sre_parse.MAX_REPEAT, sre_parse.MIN_REPEAT, sre_parse.POSSESSIVE_REPEAT):
        return False
    return av[1] == sre_parse.MAXREPEAT or av[1] > 1


def _children(op: object, av: Any) -> list[Any]:
    """The sub-patterns of one parsed node."""
    if op in (sre_parse.MAX_REPEAT, sre_parse.MIN_REPEAT, sre_parse.POSSESSIVE_REPEAT):
        return [av[2]]
    if op is sre_parse.SUBPATTERN:
        return [av[3]]
    if op is sre_parse.BRANCH:
        return list(av[1])
    if op in (sre_parse.ASSERT, sre_parse.ASSERT_NOT):
        return [av[1]]
    if op is sre_parse.ATOMIC_GROUP:
        return [av]
    return []


def _nodes(pattern: Any) -> Iterator[tuple[object, Any]]:
    for op, av in pattern:
        yield op, av
        for child in _children(op, av):
            yield from _nodes(child)


def _check_pattern(pattern: object, what: str) -> re.Pattern[str]:
    """Compile a key map pattern, refusing ones that can backtrack catastrophically.

    Refused: non-strings, patterns longer than :data:`MAX_PATTERN_LENGTH`,
    backreferences and conditionals, a repeat whose body holds another repeat or an
    alternation (``(a+)+``, ``(a|aa)*``), the shapes of exponential backtracking, and
    more than :data:`MAX_PATTERN_REPEATS` repeats (polynomial backtracking).
    """
    if not isinstance(pattern, str):
        raise ZooFormatError(f"{what}: a pattern must be a string, not {pattern!r}"[:300])
    if len(pattern) > MAX_PATTERN_LENGTH:
        raise ZooFormatError(f"{what}: a pattern is {len(pattern)} characters; "
                             f"the limit is {MAX_PATTERN_LENGTH}")
    try:
        parsed = sre_parse.parse(pattern)
        compiled = re.compile(pattern)
    except (re.error, OverflowError, RecursionError, ValueError) as error:
        raise ZooFormatError(f"{what}: bad rule {pattern!r}: {error}") from None
    repeats = 0
    for op, av in _nodes(parsed):
        repeats += _is_repeat(op, av)
        if op in (sre_parse.GROUPREF, sre_parse.GROUPREF_EXISTS):
            raise ZooFormatError(f"{what}: bad rule {pattern!r}: backreferences and "
                                 "conditionals are not allowed")
        if _is_repeat(op, av) and any(
                _is_repeat(inner, inner_av) or inner is sre_parse.BRANCH
                for inner, inner_av in _nodes(av[2])):
            raise ZooFormatError(
                f"{what}: bad rule {pattern!r}: a repeated group holds another repeat or "
                "an alternation (nested quantifiers can take exponential time); "
                "write it without nesting")
    if repeats > MAX_PATTERN_REPEATS:
        raise ZooFormatError(f"{what}: bad rule {pattern!r}: {repeats} repeats; the limit "
                             f"is {MAX_PATTERN_REPEATS}")
    return compiled


def _check_replacement(replacement: object, compiled: re.Pattern[str], what: str) -> str:
    if not isinstance(replacement, str):
        raise ZooFormatError(f"{what}: a replacement must be a string, not {replacement!r}"
                             [:300])
    if len(replacement) > MAX_PATTERN_LENGTH:
        raise ZooFormatError(f"{what}: a replacement is {len(replacement)} characters; "
                             f"the limit is {MAX_PATTERN_LENGTH}")
    try:
        sre_parse.parse_template(replacement, compiled)
    except (re.error, IndexError, ValueError) as error:
        raise ZooFormatError(f"{what}: bad rule replacement {replacement!r}: {error}") \
            from None
    return replacement


def _check_key(key: object, what: str) -> str:
    if not isinstance(key, str):
        raise ZooFormatError(f"{what}: a state key must be a string, not {key!r}"[:300])
    if len(key) > MAX_KEY_LENGTH:
        raise ZooFormatError(f"{what}: a state key is {len(key)} characters; "
                             f"the limit is {MAX_KEY_LENGTH}")
    return key


@dataclass
class KeyMap:
    """Rename foreign state keys: exact renames first, then regex rules in order.

    A JSON file ``{"rename": {"old": "new"}, "rules": [["^model\\\\.", ""]],
    "drop": ["regex", ...]}`` describes one; :meth:`from_file` reads it. Keys matching a
    ``drop`` pattern are discarded (e.g. optimizer state saved alongside weights).

    The structure is checked when a key map is built (:class:`ZooFormatError`), and so
    are the patterns: no backreferences, no nested quantifiers, at most
    :data:`MAX_PATTERN_LENGTH` characters (see :func:`_check_pattern`).
    """

    rename: dict[str, str] = field(default_factory=dict)
    rules: list[tuple[str, str]] = field(default_factory=list)
    drop: list[str] = field(default_factory=list)
    _compiled_rules: list[tuple[re.Pattern[str], str]] = field(
        default_factory=list, init=False, repr=False, compare=False)
    _compiled_drop: list[re.Pattern[str]] = field(
        default_factory=list, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._validate("key map")

    def _validate(self, what: str) -> None:
        if not isinstance(self.rename, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.rename.items()):
            raise ZooFormatError(f"{what}: 'rename' must map strings to strings")
        for old, new in self.rename.items():
            _check_key(old, what)
            _check_key(new, what)
        if isinstance(self.rules, str | bytes | Mapping) or not isinstance(
                self.rules, Iterable):
            raise ZooFormatError(f"{what}: 'rules' must be a list of [pattern, replacement] "
                                 f"pairs, not {self.rules!r}"[:300])
        rules = list(self.rules)
        for rule in rules:
            if isinstance(rule, str | bytes | Mapping) or not isinstance(rule, list | tuple) \
                    or len(rule) != 2:
                raise ZooFormatError(f"{what}: each rule must be a [pattern, replacement] "
                                     f"pair of strings, not {rule!r}"[:300])
        if isinstance(self.drop, str | bytes | Mapping) or not isinstance(self.drop, Iterable):
            raise ZooFormatError(f"{what}: 'drop' must be a list of patterns, "
                                 f"not {self.drop!r}"[:300])
        drop = list(self.drop)
        compiled_rules = []
        for pattern, replacement in rules:
            compiled = _check_pattern(pattern, what)
            compiled_rules.append((compiled, _check_replacement(replacement, compiled, what)))
        self.rename = dict(self.rename)
        self.rules = [(pattern, replacement) for pattern, replacement in rules]
        self.drop = drop
        self._compiled_rules = compiled_rules
        self._compiled_drop = [_check_pattern(pattern, what) for pattern in drop]

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> KeyMap:
        """Read and check a key map file; any problem raises one :class:`ZooFormatError`."""
        path = Path(path)
        what = f"key map {path}"
        try:
            size = path.stat().st_size
            if not path.is_file():
                raise ZooFormatError(f"{what}: not a file")
            if size > MAX_KEY_MAP_BYTES:
                raise ZooFormatError(f"{what}: {size} bytes; the limit is {MAX_KEY_MAP_BYTES}")
            text = path.read_bytes()
        except FileNotFoundError:
            raise ZooFormatError(f"key map not found: {path}") from None
        except OSError as error:
            raise ZooFormatError(f"{what} cannot be read: {error}") from None
        data = _load_json(text, what)
        if not isinstance(data, dict):
            raise ZooFormatError(f"{what}: must be a JSON object with 'rename', 'rules' "
                                 "and/or 'drop'")
        unknown = set(data) - {"rename", "rules", "drop"}
        if unknown:
            raise ZooFormatError(f"{what}: unknown entries {sorted(unknown)}"[:300])
        rename, rules, drop = data.get("rename", {}), data.get("rules", []), data.get("drop", [])
        if not isinstance(rename, dict):
            raise ZooFormatError(f"{what}: 'rename' must map strings to strings")
        if not isinstance(rules, list):
            raise ZooFormatError(f"{what}: 'rules' must be a list of [pattern, replacement] "
                                 f"pairs, not {rules!r}"[:300])
        if not isinstance(drop, list):
            raise ZooFormatError(f"{what}: 'drop' must be a list of patterns, "
                                 f"not {drop!r}"[:300])
        key_map = cls.__new__(cls)
        key_map.rename, key_map.rules, key_map.drop = rename, rules, drop
        key_map._validate(what)
        return key_map

    def apply(self, state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """Return the state with renamed keys; two keys mapping to one name raise."""
        result: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            _check_key(key, "state")
            if any(pattern.search(key) for pattern in self._compiled_drop):
                continue
            new = self.rename.get(key, key)
            for pattern, replacement in self._compiled_rules:
                new = pattern.sub(replacement, new)
                if len(new) > MAX_KEY_LENGTH:
                    raise ZooSchemaError(f"key map turns {key!r} into a key longer than "
                                         f"{MAX_KEY_LENGTH} characters")
            if new in result:
                raise ZooSchemaError(f"key map sends two keys to {new!r} (one is {key!r})")
            result[new] = value
        return result


# ---------------------------------------------------------------------- format detection
def _safetensors_header_size(prefix: bytes, size: int, limits: ReadLimits) -> int | str:
    """The header length of safetensors data starting with ``prefix``, or why it is not one.

    ``prefix`` holds the first 9 bytes (or fewer, if the data is shorter); ``size`` is the
    length of the whole data.
    """
    if len(prefix) < 9:
        return f"{size} bytes is too short"
    length = int.from_bytes(prefix[:8], "little")
    if length < 2 or length > size - 8:
        return f"its header length {length} does not fit its {size} bytes"
    if length > limits.header_bytes:
        return f"its header of {length} bytes exceeds the limit of {limits.header_bytes}"
    if prefix[8:9] != b"{":
        return "its header is not a JSON object"
    return length


def sniff_format(path: str | os.PathLike, limits: ReadLimits | None = None) -> str:
    """What an input file is, from its first bytes: ``"safetensors"``, ``"tar"``, ``"tar.gz"``.

    Nothing is decoded beyond the first tar block; anything else raises ZooFormatError.
    """
    path = Path(path)
    limits = limits or ReadLimits()
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            head = handle.read(_TAR_MAGIC_OFFSET + len(_TAR_MAGIC))
            if head[:2] == _GZIP_MAGIC:
                handle.seek(0)
                try:
                    with gzip.GzipFile(fileobj=handle, mode="rb") as stream:
                        block = stream.read(_TAR_BLOCK)
                except (OSError, EOFError, zlib.error) as error:
                    raise ZooFormatError(f"{path}: a corrupt gzip file ({error})") from None
                if block[_TAR_MAGIC_OFFSET:_TAR_MAGIC_OFFSET + 5] != _TAR_MAGIC:
                    raise ZooFormatError(f"{path}: a gzip file that does not hold a tar "
                                         "archive")
                return "tar.gz"
    except OSError as error:
        raise ZooFormatError(f"{path}: cannot be read: {error}") from None
    if head[_TAR_MAGIC_OFFSET:_TAR_MAGIC_OFFSET + 5] == _TAR_MAGIC:
        return "tar"
    found = _safetensors_header_size(head[:9], size, limits)
    if isinstance(found, int):
        return "safetensors"
    raise ZooFormatError(f"{path}: neither a safetensors file nor a tar archive ({found})")


# ---------------------------------------------------------------------- safetensors
def _check_header_values(metadata: Mapping[str, Any], name: str) -> None:
    """The ``__metadata__`` values this module writes and reads, checked for type."""
    for key, value in metadata.items():
        if not isinstance(value, str):
            raise ZooFormatError(f"{name}: header metadata {key!r} must be text")
    text = metadata.get("num_classes", "")
    if text and not (len(text) <= 9 and text.isascii() and text.isdigit() and int(text) > 0):
        raise ZooFormatError(f"{name}: header 'num_classes' must be a positive integer, "
                             f"not {text!r}"[:300])
    for key, kind, label in (("model_options", dict, "a JSON object"),
                             ("metadata", dict, "a JSON object"),
                             ("state_keys", list, "a JSON list of strings")):
        if key in metadata:
            value = _load_json(metadata[key], f"{name}: header {key!r}")
            if not isinstance(value, kind) or (
                    kind is list and not all(isinstance(item, str) for item in value)):
                raise ZooFormatError(f"{name}: header {key!r} must be {label}")
    if metadata.get("format") == CHECKPOINT_FORMAT:
        for key in ("architecture", "dataset", "method"):
            if not metadata.get(key):
                raise ZooFormatError(f"{name}: header {key!r} is missing")


def _check_header(header: Any, name: str) -> dict[str, str]:
    """Check a safetensors header's structure; returns its ``__metadata__``."""
    if not isinstance(header, dict):
        raise ZooFormatError(f"{name}: not a valid safetensors file (its header is not a "
                             "JSON object)")
    metadata = header.get("__metadata__") or {}
    if not isinstance(metadata, dict):
        raise ZooFormatError(f"{name}: header '__metadata__' must be a JSON object")
    for key, entry in header.items():
        if key == "__metadata__":
            continue
        _check_key(key, name)
        if not isinstance(entry, dict) or not isinstance(entry.get("dtype"), str):
            raise ZooFormatError(f"{name}: not a valid safetensors file (tensor {key!r} "
                                 "has no dtype)"[:300])
        if entry["dtype"] not in SUPPORTED_DTYPES:
            raise ZooFormatError(
                f"{name}: tensor {key!r} has dtype {entry['dtype']!r}; supported are "
                f"{', '.join(sorted(SUPPORTED_DTYPES))} (convert bfloat16 to float32)"[:400])
    _check_header_values(metadata, name)
    return metadata


def _parse_safetensors(data: bytes, name: str, limits: ReadLimits | None = None
                       ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    limits = limits or ReadLimits()
    if len(data) > limits.checkpoint_bytes:
        raise ZooFormatError(f"{name}: {len(data)} bytes exceeds the limit of "
                             f"{limits.checkpoint_bytes} bytes for one checkpoint")
    found = _safetensors_header_size(data[:9], len(data), limits)
    if isinstance(found, str):
        raise ZooFormatError(f"{name}: not a valid safetensors file ({found})")
    metadata = _check_header(_load_json(data[8:8 + found], f"{name}: the safetensors header"),
                             name)
    try:
        tensors = load_safetensors_bytes(data)
    except (SafetensorError, ValueError, TypeError, RuntimeError) as error:
        raise ZooFormatError(f"{name}: not a valid safetensors file ({error})"[:400]) from None
    if "state_keys" in metadata:
        keys = json.loads(metadata["state_keys"])
        if set(keys) == set(tensors):
            tensors = {key: tensors[key] for key in keys}
    return tensors, dict(metadata)


def read_checkpoint(path: str | os.PathLike, *, limits: ReadLimits | None = None
                    ) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Read a safetensors checkpoint: returns ``(state_dict, header metadata)``.

    The file is recognised by its first bytes and its size is checked against
    ``limits`` before it is read; the header's values are checked for type.
    """
    path = Path(path)
    limits = limits or ReadLimits()
    if not path.is_file():
        raise ZooFormatError(f"{path}: no such file")
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            found = _safetensors_header_size(handle.read(9), size, limits)
            if isinstance(found, str):
                raise ZooFormatError(f"{path}: not a valid safetensors file ({found})")
            if size > limits.checkpoint_bytes:
                raise ZooFormatError(f"{path}: {size} bytes exceeds the limit of "
                                     f"{limits.checkpoint_bytes} bytes for one checkpoint")
            handle.seek(0)
            data = handle.read(limits.checkpoint_bytes + 1)
    except OSError as error:
        raise ZooFormatError(f"{path}: cannot be read: {error}") from None
    return _parse_safetensors(data, str(path), limits)


# ---------------------------------------------------------------------- archives
class _BoundedReader:
    """A read-only stream that refuses to deliver more than the bytes it is allowed.

    :func:`read_release_archive` allows, after each member header, that member's
    declared data plus :attr:`ReadLimits.archive_header_bytes`; the whole archive at
    most :attr:`ReadLimits.total_archive_bytes`. Reads come in chunks of at most 1 MiB,
    so a huge request never decompresses a huge block at once.
    """

    def __init__(self, raw: BinaryIO, name: str, limits: ReadLimits) -> None:
        self.raw = raw
        self.name = name
        self.total = limits.total_archive_bytes
        self.slack = limits.archive_header_bytes
        self.consumed = 0
        self.limit = min(self.total, self.slack)

    def allow(self, data_bytes: int) -> None:
        """Let the next member's data (``data_bytes``) and the next headers be read."""
        self.limit = min(self.total, self.consumed + data_bytes + self.slack)

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            size = self.limit - self.consumed + 1
        parts = []
        while size > 0:
            allowed = self.limit - self.consumed
            if allowed <= 0:
                if self.raw.read(1):
                    self._refuse()
                break
            piece = self.raw.read(min(size, allowed, _READ_CHUNK))
            if not piece:
                break
            parts.append(piece)
            self.consumed += len(piece)
            size -= len(piece)
        return b"".join(parts)

    def _refuse(self) -> None:
        if self.limit >= self.total:
            raise ZooFormatError(f"{self.name}: the archive expands beyond {self.total} bytes, "
                                 "the limit; refusing to read on")
        raise ZooFormatError(
            f"{self.name}: the archive holds more data than its member headers declare "
            f"(over {self.slack} bytes of headers between two members); refusing to read on")


def _padded(size: int) -> int:
    return -(-size // _TAR_BLOCK) * _TAR_BLOCK


def read_release_archive(path: str | os.PathLike, *, limits: ReadLimits | None = None
                         ) -> Iterator[tuple[str, dict[str, torch.Tensor]]]:
    """Yield ``(member name, state_dict)`` for each safetensors file of a release ``.tgz``.

    Members are read from the archive stream in order; nothing is extracted to disk.
    The archive must be a plain or gzip-compressed tar (recognised by its first bytes).
    Each member's declared size is checked against ``limits.checkpoint_bytes`` before its
    data is read, as are the number of members and the bytes the archive expands to.
    """
    for name, state, _ in _read_archive(Path(path), limits or ReadLimits()):
        yield name, state


def _read_archive(path: Path, limits: ReadLimits
                  ) -> Iterator[tuple[str, dict[str, torch.Tensor], dict[str, str]]]:
    if not path.is_file():
        raise ZooFormatError(f"{path}: no such file")
    kind = sniff_format(path, limits)
    if kind == "safetensors":
        raise ZooFormatError(f"{path}: a safetensors file, not a tar archive")
    members = 0
    try:
        with open(path, "rb") as raw:
            stream: BinaryIO = gzip.GzipFile(fileobj=raw, mode="rb") if kind == "tar.gz" \
                else raw
            reader = _BoundedReader(stream, str(path), limits)
            with tarfile.open(fileobj=reader, mode="r|") as archive:  # type: ignore[call-overload]
                for member in archive:
                    members += 1
                    if members > limits.archive_members:
                        raise ZooFormatError(f"{path}: more than {limits.archive_members} "
                                             "archive members, the limit")
                    if member.size > limits.checkpoint_bytes:
                        raise ZooFormatError(
                            f"{path}: member {member.name[:200]!r} declares {member.size} "
                            f"bytes, over the limit of {limits.checkpoint_bytes} bytes")
                    reader.allow(_padded(member.size))
                    if not member.isfile() or member.issparse() \
                            or not member.name.endswith(".safetensors"):
                        continue
                    handle = archive.extractfile(member)
                    if handle is None:  # pragma: no cover - regular files have data
                        continue
                    name = f"{path.name}:{member.name}"
                    data = handle.read(member.size)
                    if len(data) != member.size:
                        raise ZooFormatError(f"{name}: truncated archive member")
                    state, header = _parse_safetensors(data, name, limits)
                    yield name, state, header
    except (tarfile.TarError, EOFError, OSError, zlib.error) as error:
        raise ZooFormatError(f"{path}: not a readable tar archive ({error})"[:400]) from None


def release_task(path: str | os.PathLike) -> dict[str, Any] | None:
    """Collection attributes implied by a release archive's name, or None if unknown."""
    name = Path(path).name
    for task, attributes in sorted(RELEASE_TASKS.items(), key=lambda item: -len(item[0])):
        if name.startswith(task + "-") or name == f"{task}.tgz":
            return dict(attributes)
    return None


def _iter_sources(files: Iterable[Path], limits: Callable[[], ReadLimits]
                  ) -> Iterator[tuple[str, dict[str, torch.Tensor], dict[str, str]]]:
    """``(name, state, header)`` of every checkpoint in ``files``; ``limits()`` is asked
    again for each file, so a caller can tighten the bounds once the size is known."""
    for file in files:
        current = limits()
        if sniff_format(file, current) == "safetensors":
            state, header = read_checkpoint(file, limits=current)
            yield file.name, state, header
        else:
            yield from _read_archive(file, current)


# ---------------------------------------------------------------------- export
def _checkpoint_bytes(zoo: Zoo, index: int) -> bytes:
    """Checkpoint ``index`` of ``zoo`` as safetensors bytes, with its describing header."""
    state = {key: tensor.contiguous() for key, tensor in zoo.state_dict(index).items()}
    row = zoo.metadata_dict(index)
    header = {
        "format": CHECKPOINT_FORMAT,
        "architecture": zoo.architecture,
        "dataset": zoo.dataset,
        "method": zoo.method,
        "num_classes": "" if zoo.num_classes is None else str(zoo.num_classes),
        "model_options": schema.canonical_json(zoo.model_options),
        "state_keys": json.dumps(zoo.state_keys),
        "index": str(index),
        "metadata": schema.canonical_json(row),
        "source_collection": zoo.path.name,
    }
    return save_safetensors_bytes(state, metadata=header)


def _write_bytes(path: Path, data: bytes) -> None:
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _check_index(zoo: Zoo, index: int) -> int:
    count = len(zoo)
    if isinstance(index, bool) or not isinstance(index, int | np.integer):
        raise InvalidOptionError(f"a checkpoint index must be an integer, not {index!r}")
    if not -count <= index < count:
        raise InvalidOptionError(f"index {index} out of range; {zoo.path} holds {count} "
                                 "checkpoint(s)")
    return int(index) % count


def _verify_checkpoint(zoo: Zoo, index: int) -> None:
    """Check one checkpoint's digests even if ``zoo`` was opened without verification."""
    if zoo.verify:
        return  # reading it checks it
    problems = zoo.check_checkpoints(index, index + 1)
    if problems:
        raise ChecksumError(f"{zoo.path}: checkpoint {index} is corrupt: {problems[0][1]}; "
                            "'posteriorzoo verify' reports all damage")


def export_checkpoint(zoo: Zoo | str | os.PathLike, index: int, path: str | os.PathLike,
                      *, overwrite: bool = False, verify: bool = True) -> Path:
    """Write checkpoint ``index`` of a collection to a safetensors file; returns its path.

    The header's metadata records the collection attributes and the metadata row, so
    :func:`import_checkpoints` can rebuild a collection from exported files alone.

    Parameters
    ----------
    zoo : Zoo or path-like
        An open collection, or the path of one (opened read-only for the call).
    index : int
        Checkpoint index; negative counts from the end.
    path : path-like
        The output file. Its folder must exist; it is never the collection itself, and
        an existing file is replaced only with ``overwrite=True``. It is written under a
        temporary name next to it and renamed into place.
    overwrite : bool
        Replace an existing output file.
    verify : bool
        Check the checkpoint's SHA-256 digests before writing it (default);
        a corrupt checkpoint raises :class:`ChecksumError` and nothing is written.
    """
    if not isinstance(zoo, Zoo):
        with open_zoo(zoo, verify=verify) as opened:
            return export_checkpoint(opened, index, path, overwrite=overwrite, verify=verify)
    index = _check_index(zoo, index)
    with atomic_file(path, overwrite=overwrite, inputs=[zoo.path]) as partial:
        if verify:
            _verify_checkpoint(zoo, index)
        _write_bytes(partial, _checkpoint_bytes(zoo, index))
    return Path(path)


def export_all(zoo: Zoo | str | os.PathLike, folder: str | os.PathLike, *,
               overwrite: bool = False, verify: bool = True, progress: bool = False) -> Path:
    """Write every checkpoint of a collection into a new folder as ``NNNNNN.safetensors``.

    The folder is built under a temporary name next to ``folder`` and renamed into place
    when every file is written, so it appears complete or not at all. An existing folder
    is replaced only with ``overwrite=True``; the folder never holds the collection.
    With ``verify`` (default) every checkpoint's digests are checked as it is read and a
    corrupt one raises :class:`ChecksumError` with nothing written. Returns the folder.
    """
    from tqdm.auto import tqdm

    if not isinstance(zoo, Zoo):
        with open_zoo(zoo, verify=verify) as opened:
            return export_all(opened, folder, overwrite=overwrite, verify=verify,
                              progress=progress)
    folder = Path(folder)
    with atomic_directory(folder, overwrite=overwrite, inputs=[zoo.path]) as partial:
        for index in tqdm(range(len(zoo)), desc="export", unit="ckpt", disable=not progress):
            if verify:
                _verify_checkpoint(zoo, index)
            _write_bytes(partial / f"{index:06d}.safetensors", _checkpoint_bytes(zoo, index))
            fault_point("export-file")
    return folder


# ---------------------------------------------------------------------- import
@dataclass
class ImportSummary:
    """What :func:`import_checkpoints` did.

    Attributes
    ----------
    path : Path
        The collection.
    created : bool
        Whether the collection was created by this import.
    indices : range
        Indices of the checkpoints appended.
    sources : list of str
        Where each appended checkpoint came from (file, or ``archive:member``).
    skipped_existing : int
        Inputs skipped because the collection already held the same tensors (an
        interrupted import run again, or a file imported twice).
    skipped_repeated : int
        Inputs skipped because an earlier input had the same tensors.
    """

    path: Path
    created: bool
    indices: range
    sources: list[str]
    skipped_existing: int = 0
    skipped_repeated: int = 0

    @property
    def skipped(self) -> int:
        """Inputs not appended because their tensors were already stored or repeated."""
        return self.skipped_existing + self.skipped_repeated


def _convert(state: dict[str, torch.Tensor], dtype: torch.dtype | None) -> dict[str, torch.Tensor]:
    if dtype is None:
        return state
    return {key: value.to(dtype) if value.is_floating_point() else value
            for key, value in state.items()}


def _source_text(name: str) -> str:
    """The last 256 bytes of ``name`` as valid UTF-8 (the ``source`` column's width)."""
    encoded = name.encode("utf-8", errors="replace")[-256:]
    return encoded.decode("utf-8", errors="ignore")


def _row_from_header(header: Mapping[str, str], source: str) -> dict[str, Any]:
    row = _load_json(header["metadata"], f"{source}: header 'metadata'") \
        if "metadata" in header else {}
    if not isinstance(row, dict):
        raise ZooFormatError(f"{source}: header 'metadata' must be a JSON object")
    row = {key: value for key, value in row.items()
           if key in schema.COLUMN_NAMES and key not in ("sha256", "written_at")}
    row["source"] = _source_text(source)
    return row


def _checked_row(header: Mapping[str, str], source: str, method: str) -> dict[str, Any]:
    """The metadata row an input will get, checked now for the columns' types."""
    row = _row_from_header(header, source)
    try:
        schema.metadata_row({"method": method, **row})
    except ZooSchemaError as error:
        raise ZooSchemaError(f"{source}: {error}") from None
    return row


def _same_file(a: Path, b: Path) -> bool:
    try:
        return a.resolve() == b.resolve() or (a.exists() and b.exists()
                                              and os.path.samefile(a, b))
    except OSError:
        return False


@dataclass
class _Prepared:
    """One input after the key map and dtype conversion, checked, with its digest."""

    name: str
    state: dict[str, torch.Tensor]
    row: dict[str, Any]
    digest: str


def import_checkpoints(
    zoo_path: str | os.PathLike,
    files: Iterable[str | os.PathLike],
    *,
    architecture: str | None = None,
    dataset: str | None = None,
    method: str | None = None,
    num_classes: int | None = None,
    model_options: Mapping[str, Any] | None = None,
    key_map: KeyMap | None = None,
    dtype: torch.dtype | None = None,
    command: str | None = None,
    batch_size: int = 64,
    progress: bool = False,
    limits: ReadLimits | None = None,
) -> ImportSummary:
    """Append checkpoints from safetensors files and release archives to a collection.

    The collection is created if ``zoo_path`` does not exist; its attributes come from
    the arguments, else from the first exported checkpoint's header, else from the
    release archive's name (e.g. ``mnist-optunet-0-1023.tgz``). Floating tensors are
    cast to ``dtype`` if given (the release is float16).

    All or nothing, and idempotent:

    - Every input is read and checked first (format, sizes, header values, keys after
      ``key_map``, shapes, dtypes, finite values, metadata rows); a bad input raises a
      :class:`PosteriorZooError` before anything is created or appended.
    - A new collection is built under a temporary name and appears only when complete:
      a failure or a kill leaves nothing at ``zoo_path``.
    - An existing collection gets batches of ``batch_size`` checkpoints, each committed
      atomically. An input whose tensors (as they would be stored) are already in the
      collection, or repeat an earlier input, is skipped and counted, so an import
      killed part-way is completed by running it again.

    ``limits`` bounds what reading the inputs may cost (:class:`ReadLimits`); the
    checkpoint size bound tightens to the architecture's when it is known.
    """
    from tqdm.auto import tqdm

    files = [Path(file) for file in files]
    if not files:
        raise ZooFormatError("no input files given")
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise InvalidOptionError(f"batch_size must be a positive integer, not {batch_size!r}")
    zoo_path = Path(zoo_path)
    for file in files:
        if not file.is_file():
            raise ZooFormatError(f"{file}: no such file")
        if _same_file(file, zoo_path):
            raise InvalidOptionError(f"{zoo_path}: the collection is also an input")
    key_map = key_map or KeyMap()
    exists = zoo_path.exists()
    given = {"architecture": architecture, "dataset": dataset, "method": method,
             "num_classes": num_classes}
    attributes: dict[str, Any] = {}
    stored: set[str] = set()
    spec: dict[str, tuple[tuple[int, ...], np.dtype]] | None = None
    current = limits or ReadLimits()
    if exists:
        with open_zoo(zoo_path) as zoo:
            attributes = {"architecture": zoo.architecture, "dataset": zoo.dataset,
                          "method": zoo.method, "num_classes": zoo.num_classes,
                          "model_options": zoo.model_options}
            spec = zoo.spec
            stored = set(zoo.digests)
            values = sum(int(np.prod(shape, dtype=np.int64)) for shape, _ in spec.values())
        for key, value in given.items():
            if value is not None and value != attributes[key]:
                raise InvalidOptionError(f"{zoo_path} holds {key} {attributes[key]!r}, "
                                         f"not {value!r}")
        current = current.for_values(values)
    else:
        check_output(zoo_path, inputs=files)
        implied = release_task(files[0]) or {}
        current = _limits_for_architecture(
            current, architecture or implied.get("architecture"),
            num_classes if num_classes is not None else implied.get("num_classes"),
            model_options)

    def prepare(name: str, state: dict[str, torch.Tensor], header: Mapping[str, str]
                ) -> _Prepared:
        assert spec is not None
        state = _convert(key_map.apply(state), dtype)
        row = _checked_row(header, name, attributes["method"])
        _check_against(spec, state, name, diverged=bool(row.get("diverged", False)))
        arrays = {key: as_numpy(state[key]) for key in spec}
        return _Prepared(name, state, row, schema.checkpoint_digest(arrays, list(spec)))

    # Pass 1: read and check everything, keep only the digests. The size bound tightens
    # once the first checkpoint tells the architecture (read through ``bounds``).
    bounds = [current]
    template: dict[str, torch.Tensor] | None = None
    count = 0
    seen = set(stored)
    new_count = 0
    for name, state, header in tqdm(_iter_sources(files, lambda: bounds[0]), desc="check",
                                    unit="ckpt", disable=not progress):
        if spec is None:
            attributes = _attributes_for(files[0], header, architecture, dataset, method,
                                         num_classes, model_options)
            template = _ordered(_convert(key_map.apply(state), dtype), attributes)
            spec = normalise_template(template)
            try:
                check_architecture(attributes["architecture"], spec,
                                   attributes["num_classes"], attributes["model_options"])
            except ZooSchemaError as error:
                raise ZooSchemaError(f"{name}: {error}; a key map can rename keys") from None
            bounds[0] = bounds[0].for_values(sum(int(np.prod(shape, dtype=np.int64))
                                                 for shape, _ in spec.values()))
        prepared = prepare(name, state, header)
        count += 1
        if prepared.digest not in seen:
            seen.add(prepared.digest)
            new_count += 1
    if count == 0:
        raise ZooFormatError("the inputs hold no safetensors checkpoints")
    assert spec is not None

    # Pass 2: append in batches; each batch is committed atomically.
    if exists:
        zoo = open_zoo(zoo_path, mode="a")
    else:
        assert template is not None
        zoo = create_zoo(zoo_path, template=template, command=command, validate=True,
                         publish=False, **attributes)
    sources: list[str] = []
    skipped_existing = skipped_repeated = 0
    with zoo, tqdm(total=new_count, desc="import", unit="ckpt",
                   disable=not progress) as bar:
        first = len(zoo)
        stored = set(zoo.digests)
        appended: set[str] = set()
        batch: list[_Prepared] = []

        def commit() -> None:
            zoo.append_many([item.state for item in batch], [item.row for item in batch])
            fault_point("import-batch")
            bar.update(len(batch))
            batch.clear()

        for name, state, header in _iter_sources(files, lambda: bounds[0]):
            prepared = prepare(name, state, header)
            if prepared.digest in stored:
                skipped_existing += 1
                continue
            if prepared.digest in appended:
                skipped_repeated += 1
                continue
            appended.add(prepared.digest)
            sources.append(name)
            batch.append(prepared)
            if len(batch) == batch_size:
                commit()
        if batch:
            commit()
        last = len(zoo)
    return ImportSummary(zoo_path, not exists, range(first, last), sources,
                         skipped_existing, skipped_repeated)


def _attributes_for(first: Path, header: Mapping[str, str], architecture: str | None,
                    dataset: str | None, method: str | None, num_classes: int | None,
                    model_options: Mapping[str, Any] | None) -> dict[str, Any]:
    implied: dict[str, Any] = {}
    if header.get("format") == CHECKPOINT_FORMAT:  # values checked by _check_header
        implied = {"architecture": header["architecture"], "dataset": header["dataset"],
                   "method": header["method"],
                   "num_classes": int(header["num_classes"]) if header.get("num_classes")
                   else None,
                   "model_options": json.loads(header.get("model_options", "{}"))}
    elif (task := release_task(first)) is not None:
        implied = {**task, "method": "de"}
    given = {"architecture": architecture, "dataset": dataset, "method": method,
             "num_classes": num_classes, "model_options": model_options}
    attributes = {key: value if value is not None else implied.get(key)
                  for key, value in given.items()}
    attributes["model_options"] = dict(attributes["model_options"] or {})
    missing = [key for key in ("architecture", "dataset", "method") if not attributes[key]]
    if missing:
        raise ZooFormatError(
            f"cannot tell the new collection's {', '.join(missing)} from the inputs; "
            f"give the {missing[0].replace('_', ' ')}")
    return attributes


def _ordered(state: dict[str, torch.Tensor], attributes: Mapping[str, Any]
             ) -> dict[str, torch.Tensor]:
    """The state in the registered model's key order (storage order follows it)."""
    from posteriorzoo import models

    order = list(models.expected_state_shapes(attributes["architecture"],
                                              num_classes=attributes["num_classes"],
                                              **attributes["model_options"]))
    ranked = {key: position for position, key in enumerate(order)}
    return dict(sorted(state.items(), key=lambda item: ranked.get(item[0], len(ranked))))


def _check_against(spec: Mapping[str, tuple[tuple[int, ...], np.dtype]],
                   state: Mapping[str, torch.Tensor], name: str, diverged: bool) -> None:
    if set(spec) != set(state):
        missing = sorted(set(spec) - set(state))[:3]
        extra = sorted(set(state) - set(spec))[:3]
        raise ZooSchemaError(f"{name}: keys do not match (missing {missing}, unexpected "
                             f"{extra}); a key map can rename them")
    for key, (shape, dtype) in spec.items():
        tensor = state[key]
        if tuple(tensor.shape) != tuple(shape):
            raise ZooSchemaError(f"{name}: {key} has shape {tuple(tensor.shape)}, "
                                 f"expected {tuple(shape)}")
        found = as_numpy(tensor).dtype
        if found != dtype:
            raise ZooSchemaError(f"{name}: {key} has dtype {found}, expected {dtype} "
                                 "(a dtype conversion can be asked for)")
        if not diverged and tensor.is_floating_point() and not torch.isfinite(tensor).all():
            raise NonFiniteWeightsError(f"{name}: {key} has NaN or infinite values")
