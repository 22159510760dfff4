"""Hub download/upload (posteriorzoo.hub) and the download/upload commands.

No test touches the network: huggingface_hub is either replaced by fakes, or used for
real in offline mode against a Hugging Face cache built in a temporary folder, or pointed
at a closed port on localhost (connection refused).
"""

from __future__ import annotations

import hashlib
import json
import shutil
import socket
import time
from pathlib import Path

import httpx2
import numpy as np
import pytest
from fake_hub import FakeHub
from huggingface_hub import constants
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import filter_repo_objects

import posteriorzoo.cli as cli
from posteriorzoo.errors import ChecksumError, HubError, ZooFormatError
from posteriorzoo.hub import download, upload, verify_snapshot
from posteriorzoo.hub import fetch as fetch_module
from posteriorzoo.hub import publish as publish_module
from posteriorzoo.zoo import create_zoo
from posteriorzoo.zoo.manifest import (
    MANIFEST_NAME,
    MAX_MANIFEST_BYTES,
    read_manifest,
    sha256_file,
    write_manifest,
)

REPO = "org/zoo"
COMMIT = "0123456789abcdef0123456789abcdef01234567"


# ---------------------------------------------------------------- fixtures and helpers


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _set_offline(monkeypatch: pytest.MonkeyPatch, offline: bool) -> None:
    if offline:
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", offline)


