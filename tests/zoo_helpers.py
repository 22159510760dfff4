"""Shared helpers of the zoo tests: deterministic checkpoints and file corruption."""

from __future__ import annotations

from pathlib import Path

import h5py
import torch

from posteriorzoo.models import build
from posteriorzoo.zoo import create_zoo


def checkpoint(seed: int, architecture: str = "optunet", **options) -> dict[str, torch.Tensor]:
    """A state_dict that is a pure function of ``seed`` (random init under that seed)."""
    torch.manual_seed(seed)
    model = build(architecture, **options)
    state = model.state_dict()
    if architecture.startswith("resnet"):
        # Make BN buffers non-trivial so a round trip proves they are stored.
        for key, value in state.items():
            if key.endswith("running_mean") or key.endswith("running_var"):
                value.copy_(torch.rand_like(value) + 0.5)
            if key.endswith("num_batches_tracked"):
                value.fill_(seed + 3)
    return {key: value.clone() for key, value in state.items()}


def make_zoo(path: Path, seeds) -> Path:
    """An optunet collection at ``path`` of ``checkpoint(seed)`` for each seed, in order
    (the MMD tests' zoos: their contents, hence their digests, follow from the seeds)."""
    states = [checkpoint(seed) for seed in seeds]
    with create_zoo(path, architecture="optunet", dataset="digits", method="test",
                    num_classes=10, template=states[0]) as zoo:
        zoo.append_many(states, [{"seed": s} for s in seeds])
    return path


def method_collection(path: Path, seeds, dataset: str = "digits", method: str = "de",
                      scale: float = 1.0) -> Path:
    """An optunet collection of ``checkpoint(seed)`` for each seed, times ``scale``,
    recorded as ``method``'s on ``dataset`` (the report tests' collections)."""
    states = [checkpoint(seed) for seed in seeds]
    with create_zoo(path, architecture="optunet", dataset=dataset, method=method,
                    num_classes=10, template=states[0]) as zoo:
        for state in states:
            zoo.append({key: value * scale for key, value in state.items()})
    return path


def flip_byte_in_chunk(path: Path, key: str, chunk: int = 0, offset: int = 3) -> None:
    """Flip one byte inside a stored chunk of ``/state/<key>`` (simulated bit rot)."""
    with h5py.File(path, "r", swmr=True, locking=False) as handle:
        info = handle["state"][key].id.get_chunk_info(chunk)
        position = info.byte_offset + offset
    with open(path, "r+b") as raw:
        raw.seek(position)
        byte = raw.read(1)
        raw.seek(position)
        raw.write(bytes([byte[0] ^ 0xFF]))


def run(capsys, *argv):
    """Run the CLI; return (exit code, stdout, stderr)."""
    from posteriorzoo.cli import main

    try:
        code = main([str(a) for a in argv])
    except SystemExit as stop:  # argparse's usage errors
        code = stop.code
    out, err = capsys.readouterr()
    return code, out, err


def run_quietly(*argv) -> tuple[int, str]:
    """Run the CLI in this process without pytest's capsys (e.g. in a module-scoped
    fixture); return (exit code, stderr)."""
    import contextlib
    import io

    from posteriorzoo.cli import main

    stderr = io.StringIO()
    with contextlib.redirect_stderr(stderr), contextlib.redirect_stdout(io.StringIO()):
        code = main([str(a) for a in argv])
    return code, stderr.getvalue()


def assert_one_line_error(code, err, *fragments):
    """Exit code 2 and exactly one line on stderr containing every fragment."""
    assert code == 2
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1, lines
    for fragment in fragments:
        assert fragment in lines[0]


def load_script(path: Path):
    """A benchmark script (not a package module) imported from its file."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def need_fashion_mnist() -> None:
    """Skip the calling test when Debian's Fashion-MNIST files are not installed."""
    import pytest

    from posteriorzoo.data import dataset_files
    from posteriorzoo.errors import PosteriorZooError

    try:
        dataset_files("fashion-mnist", download=False)
    except PosteriorZooError:
        pytest.skip("the Fashion-MNIST files are not installed")
