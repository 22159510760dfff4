"""Reading foreign checkpoints: renaming their keys (:class:`KeyMap`), with a guard
against slow patterns; the readings an import applies when no key map is given (a
wrapper's prefix stripped, a known foreign layout renamed and the model options it
implies: :func:`implied_reading`, :data:`FOREIGN_LAYOUTS`); and integer counters saved
as floats (:func:`restore_integers`).

A key map's regex rules run on keys read from hostile files, so a pattern that could
backtrack catastrophically is refused when the key map is built, not found out when an
import hangs: no backreferences, no nested quantifiers, a bounded number of repeats and
a bounded length (see :func:`_check_pattern`). Keys themselves are at most
:data:`~posteriorzoo.zoo.formats.MAX_KEY_LENGTH` characters, which bounds the work of
every match. A hostile input may still bring many keys, and a key map many patterns: the
time of all the matches of one key map together is bounded too
(:data:`MAX_MATCHING_SECONDS`), each distinct key being matched once.
"""

from __future__ import annotations

import os
import re
import re._parser as sre_parse
import time
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from posteriorzoo._streams import read_small_file
from posteriorzoo.errors import ZooFormatError, ZooSchemaError
from posteriorzoo.zoo.formats import MAX_KEY_LENGTH, check_state_key, load_json

#: Longest key map pattern, in characters.
MAX_PATTERN_LENGTH = 300
#: Most repeats (``*``, ``+``, ``{m,n}``) in one key map pattern: matching time grows
#: like the key length to this power at worst.
MAX_PATTERN_REPEATS = 3
#: Largest key map file, bytes.
MAX_KEY_MAP_BYTES = 2**20
#: Most seconds all the pattern matches of one key map may take together (its drop
#: patterns and rules, on every distinct key of every input). The pattern checks bound
#: one match (at worst about a second, on a key of MAX_KEY_LENGTH characters), not how
#: many keys and patterns meet. A real key map renames a model's few hundred keys in
#: milliseconds, so 5 s leaves it a thousandfold room, and a hostile key map or input is
#: refused within about a second past it.
MAX_MATCHING_SECONDS = 5.0
#: Most distinct keys whose new names a key map remembers: the inputs of one import share
#: their keys (a model has at most a few thousand tensors), each matched once; the bound
#: keeps a key map used for ever from growing without end.
MAX_REMEMBERED_KEYS = 65_536


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
    """Every node of a parsed pattern, depth first."""
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
    """``replacement`` if it is a short string referring only to groups ``compiled`` has."""
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