def _set_endpoint(monkeypatch: pytest.MonkeyPatch, endpoint: str) -> None:
    """Point huggingface_hub at ``endpoint``: its API calls and its file URLs (a template
    huggingface_hub builds from ``HF_ENDPOINT`` once, when it is imported)."""
    monkeypatch.setenv("HF_ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "ENDPOINT", endpoint)
    monkeypatch.setattr(constants, "HUGGINGFACE_CO_URL_TEMPLATE",
                        endpoint + "/{repo_id}/resolve/{revision}/{filename}")


@pytest.fixture(autouse=True)
def loopback_only(monkeypatch: pytest.MonkeyPatch):
    """Fail any attempt to resolve a host other than the loopback interface."""
    real = socket.getaddrinfo
    attempts: list[str] = []

    def getaddrinfo(host, *args, **kwargs):
        if host not in ("127.0.0.1", "localhost", b"127.0.0.1", b"localhost"):
            attempts.append(str(host))
            raise socket.gaierror(socket.EAI_NONAME, f"tests contact 127.0.0.1 only, not {host}")
        return real(host, *args, **kwargs)

    monkeypatch.setattr(socket, "getaddrinfo", getaddrinfo)
    yield
    assert attempts == [], f"a test tried to reach {attempts}"


@pytest.fixture(autouse=True)
def isolated_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Offline by default, a private HF cache, and an endpoint that refuses connections."""
    cache = tmp_path / "hf-cache"
    cache.mkdir()
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf-home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_DISABLE_TELEMETRY", "1")
    monkeypatch.delenv("HF_TOKEN", raising=False)
    _set_endpoint(monkeypatch, f"http://127.0.0.1:{_closed_port()}")
    _set_offline(monkeypatch, True)
    return cache


def make_h5(path: Path, seed: int) -> Path:
    """A small real collection file (an MLP zoo of two checkpoints)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    states = [{"layers.0.weight": rng.normal(size=(4, 2)).astype("float32"),
               "layers.0.bias": rng.normal(size=4).astype("float32"),
               "layers.1.weight": rng.normal(size=(1, 4)).astype("float32"),
               "layers.1.bias": rng.normal(size=1).astype("float32")} for _ in range(2)]
    with create_zoo(path, architecture="mlp", dataset="blobs", method="de",
                    model_options={"widths": [2, 4, 1]}, template=states[0]) as zoo:
        zoo.append_many(states)
    return path


def flip_byte(path: Path, offset: int = -20) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0xFF
    path.write_bytes(bytes(data))


@pytest.fixture
def repo_source(tmp_path: Path) -> Path:
    """The files of a published zoo: two collections, a card and the root manifest."""
    source = tmp_path / "repo"
    make_h5(source / "a.h5", 0)
    make_h5(source / "sub" / "b.h5", 1)
    (source / "README.md").write_text("# zoo\n")
    write_manifest(source)
    return source


class FakeSnapshotDownload:
    """Records its arguments and copies the allowed files of ``source`` to the target."""

    def __init__(self, source: Path) -> None:
        self.source = source
        self.calls: list[dict] = []

    def target(self, kwargs: dict) -> Path:
        if kwargs.get("local_dir") is not None:
            return Path(kwargs["local_dir"])
        cache = Path(kwargs.get("cache_dir") or constants.HF_HUB_CACHE)
        folder = f"{kwargs['repo_type']}s--" + kwargs["repo_id"].replace("/", "--")
        return cache / folder / "snapshots" / COMMIT

    def __call__(self, **kwargs) -> str:
        self.calls.append(kwargs)
        target = self.target(kwargs)
        names = [p.relative_to(self.source).as_posix() for p in self.source.rglob("*")]
        for name in filter_repo_objects(names, allow_patterns=kwargs["allow_patterns"]):
            if (self.source / name).is_file():
                (target / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(self.source / name, target / name)
        target.mkdir(parents=True, exist_ok=True)
        return str(target)


@pytest.fixture
def fake_download(repo_source: Path, monkeypatch: pytest.MonkeyPatch) -> FakeSnapshotDownload:
    fake = FakeSnapshotDownload(repo_source)
    monkeypatch.setattr(fetch_module, "snapshot_download", fake)
    return fake


def raising(error: BaseException):
    def fake(**kwargs):
        raise error

    return fake


def http_error(cls: type, status: int, message: str = "boom"):
    request = httpx2.Request("GET", "https://huggingface.co/api/datasets/org/zoo")
    return cls(message, response=httpx2.Response(status, request=request))


def build_hf_cache(cache: Path, source: Path, repo_id: str = REPO, commit: str = COMMIT) -> Path:
    """Lay out ``source`` as huggingface_hub caches a dataset: blobs, refs, snapshots."""
    storage = cache / ("datasets--" + repo_id.replace("/", "--"))
    (storage / "refs").mkdir(parents=True)
    (storage / "refs" / "main").write_text(commit)  # no newline, as huggingface_hub writes
    snapshot = storage / "snapshots" / commit
    for path in sorted(source.rglob("*")):
        if not path.is_file():
            continue
        blob = storage / "blobs" / hashlib.sha256(path.read_bytes()).hexdigest()
        blob.parent.mkdir(exist_ok=True)
        shutil.copyfile(path, blob)
        link = snapshot / path.relative_to(source)
        link.parent.mkdir(parents=True, exist_ok=True)
        link.symlink_to(blob)
    return snapshot


# ---------------------------------------------------------------- (a) download with a fake


def test_download_passes_patterns_revision_and_type(
    fake_download: FakeSnapshotDownload, monkeypatch: pytest.MonkeyPatch, isolated_hub: Path
) -> None:
    _set_offline(monkeypatch, False)
    path = download(REPO, revision="v1.0", include=["sub/*.h5"])
    (call,) = fake_download.calls
    assert call["repo_id"] == REPO
    assert call["repo_type"] == "dataset"
    assert call["revision"] == "v1.0"
    assert "sub/*.h5" in call["allow_patterns"]
    assert MANIFEST_NAME in call["allow_patterns"]
    assert call["local_files_only"] is False
    assert call["local_dir"] is None and call["cache_dir"] is None
    assert 0 < call["etag_timeout"] <= 60
    assert path == isolated_hub / "datasets--org--zoo" / "snapshots" / COMMIT
    assert sorted(p.name for p in path.rglob("*") if p.is_file()) == [MANIFEST_NAME, "b.h5"]


def test_download_everything_without_include(fake_download: FakeSnapshotDownload) -> None:
    path = download(REPO)
    assert fake_download.calls[0]["allow_patterns"] is None
    assert (path / "a.h5").is_file() and (path / "sub" / "b.h5").is_file()


def test_single_pattern_string(fake_download: FakeSnapshotDownload) -> None:
    download(REPO, include="a.h5")
    patterns = fake_download.calls[0]["allow_patterns"]
    assert patterns[0] == "a.h5" and MANIFEST_NAME in patterns


def test_download_to_local_dir(fake_download: FakeSnapshotDownload, tmp_path: Path,
                               monkeypatch: pytest.MonkeyPatch) -> None:
    _set_offline(monkeypatch, False)
    path = download(REPO, local_dir=tmp_path / "here", cache_dir=tmp_path / "c")
    assert path == tmp_path / "here"
    # fetched into a temporary folder next to the output, then moved into place
    staging = fake_download.calls[0]["local_dir"]
    assert staging.parent == tmp_path and staging.name.startswith(".here.partial-")
    assert not staging.exists()
    assert snapshot_names(path) == ["README.md", MANIFEST_NAME, "a.h5", "sub/b.h5"]
    # offline, the files come from the cache instead
    _set_offline(monkeypatch, True)
    again = download(REPO, local_dir=tmp_path / "there", cache_dir=tmp_path / "c")
    assert fake_download.calls[1]["local_dir"] is None
    assert fake_download.calls[1]["cache_dir"] == tmp_path / "c"
    assert snapshot_names(again) == snapshot_names(path)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def snapshot_names(folder: Path) -> list[str]:
    """Every file under ``folder``, hidden ones included, as sorted relative paths."""
    return sorted(p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file())


def test_offline_env_set_after_import_is_honoured(
    fake_download: FakeSnapshotDownload, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)  # as if imported before setenv
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    download(REPO)
    assert fake_download.calls[0]["local_files_only"] is True


def test_corrupted_file_raises_checksum_error(
    fake_download: FakeSnapshotDownload, repo_source: Path
) -> None:
    flip_byte(repo_source / "sub" / "b.h5")
    with pytest.raises(ChecksumError, match=r"sub/b\.h5: SHA-256 mismatch"):
        download(REPO)


def test_only_included_files_are_verified(
    fake_download: FakeSnapshotDownload, repo_source: Path
) -> None:
    flip_byte(repo_source / "sub" / "b.h5")  # corrupt, but not requested
    path = download(REPO, include="a.h5")
    report = verify_snapshot(path, "a.h5")
    assert report.verified == ("a.h5",)
    assert report.manifests == (MANIFEST_NAME,)


def test_missing_manifest_is_an_error_unless_no_verify(
    fake_download: FakeSnapshotDownload, repo_source: Path
) -> None:
    (repo_source / MANIFEST_NAME).unlink()
    with pytest.raises(ChecksumError, match="no SHA256SUMS.*verify=False"):
        download(REPO)
    assert (download(REPO, verify=False) / "a.h5").is_file()


def test_include_matching_nothing(fake_download: FakeSnapshotDownload) -> None:
    with pytest.raises(HubError, match=r"no file .* matches \*\.safetensors"):
        download(REPO, include="*.safetensors")


def test_bad_repo_type_rejected_before_download(fake_download: FakeSnapshotDownload) -> None:
    with pytest.raises(HubError, match="repo_type"):
        download(REPO, repo_type="space")
    assert fake_download.calls == []


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (http_error(RepositoryNotFoundError, 404), "not found .*HF_TOKEN"),
        (http_error(GatedRepoError, 403), "gated: accept its conditions"),
        (http_error(RevisionNotFoundError, 404), "revision 'v9' not found"),
        (httpx2.ConnectError("[Errno -3] name resolution failed"), "network error.*ConnectError"),
        (httpx2.ReadTimeout("timed out"), "network error.*ReadTimeout"),
        (LocalEntryNotFoundError("nope\nmore"), "could not reach the Hugging Face Hub"),
    ],
)
def test_hub_errors_become_one_line_hub_error(
    monkeypatch: pytest.MonkeyPatch, error: BaseException, expected: str
) -> None:
    _set_offline(monkeypatch, False)
    monkeypatch.setattr(fetch_module, "snapshot_download", raising(error))
    with pytest.raises(HubError, match=expected) as info:
        download(REPO, revision="v9")
    assert "\n" not in str(info.value)
    assert info.value.__cause__ is error


