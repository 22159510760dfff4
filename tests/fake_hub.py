"""A fake Hugging Face Hub on 127.0.0.1 for tests: the few routes huggingface_hub calls.

:class:`FakeHub` serves one dataset repository from a dict ``{path in repo: bytes}``
(repository info, the recursive file tree, file downloads) and accepts repository
creation, branch creation and commits (pre-upload answers "regular" for every file, so
the commit carries the bytes inline). Tests change :attr:`FakeHub.files`,
:attr:`FakeHub.create_repo_answer` or :attr:`FakeHub.fail` to play a hostile or broken
Hub. It listens on the loopback interface only; nothing else is contacted.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import threading
import urllib.parse
from dataclasses import dataclass, field
from typing import Any

COMMIT = "0123456789abcdef0123456789abcdef01234567"


def git_blob_id(data: bytes) -> str:
    """The git object id of a blob, as the Hub reports it for non-LFS files."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class FakeHub:
    """One dataset repository ``repo_id`` served at :attr:`endpoint` while started."""

    repo_id: str = "org/zoo"
    files: dict[str, bytes] = field(default_factory=dict)
    commit: str = COMMIT
    #: The JSON answer of ``POST /api/repos/create`` (``None``: a proper repository URL).
    create_repo_answer: Any = None
    #: ``{route: (status, body[, headers])}`` to fail a route: a kind ("info", "tree",
    #: "resolve", "create", "branch", "preupload", "commit"), or a kind and revision
    #: ("tree:main"). The Hub tells errors apart by an ``X-Error-Code`` header.
    fail: dict[str, tuple] = field(default_factory=dict)
    requests: list[tuple[str, str]] = field(default_factory=list)
    commits: list[list[dict[str, Any]]] = field(default_factory=list)
    endpoint: str = ""

    # ------------------------------------------------------------------ serving
    def __enter__(self) -> FakeHub:
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format, *args):  # noqa: A002 - the base class's signature
                pass

            def _body(self) -> bytes:
                length = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(length) if length else b""

            def _answer(self, status: int, body: bytes = b"", headers: dict | None = None,
                        content_type: str = "application/json") -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                for key, value in (headers or {}).items():
                    self.send_header(key, value)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(body)

            def _handle(self) -> None:
                body = self._body()
                hub.requests.append((self.command, self.path))
                status, payload, headers, kind = hub.route(self.command, self.path, body)
                self._answer(status, payload, headers, kind)

            do_GET = do_HEAD = do_POST = do_PUT = _handle  # noqa: N815 - http.server names

        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(target=self._server.serve_forever,
                                        kwargs={"poll_interval": 0.05}, daemon=True)
        self._thread.start()
        self.endpoint = f"http://127.0.0.1:{self._server.server_address[1]}"
        return self

    def __exit__(self, *exc: object) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)

    # ------------------------------------------------------------------ routes
    def _json(self, value: Any, status: int = 200) -> tuple[int, bytes, dict, str]:
        return status, json.dumps(value).encode(), {}, "application/json"

    def _failure(self, kind: str, revision: str = "") -> tuple[int, bytes, dict, str] | None:
        for key in (f"{kind}:{revision}", kind):
            if key in self.fail:
                status, body, *headers = self.fail[key]
                return status, body, dict(*headers), "application/json"
        return None

    def route(self, method: str, raw_path: str, body: bytes) -> tuple[int, bytes, dict, str]:
        path = urllib.parse.urlsplit(raw_path).path
        prefix = f"/api/datasets/{self.repo_id}/"
        resolve = f"/datasets/{self.repo_id}/resolve/"
        if path.startswith(prefix + "revision/"):
            return self._failure("info") or self._json({
                "id": self.repo_id, "sha": self.commit, "private": False,
                "siblings": [{"rfilename": name} for name in sorted(self.files)]})
        if path.startswith(prefix + "tree/"):
            revision = path[len(prefix + "tree/"):].split("/")[0]
            return self._failure("tree", revision) or self._json(
                [self._tree_entry(name) for name in sorted(self.files)])
        if path.startswith(resolve):
            return self._failure("resolve") or self._resolve(method, path[len(resolve):])
        if path == "/api/repos/create" and method == "POST":
            answer = self.create_repo_answer
            if answer is None:
                answer = {"url": f"{self.endpoint}/datasets/{self.repo_id}"}
            return self._failure("create") or self._json(answer)
        if path.startswith(prefix + "branch/") and method == "POST":
            return self._failure("branch") or self._json({})
        if path.startswith(prefix + "preupload/") and method == "POST":
            names = [entry["path"] for entry in json.loads(body)["files"]]
            return self._failure("preupload") or self._json({"files": [
                {"path": name, "uploadMode": "regular", "shouldIgnore": False}
                for name in names]})
        if path.startswith(prefix + "commit/") and method == "POST":
            return self._failure("commit") or self._commit(body)
        return 404, b'{"error": "not found"}', {}, "application/json"

    def _tree_entry(self, name: str) -> dict[str, Any]:
        data = self.files[name]
        entry: dict[str, Any] = {"type": "file", "path": name, "size": len(data),
                                 "oid": git_blob_id(data)}
        if name.endswith(".h5"):  # collections are stored with LFS on the Hub
            entry["lfs"] = {"oid": hashlib.sha256(data).hexdigest(), "size": len(data),
                            "pointerSize": 134}
        return entry

    def _resolve(self, method: str, rest: str) -> tuple[int, bytes, dict, str]:
        _revision, _, quoted = rest.partition("/")
        name = urllib.parse.unquote(quoted)
        if name not in self.files:
            return 404, b'{"error": "Entry not found"}', {"X-Error-Code": "EntryNotFound"}, \
                "application/json"
        data = self.files[name]
        etag = hashlib.sha256(data).hexdigest() if name.endswith(".h5") else git_blob_id(data)
        headers = {"X-Repo-Commit": self.commit, "ETag": f'"{etag}"'}
        return 200, data, headers, "application/octet-stream"

    def _commit(self, body: bytes) -> tuple[int, bytes, dict, str]:
        operations = []
        for line in body.decode().splitlines():
            item = json.loads(line)
            if item.get("key") == "file":
                value = item["value"]
                operations.append({"path": value["path"],
                                   "content": base64.b64decode(value["content"])})
        self.commits.append(operations)
        for operation in operations:
            self.files[operation["path"]] = operation["content"]
        return self._json({"commitUrl": f"{self.endpoint}/datasets/{self.repo_id}/commit/"
                                        f"{self.commit}", "commitOid": self.commit})
