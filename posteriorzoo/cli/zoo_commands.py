"""Subcommands on collection files: ``info``, ``verify``, ``export``, ``import``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from posteriorzoo.cli._types import (
    add_json_option,
    add_no_verify_option,
    add_overwrite_option,
    integer_in,
)
from posteriorzoo.errors import ZooFormatError
from posteriorzoo.vocabulary import STORAGE_DTYPES

# The ranges of the numeric options (each is checked when the command line is parsed).
#: Output classes, as a spec's num_classes (train_zoo.spec.MAX_CLASSES): the last layer
#: holds num_classes x features weights.
CLASSES = integer_in(1, 100_000)
#: Checkpoints committed together: they are held in memory until the commit.
PER_COMMIT = integer_in(1, 100_000)


def register(subparsers: argparse._SubParsersAction) -> None:
    info = subparsers.add_parser(
        "info", help="what a collection file holds",
        description="Show a collection's architecture, dataset, method, number of checkpoints "
                    "and modes, tensors (shape, dtype, parameter count), its annotations (what "
                    "was derived: symmetries removed, multi-mode, ...) and a metadata summary. "
                    "Every "
                    "checkpoint is checked against its digests first (--no-verify skips "
                    "this, e.g. to look at a damaged file). It also says whether the stored "
                    "tensors fit the registered architecture. --json prints strict JSON: a "
                    "NaN or infinite number (e.g. in a recipe) is null.")
    info.add_argument("zoo", type=Path, help="collection file (.h5)")
    add_json_option(info, "machine-readable JSON")
    add_no_verify_option(info)
    info.set_defaults(func=run_info)

    verify = subparsers.add_parser(
        "verify", help="detect corruption in collection files",
        description="Re-hash every checkpoint and compare with the SHA-256 stored when it "
                    "was written; check the tensors fit the architecture, that NaN/inf only "
                    "occur in checkpoints flagged diverged, and the whole file against a "
                    "SHA256SUMS manifest next to it, if any. Exit code 2 if anything is wrong.")
    verify.add_argument("zoos", type=Path, nargs="+", help="collection files (.h5)")
    add_json_option(verify, "one JSON list with every file's result")
    verify.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    verify.set_defaults(func=run_verify)

    export = subparsers.add_parser(
        "export", help="write checkpoints as safetensors files",
        description="Write checkpoint INDEX (or all with --all) of a collection as "
                    "safetensors files; the header records the collection attributes and "
                    "the checkpoint's metadata row, so 'import' can rebuild a collection. "
                    "Each checkpoint's SHA-256 is checked as it is read. The output is "
                    "written under a temporary name and renamed into place; it is never "
                    "the collection, and an existing output is refused unless --overwrite.")
    export.add_argument("zoo", type=Path, help="collection file (.h5)")
    export.add_argument("index", nargs="?", type=int, help="checkpoint index (negative counts "
                        "from the end)")
    export.add_argument("--out", type=Path, required=True,
                        help="output .safetensors file, or a new folder with --all (its "
                             "parent folder must exist)")
    export.add_argument("--all", action="store_true",
                        help="export every checkpoint into the new folder --out as "
                             "NNNNNN.safetensors")
    add_overwrite_option(export)
    add_no_verify_option(export)
    add_json_option(export, "what was written (every file with its SHA-256) as JSON")
    export.set_defaults(func=run_export)

    importer = subparsers.add_parser(
        "import", help="append safetensors checkpoints or release archives to a collection",
        description="Append checkpoints to the collection --out (created if missing) from "
                    "safetensors files "
                    "and from the authors' release archives (.tgz of float16 safetensors, "
                    "one per model). Every input is validated before anything is appended, "
                    "so bad input leaves the collection unchanged, and a new collection "
                    "appears only when complete. Inputs whose tensors the collection already "
                    "holds (or that repeat an earlier input) are skipped, so an interrupted "
                    "import finishes when run again. A new collection takes its attributes "
                    "from the options, else from an exported file's header, else from the "
                    "release archive's name (e.g. mnist-optunet-0-1023.tgz).")
    importer.add_argument("inputs", type=Path, nargs="+", help=".safetensors files or .tgz")
    importer.add_argument("--out", dest="zoo", type=Path, required=True,
                          help="collection file (.h5), created if missing")
    importer.add_argument("--architecture", help="model name (see posteriorzoo.models)")
    importer.add_argument("--dataset", help="training data set name")
    importer.add_argument("--method", help="posterior approximation, e.g. de, swag, laplace")
    importer.add_argument("--num-classes", type=CLASSES,
                          help=f"output classes, {CLASSES.range_text} (the last layer holds "
                               "num-classes x features weights) (default: an exported "
                               "checkpoint's header, else the model's)")
    importer.add_argument("--model-option", action="append", default=[], metavar="KEY=VALUE",
                          help="model option (JSON value), e.g. width=8; repeatable")
    importer.add_argument("--key-map", type=Path, help='JSON file {"rename": {...}, '
                          '"rules": [[regex, replacement], ...], "drop": [regex, ...]} that '
                          "renames foreign state keys to this project's model keys "
                          "(without one, a wrapper's prefix on every key, e.g. the "
                          "release's 'model.', is stripped when that alone makes them fit)")
    importer.add_argument("--dtype", choices=STORAGE_DTYPES,
                          help="cast floating tensors (the release stores float16)")
    importer.add_argument("--checkpoints-per-batch", type=PER_COMMIT, default=64,
                          help=f"checkpoints committed together when appending, "
                               f"{PER_COMMIT.range_text} (held in memory until the commit) "
                               "(default: %(default)s)")
    importer.add_argument("--dry-run", action="store_true",
                          help="write nothing: list what would be taken from each input "
                               "(files, archive members and the modes their names number, "
                               "the members skipped), the new collection's attributes and "
                               "the key map, from the inputs' headers alone")
    add_no_verify_option(importer)
    add_json_option(importer, "what was imported as JSON")
    importer.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    importer.set_defaults(func=run_import)


def _dry_run_import(args: argparse.Namespace) -> int:
    import json

    from posteriorzoo.collection import plan_import
    from posteriorzoo.zoo.keymap import KeyMap

    plan = plan_import(args.inputs, architecture=args.architecture, dataset=args.dataset,
                       method=args.method, num_classes=args.num_classes,
                       model_options=_model_options(args.model_option),
                       key_map=KeyMap.from_file(args.key_map) if args.key_map else None)
    if args.json:
        print(json.dumps(plan, indent=1))
        return 0
    for entry in plan["inputs"]:
        print(f"{entry['input']}: {len(entry['taken'])} checkpoint(s) taken, "
              f"{len(entry['skipped'])} member(s) skipped")
        for item in entry["taken"]:
            mode = "" if item["mode"] is None else f" -> mode {item['mode']}"
            print(f"  take {item['name']} ({item['bytes']:,} bytes){mode}")
        for item in entry["skipped"]:
            print(f"  skip {item['name']} (not a safetensors file)")
    attributes = plan["attributes"]
    told = ("from the first checkpoint's header, at import" if attributes is None else
            ", ".join(f"{key} {value}" for key, value in attributes.items()))
    if args.zoo.exists():
        told = "appended: the existing collection's attributes apply"
    rules = plan["key_map"]["rules"]
    keys = (f"key map rules {rules}" + (f" (implied: {plan['key_map']['reading']})"
                                         if plan["key_map"]["implied"] else "")
            if rules else "keys as they are")
    print(f"{plan['checkpoints']} checkpoint(s) would be imported into {args.zoo} "
          f"({told}; {keys}); nothing was written")
    return 0


# ---------------------------------------------------------------------- info
def run_info(args: argparse.Namespace) -> int:
    from posteriorzoo.collection import describe

    description = describe(args.zoo, verify=not args.no_verify, command=args.command_line)
    if args.json:
        print(description.to_json(), end="")
        return 0
    info = description.to_dict()
    options = f" {info['model_options']}" if info["model_options"] else ""
    print(f"{info['path']}")
    print(f"  architecture  {info['architecture']}{options} ({info['num_classes']} classes)")
    fits = {True: "yes (its keys, shapes and kinds of number)",
            False: f"NO: {info['architecture_problem']}; commands that build the network "
                   "refuse this collection",
            None: f"not checked: {info['architecture_problem']}"}
    print(f"  fits model    {fits[info['fits_architecture']]}")
    print(f"  dataset       {info['dataset']}")
    print(f"  method        {info['method']}")
    modes = info["metadata"]["modes"]
    print(f"  checkpoints   {info['checkpoints']} "
          f"({'modes unknown' if modes is None else f'{modes} modes'})")
    print(f"  values/ckpt   {info['values_per_checkpoint']:,}")
    width = max(len(t["key"]) for t in info["tensors"])
    print(f"  {'tensor':<{width}}  {'shape':<18} {'dtype':<8} {'count':>10}")
    for tensor in info["tensors"]:
        shape = "x".join(map(str, tensor["shape"])) or "scalar"
        print(f"  {tensor['key']:<{width}}  {shape:<18} {tensor['dtype']:<8} "
              f"{tensor['count']:>10,}")
    meta = info["metadata"]
    print(f"  seeds         {meta['seeds']} ({meta['distinct_seeds']} distinct)"
          if meta["seeds"] is not None else "  seeds         unknown")
    print(f"  diverged      {meta['diverged']}")
    for name in ("test_accuracy", "test_loss", "wall_time_seconds"):
        if meta[name]:
            stats = meta[name]
            print(f"  {name:<13} min {stats['min']:.4g}  median {stats['median']:.4g}  "
                  f"max {stats['max']:.4g}")
    if info["recipe"]:
        print("  recipe")
        for line in recipe_lines(info["recipe"], indent=4):
            print(line)
    # Canonical and raw files differ here (symmetries removed, min-mass, ...). A group set
    # after training (posteriorzoo annotate) is said on a line of its own: the group
    # before, when, and the measurement that decided it (its provenance is in --json).
    annotations = dict(info["annotations"])
    setting = annotations.pop("posterior_set", None)
    print(f"  annotations   {json.dumps(annotations, sort_keys=True)}")
    if isinstance(setting, dict):
        made = setting.get("provenance")
        when = made.get("created_at") if isinstance(made, dict) else None
        reason = " ".join(str(setting.get("reason")).split())  # one line, whatever the file
        print(f"  posterior     {annotations.get('posterior')}, set after training (was "
              f"{setting.get('from') or 'not recorded'}{f'; {when}' if when else ''}): "
              f"{reason}")
    if info["created_by"].get("command"):
        print(f"  created by    {info['created_by']['command']}")
    return 0


def _value_text(value: Any) -> str:
    """A recipe value as typed in a spec: strings bare, the rest as compact JSON."""
    if isinstance(value, str) and value:
        return value
    return json.dumps(value, sort_keys=True, separators=(", ", ": "))


def recipe_lines(recipe: dict[str, Any], indent: int) -> list[str]:
    """The recipe as aligned ``key  value`` lines, sorted by key; a table (a non-empty
    mapping, such as ``method_options``) as its own lines, indented two more."""
    width = max(len(key) for key in recipe)
    lines = []
    for key in sorted(recipe):
        value = recipe[key]
        if isinstance(value, dict) and value:
            lines.append(f"{' ' * indent}{key}")
            lines.extend(recipe_lines(value, indent + 2))
        else:
            lines.append(f"{' ' * indent}{key:<{width}}  {_value_text(value)}")
    return lines


# ---------------------------------------------------------------------- verify
def run_verify(args: argparse.Namespace) -> int:
    from posteriorzoo.collection import verify
    from posteriorzoo.errors import PosteriorZooError
    from posteriorzoo.results import strict_json

    failed, reports = 0, []
    for path in args.zoos:
        try:
            report = verify(path, progress=not args.no_progress, command=args.command_line)
        except PosteriorZooError as error:
            print(f"posteriorzoo verify: error: {error}", file=sys.stderr)
            reports.append({"kind": "verify", "path": str(path), "ok": False,
                            "problems": [str(error)]})
            failed += 1
            continue
        reports.append(report.to_dict())
        if args.json:
            failed += not report.ok
        elif report.ok:
            print(report.summary())
        else:
            print(f"posteriorzoo verify: error: {report.summary()}", file=sys.stderr)
            failed += 1
    if args.json:
        print(strict_json(reports, indent=1))
    return 2 if failed else 0


# ---------------------------------------------------------------------- export / import
def run_export(args: argparse.Namespace) -> int:
    from posteriorzoo.collection import export_all, export_checkpoint

    verify = not args.no_verify
    if args.all:
        if args.index is not None:
            raise ZooFormatError("give a checkpoint INDEX or --all, not both")
        result = export_all(args.zoo, args.out, overwrite=args.overwrite, verify=verify,
                            command=args.command_line)
        line = f"exported {len(result.files)} checkpoints to {result.out}/"
    else:
        if args.index is None:
            raise ZooFormatError("give a checkpoint INDEX, or --all")
        result = export_checkpoint(args.zoo, args.index, args.out, overwrite=args.overwrite,
                                   verify=verify, command=args.command_line)
        line = f"exported checkpoint {args.index} to {result.out}"
    if args.json:
        print(result.to_json(), end="")
    else:
        print(line)
    return 0


def _model_options(pairs: list[str]) -> dict[str, Any] | None:
    if not pairs:
        return None
    options: dict[str, Any] = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise ZooFormatError(f"--model-option takes KEY=VALUE, not {pair!r}")
        try:
            options[key] = json.loads(value)
        except json.JSONDecodeError:
            options[key] = value
    return options


def run_import(args: argparse.Namespace) -> int:
    import torch

    from posteriorzoo.collection import import_checkpoints
    from posteriorzoo.zoo.keymap import KeyMap

    if args.dry_run:
        return _dry_run_import(args)
    summary = import_checkpoints(
        args.zoo, args.inputs,
        architecture=args.architecture, dataset=args.dataset, method=args.method,
        num_classes=args.num_classes, model_options=_model_options(args.model_option),
        key_map=KeyMap.from_file(args.key_map) if args.key_map else None,
        dtype=getattr(torch, args.dtype) if args.dtype else None,
        command=args.command_line, checkpoints_per_batch=args.checkpoints_per_batch,
        verify=not args.no_verify, progress=not args.no_progress)
    if args.json:
        print(summary.to_json(), end="")
        return 0
    verb = "created" if summary.created else "appended to"
    added = len(summary.indices)
    where = (f" (checkpoints {summary.indices.start}..{summary.indices.stop - 1})"
             if added else "")
    print(f"{verb} {summary.path}: {added} checkpoint(s) added{where} from "
          f"{len(args.inputs)} input(s); skipped {summary.skipped_existing} already in the "
          f"collection and {summary.skipped_repeated} repeated")
    return 0
