"""Fuzz suite: every subcommand on crafted, corrupted and hostile collections.

Each probe runs one subcommand on one damaged collection (see ``fuzz_cases.py``) in a
driver process (``fuzz_driver.py``), so that a hard crash inside the HDF5 library costs
one case and is reported, not the test run. What every probe must show:

- exit code 0 or 2, never a traceback; on 2, exactly one line on stderr;
- the input byte-identical (unless the command appended to it and succeeded);
- on failure, no output and no temporary file left behind;
- never a byte of a file that a hostile collection names as external storage;
- a refusal wherever the damage matters: structural and hostile damage, and numbers of a
  foreign dtype, are refused by every command (the few foreign-dtype cases a collection
  may legitimately hold, by the commands they matter to: ``PARTLY_REFUSED``); changed
  weights or metadata by every command that reads checkpoints; a bit flip that changes
  what the file means, likewise.

The fast part runs in ``make test``; ``-m slow`` runs every attribute case and a few
hundred bit flips. With ``POSTERIORZOO_PROBE_LOG=FILE`` each probe's verdict is appended
to FILE (``tests/probe_table.py FILE`` prints the table by command and class).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from fuzz_cases import ATTRIBUTES, PARTLY_REFUSED, named_cases

DRIVER = Path(__file__).parent / "fuzz_driver.py"
READERS = {"info", "verify", "export-all", "canonicalize", "min-mass", "mmd-target",
           "mmd-method", "train-into", "import-into"}
APPENDERS = {"import-into", "train-into"}
FAST_NAMED = [
    "attr-format-deleted", "attr-schema_version-nan", "attr-state_keys-bad-json",
    "attr-model_options-json-list", "attr-num_classes-non-utf8", "attr-recipe-array",
    "attr-architecture-int", "attr-annotations-deleted", "attr-created_by-json-string",
    "committed-negative", "committed-huge", "committed-float", "committed-string",
    "committed-2d", "metadata-dropped-column", "metadata-2d", "metadata-group",
    "row-digests-deleted", "state-entry-group", "short-dataset", "extra-member",
    "extra-state", "wrong-shape", "undeclared-rows",
    "nan-unflagged", "changed-weight", "changed-accuracy", "changed-data-seed",
    "changed-diverged", "changed-row-digest",
    "soft-link", "external-link", "external-storage", "virtual-dataset", "compressed",
    "big-endian-float", "bool-tensor", "int32-weights", "num-classes-huge",
    "unvalidated-wrong-shape", "non-utf8-metadata",
]
#: Classes whose every case every command must refuse (but PARTLY_REFUSED's).
MUST_REFUSE_KINDS = {"structure", "hostile", "foreign dtype"}


def _run_driver(probes: list[dict], workdir: Path, timeout: float) -> dict[str, list[dict]]:
    """Run the probes; restart the driver after a crash. Returns results by probe id."""
    results: dict[str, list[dict]] = {str(p["id"]): [] for p in probes}
    remaining = list(probes)
    log = workdir / "results.jsonl"
    while remaining:
        (workdir / "cases.json").write_text(json.dumps(remaining))
        log.write_text("")
        try:
            process = subprocess.run(
                [sys.executable, str(DRIVER), str(workdir / "cases.json"), str(log),
                 str(workdir)], capture_output=True, text=True, timeout=timeout)
            crashed = process.returncode != 0
            detail = f"driver exit {process.returncode}: {process.stderr[-300:]}"
        except subprocess.TimeoutExpired:
            crashed, detail = True, f"hung for more than {timeout} s"
        started = None
        for line in log.read_text().splitlines():
            record = json.loads(line)
            if "started" in record:
                started = str(record["started"])
            else:
                results[str(record["id"])].append(record)
        if crashed:
            if started is None:
                raise AssertionError(f"the fuzz driver failed before any case: {detail}")
            results[started].append({"id": started, "command": "*", "crash": detail})
        remaining = [p for p in remaining if not results[str(p["id"])]]
    return results


def _violations(kind: str, record: dict) -> list[str]:
    if "crash" in record:
        return [f"crash: {record['crash']}"]
    command, code, problems = record["command"], record["code"], []
    if code not in (0, 2):
        problems.append(f"exit {code}: {record['stderr'][-3:]}")
    if code == 2 and (len(record["stderr"]) != 1 or "Traceback" in " ".join(record["stderr"])):
        problems.append(f"stderr is not one line: {record['stderr'][:4]}")
    if not record["input_unchanged"] and (code != 0 or command not in APPENDERS):
        problems.append("the input changed")
    if code != 0 and (record["outputs"] or record["partials"]):
        problems.append(f"left {record['outputs'] + record['partials']}")
    if record["leaked"]:
        problems.append("leaked the external file's bytes")
    partly = PARTLY_REFUSED.get(str(record["id"]))
    # A partly refused case's export is of the crafted file, not of the pristine one.
    if command == "export" and code == 0 and not record.get("output_correct") \
            and partly is None:
        problems.append("exported something other than the stored checkpoint 0")
    must_refuse = (
        (kind in MUST_REFUSE_KINDS and (partly is None or command in partly))
        or (kind == "content" and command in READERS)
        or not record["opens"]
        or (kind == "bitflip" and not record["same_content"] and command in READERS))
    if must_refuse and code != 2:
        problems.append("accepted a damaged collection")
    return problems


def _log(kind_of: dict[str, str], results: dict[str, list[dict]]) -> None:
    path = os.environ.get("POSTERIORZOO_PROBE_LOG")
    if not path:
        return
    with open(path, "a") as log:
        for probe_id, records in results.items():
            for record in records:
                log.write(json.dumps({"suite": "collections", "command": record["command"],
                                      "class": kind_of[probe_id],
                                      "refused": record.get("code") == 2,
                                      "ok": not _violations(kind_of[probe_id], record)}) + "\n")


def _check(probes: list[dict], workdir: Path, timeout: float) -> None:
    cases = named_cases()
    kind_of = {str(p["id"]): cases[p["case"]][0] if "case" in p else "bitflip"
               for p in probes}
    results = _run_driver(probes, workdir, timeout)
    _log(kind_of, results)
    failures = []
    for probe in probes:
        probe_id = str(probe["id"])
        records = results[probe_id]
        assert records, f"no result for {probe}"
        label = probe.get("case") or f"bit {probe['bit']} of byte {probe['offset']}"
        for record in records:
            failures += [f"{label} / {record['command']}: {problem}"
                         for problem in _violations(kind_of[probe_id], record)]
    assert not failures, f"{len(failures)} violations:\n" + "\n".join(failures[:40])


def _meaningful_ranges(path: Path) -> list[tuple[int, int]]:
    """Byte ranges of the committed rows of every dataset (most of a small collection's
    file is preallocated chunk space that no reader sees)."""
    import h5py

    ranges = []
    with h5py.File(path, "r", locking=False) as handle:
        committed = int(handle["committed"][0])

        def visit(name: str, item: object) -> None:
            if isinstance(item, h5py.Dataset) and item.chunks:
                row = item.dtype.itemsize * int(np.prod(item.shape[1:], dtype=np.int64))
                for chunk in range(item.id.get_num_chunks()):
                    info = item.id.get_chunk_info(chunk)
                    ranges.append((info.byte_offset, info.byte_offset + committed * row))

        handle.visititems(visit)
    return ranges


def _bitflips(count: int, seed: int, path: Path) -> list[dict]:
    """Flip offsets: a third anywhere, a third in the first 8 KiB (superblock and object
    headers), a third inside committed rows."""
    rng = np.random.default_rng(seed)
    size = path.stat().st_size
    ranges = _meaningful_ranges(path)
    anywhere = rng.integers(0, size, count // 3)
    headers = rng.integers(0, min(size, 8192), count // 3)
    picks = rng.integers(0, len(ranges), count - 2 * (count // 3))
    data = [rng.integers(*ranges[i]) for i in picks]
    offsets = np.unique(np.concatenate([anywhere, headers, np.array(data, dtype=np.int64)]))
    return [{"id": f"flip-{o}-{b}", "offset": int(o), "bit": int(b)}
            for o, b in zip(offsets, rng.integers(0, 8, offsets.size), strict=True)]


def _pristine(workdir: Path) -> Path:
    sys.path.insert(0, str(Path(__file__).parent))
    from fuzz_driver import prepare

    return prepare(workdir)["pristine"]


def test_fuzz_named_cases_fast(tmp_path):
    probes = [{"id": name, "case": name} for name in FAST_NAMED]
    probes += _bitflips(24, seed=0, path=_pristine(tmp_path))
    _check(probes, tmp_path, timeout=900)


@pytest.mark.slow
def test_fuzz_every_named_case(tmp_path):
    probes = [{"id": name, "case": name} for name in named_cases()]
    _check(probes, tmp_path, timeout=3600)


@pytest.mark.slow
def test_fuzz_bit_flips(tmp_path):
    _check(_bitflips(300, seed=1, path=_pristine(tmp_path)), tmp_path, timeout=3600)


def test_every_attribute_has_cases():
    cases = named_cases()
    for attribute in ATTRIBUTES:
        assert any(name.startswith(f"attr-{attribute}-") for name in cases)
