"""A Hugging Face Hub look-alike on 127.0.0.1 that serves model repos from local folders.

It speaks the endpoints huggingface_hub 2.x calls for `model_info(files_metadata=True)` and
`snapshot_download` / `hf_hub_download`:
  GET       /api/models/{repo}[/revision/{rev}][?blobs=True]   repo info, siblings with sizes when blobs
  GET       /api/models/{repo}/tree/{rev}[/{path}]?recursive=   file listing (one page, no Link header)
  HEAD|GET  /{repo}/resolve/{rev}/{file}                        file metadata / bytes (Range supported)
  GET       /api/models?search=&filter=&sort=&limit=&expand=    `list_models`: ids containing `search`, every
                                                                `filter` among the tags, most downloads first;
                                                                gated repos are listed to anyone, as on the Hub
Errors carry the headers the library maps to exceptions (X-Error-Code RepoNotFound, RevisionNotFound,
GatedRepo, EntryNotFound; 401 "Invalid credentials in Authorization header" for an unknown token).
Unlike the real Hub, LFS files are served directly (200, ETag = sha256) instead of a 302 to a CDN.

Uploads, as `create_repo` + `upload_folder` do them (every file is answered "regular", so no LFS or Xet
storage is involved; the file bytes travel base64-encoded inside the commit):
  GET   /api/whoami-v2                             the token's user (HubServer.users maps token -> name)
  POST  /api/repos/create                          409 when the repo exists; 403 outside the user's namespace
  POST  /api/models/{repo}/preupload/{rev}         uploadMode "regular" for every file
  POST  /api/models/{repo}/commit/{rev}            ndjson header + base64 files; then downloadable as usual
  POST  /api/validate-yaml                         a README's front matter: always valid here
"""
from __future__ import annotations

import base64
import hashlib
import json
import re
import tempfile
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

LFS_SUFFIXES = (".safetensors", ".bin", ".pth", ".pt", ".ckpt", ".gguf")
API_RE = re.compile(r"/api/models/(?P<repo>[^/]+(?:/[^/]+)?)(?:/(?P<kind>revision|tree)/(?P<rev>[^/]+)(?:/.*)?)?")
RESOLVE_RE = re.compile(r"/(?P<repo>[^/]+(?:/[^/]+)?)/resolve/(?P<rev>[^/]+)/(?P<file>.+)")
UPLOAD_RE = re.compile(r"/api/models/(?P<repo>[^/]+/[^/]+)/(?P<kind>preupload|commit)/(?P<rev>[^/]+)")


@dataclass
class RepoFile:
    path: str
    data_path: Path
    size: int
    blob_id: str  # git blob sha1, what the Hub reports as oid / blobId
    sha256: str | None  # set for LFS files


@dataclass
class Repo:
    repo_id: str
    sha: str
    branches: tuple[str, ...]
    files: dict[str, RepoFile]
    gated_for: set[str] | None  # tokens with access; None = not gated
    reported_sizes: dict[str, int] = field(default_factory=dict)
    tags: tuple[str, ...] = ("transformers", "safetensors", "llama", "text-generation")
    pipeline_tag: str | None = "text-generation"
    downloads: int = 0

    def size(self, f: RepoFile) -> int:
        return self.reported_sizes.get(f.path, f.size)

    def lfs(self, f: RepoFile) -> dict | None:
        return {"sha256": f.sha256, "size": self.size(f), "pointerSize": 134} if f.sha256 else None


