"""Runs every subcommand on crafted collections, in one process, and reports each probe.

Usage: ``python fuzz_driver.py CASES.json RESULTS.jsonl WORKDIR``. ``CASES.json`` is a list
of ``{"id", "case"}`` (a name from :func:`fuzz_cases.named_cases`) or ``{"id", "offset",
"bit"}`` (a bit flip). For each case the driver copies a pristine collection, crafts it,
then runs each command through ``posteriorzoo.cli.main`` and appends one JSON line per
command to RESULTS.jsonl: exit code, stderr lines, whether the input changed, which
outputs exist, whether a hostile file's secret leaked. A line ``{"started": id}``
precedes each case, so the test can tell which case a hard crash (a signal from inside
the HDF5 library) or a hang happened in, and restart the driver after it.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shutil
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from fuzz_cases import SECRET, bitflip, content_of, named_cases  # noqa: E402
from zoo_helpers import checkpoint  # noqa: E402

from posteriorzoo.cli import main  # noqa: E402
from posteriorzoo.collection import export_checkpoint  # noqa: E402
from posteriorzoo.zoo import create_zoo, open_zoo  # noqa: E402

SPEC = """name = "fuzz"
recipe = "optunet-mnist"
dataset = "digits"
checkpoints = 1
base_seed = 3
[recipe_overrides]
epochs = 1
"""


def make_collection(path: Path, first_seed: int, count: int = 6) -> None:
    with create_zoo(path, architecture="optunet", dataset="digits", method="de",
                    num_classes=10, template=checkpoint(0)) as zoo:
        zoo.append_many([checkpoint(first_seed + i) for i in range(count)],
                        [{"seed": first_seed + i, "test_accuracy": 0.5 + i / 100}
                         for i in range(count)])


def prepare(workdir: Path) -> dict[str, Path]:
    fixtures = workdir / "fixtures"
    if not (fixtures / "done").exists():
        shutil.rmtree(fixtures, ignore_errors=True)
        fixtures.mkdir(parents=True)
        make_collection(fixtures / "pristine.h5", 0)
        make_collection(fixtures / "good.h5", 100)
        with open_zoo(fixtures / "good.h5") as zoo:
            export_checkpoint(zoo, 0, fixtures / "good.safetensors")
        (fixtures / "spec.toml").write_text(SPEC)
        (fixtures / "done").write_text("")
    return {name: fixtures / file for name, file in (
        ("pristine", "pristine.h5"), ("good", "good.h5"),
        ("safetensors", "good.safetensors"), ("spec", "spec.toml"))}


def commands(case: Path, out: Path, fixtures: dict[str, Path]) -> dict[str, list[str]]:
    """Every subcommand that takes a collection, with ``case`` in that role."""
    quiet = "--no-progress"
    return {
        "info": ["info", case],
        "verify": ["verify", case, quiet],
        "export": ["export", case, "0", "--out", out / "one.safetensors"],
        "export-all": ["export", case, "--all", "--out", out / "all"],
        "canonicalize": ["canonicalize", case, "--out", out / "canonical.h5", quiet],
        "min-mass": ["min-mass", case, "--out", out / "mass", quiet],
        "mmd-target": ["mmd", case, fixtures["good"], "--symmetries", "keep", "--out",
                       out / "mmd-target", quiet],
        "mmd-method": ["mmd", fixtures["good"], case, "--out", out / "mmd-method", quiet],
        "import-into": ["import", "--out", case, fixtures["safetensors"], quiet],
        "train-into": ["train", fixtures["spec"], "--out", case, "--backend", "serial",
                       quiet],
        # the Hub is unreachable here (HF_ENDPOINT points at a closed local port): a good
        # file fails at the network call, a damaged one must be refused before it
        "upload": ["upload", "someone/collection", case],
    }


def run_command(argv: list) -> tuple[int, str, str]:
    stdout, stderr = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(stdout), contextlib.redirect_stderr(stderr):
        try:
            code = main([str(a) for a in argv])
        except SystemExit as stop:
            code = stop.code if isinstance(stop.code, int) else 2
        except Exception:  # noqa: BLE001 - reported as the traceback a user would see
            traceback.print_exc()
            code = 1
    return code, stdout.getvalue(), stderr.getvalue()


def exported_correctly(exported: Path, pristine: Path) -> bool:
    """Whether an exported checkpoint equals the pristine collection's checkpoint 0."""
    import torch

    from posteriorzoo.zoo import read_checkpoint

    try:
        state, header = read_checkpoint(exported)
    except Exception:  # noqa: BLE001 - an export that cannot be read back is wrong
        return False
    with open_zoo(pristine) as zoo:
        expected, row = zoo.state_dict(0), zoo.metadata_dict(0)
    stored = json.loads(header.get("metadata", "{}"))

    def same(a: object, b: object) -> bool:
        return a == b or (isinstance(a, float) and isinstance(b, float) and a != a and b != b)

    return (set(state) == set(expected)
            and all(torch.equal(state[key], expected[key]) for key in expected)
            and all(same(stored[k], v) for k, v in row.items() if k in stored))


def leaked(out: Path) -> bool:
    return any(SECRET in path.read_bytes() for path in out.rglob("*") if path.is_file())


def sha(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest() if path.exists() else ""


def run_case(probe: dict, fixtures: dict[str, Path], workdir: Path, results) -> None:
    folder = workdir / f"case-{probe['id']}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    case = folder / "zoo.h5"
    shutil.copyfile(fixtures["pristine"], case)
    if "case" in probe:
        named_cases()[probe["case"]][1](case, folder)
    else:
        bitflip(probe["offset"], probe["bit"])(case, folder)
    readable = content_of(case)
    same = readable is not None and readable == content_of(fixtures["pristine"])
    try:
        with open_zoo(case):
            opens = True
    except Exception:  # noqa: BLE001
        opens = False
    crafted = case.read_bytes()
    for name, argv in commands(case, folder / "out", fixtures).items():
        out = folder / "out"
        shutil.rmtree(out, ignore_errors=True)
        out.mkdir()
        case.write_bytes(crafted)
        for leftover in folder.glob(".zoo.h5.partial-*"):
            leftover.unlink()
        before = sha(case)
        clock = time.perf_counter()
        code, stdout, stderr = run_command(argv)
        seconds = time.perf_counter() - clock
        correct = name == "export" and code == 0 and exported_correctly(
            out / "one.safetensors", fixtures["pristine"])
        results.write(json.dumps({
            "id": probe["id"], "command": name, "code": code, "output_correct": correct,
            "seconds": round(seconds, 3),
            "stderr": stderr.strip().splitlines(), "input_unchanged": sha(case) == before,
            "outputs": sorted(str(p.relative_to(out)) for p in out.iterdir()),
            "partials": sorted(p.name for p in folder.iterdir() if ".partial-" in p.name),
            "leaked": leaked(out) or SECRET in stdout.encode(),
            "same_content": same, "readable": readable is not None, "opens": opens,
        }) + "\n")
        results.flush()
    shutil.rmtree(folder, ignore_errors=True)


def main_driver() -> None:
    os.environ.update(HF_ENDPOINT="http://127.0.0.1:9", HF_TOKEN="not-a-token",
                      HF_HUB_OFFLINE="0")
    cases = json.loads(Path(sys.argv[1]).read_text())
    workdir = Path(sys.argv[3])
    fixtures = prepare(workdir)
    with open(sys.argv[2], "a") as results:
        for probe in cases:
            results.write(json.dumps({"started": probe["id"]}) + "\n")
            results.flush()
            run_case(probe, fixtures, workdir, results)


if __name__ == "__main__":
    main_driver()