@dataclass
class KeyMap:
    """Rename foreign state keys: exact renames first, then regex rules in order.

    A JSON file ``{"rename": {"old": "new"}, "rules": [["^model\\\\.", ""]],
    "drop": ["regex", ...]}`` describes one; :meth:`from_file` reads it. Keys matching a
    ``drop`` pattern are discarded (e.g. optimizer state saved alongside weights).

    The structure is checked when a key map is built (:class:`ZooFormatError`), and so
    are the patterns: no backreferences, no nested quantifiers, at most
    :data:`MAX_PATTERN_LENGTH` characters (see :func:`_check_pattern`). All the matches
    of one key map together may take at most :data:`MAX_MATCHING_SECONDS` (then
    :meth:`apply` raises :class:`ZooFormatError`); each distinct key is matched once.
    """

    rename: dict[str, str] = field(default_factory=dict)
    rules: list[tuple[str, str]] = field(default_factory=list)
    drop: list[str] = field(default_factory=list)
    _compiled_rules: list[tuple[re.Pattern[str], str]] = field(
        default_factory=list, init=False, repr=False, compare=False)
    _compiled_drop: list[re.Pattern[str]] = field(
        default_factory=list, init=False, repr=False, compare=False)
    #: What messages call the key map (its file, for :meth:`from_file`).
    _what: str = field(default="key map", init=False, repr=False, compare=False)
    #: Seconds its matches took so far, against :data:`MAX_MATCHING_SECONDS`.
    _matching_seconds: float = field(default=0.0, init=False, repr=False, compare=False)
    #: Keys matched so far -> their new names (None: dropped).
    _mapped: dict[str, str | None] = field(
        default_factory=dict, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self._validate("key map")

    def _validate(self, what: str) -> None:
        """Check the fields, normalise them to dict and lists, and compile the patterns.

        ``what`` names the key map in messages (its file, for :meth:`from_file`).
        """
        if not isinstance(self.rename, Mapping) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in self.rename.items()):
            raise ZooFormatError(f"{what}: 'rename' must map strings to strings")
        for old, new in self.rename.items():
            check_state_key(old, what)
            check_state_key(new, what)
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
        self._what = what
        self._matching_seconds = 0.0
        self._mapped = {}

    @classmethod
    def from_file(cls, path: str | os.PathLike) -> KeyMap:
        """Read and check a key map file; any problem raises one :class:`ZooFormatError`."""
        path = Path(path)
        what = f"key map {path}"
        try:
            if path.exists() and not path.is_file():
                raise ZooFormatError(f"{what}: not a file")
            text = read_small_file(path, MAX_KEY_MAP_BYTES, what,
                                   " (a key map is a short JSON file)")
        except FileNotFoundError:
            raise ZooFormatError(f"key map not found: {path}") from None
        except OSError as error:
            raise ZooFormatError(f"{what} cannot be read: {error}") from None
        data = load_json(text, what)
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
        """Return the state with renamed keys; two keys mapping to one name raise, and so
        do matches that take the key map over :data:`MAX_MATCHING_SECONDS` in all."""
        result: dict[str, torch.Tensor] = {}
        for key, value in state.items():
            check_state_key(key, "state")
            new = self._new_name(key)
            if new is None:
                continue
            if new in result:
                raise ZooSchemaError(f"key map sends two keys to {new!r} (one is {key!r})")
            result[new] = value
        return result

    def _new_name(self, key: str) -> str | None:
        """``key``'s new name (None: dropped); a key already seen is not matched again."""
        if key in self._mapped:
            return self._mapped[key]
        new: str | None = None
        if not any(self._timed(pattern.search, key) for pattern in self._compiled_drop):
            new = self.rename.get(key, key)
            for pattern, replacement in self._compiled_rules:
                new = self._timed(pattern.sub, replacement, new)
                if len(new) > MAX_KEY_LENGTH:
                    raise ZooSchemaError(f"key map turns {key!r} into a key longer than "
                                         f"{MAX_KEY_LENGTH} characters")
        if len(self._mapped) < MAX_REMEMBERED_KEYS:
            self._mapped[key] = new
        return new

    def _timed(self, match: Any, *args: Any) -> Any:
        """``match(*args)`` (a pattern's search or sub), its time counted against
        :data:`MAX_MATCHING_SECONDS`, the bound on all the key map's matches together."""
        start = time.perf_counter()
        found = match(*args)
        self._matching_seconds += time.perf_counter() - start
        if self._matching_seconds > MAX_MATCHING_SECONDS:
            raise ZooFormatError(
                f"{self._what}: its patterns took over {MAX_MATCHING_SECONDS:g} s matching "
                f"{len(self._mapped) + 1} key(s), the limit for one key map (several repeats "
                "backtrack for long on long keys that do not match): anchor the patterns "
                "with ^, or use fewer repeats")
        return found


@dataclass(frozen=True)
class ForeignLayout:
    """Another library's layout of one of our models: the rules that rename its keys to
    ours (``(pattern, replacement)``, applied in order, as a :class:`KeyMap`'s) and the
    model options that give our network its architecture (e.g. convolution biases).
    Only a whole state that the rules turn into exactly the keys of our model so built
    is read this way (:func:`implied_reading`), so a rule may be short."""

    name: str
    rules: tuple[tuple[str, str], ...]
    options: tuple[tuple[str, Any], ...] = ()


