"""Documentation matches the code: README commands, data card columns, CI entry point."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from posteriorzoo.cli import build_parser
from posteriorzoo.zoo.schema import METADATA_COLUMNS

ROOT = Path(__file__).resolve().parent.parent


def test_readme_opens_with_the_two_commands():
    text = (ROOT / "README.md").read_text()
    first_block = re.search(r"```sh\n(.*?)```", text, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]


def test_ci_runs_the_readme_test_command():
    script = (ROOT / ".ci" / "run").read_text()
    runs = [line.strip() for line in script.splitlines()
            if line.strip() and not line.strip().startswith("#")]
    # the README's command, then the numerical tests again as on an AVX2 CPU (issue 30)
    assert runs[-2:] == ["make test", "make test-avx2"]


def test_readme_documents_every_subcommand():
    text = (ROOT / "README.md").read_text()
    parser = build_parser()
    subcommands = next(a for a in parser._actions if a.dest == "command").choices
    for name in subcommands:
        assert f"posteriorzoo {name}" in text, name


def test_data_card_header_and_columns():
    text = (ROOT / "data_card.md").read_text()
    header = text.split("---")[1]
    for field in ("license:", "task_categories:", "tags:", "size_categories:"):
        assert field in header
    for column in METADATA_COLUMNS:
        assert f"| `{column.name}` |" in text, column.name


def test_no_pickle_in_the_code():
    """Checkpoints come from strangers: nothing may unpickle (see README, 'No pickle')."""
    offenders = []
    for folder in ("posteriorzoo", "train_zoo", "analysis", "benchmarks"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text()
            if re.search(r"^\s*(import pickle|from pickle|import dill|import joblib)", text, re.M):
                offenders.append(f"{path}: imports a pickle library")
            if "allow_pickle=True" in text:
                offenders.append(f"{path}: allow_pickle=True")
            for node in ast.walk(ast.parse(text)):
                if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                        and node.func.attr == "load"
                        and getattr(node.func.value, "id", None) == "torch"
                        and not any(k.arg == "weights_only" and getattr(k.value, "value", 0)
                                    is True for k in node.keywords)):
                    offenders.append(f"{path}:{node.lineno}: torch.load without weights_only")
    assert not offenders
