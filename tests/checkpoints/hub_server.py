"""A small Hugging Face Hub stand-in on 127.0.0.1 for the download tests (point HF_ENDPOINT at `LocalHub.url`).

It speaks what huggingface_hub 2.x asks of the Hub when specexec.checkpoints.hub downloads: the model API
(`GET /api/models/{repo}/revision/{rev}?blobs=true`: commit sha + files with size, git blob id and LFS sha256),
and `HEAD`/`GET /{repo}/resolve/{rev}/{file}` with X-Repo-Commit and ETag (the git blob sha1 of a small file),
where an LFS file (*.safetensors, *.gguf) answers 302 to `/cdn/{sha256}` with X-Linked-Etag / X-Linked-Size as
the real Hub does; `/cdn/...` honours `Range: bytes=N-` with 206. Errors carry the X-Error-Code header the client
maps to its exceptions: unknown repo -> 404 RepoNotFound; private repo without the token -> 401 RepoNotFound;
gated repo: the listing is public, the files answer 401 GatedRepo without a token and 403 with a wrong one.

Fault injection: `drop_after_half` (file names): the first GET of such a file sends half its body and closes the
connection. Every request is logged (method, path, Range, Authorization) so tests count what was fetched.

Does not know: specexec. Uses only the standard library.
"""
from __future__ import annotations

import hashlib
import json
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pth")