_TORCH_UNCERTAINTY_HEAD = ((r"^linear\.", "fc."),)

#: The foreign layouts an import recognises with no key map. torch-uncertainty's
#: ResNets (``torch_uncertainty/models/classification/resnet/std.py``, whose networks
#: the authors' release saves) name everything as ours (``conv1``, ``bn1``,
#: ``layer{i}.{j}.{conv,bn}{1,2}``, the projection ``shortcut.{0,1}``) but for the head,
#: ``linear``, which our ``resnet18`` and ``resnet18-tiny`` call ``fc``; built with
#: ``conv_bias=True`` (its ``resnet`` default from February 2024 to May 2025; its ResNet
#: baseline passed False) every convolution has a bias, our option ``conv_bias``.
FOREIGN_LAYOUTS: tuple[ForeignLayout, ...] = (
    ForeignLayout("torch-uncertainty's ResNet (head 'linear', ours 'fc')",
                  _TORCH_UNCERTAINTY_HEAD),
    ForeignLayout("torch-uncertainty's ResNet with convolution biases (conv_bias=true)",
                  _TORCH_UNCERTAINTY_HEAD, (("conv_bias", True),)),
)

#: ``keys_with(options)``: the model's keys when built with these options as well as the
#: ones given (empty when the model takes no such option).
KeysWith = Callable[[Mapping[str, Any]], Iterable[str]]


@dataclass(frozen=True)
class Reading:
    """How an import reads a checkpoint's keys when no key map is given: ``key_map``
    (a wrapper's prefix stripped, a known layout's names renamed: recorded in the
    provenance like a given key map) and the model ``options`` it implies (recorded in
    the collection's attributes); ``what`` says it in words."""

    key_map: KeyMap
    options: dict[str, Any]
    what: str


def _wrapper_prefix(keys: list[str]) -> str | None:
    """The one ``PREFIX`` every key starts with as ``PREFIX.`` (``model``, as the
    authors' release saves a Lightning module's network; ``module``, as DataParallel
    does), else None."""
    prefixes = {key.partition(".")[0] for key in keys}
    if len(prefixes) != 1 or not all("." in key for key in keys):
        return None
    return prefixes.pop()


def _readings(keys: list[str], expected: list[str], keys_with: KeysWith | None
              ) -> Iterator[tuple[str, list[tuple[str, str]], dict[str, Any], list[str]]]:
    """Each way of reading ``keys`` this module knows, as (what it does, its rules, the
    model options it implies, the keys expected then): the keys as they are, without
    their wrapper's prefix, and each as a :data:`FOREIGN_LAYOUTS` layout (those with
    options only given ``keys_with``, and where the model takes them); the plain reading
    first."""
    prefix = _wrapper_prefix(keys)
    strips: list[tuple[str, list[tuple[str, str]]]] = [("", [])]
    if prefix is not None:
        strips.append((f"without the keys' prefix '{prefix}.'",
                       [(f"^{re.escape(prefix)}\\.", "")]))
    for strip, strip_rules in strips:
        yield strip, strip_rules, {}, expected
        for layout in FOREIGN_LAYOUTS:
            if layout.options and keys_with is None:
                continue
            options = dict(layout.options)
            wanted = list(keys_with(options)) if keys_with and options else expected
            if wanted:   # else the model takes no such option
                what = f"{strip} read as {layout.name}".strip()
                yield what, strip_rules + list(layout.rules), options, wanted


def _renamed(keys: list[str], rules: list[tuple[str, str]]) -> list[str]:
    """``keys`` through ``rules`` (this module's own anchored patterns: no timing)."""
    compiled = [(re.compile(pattern), replacement) for pattern, replacement in rules]
    renamed = []
    for key in keys:
        for pattern, replacement in compiled:
            key = pattern.sub(replacement, key)
        renamed.append(key)
    return renamed