def test_offline_without_cache_message(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fetch_module, "snapshot_download", raising(LocalEntryNotFoundError("x")))
    with pytest.raises(HubError, match="run with network once, or set HF_HUB_OFFLINE=0"):
        download(REPO)


def test_verify_snapshot_nested_manifest_and_unlisted_files(tmp_path: Path) -> None:
    make_h5(tmp_path / "run1" / "a.h5", 0)
    make_h5(tmp_path / "run1" / "extra.h5", 1)
    write_manifest(tmp_path / "run1", names=["a.h5"])
    (tmp_path / "README.md").write_text("card")
    (tmp_path / ".cache").mkdir()
    (tmp_path / ".cache" / "x.h5").write_text("bookkeeping, ignored")
    report = verify_snapshot(tmp_path)
    assert report.manifests == (f"run1/{MANIFEST_NAME}",)
    assert report.verified == ("run1/a.h5",)
    assert report.unverified == ("README.md", "run1/extra.h5")
    assert verify_snapshot(tmp_path, "*.h5").unverified == ("run1/extra.h5",)
    flip_byte(tmp_path / "run1" / "a.h5")
    with pytest.raises(ChecksumError, match=r"run1/SHA256SUMS: a\.h5: SHA-256 mismatch"):
        verify_snapshot(tmp_path)


def test_verify_snapshot_refuses_paths_outside_folder(tmp_path: Path) -> None:
    make_h5(tmp_path / "a.h5", 0)
    (tmp_path / MANIFEST_NAME).write_text(f"{sha256_file(tmp_path / 'a.h5')}  ../a.h5\n")
    with pytest.raises(ChecksumError, match="outside its folder"):
        verify_snapshot(tmp_path)


# ---------------------------------------------------------------- (b) real huggingface_hub


def test_offline_cache_snapshot_is_returned_and_verified(
    repo_source: Path, isolated_hub: Path
) -> None:
    snapshot = build_hf_cache(isolated_hub, repo_source)
    assert download(REPO) == snapshot  # default cache: HF_HUB_CACHE
    assert download(REPO, revision=COMMIT, cache_dir=isolated_hub) == snapshot
    assert download(REPO, include="sub/*.h5", cache_dir=isolated_hub) == snapshot


def test_offline_cache_corruption_detected(repo_source: Path, tmp_path: Path) -> None:
    cache = tmp_path / "other-cache"
    snapshot = build_hf_cache(cache, repo_source)
    flip_byte((snapshot / "a.h5").resolve())  # the blob behind the symlink
    with pytest.raises(ChecksumError, match=r"a\.h5: SHA-256 mismatch"):
        download(REPO, cache_dir=cache)
    assert download(REPO, cache_dir=cache, include="sub/*") == snapshot


