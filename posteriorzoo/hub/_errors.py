"""Translate huggingface_hub and network exceptions into one-sentence :class:`HubError`.

Every message says what went wrong and what to do about it, on one line, so the
command line can print it as is.
"""

from __future__ import annotations

import os
import sys

from huggingface_hub import constants
from huggingface_hub.errors import (
    DisabledRepoError,
    EntryNotFoundError,
    FileMetadataError,
    GatedRepoError,
    HfHubHTTPError,
    HFValidationError,
    LocalEntryNotFoundError,
    LocalTokenNotFoundError,
    OfflineModeIsEnabled,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)

from posteriorzoo.errors import HubError

_TRUE = {"1", "on", "yes", "true"}


def is_offline() -> bool:
    """Whether Hub access is disabled (``HF_HUB_OFFLINE=1``).

    huggingface_hub reads ``HF_HUB_OFFLINE`` once, when it is imported; the environment is
    read again here so that setting it later in the same process is honoured too.
    """
    from_env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return bool(constants.HF_HUB_OFFLINE) or from_env.strip().lower() in _TRUE


def network_errors() -> tuple[type[BaseException], ...]:
    """Exception types that mean "the Hub could not be reached".

    huggingface_hub has used ``requests``, ``httpx`` and ``httpx2`` over its versions; only
    the HTTP libraries already imported (hence possibly raising) are looked at.
    """
    found: list[type[BaseException]] = [ConnectionError, TimeoutError]
    for module_name, class_names in (
        ("httpx2", ("TransportError",)),
        ("httpx", ("TransportError",)),
        ("requests", ("ConnectionError", "Timeout")),
    ):
        module = sys.modules.get(module_name)
        for class_name in class_names:
            error_class = getattr(module, class_name, None)
            if isinstance(error_class, type) and issubclass(error_class, BaseException):
                found.append(error_class)
    return tuple(found)


#: What huggingface_hub raises on an answer it cannot use: a file name that would leave
#: the download folder (``ValueError``), an unexpected repository URL (``HfUriError``, a
#: ValueError), malformed JSON (``ValueError``), a missing field (``KeyError``) or JSON of
#: another shape (``TypeError``), a file without metadata.
UNEXPECTED_ANSWER_ERRORS: tuple[type[BaseException], ...] = (
    ValueError, KeyError, TypeError, EntryNotFoundError, FileMetadataError)


def handled_errors() -> tuple[type[BaseException], ...]:
    """Every exception type :func:`to_hub_error` knows how to explain.

    Catch them only around huggingface_hub calls: ``ValueError`` and ``KeyError`` there
    mean an answer of the Hub that cannot be used.
    """
    return (
        HfHubHTTPError,
        HFValidationError,
        LocalEntryNotFoundError,
        LocalTokenNotFoundError,
        *network_errors(),
        *UNEXPECTED_ANSWER_ERRORS,
    )


def login_command() -> str:
    """The command that saves a Hugging Face token with the installed huggingface_hub
    (``huggingface-cli`` was replaced by ``hf`` in version 1.0)."""
    import huggingface_hub

    major = huggingface_hub.__version__.split(".")[0]
    return "hf auth login" if major.isdigit() and int(major) >= 1 else "huggingface-cli login"


def no_token_message() -> str:
    """What to say when an upload finds no token."""
    return f"no Hugging Face token: run `{login_command()}` or set HF_TOKEN"


def find_token(token: str | bool | None) -> bool:
    """Whether an upload has a token: the one given, else ``HF_TOKEN`` or a saved login
    (``token=False`` asks for none)."""
    if isinstance(token, str):
        return bool(token.strip())
    if token is False:
        return False
    from huggingface_hub import get_token

    return bool(get_token())


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _status(error: BaseException) -> int | None:
    response = getattr(error, "response", None)
    return getattr(response, "status_code", None)


def _repo_url(repo_id: str, repo_type: str) -> str:
    prefix = "" if repo_type == "model" else f"{repo_type}s/"
    return f"{constants.ENDPOINT}/{prefix}{repo_id}"


def to_hub_error(
    error: BaseException,
    *,
    repo_id: str,
    revision: str | None,
    repo_type: str = "dataset",
    action: str = "download",
) -> HubError:
    """Return a :class:`HubError` explaining ``error`` in one sentence with a remedy.

    ``action`` is ``"download"`` or ``"upload"``; it changes the advice (an upload always
    needs the network and a token with write access).
    """
    where = f"{repo_type} '{repo_id}'" + (f" (revision '{revision}')" if revision else "")
    if isinstance(error, HFValidationError):
        return HubError(f"invalid repository id '{repo_id}': {_first_line(error)}")
    if isinstance(error, LocalTokenNotFoundError):
        return HubError(no_token_message())
    if isinstance(error, OfflineModeIsEnabled) or (
        isinstance(error, LocalEntryNotFoundError) and is_offline()
    ):
        if action == "upload":
            return HubError(
                "HF_HUB_OFFLINE=1 forbids network access, which an upload needs: "
                "set HF_HUB_OFFLINE=0 and try again"
            )
        return HubError(
            f"no network access (HF_HUB_OFFLINE=1) and no cached copy of {where}: "
            "run with network once, or set HF_HUB_OFFLINE=0"
        )
    if isinstance(error, LocalEntryNotFoundError):
        if hasattr(error, "snapshot_path"):  # IncompleteSnapshotError (huggingface_hub >= 1.x)
            return HubError(
                f"the Hub could not be reached and the cached copy of {where} is incomplete: "
                "run again with network access to complete it"
            )
        return HubError(
            f"could not reach the Hugging Face Hub and there is no cached copy of {where}: "
            "check your network connection (and HF_ENDPOINT) and try again"
        )
    if isinstance(error, GatedRepoError):
        return HubError(
            f"{where} is gated: accept its conditions at {_repo_url(repo_id, repo_type)} "
            "and set HF_TOKEN to a token of that account"
        )
    if isinstance(error, RevisionNotFoundError):
        return HubError(
            f"revision '{revision}' not found in {repo_type} '{repo_id}': "
            "give an existing branch, tag or commit hash"
        )
    if isinstance(error, RepositoryNotFoundError):
        return HubError(
            f"{repo_type} repository '{repo_id}' not found (or private): check the name and "
            "that it is a dataset, or set HF_TOKEN to a token that can read it"
        )
    if isinstance(error, DisabledRepoError):
        return HubError(f"{where} has been disabled by its owner and cannot be accessed")
    if isinstance(error, HfHubHTTPError):
        status = _status(error)
        if status == 401:
            return HubError(
                f"the Hub rejected the credentials for {where}: set HF_TOKEN to a valid token"
            )
        if status == 403:
            need = "write" if action == "upload" else "read"
            return HubError(
                f"no permission to {action} {where}: set HF_TOKEN to a token with {need} access"
            )
        return HubError(
            f"the Hub refused to {action} {where} (HTTP {status}): {_first_line(error)}"
        )
    if isinstance(error, network_errors()):
        return HubError(
            f"network error while trying to {action} {where} "
            f"({type(error).__name__}: {_first_line(error)}): "
            "check your network connection (and HF_ENDPOINT) and try again"
        )
    if isinstance(error, UNEXPECTED_ANSWER_ERRORS):
        return HubError(
            f"the Hub's answer cannot be used to {action} {where} "
            f"({type(error).__name__}: {_first_line(error)})"[:600]
            + ": check HF_ENDPOINT, or ask the repository owner"
        )
    return HubError(f"could not {action} {where}: {_first_line(error)}")
