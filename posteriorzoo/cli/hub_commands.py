"""``posteriorzoo download`` and ``posteriorzoo upload``: zoos on the Hugging Face Hub.

:mod:`posteriorzoo.hub` (and huggingface_hub with it) is imported only when one of these
commands runs, so other commands start fast.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Iterator
from typing import TYPE_CHECKING

from posteriorzoo.cli._types import add_json_option

if TYPE_CHECKING:
    from posteriorzoo.hub.plan import TransferPlan

_NETWORK_NOTE = (
    "Needs network access to huggingface.co (or HF_ENDPOINT) unless the files are already "
    "cached: with HF_HUB_OFFLINE=1 only the local Hugging Face cache (HF_HUB_CACHE) is used."
)


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``download`` and ``upload`` subcommands."""
    _register_download(subparsers)
    _register_upload(subparsers)


def _register_download(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "download",
        help="download a zoo (Hub dataset repository) and verify its SHA256SUMS",
        description=(
            "Download the collection files of a Hugging Face Hub dataset repository into the "
            "Hugging Face cache (or --out) and check them against the repository's "
            "SHA256SUMS manifest, which is always fetched. With --out, the files are "
            "fetched and verified under a temporary name next to DIR and only then moved "
            "into it (the manifests last): a file that fails verification never appears "
            "there. A file already in DIR is kept if identical and refused if it differs, "
            "unless --overwrite. "
            + _NETWORK_NOTE
            + " Private or gated repositories need HF_TOKEN."
        ),
    )
    parser.add_argument("repo_id", metavar="REPO_ID", help="dataset repository, e.g. org/name")
    parser.add_argument(
        "--revision", metavar="R", help="branch, tag or commit hash to pin (default: main)"
    )
    parser.add_argument(
        "--include",
        metavar="PATTERN",
        nargs="+",
        action="extend",
        help="fetch only files matching these glob patterns, e.g. 'mlp/*.h5' (quote them, "
        "and give REPO_ID before --include); repeatable (default: every file)",
    )
    parser.add_argument(
        "--out",
        dest="local_dir",
        metavar="DIR",
        help="put the files in DIR instead of the Hugging Face cache (DIR may exist; if "
        "not, its parent folder must)",
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="with --out, replace files of DIR that differ from the repository's",
    )
    parser.add_argument(
        "--cache-dir", metavar="DIR", help="Hugging Face cache to use (default: HF_HUB_CACHE)"
    )
    parser.add_argument(
        "--no-verify",
        action="store_true",
        help="skip the SHA-256 check (also allows repositories without SHA256SUMS)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="list the files that would be fetched (with sizes, and whether they are "
        "cached or already in DIR) and the commit the revision resolves to, and fetch "
        "nothing: only the repository's file list is asked for (nothing at all offline)",
    )
    add_json_option(parser, "the download's JSON (repository, revision, folder, verified "
                            "and unverified files; with --dry-run the planned files) "
                            "instead of the lines")
    parser.set_defaults(func=run_download)


def _register_upload(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "upload",
        help="publish collection files to a Hub dataset repository (needs HF_TOKEN)",
        description=(
            "Upload collection files (or folders of *.h5 files) to a Hugging Face Hub dataset "
            "repository in one commit, with a freshly computed SHA256SUMS manifest (your "
            "folders are not modified) and optionally a dataset card. The repository is "
            "created if needed. Needs network access and HF_TOKEN set to a token with write "
            "access (or a saved `hf auth login`). Every file is verified as a collection "
            "(posteriorzoo verify) before anything is sent."
        ),
    )
    parser.add_argument("repo_id", metavar="REPO_ID", help="dataset repository, e.g. org/name")
    parser.add_argument(
        "paths",
        metavar="PATH",
        nargs="+",
        help="collection file, or folder whose *.h5 files (searched recursively) are uploaded",
    )
    parser.add_argument(
        "--revision",
        metavar="BRANCH",
        help="branch to commit to, created from main if missing (default: main)",
    )
    parser.add_argument("--message", metavar="M", help="commit message")
    parser.add_argument(
        "--private",
        action="store_true",
        default=None,
        help="create the repository as private (if it does not exist yet)",
    )
    parser.add_argument(
        "--card", metavar="FILE", help="Markdown file uploaded as the dataset card README.md"
    )
    parser.add_argument(
        "--path-in-repo",
        metavar="FOLDER",
        default="",
        help="repository folder for the files and their SHA256SUMS (default: the root)",
    )
    parser.add_argument(
        "--no-verify",
        action="store_true",
        help="skip verifying the collections before upload (not recommended)",
    )
    parser.add_argument(
        "--dry-run",
        action="store_true",
        help="make every check of the upload (files, verification, repository id) and list "
        "what would be sent (paths in the repository, sizes, SHA256SUMS, card) and to "
        "which revision, sending nothing and contacting nobody; a missing token is noted",
    )
    add_json_option(parser, "the upload's JSON (repository, revision, commit URL, files; "
                            "with --dry-run the planned files) instead of the line")
    parser.set_defaults(func=run_upload)


@contextlib.contextmanager
def _progress_bars_on_terminals_only() -> Iterator[None]:
    """huggingface_hub's progress bars only when stderr is a terminal: in a log or a pipe
    they would be lines around the one-line error."""
    from huggingface_hub.utils import (
        are_progress_bars_disabled,
        disable_progress_bars,
        enable_progress_bars,
    )

    hide = not sys.stderr.isatty() and not are_progress_bars_disabled()
    if hide:
        disable_progress_bars()
    try:
        yield
    finally:
        if hide:
            enable_progress_bars()


def run_download(args: argparse.Namespace) -> int:
    """Download, then report where the files are and what was verified."""
    from posteriorzoo.errors import InvalidOptionError
    from posteriorzoo.hub.fetch import fetch

    if args.overwrite and args.local_dir is None:
        raise InvalidOptionError("--overwrite applies to the files of --out DIR; give --out")
    if args.dry_run:
        from posteriorzoo.hub import plan_download

        plan = plan_download(args.repo_id, revision=args.revision, include=args.include,
                             local_dir=args.local_dir, cache_dir=args.cache_dir,
                             overwrite=args.overwrite)
        _print_plan(plan, args.json)
        return 0
    with _progress_bars_on_terminals_only():
        path, report = fetch(
            args.repo_id,
            revision=args.revision,
            include=args.include,
            local_dir=args.local_dir,
            cache_dir=args.cache_dir,
            verify=not args.no_verify,
            overwrite=args.overwrite,
        )
    revision = args.revision or "main"
    if args.json:
        print(json.dumps({
            "kind": "download", "repo_id": args.repo_id, "revision": revision,
            "path": str(path), "verified": None if report is None else list(report.verified),
            "unverified": None if report is None else list(report.unverified),
            "manifests": None if report is None else list(report.manifests)}, indent=1))
        return 0
    print(f"{args.repo_id} (revision {revision}) is in {path}")
    if report is None:
        print("not verified (--no-verify)")
        return 0
    print(f"verified {len(report.verified)} file(s) against {', '.join(report.manifests)}:")
    for name in report.verified:
        print(f"  ok  {name}")
    for name in report.unverified:
        print(f"  --  {name} (not listed in any SHA256SUMS, not verified)")
    return 0


def _print_plan(plan: TransferPlan, as_json: bool) -> None:
    """A dry run's plan (:class:`posteriorzoo.hub.TransferPlan`) as JSON or lines."""
    if as_json:
        print(json.dumps(plan.to_dict(), indent=1))
        return
    for line in plan.lines():
        print(line)


def run_upload(args: argparse.Namespace) -> int:
    """Upload, then report what was committed where."""
    from posteriorzoo.hub import collect_collection_files, plan_upload, upload

    if args.dry_run:
        plan = plan_upload(args.repo_id, args.paths, revision=args.revision, card=args.card,
                           path_in_repo=args.path_in_repo, verify=not args.no_verify)
        _print_plan(plan, args.json)
        return 0
    count = len(collect_collection_files(args.paths))
    url = upload(
        args.repo_id,
        args.paths,
        revision=args.revision,
        commit_message=args.message,
        private=args.private,
        card=args.card,
        path_in_repo=args.path_in_repo,
        verify=not args.no_verify,
    )
    if args.json:
        print(json.dumps({"kind": "upload", "repo_id": args.repo_id,
                          "revision": args.revision or "main", "url": str(url),
                          "files": count, "card": args.card}, indent=1))
        return 0
    extra = " and the dataset card" if args.card else ""
    print(f"uploaded {count} collection file(s), SHA256SUMS{extra} to {args.repo_id}: {url}")
    return 0