class HubServer:
    def __init__(self, tokens=()):
        self.repos: dict[str, Repo] = {}
        self.tokens = set(tokens)  # tokens the Hub accepts at all
        self.log: list[tuple[str, str, int | None]] = []  # (method, path, status); never headers, so never tokens
        self.drop_downloads: set[str] = set()  # files whose GET is cut off before any answer
        self.endpoint = ""
        self.users: dict[str, str] = {}  # token -> user name, for whoami and the namespace a token may write to
        self.commits: list[tuple[str, str, list[str]]] = []  # (repo, summary, paths) of every commit received
        self._upload_dir: Path | None = None
        self._httpd: ThreadingHTTPServer | None = None

    def add_repo(self, repo_id, folder, *, branches=("main",), gated_for=None, reported_sizes=None, downloads=0,
                 tags=None, pipeline_tag="text-generation") -> str:
        files = {}
        for p in sorted(Path(folder).rglob("*")):
            if p.is_file():
                data = p.read_bytes()
                rel = p.relative_to(folder).as_posix()
                blob_id = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
                sha256 = hashlib.sha256(data).hexdigest() if rel.endswith(LFS_SUFFIXES) else None
                files[rel] = RepoFile(rel, p, len(data), blob_id, sha256)
        sha = hashlib.sha1(repo_id.encode() + b"".join(f.blob_id.encode() for f in files.values())).hexdigest()
        self.repos[repo_id] = Repo(
            repo_id, sha, tuple(branches), files, set(gated_for) if gated_for is not None else None,
            dict(reported_sizes or {}), tuple(tags or Repo.tags), pipeline_tag, downloads,
        )
        return sha

    def start(self) -> str:
        self._httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Handler)
        self._httpd.daemon_threads = True
        self._httpd.hub = self
        threading.Thread(target=self._httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        self.endpoint = f"http://127.0.0.1:{self._httpd.server_address[1]}"
        return self.endpoint

    def stop(self) -> None:
        if self._httpd is not None:
            self._httpd.shutdown()
            self._httpd.server_close()
            self._httpd = None

    def requested_files(self, repo_id: str) -> set[str]:
        """Files of repo_id that a client asked for on /resolve/ (HEAD or GET), at any revision."""
        files = set()
        for _, path, _ in self.log:
            m = RESOLVE_RE.fullmatch(path)
            if m and m["repo"] == repo_id:
                files.add(unquote(m["file"]))
        return files


class _Handler(BaseHTTPRequestHandler):
    # HTTP/1.0 closes every connection, so once stop() returns no pooled connection can still reach us.
    protocol_version = "HTTP/1.0"

    def log_message(self, *args):
        pass

    def do_GET(self):
        self._route()

    def do_HEAD(self):
        self._route()

    def do_POST(self):
        hub: HubServer = self.server.hub
        url = urlsplit(self.path)
        self.log_path = url.path
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        auth = self.headers.get("Authorization", "")
        token = auth[len("Bearer "):] if auth.startswith("Bearer ") else None
        if token is None or token not in hub.tokens:
            return self._error(401, None, "Invalid credentials in Authorization header")
        user = hub.users.get(token)
        if url.path == "/api/validate-yaml":
            return self._json({"errors": [], "warnings": []})
        if url.path == "/api/repos/create":
            payload = json.loads(body)
            repo_id = f"{payload.get('organization') or user}/{payload['name']}"
            if repo_id.split("/")[0] != user:
                return self._error(403, None, f"You don't have the rights to create a model under {repo_id.split('/')[0]}")
            if repo_id in hub.repos:
                # The Hub's 409 carries the repo url too; create_repo(exist_ok=True) reads it.
                return self._send(409, {"Content-Type": "application/json", "X-Error-Message": "You already created this model repo"},
                                  json.dumps({"error": "You already created this model repo",
                                              "url": f"{hub.endpoint}/{repo_id}"}).encode())
            hub.repos[repo_id] = Repo(repo_id, hashlib.sha1(repo_id.encode()).hexdigest(), ("main",), {}, None)
            return self._json({"url": f"{hub.endpoint}/{repo_id}", "name": repo_id})
        m = UPLOAD_RE.fullmatch(url.path)
        if m is None:
            return self._error(404, None, "Not found")
        repo = hub.repos.get(unquote(m["repo"]))
        if repo is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        if repo.repo_id.split("/")[0] != user:
            return self._error(403, None, f"You don't have the rights to write to {repo.repo_id}")
        if m["kind"] == "preupload":
            files = json.loads(body)["files"]
            return self._json({"files": [{"path": f["path"], "uploadMode": "regular", "shouldIgnore": False}
                                         for f in files]})
        lines = [json.loads(line) for line in body.splitlines() if line.strip()]
        header = next(item["value"] for item in lines if item["key"] == "header")
        paths = []
        if hub._upload_dir is None:
            hub._upload_dir = Path(tempfile.mkdtemp(prefix="hub-uploads-"))
        for item in lines:
            if item["key"] != "file":
                continue
            data = base64.b64decode(item["value"]["content"])
            path = item["value"]["path"]
            target = hub._upload_dir / repo.repo_id / hashlib.sha1(data).hexdigest()
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(data)
            blob_id = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()
            sha256 = hashlib.sha256(data).hexdigest() if path.endswith(LFS_SUFFIXES) else None
            repo.files[path] = RepoFile(path, target, len(data), blob_id, sha256)
            paths.append(path)
        repo.sha = hashlib.sha1(repo.sha.encode() + b"".join(f.blob_id.encode() for f in repo.files.values())).hexdigest()
        hub.commits.append((repo.repo_id, header.get("summary", ""), paths))
        return self._json({"commitUrl": f"{hub.endpoint}/{repo.repo_id}/commit/{repo.sha}", "commitOid": repo.sha,
                           "pullRequestUrl": None})

    def _route(self):
        hub: HubServer = self.server.hub
        url = urlsplit(self.path)
        self.log_path = url.path
        auth = self.headers.get("Authorization", "")
        token = auth[len("Bearer "):] if auth.startswith("Bearer ") else None
        if token is not None and token not in hub.tokens:
            return self._error(401, None, "Invalid credentials in Authorization header")

        if url.path == "/api/whoami-v2":
            if token is None:
                return self._error(401, None, "Invalid credentials in Authorization header")
            name = hub.users.get(token, "anonymous")
            return self._json({"type": "user", "name": name, "fullname": name, "orgs": [],
                               "auth": {"type": "access_token", "accessToken": {"role": "write"}}})
        if url.path == "/api/models":
            return self._json(self._list(parse_qs(url.query)))
        api, resolve = API_RE.fullmatch(url.path), RESOLVE_RE.fullmatch(url.path)
        m = api or resolve
        if m is None:
            return self._error(404, None, "Not found")
        repo = hub.repos.get(unquote(m["repo"]))
        if repo is None:
            return self._error(404, "RepoNotFound", "Repository not found")
        if repo.gated_for is not None and token not in repo.gated_for:
            # The Hub answers 401 to anonymous users and 403 to logged-in users without access.
            return self._error(
                401 if token is None else 403, "GatedRepo",
                f"Access to model {repo.repo_id} is restricted. You must have access to it and be authenticated.",
            )
        rev = unquote(m["rev"] or "main")
        if rev not in repo.branches and rev != repo.sha:
            return self._error(404, "RevisionNotFound", f"Invalid rev id: {rev}", repo)

        if resolve:
            return self._file(repo, unquote(m["file"]))
        if api["kind"] == "tree":
            return self._json(self._tree(repo))
        blobs = parse_qs(url.query).get("blobs", [""])[0].lower() == "true"
        return self._json(self._info(repo, blobs))

    def _info(self, repo: Repo, blobs: bool) -> dict:
        siblings = []
        for f in repo.files.values():
            entry = {"rfilename": f.path}
            if blobs:
                entry.update(blobId=f.blob_id, size=repo.size(f))
                if f.sha256:
                    entry["lfs"] = repo.lfs(f)
            siblings.append(entry)
        return {
            "_id": repo.sha[:24], "id": repo.repo_id, "modelId": repo.repo_id, "sha": repo.sha,
            "author": repo.repo_id.split("/")[0], "lastModified": "2025-01-01T00:00:00.000Z", "private": False,
            "gated": "manual" if repo.gated_for is not None else False, "disabled": False,
            "library_name": "transformers", "tags": list(repo.tags), "siblings": siblings,
        }

    def _list(self, query: dict) -> list[dict]:
        """What the Hub's model listing answers: without `expand` its default fields, with it `_id`, `id` and
        the fields asked for."""
        hub: HubServer = self.server.hub
        search = query.get("search", [""])[0].lower()
        wanted = set(query.get("filter", []))
        found = [r for r in hub.repos.values() if search in r.repo_id.lower() and wanted <= set(r.tags)]
        if query.get("sort", [""])[0] == "downloads":
            found.sort(key=lambda r: -r.downloads)
        found = found[: int(query.get("limit", [len(found)])[0])]
        fields = query.get("expand") or ["likes", "trendingScore", "private", "downloads", "tags", "pipeline_tag",
                                         "library_name", "createdAt", "modelId"]
        return [{"_id": r.sha[:24], "id": r.repo_id, **{name: value for name, value in self._fields(r).items()
                                                        if name in fields}} for r in found]

    @staticmethod
    def _fields(repo: Repo) -> dict:
        return {"gated": "manual" if repo.gated_for is not None else False, "downloads": repo.downloads,
                "pipeline_tag": repo.pipeline_tag, "tags": list(repo.tags), "likes": 0, "trendingScore": 0,
                "private": False, "library_name": "transformers", "createdAt": "2025-01-01T00:00:00.000Z",
                "modelId": repo.repo_id}

    def _tree(self, repo: Repo) -> list[dict]:
        folders = sorted({p.rsplit("/", 1)[0] for p in repo.files if "/" in p})
        entries = [{"type": "directory", "oid": hashlib.sha1(d.encode()).hexdigest(), "path": d} for d in folders]
        for f in repo.files.values():
            entry = {"type": "file", "oid": f.blob_id, "size": repo.size(f), "path": f.path}
            if f.sha256:
                entry["lfs"] = {"oid": f.sha256, "size": repo.size(f), "pointerSize": 134}
            entries.append(entry)
        return entries

    def _file(self, repo: Repo, name: str):
        f = repo.files.get(name)
        if f is None:
            return self._error(404, "EntryNotFound", f"{name} does not exist on this revision", repo)
        if self.command == "GET" and name in self.server.hub.drop_downloads:
            self._record(None)
            self.close_connection = True
            return
        start = 0
        match = re.fullmatch(r"bytes=(\d+)-", self.headers.get("Range", ""))
        if match and self.command == "GET":
            start = int(match[1])
        status = 206 if start else 200
        self._record(status)
        self.send_response(status)
        self.send_header("X-Repo-Commit", repo.sha)
        self.send_header("ETag", f'"{f.sha256 or f.blob_id}"')
        self.send_header("Content-Type", "application/octet-stream")
        self.send_header("Accept-Ranges", "bytes")
        self.send_header("Content-Length", str(f.size - start))
        if start:
            self.send_header("Content-Range", f"bytes {start}-{f.size - 1}/{f.size}")
        self.end_headers()
        if self.command == "GET":
            with open(f.data_path, "rb") as src:
                src.seek(start)
                self.wfile.write(src.read())

    def _json(self, payload):
        self._send(200, {"Content-Type": "application/json"}, json.dumps(payload).encode())

    def _error(self, status: int, code: str | None, message: str, repo: Repo | None = None):
        headers = {"Content-Type": "application/json", "X-Error-Message": message}
        if code:
            headers["X-Error-Code"] = code
        if repo is not None:
            headers["X-Repo-Commit"] = repo.sha
        self._send(status, headers, json.dumps({"error": message}).encode())

    def _send(self, status: int, headers: dict, body: bytes):
        self._record(status)
        self.send_response(status)
        for key, value in headers.items():
            self.send_header(key, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)

    def _record(self, status: int | None):
        self.server.hub.log.append((self.command, self.log_path, status))