def test_offline_absent_repo_fails_fast(repo_source: Path, isolated_hub: Path) -> None:
    build_hf_cache(isolated_hub, repo_source)
    start = time.monotonic()
    with pytest.raises(HubError, match="HF_HUB_OFFLINE=1.*no cached copy of dataset 'org/other'"):
        download("org/other")
    with pytest.raises(HubError, match="no cached copy"):
        download(REPO, revision="never-fetched")
    assert time.monotonic() - start < 5


def test_connection_refused_uses_cache_or_fails_fast(
    repo_source: Path, isolated_hub: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    _set_offline(monkeypatch, False)  # online, but the endpoint refuses connections
    snapshot = build_hf_cache(isolated_hub, repo_source)
    start = time.monotonic()
    assert download(REPO) == snapshot
    with pytest.raises(HubError, match="could not reach the Hugging Face Hub"):
        download("org/other")
    assert time.monotonic() - start < 10


# ---------------------------------------------------------------- (c) upload with a fake HfApi


class FakeHfApi:
    """Records calls; writes committed files to ``repo_dir`` like a tiny Hub would."""

    instances: list[FakeHfApi] = []
    repo_dir: Path = Path("unset")
    fail_with: BaseException | None = None

    def __init__(self, token=None) -> None:
        self.token = token
        self.calls: list[tuple[str, tuple, dict]] = []
        FakeHfApi.instances.append(self)

    def create_repo(self, *args, **kwargs) -> str:
        self.calls.append(("create_repo", args, kwargs))
        return f"https://hub.test/datasets/{args[0]}"

    def create_branch(self, *args, **kwargs) -> None:
        self.calls.append(("create_branch", args, kwargs))

    def create_commit(self, repo_id, operations, **kwargs):
        self.calls.append(("create_commit", (repo_id, operations), kwargs))
        if self.fail_with is not None:
            raise self.fail_with
        for op in operations:
            target = self.repo_dir / op.path_in_repo
            target.parent.mkdir(parents=True, exist_ok=True)
            content = op.path_or_fileobj
            if isinstance(content, bytes):
                target.write_bytes(content)
            else:
                shutil.copyfile(content, target)

        class Info:
            commit_url = f"https://hub.test/datasets/{repo_id}/commit/{COMMIT}"
            oid = COMMIT

        return Info()

    def operations(self) -> dict[str, object]:
        (call,) = [c for c in self.calls if c[0] == "create_commit"]
        return {op.path_in_repo: op for op in call[1][1]}


@pytest.fixture
def fake_api(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> type[FakeHfApi]:
    _set_offline(monkeypatch, False)
    monkeypatch.setenv("HF_TOKEN", "hf_fake_token")  # a logged-in user: uploads need a token
    monkeypatch.setattr(FakeHfApi, "instances", [])
    monkeypatch.setattr(FakeHfApi, "repo_dir", tmp_path / "remote")
    monkeypatch.setattr(FakeHfApi, "fail_with", None)
    monkeypatch.setattr(publish_module, "HfApi", FakeHfApi)
    return FakeHfApi


@pytest.fixture
def collections(tmp_path: Path) -> Path:
    folder = tmp_path / "collections"
    make_h5(folder / "a.h5", 0)
    make_h5(folder / "deep" / "b.h5", 1)
    (folder / "log.txt").write_text("not a collection, not uploaded")
    return folder


def test_upload_folder_manifest_matches_files(
    fake_api: type[FakeHfApi], collections: Path, tmp_path: Path
) -> None:
    before = sorted(p.relative_to(collections) for p in collections.rglob("*"))
    url = upload(REPO, [collections], token="hf_x")
    assert url == f"https://hub.test/datasets/{REPO}/commit/{COMMIT}"
    (api,) = fake_api.instances
    assert api.token == "hf_x"
    assert [c[0] for c in api.calls] == ["create_repo", "create_commit"]
    assert api.calls[0][2] == {"repo_type": "dataset", "private": None, "exist_ok": True}
    assert api.calls[1][2]["repo_type"] == "dataset"
    ops = api.operations()
    assert sorted(ops) == [MANIFEST_NAME, "a.h5", "deep/b.h5"]
    manifest = tmp_path / "uploaded-manifest"
    manifest.write_bytes(ops[MANIFEST_NAME].path_or_fileobj)
    assert read_manifest(manifest) == {
        "a.h5": hashlib.sha256((collections / "a.h5").read_bytes()).hexdigest(),
        "deep/b.h5": hashlib.sha256((collections / "deep" / "b.h5").read_bytes()).hexdigest(),
    }
    assert sorted(p.relative_to(collections) for p in collections.rglob("*")) == before


def test_upload_then_verify_round_trip(
    fake_api: type[FakeHfApi], collections: Path, tmp_path: Path
) -> None:
    card = tmp_path / "data_card.md"
    card.write_text("---\nlicense: mit\n---\n# A zoo\n")
    single = make_h5(tmp_path / "single.h5", 7)
    upload(REPO, [collections, single], path_in_repo="/runs/2024/", card=card, revision="dev")
    api = fake_api.instances[0]
    assert sorted(api.operations()) == [
        "README.md",
        f"runs/2024/{MANIFEST_NAME}",
        "runs/2024/a.h5",
        "runs/2024/deep/b.h5",
        "runs/2024/single.h5",
    ]
    assert api.calls[1] == (
        "create_branch",
        (REPO,),
        {"branch": "dev", "repo_type": "dataset", "exist_ok": True},
    )
    assert api.calls[2][2]["revision"] == "dev"
    assert (fake_api.repo_dir / "README.md").read_text() == card.read_text()
    report = verify_snapshot(fake_api.repo_dir)
    assert report.verified == ("runs/2024/a.h5", "runs/2024/deep/b.h5", "runs/2024/single.h5")
    assert report.unverified == ("README.md",)


def test_upload_message_and_private(fake_api: type[FakeHfApi], collections: Path) -> None:
    upload(REPO, collections / "a.h5", commit_message="first zoo", private=True)
    api = fake_api.instances[0]
    assert api.calls[0][2]["private"] is True
    assert api.calls[1][2]["commit_message"] == "first zoo"
    assert api.calls[1][2]["revision"] is None


def test_upload_without_create_repo(fake_api: type[FakeHfApi], collections: Path) -> None:
    upload(REPO, collections, create_repo=False)
    assert [c[0] for c in fake_api.instances[0].calls] == ["create_commit"]


@pytest.mark.parametrize(
    "make_bad",
    [
        lambda d: d / "missing.h5",
        lambda d: (d / "fake.h5").write_bytes(b"PK\x03\x04 not hdf5") and d / "fake.h5",
        lambda d: (d / "empty").mkdir() or d / "empty",
    ],
    ids=["missing", "not-hdf5", "folder-without-collections"],
)
def test_bad_input_rejected_before_any_api_call(
    fake_api: type[FakeHfApi], collections: Path, tmp_path: Path, make_bad
) -> None:
    bad = make_bad(tmp_path)
    with pytest.raises(ZooFormatError):
        upload(REPO, [collections, bad])
    assert fake_api.instances == []


def test_corrupt_or_foreign_collections_are_not_published(
    fake_api: type[FakeHfApi], collections: Path, tmp_path: Path
) -> None:
    import h5py

    foreign = tmp_path / "foreign.h5"
    with h5py.File(foreign, "w") as handle:
        handle["x"] = np.arange(3)
    with pytest.raises(ZooFormatError, match="not a posteriorzoo collection"):
        upload(REPO, [collections, foreign])
    damaged = collections / "a.h5"
    with h5py.File(damaged, "r") as handle:
        offset = handle["state/layers.0.weight"].id.get_chunk_info(0).byte_offset
    data = bytearray(damaged.read_bytes())
    data[offset + 2] ^= 0xFF
    damaged.write_bytes(bytes(data))
    with pytest.raises(ChecksumError, match="CORRUPT"):
        upload(REPO, collections)
    assert fake_api.instances == []
    upload(REPO, collections, verify=False)  # an explicit opt-out still uploads
    assert len(fake_api.instances) == 1


def test_non_hdf5_inside_folder_rejected(fake_api: type[FakeHfApi], collections: Path) -> None:
    (collections / "deep" / "bad.h5").write_text("text pretending to be HDF5")
    with pytest.raises(ZooFormatError, match=r"not an HDF5 file.*bad\.h5"):
        upload(REPO, collections)
    assert fake_api.instances == []


def test_name_collision_and_missing_card(
    fake_api: type[FakeHfApi], collections: Path, tmp_path: Path
) -> None:
    other = make_h5(tmp_path / "elsewhere" / "a.h5", 3)
    with pytest.raises(ZooFormatError, match="two files would be uploaded as a.h5"):
        upload(REPO, [collections, other])
    with pytest.raises(ZooFormatError, match="dataset card not found"):
        upload(REPO, collections, card=tmp_path / "nope.md")
    assert fake_api.instances == []


def test_upload_offline_or_bad_repo_id_fails_before_api(
    fake_api: type[FakeHfApi], collections: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(HubError, match="invalid repository id"):
        upload("not a valid//id", collections)
    with pytest.raises(HubError, match="path_in_repo"):
        upload(REPO, collections, path_in_repo="../escape")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(HubError, match="HF_HUB_OFFLINE=1 .* upload needs"):
        upload(REPO, collections)
    assert fake_api.instances == []


def test_upload_api_errors_mapped(fake_api: type[FakeHfApi], collections: Path) -> None:
    fake_api.fail_with = http_error(HfHubHTTPError, 403, "forbidden")
    with pytest.raises(HubError, match="no permission to upload.*write access"):
        upload(REPO, collections)
    fake_api.fail_with = httpx2.ConnectError("unreachable")
    with pytest.raises(HubError, match="network error while trying to upload"):
        upload(REPO, collections)


# ---------------------------------------------------------------- (d) command line


@pytest.fixture
def run_cli(monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture):
    """``posteriorzoo.cli.main`` with only the hub commands registered."""
    monkeypatch.setattr(cli, "_SUBCOMMAND_MODULES", ("posteriorzoo.cli.hub_commands",))

    def run(*argv: str) -> tuple[int, str, list[str]]:
        code = cli.main(list(argv))
        out, err = capsys.readouterr()
        return code, out, err.splitlines()

    return run


def test_cli_download_success(run_cli, repo_source: Path, isolated_hub: Path) -> None:
    snapshot = build_hf_cache(isolated_hub, repo_source)
    code, out, err = run_cli("download", REPO, "--include", "*.h5")
    assert code == 0, err
    assert str(snapshot) in out
    assert "  ok  a.h5" in out and "  ok  sub/b.h5" in out
    assert err == []


def test_cli_download_and_upload_json(run_cli, repo_source: Path, isolated_hub: Path,
                                      fake_api: type[FakeHfApi], collections: Path) -> None:
    snapshot = build_hf_cache(isolated_hub, repo_source)
    code, out, err = run_cli("download", REPO, "--include", "*.h5", "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["kind"] == "download" and data["path"] == str(snapshot)
    assert data["verified"] == ["a.h5", "sub/b.h5"] and data["manifests"]
    code, out, err = run_cli("upload", REPO, str(collections), "--json")
    assert code == 0, err
    data = json.loads(out)
    assert data["kind"] == "upload" and data["files"] == 2 and COMMIT in data["url"]


def test_cli_download_no_verify(run_cli, repo_source: Path, isolated_hub: Path) -> None:
    (repo_source / MANIFEST_NAME).unlink()
    build_hf_cache(isolated_hub, repo_source)
    code, out, _ = run_cli("download", REPO, "--no-verify")
    assert code == 0 and "not verified" in out
    code, _, err = run_cli("download", REPO)
    assert code == 2 and len(err) == 1 and "--no-verify" in err[0]


def test_cli_download_hub_error_one_line(run_cli) -> None:
    code, out, err = run_cli("download", "org/absent")
    assert code == 2
    assert out == ""
    assert len(err) == 1, err
    assert err[0].startswith("posteriorzoo download: error: ")
    assert "HF_HUB_OFFLINE" in err[0]


def test_cli_download_checksum_error_one_line(
    run_cli, repo_source: Path, isolated_hub: Path
) -> None:
    snapshot = build_hf_cache(isolated_hub, repo_source)
    flip_byte((snapshot / "sub" / "b.h5").resolve())
    code, _, err = run_cli("download", REPO, "--revision", COMMIT)
    assert code == 2
    assert len(err) == 1 and "SHA-256 mismatch" in err[0] and "Traceback" not in err[0]


def test_cli_upload(run_cli, fake_api: type[FakeHfApi], collections: Path) -> None:
    code, out, err = run_cli(
        "upload", REPO, str(collections), "--revision", "dev", "--message", "m", "--private"
    )
    assert code == 0, err
    assert "uploaded 2 collection file(s)" in out and COMMIT in out
    calls = fake_api.instances[0].calls
    assert calls[0][2]["private"] is True
    assert calls[-1][2]["commit_message"] == "m" and calls[-1][2]["revision"] == "dev"


def test_cli_upload_missing_path_one_line(
    run_cli, fake_api: type[FakeHfApi], tmp_path: Path
) -> None:
    code, out, err = run_cli("upload", REPO, str(tmp_path / "nowhere.h5"))
    assert code == 2 and out == ""
    assert err == [f"posteriorzoo upload: error: no such file or folder: {tmp_path / 'nowhere.h5'}"]
    assert fake_api.instances == []


@pytest.mark.parametrize(
    ("command", "needle"), [("download", "HF_HUB_OFFLINE"), ("upload", "HF_TOKEN")]
)
def test_cli_help_mentions_network(run_cli, capsys, command: str, needle: str) -> None:
    with pytest.raises(SystemExit) as info:
        cli.main([command, "--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    assert "network" in text and needle in text


def test_cli_download_several_patterns_to_local_dir(
    run_cli, fake_download: FakeSnapshotDownload, tmp_path: Path
) -> None:
    target = tmp_path / "here"
    code, out, err = run_cli(
        "download", REPO, "--out", str(target), "--include", "a.h5", "sub/*"
    )
    assert code == 0, err
    patterns = fake_download.calls[0]["allow_patterns"]
    assert patterns[:2] == ["a.h5", "sub/*"] and MANIFEST_NAME in patterns
    assert str(target) in out and "  ok  a.h5" in out and "  ok  sub/b.h5" in out


# ---------------------------------------------------------------- (e) a fake Hub on 127.0.0.1
# Real huggingface_hub against tests/fake_hub.py: repository info, file tree, downloads,
# repository creation and commits, all on the loopback interface.


@pytest.fixture
def hub(repo_source: Path, monkeypatch: pytest.MonkeyPatch):
    """A fake Hub serving ``repo_source`` as ``org/zoo``; online, with a (fake) token."""
    files = {p.relative_to(repo_source).as_posix(): p.read_bytes()
             for p in sorted(repo_source.rglob("*")) if p.is_file()}
    with FakeHub(REPO, files) as server:
        _set_endpoint(monkeypatch, server.endpoint)
        monkeypatch.setenv("HF_TOKEN", "hf_fake_token_for_the_loopback_hub")
        _set_offline(monkeypatch, False)
        yield server


def transfers(server: FakeHub) -> list[str]:
    """The file downloads (GET .../resolve/...) the fake Hub answered."""
    return [path for method, path in server.requests if method == "GET" and "/resolve/" in path]


def files_under(folder: Path) -> dict[str, bytes]:
    """Every file under ``folder`` (hidden ones too) and its bytes."""
    return {p.relative_to(folder).as_posix(): p.read_bytes()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def test_fake_hub_round_trip(run_cli, hub: FakeHub, collections: Path, tmp_path: Path) -> None:
    code, out, err = run_cli("upload", REPO, str(collections), "--path-in-repo", "runs")
    assert code == 0, err
    assert sorted(op["path"] for op in hub.commits[0]) == [
        f"runs/{MANIFEST_NAME}", "runs/a.h5", "runs/deep/b.h5"]
    target = tmp_path / "mirror"
    code, out, err = run_cli("download", REPO, "--include", "runs/*", "--out", str(target))
    assert code == 0, err
    assert "  ok  runs/a.h5" in out and "  ok  runs/deep/b.h5" in out
    assert files_under(target) == {name: data for name, data in hub.files.items()
                                   if name.startswith("runs/") or name == MANIFEST_NAME}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_download_out_refuses_a_different_file_before_any_transfer(
    run_cli, hub: FakeHub, tmp_path: Path
) -> None:
    target = tmp_path / "mine"
    target.mkdir()
    (target / "a.h5").write_bytes(b"my own a.h5, not the repository's")
    (target / "notes.txt").write_text("kept")
    before = files_under(target)
    code, out, err = run_cli("download", REPO, "--out", str(target))
    assert code == 2 and out == ""
    assert len(err) == 1 and "a.h5 already exists and differs" in err[0], err
    assert "--overwrite" in err[0]
    assert files_under(target) == before
    assert transfers(hub) == []  # refused from the file list, before any download
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    # an identical file is accepted as done; the rest is added, other files stay
    (target / "a.h5").write_bytes(hub.files["a.h5"])
    code, out, err = run_cli("download", REPO, "--out", str(target))
    assert code == 0, err
    assert files_under(target) == {**hub.files, "notes.txt": b"kept"}
    # --overwrite replaces a differing file
    (target / "sub" / "b.h5").write_bytes(b"stale")
    code, out, err = run_cli("download", REPO, "--out", str(target), "--overwrite")
    assert code == 0, err
    assert files_under(target) == {**hub.files, "notes.txt": b"kept"}


def test_download_out_compares_fetched_bytes_when_the_list_cannot_tell(
    run_cli, hub: FakeHub, tmp_path: Path
) -> None:
    # the listing by branch (the pre-check's) fails, the one by commit (the download's) works
    hub.fail["tree:main"] = (404, b'{"error": "no listing by branch name today"}')
    target = tmp_path / "mine"
    target.mkdir()
    (target / "a.h5").write_bytes(b"precious")
    code, _, err = run_cli("download", REPO, "--out", str(target))
    assert code == 2 and len(err) == 1 and "a.h5 already exists and differs" in err[0], err
    assert transfers(hub) != []  # this time the fetched bytes told
    assert (target / "a.h5").read_bytes() == b"precious"
    assert sorted(p.name for p in target.iterdir()) == ["a.h5"]
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_download_that_fails_verification_publishes_nothing(
    run_cli, hub: FakeHub, tmp_path: Path
) -> None:
    data = bytearray(hub.files["sub/b.h5"])
    data[-20] ^= 0xFF
    hub.files["sub/b.h5"] = bytes(data)  # the manifest still lists the original digest
    new, existing = tmp_path / "new", tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    for target in (new, existing):
        code, out, err = run_cli("download", REPO, "--out", str(target))
        assert code == 2 and out == ""
        assert len(err) == 1 and "sub/b.h5: SHA-256 mismatch" in err[0], err
    assert not new.exists()
    assert files_under(existing) == {"keep.txt": b"mine"}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        ["existing", "hf-cache", "repo"])


@pytest.mark.parametrize("name", ["../x.h5", "/abs/x.h5", "sub/../../x.h5"])
@pytest.mark.parametrize("into", ["cache", "out"])
def test_repo_file_names_outside_the_folder_are_one_line(
    run_cli, hub: FakeHub, tmp_path: Path, name: str, into: str
) -> None:
    hub.files[name] = b"escapes"
    hub.commit = hashlib.sha1(name.encode()).hexdigest()  # no tree cached from another case
    argv = ["--out", str(tmp_path / "out" / "here")] if into == "out" else []
    (tmp_path / "out").mkdir()
    code, out, err = run_cli("download", REPO, *argv)
    assert code == 2 and out == "", err
    assert len(err) == 1 and err[0].startswith("posteriorzoo download: error: "), err
    assert "x.h5" in err[0] and "Traceback" not in err[0]
    assert not (tmp_path / "x.h5").exists() and not Path("/abs/x.h5").exists()
    assert list((tmp_path / "out").iterdir()) == []


def test_non_utf8_manifest_is_one_line(run_cli, hub: FakeHub, tmp_path: Path) -> None:
    hub.files[MANIFEST_NAME] = NOT_UTF8
    for argv in ([], ["--out", str(tmp_path / "here")]):
        code, out, err = run_cli("download", REPO, *argv)
        assert code == 2 and out == ""
        assert len(err) == 1 and f"{MANIFEST_NAME}: not a sha256sum manifest (not UTF-8" in err[0]
        assert ".partial-" not in err[0]  # names the output, not its temporary folder
    assert not (tmp_path / "here").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


NOT_UTF8 = b"\xff\xfe\x00 not text " + bytes(range(128, 256))


@pytest.mark.parametrize("listed", [True, False],
                         ids=["refused-from-the-file-list", "refused-when-read"])
def test_manifest_over_the_cap_is_one_line(run_cli, hub: FakeHub, tmp_path: Path,
                                           listed: bool) -> None:
    hub.files["sub/" + MANIFEST_NAME] = b"0" * (MAX_MANIFEST_BYTES + 1)
    new, existing = tmp_path / "new", tmp_path / "existing"
    existing.mkdir()
    (existing / "keep.txt").write_text("mine")
    if listed:  # a dry run, and a download into a folder holding files, list them first
        runs = [["--dry-run"], ["--out", str(existing)]]
    else:  # the cache and a new folder are not listed first: the manifest is fetched
        runs = [[], ["--out", str(new)], ["--out", str(existing)]]
        hub.fail["tree:main"] = (404, b'{"error": "no listing by branch name today"}')
    for argv in runs:
        code, out, err = run_cli("download", REPO, *argv)
        assert code == 2 and out == "" and len(err) == 1, err
        assert f"{MAX_MANIFEST_BYTES + 1:,} bytes, over the limit of " \
               f"{MAX_MANIFEST_BYTES:,}" in err[0] and len(err[0]) < 500, err
        assert ".partial-" not in err[0]
    assert (transfers(hub) == []) == listed  # listed: refused before any file was fetched
    assert not new.exists()
    assert files_under(existing) == {"keep.txt": b"mine"}
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_non_utf8_manifest_beside_a_collection_is_reported(
    tmp_path: Path, capsys: pytest.CaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = tmp_path / "published"
    make_h5(folder / "a.h5", 0)
    (folder / MANIFEST_NAME).write_bytes(NOT_UTF8)
    before = files_under(folder)
    monkeypatch.setattr(cli, "_SUBCOMMAND_MODULES", ("posteriorzoo.cli.zoo_commands",))
    code = cli.main(["verify", str(folder / "a.h5")])
    out, err = capsys.readouterr()
    assert code == 2 and "Traceback" not in err
    assert "not UTF-8" in out + err
    assert files_under(folder) == before
    with pytest.raises(ZooFormatError, match="not UTF-8"):
        verify_snapshot(folder)


@pytest.mark.parametrize("answer", [{"url": "not a repository url"}, {"no": "url"}, [1, 2]],
                         ids=["bad-url", "no-url", "not-an-object"])
def test_unexpected_create_repo_answer_is_one_line(
    run_cli, hub: FakeHub, collections: Path, answer
) -> None:
    hub.create_repo_answer = answer
    code, out, err = run_cli("upload", REPO, str(collections))
    assert code == 2 and out == ""
    assert len(err) == 1 and err[0].startswith("posteriorzoo upload: error: "), err
    assert "org/zoo" in err[0]
    assert hub.commits == []


@pytest.mark.parametrize(("route", "failure", "fragment"), [
    ("resolve", (403, b"{}"), "org/zoo"),
    ("info", (404, b"{}", {"X-Error-Code": "RepoNotFound"}), "not found"),
    ("tree", (400, b'{"error": "bad request"}'), "org/zoo")])
def test_fake_hub_download_errors_are_one_line(
    run_cli, hub: FakeHub, tmp_path: Path, route: str, failure: tuple, fragment: str
) -> None:
    hub.fail[route] = failure
    for argv in ([], ["--out", str(tmp_path / "here")]):
        code, out, err = run_cli("download", REPO, *argv)
        assert code == 2 and out == "" and len(err) == 1 and fragment in err[0], err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["hf-cache", "repo"]


@pytest.mark.parametrize(("route", "failure", "fragment"), [
    ("create", (500, b"not json at all"), "org/zoo"),
    ("preupload", (400, b'{"error": "bad request"}'), "refused"),
    ("commit", (403, b'{"error": "no"}'), "permission")])
def test_fake_hub_upload_errors_are_one_line(
    run_cli, hub: FakeHub, collections: Path, route: str, failure: tuple, fragment: str
) -> None:
    hub.fail[route] = failure
    code, out, err = run_cli("upload", REPO, str(collections))
    assert code == 2 and out == "" and len(err) == 1 and fragment in err[0], err
    assert hub.commits == []