def implied_reading(keys: Iterable[str], expected: Iterable[str],
                    keys_with: KeysWith | None = None) -> Reading | None:
    """How an import reads ``keys`` when no key map is given: the reading that makes
    them exactly the model's ``expected`` keys by stripping a wrapper's prefix (every key
    starts with one ``PREFIX.``), by renaming a known foreign layout's keys
    (:data:`FOREIGN_LAYOUTS`), or both; a layout that implies model options is tried
    against ``keys_with(options)`` (not given: the options are fixed, as when appending
    to a collection). None when the keys fit as they are, or no reading fits exactly
    (then the model's check names what differs, and :func:`closest_reading` what is
    closest)."""
    keys, expected = list(keys), list(expected)
    if not keys or set(keys) == set(expected):
        return None
    for what, rules, options, wanted in _readings(keys, expected, keys_with):
        renamed = _renamed(keys, rules)
        if rules and len(set(renamed)) == len(keys) and set(renamed) == set(wanted):
            return Reading(KeyMap(rules=rules), options, what)
    return None


def closest_reading(keys: Iterable[str], expected: Iterable[str],
                    keys_with: KeysWith | None = None) -> str | None:
    """When ``keys`` do not fit ``expected`` however they are read, the reading that
    comes closest, in one line: what it does (strip the wrapper's prefix, rename a known
    layout) and the keys, so read, that are still missing or unexpected, e.g.
    ``without the keys' prefix 'model.' read as torch-uncertainty's ResNet (...):
    missing key 'bn1.num_batches_tracked' (and 19 more)``. None when the keys as they
    are come closest (the plain missing/unexpected message says it best)."""
    keys = list(keys)
    best: tuple[int, str, list[str], list[str]] | None = None
    for what, rules, _, wanted in _readings(keys, list(expected), keys_with):
        renamed = _renamed(keys, rules)
        renamed_set, wanted_set = set(renamed), set(wanted)
        missing = [key for key in wanted if key not in renamed_set]
        unexpected = [key for key in renamed if key not in wanted_set]
        if best is None or len(missing) + len(unexpected) < best[0]:
            best = (len(missing) + len(unexpected), what, missing, unexpected)
    if best is None or not best[1]:
        return None
    _, what, missing, unexpected = best
    parts = [f"{kind} key {names[0]!r}" + (f" (and {len(names) - 1} more)"
                                           if len(names) > 1 else "")
             for kind, names in (("missing", missing), ("unexpected", unexpected)) if names]
    return f"{what}: {'; '.join(parts) or 'keys repeat'}"


def restore_integers(state: Mapping[str, torch.Tensor], integers: Mapping[str, torch.dtype],
                     name: str) -> dict[str, torch.Tensor]:
    """``state`` with each tensor the model holds as an integer (``integers``: key ->
    dtype) that arrived in floating point cast back to it, when its values are whole
    numbers that dtype holds; other values raise :class:`ZooSchemaError`.

    Why: torch-uncertainty's script that prepares checkpoints for the Hub casts a whole
    state to float16, BatchNorm's ``num_batches_tracked`` counters too. float16 holds
    whole numbers exactly up to 2048 and rounds larger counts, which no prediction reads
    (they matter only to a BatchNorm without momentum in training); the rounded count is
    what is kept.
    """
    restored = dict(state)
    for key, dtype in integers.items():
        value = state.get(key)
        if value is None or not value.is_floating_point():
            continue
        wide = value.double()
        info = torch.iinfo(dtype)
        whole = torch.isfinite(wide) & (wide == wide.round()) & (wide >= info.min) & (
            wide < info.max + 1.0)
        if not bool(whole.all()):
            raise ZooSchemaError(f"{name}: {key!r} holds {str(value.dtype)[6:]} values that "
                                 f"are not whole numbers, where the model has "
                                 f"{str(dtype)[6:]} (a counter)")
        restored[key] = wide.to(dtype)
    return restored