def git_blob_id(data: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


@dataclass
class Repo:
    files: dict[str, bytes]
    commit: str
    access: str = "public"                      # public | private | gated
    token: str = "good-token"

    def etag(self, name: str) -> str:
        data = self.files[name]
        return hashlib.sha256(data).hexdigest() if name.endswith(LFS_SUFFIXES) else git_blob_id(data)


@dataclass
class Request:
    method: str
    path: str
    range: str | None
    auth: str | None


@dataclass
class LocalHub:
    repos: dict[str, Repo] = field(default_factory=dict)
    log: list[Request] = field(default_factory=list)
    drop_after_half: set[str] = field(default_factory=set)
    url: str = ""

    def add(self, repo: str, files: dict[str, bytes], access: str = "public") -> Repo:
        commit = hashlib.sha1(repo.encode() + b"".join(sorted(files.values()))).hexdigest()
        self.repos[repo] = Repo(dict(files), commit, access)
        return self.repos[repo]

    def add_dir(self, repo: str, directory: Path, extra: dict[str, bytes] | None = None, access: str = "public"
                ) -> Repo:
        files = {p.relative_to(directory).as_posix(): p.read_bytes() for p in sorted(directory.rglob("*"))
                 if p.is_file()}
        return self.add(repo, {**files, **(extra or {})}, access)

    def gets(self, suffix: str) -> list[Request]:
        """The GETs whose path ends with `suffix` (a file name, or a sha256 for /cdn/)."""
        return [r for r in self.log if r.method == "GET" and r.path.endswith(suffix)]

    def by_sha(self, name: str, repo: str) -> str:
        return self.repos[repo].etag(name)


def serve(hub: LocalHub):
    """Start `hub` on 127.0.0.1:<free port>; returns (server, thread). Stop with stop(server, thread)."""
    handler = type("Handler", (_Handler,), {"hub": hub})
    server = _Server(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    hub.url = f"http://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, name="local-hub", daemon=True)
    thread.start()
    return server, thread


class _Server(ThreadingHTTPServer):
    def handle_error(self, request, client_address) -> None:
        """A client that went away mid-body (an interrupted download) is expected here, not an error."""
        import sys
        if not isinstance(sys.exc_info()[1], (ConnectionError, TimeoutError)):
            super().handle_error(request, client_address)


def stop(server, thread) -> None:
    server.shutdown()
    server.server_close()
    thread.join(10)


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: LocalHub

    def log_message(self, *args) -> None:          # quiet
        pass

    def do_HEAD(self) -> None:
        self._route(body=False)

    def do_GET(self) -> None:
        self._route(body=True)

    # ------------------------------------------------------------------------------------ routing
    def _route(self, body: bool) -> None:
        path = unquote(urlsplit(self.path).path)
        self.hub.log.append(Request(self.command, path, self.headers.get("Range"), self.headers.get("Authorization")))
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"] and len(parts) >= 6 and parts[4] == "revision":
            return self._model_info("/".join(parts[2:4]), "/".join(parts[5:]))
        if len(parts) >= 5 and parts[2] == "resolve":
            return self._resolve("/".join(parts[:2]), parts[3], "/".join(parts[4:]), body)
        if len(parts) == 2 and parts[0] == "cdn":
            return self._cdn(parts[1], body)
        self._error(404, "EntryNotFound", "no such route")

    def _repo(self, repo_id: str, files: bool) -> Repo | None:
        repo = self.hub.repos.get(repo_id)
        token = (self.headers.get("Authorization") or "").removeprefix("Bearer ")
        if repo is None:
            self._error(404, "RepoNotFound", "Repository not found")
        elif repo.access == "private" and token != repo.token:
            self._error(401, "RepoNotFound", "Repository not found")
        elif repo.access == "gated" and files and token != repo.token:
            self._error(403 if token else 401, "GatedRepo", f"Access to model {repo_id} is restricted")
        else:
            return repo
        return None

    def _model_info(self, repo_id: str, revision: str) -> None:
        repo = self._repo(repo_id, files=False)
        if repo is None:
            return
        if revision not in ("main", repo.commit):
            return self._error(404, "RevisionNotFound", "Invalid rev id")
        siblings = []
        for name, data in repo.files.items():
            s = {"rfilename": name, "size": len(data), "blobId": git_blob_id(data)}
            if name.endswith(LFS_SUFFIXES):
                s["lfs"] = {"size": len(data), "sha256": repo.etag(name), "pointerSize": 134}
            siblings.append(s)
        self._json({"id": repo_id, "modelId": repo_id, "sha": repo.commit, "private": repo.access == "private",
                    "gated": "auto" if repo.access == "gated" else False, "siblings": siblings})

    def _resolve(self, repo_id: str, revision: str, name: str, body: bool) -> None:
        repo = self._repo(repo_id, files=True)
        if repo is None:
            return
        if revision not in ("main", repo.commit):
            return self._error(404, "RevisionNotFound", "Invalid rev id")
        if name not in repo.files:
            return self._error(404, "EntryNotFound", f"{name} does not exist")
        data, etag = repo.files[name], repo.etag(name)
        common = {"X-Repo-Commit": repo.commit, "ETag": f'"{etag}"'}
        if name.endswith(LFS_SUFFIXES):
            self._send(302, b"", {**common, "Location": f"{self.hub.url}/cdn/{etag}", "X-Linked-Etag": f'"{etag}"',
                                  "X-Linked-Size": str(len(data))}, body)
            return
        self._bytes(data, common, body, name)

    def _cdn(self, sha: str, body: bool) -> None:
        for repo in self.hub.repos.values():
            for name in repo.files:
                if repo.etag(name) == sha:
                    return self._bytes(repo.files[name], {"ETag": f'"{sha}"'}, body, name)
        self._error(404, "EntryNotFound", "no such blob")

    # ------------------------------------------------------------------------------------ responses
    def _bytes(self, data: bytes, headers: dict, body: bool, name: str) -> None:
        start, status = 0, 200
        rng = self.headers.get("Range")
        if rng and rng.startswith("bytes=") and rng.endswith("-"):
            start, status = int(rng[len("bytes="):-1]), 206
            if start >= len(data):
                return self._send(416, b"", {"Content-Range": f"bytes */{len(data)}"}, body)
            headers = {**headers, "Content-Range": f"bytes {start}-{len(data) - 1}/{len(data)}"}
        payload = data[start:]
        drop = body and name in self.hub.drop_after_half
        if drop:
            self.hub.drop_after_half.discard(name)
        self._send(status, payload, {**headers, "Accept-Ranges": "bytes"}, body, drop=drop)

    def _json(self, obj: dict) -> None:
        self._send(200, json.dumps(obj).encode(), {"Content-Type": "application/json"}, True)

    def _error(self, status: int, code: str, message: str) -> None:
        body = json.dumps({"error": message}).encode()
        self._send(status, body, {"Content-Type": "application/json", "X-Error-Code": code,
                                  "X-Error-Message": message}, self.command != "HEAD")

    def _send(self, status: int, payload: bytes, headers: dict, body: bool, drop: bool = False) -> None:
        self.send_response(status)
        for k, v in headers.items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        if not body:
            return
        if drop:                                    # half the body, then the connection goes away
            self.wfile.write(payload[: len(payload) // 2])
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_RDWR)
            self.close_connection = True
            return
        for i in range(0, len(payload), 64 << 10):
            self.wfile.write(payload[i:i + (64 << 10)])
        self.wfile.flush()
