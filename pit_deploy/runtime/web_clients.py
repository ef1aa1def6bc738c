"""Run an exported ONNX causal LM through transformers.js, in Node and in headless Chromium.

An export in the transformers.js folder layout (``config.json`` with a ``transformers.js_config``,
the tokenizer files, ``onnx/model{suffix}.onnx`` + ``.onnx_data``) is meant to be loaded by
transformers.js as it is, in Node (onnxruntime-node) or in a browser (onnxruntime-web, WASM).
The only way to know that it works there — that transformers.js picks the right file, that
the runtime has every operator, that the numbers agree with PyTorch — is to run it there. This
module does that and hands the results back to Python for comparison:

* ``node``: ``node web/harness/node_run.mjs REQUEST.json OUT_DIR`` in a temporary directory;
  the results come back as ``result.json`` and one ``logits_{i}.f32`` per prompt.
* ``chromium``: a local HTTP server (127.0.0.1, a free port) serves the model folder, the
  transformers.js browser bundle, onnxruntime-web's WASM files and ``web/harness/page.html``;
  headless Chromium opens the page, which runs the same job (``web/harness/core.mjs``) and
  POSTs the results (or its first error) back to the server.

Both clients run, for each prompt, one forward over the whole prompt (the full logits) and
then transformers.js's own ``generate`` loop, greedy, for exactly ``greedy_tokens`` tokens:
EOS neither stops it nor is suppressed (``eos_token_id=None`` in the generation config, every
other logits processor off), so the tokens are comparable with a plain argmax loop in Python.

The JavaScript side lives in ``web/`` at the repository root (``PIT_DEPLOY_WEB_DIR`` overrides
it); ``bash scripts/setup_web.sh`` installs its npm packages (transformers.js pinned) and
Chromium. Any failure is a :class:`~pit_deploy.errors.PitError` with one line that names the
client, the folder and the client's own first error line.

Only the standard library and numpy are imported, so importing this module costs nothing for
users who never run a web client.
"""

from __future__ import annotations

import http.server
import json
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import PitError

class WebClientFailed(PitError):
    """The client was set up and started, but running the folder failed there (an operator its
    runtime lacks, a crash, a timeout): a finding about the artifact, which ``verify`` records as
    a failed check, unlike a missing client (a plain :class:`PitError`)."""


#: the clients :func:`run_web_client` runs
CLIENTS: tuple[str, ...] = ("node", "chromium")
#: environment variable that points at another ``web/`` directory (package.json, node_modules,
#: harness/) than the one next to the package, e.g. for an installed (non-editable) pit-deploy
WEB_DIR_ENV = "PIT_DEPLOY_WEB_DIR"
#: environment variable naming the Chromium binary (default: ``chromium`` on PATH)
CHROMIUM_ENV = "PIT_DEPLOY_CHROMIUM"
#: the transformers.js version package.json pins; a different installed one is refused, since
#: results from another version would be compared as if they were this one's
TRANSFORMERS_JS_VERSION = "4.3.1"
SETUP_HINT = "run `bash scripts/setup_web.sh`"
#: the browser's WASM build of onnxruntime that transformers.js's bundle loads (asyncify:
#: the build its bundled onnxruntime-web expects, see its default jsDelivr paths)
_ORT_WASM_FILES = ("ort-wasm-simd-threaded.asyncify.mjs", "ort-wasm-simd-threaded.asyncify.wasm")


@dataclass
class WebRun:
    """What one client returned for a list of prompts."""

    client: str
    #: per prompt, float32 ``[len(prompt), vocab]``: the logits of one forward over the prompt
    logits: list[np.ndarray]
    #: per prompt, the ``greedy_tokens`` tokens transformers.js's ``generate`` chose greedily
    greedy: list[list[int]]
    #: time to load the model (``from_pretrained``: files, session creation)
    load_ms: float
    #: mean over prompts of the time from calling ``generate`` to its first new token
    prefill_ms: float | None
    #: mean over prompts of the time per new token after the first
    decode_ms_per_token: float | None
    #: versions as the client reports them: ``transformers.js``, ``onnxruntime-common``,
    #: ``onnxruntime-node`` or ``onnxruntime-web``
    versions: dict[str, str]
    #: the dtype transformers.js selected (from config's ``transformers.js_config``)
    dtype: str | None
    #: anything worth knowing: tokenizer check, 404s, blocked off-machine requests, threads
    notes: list[str] = field(default_factory=list)
    #: the chat template rendered by transformers.js for ``[{"role": "user", "content":
    #: "hello"}]`` with a generation prompt (``None`` without a chat template)
    chat_ids: list[int] | None = None
    #: wall time of the whole client run (start of the process to its result), seconds
    wall_s: float = 0.0
    #: the result JSON as the client sent it
    raw: dict[str, Any] = field(default_factory=dict, repr=False)


def web_dir() -> Path:
    """The ``web/`` directory: ``$PIT_DEPLOY_WEB_DIR``, else the one at the repository root."""
    override = os.environ.get(WEB_DIR_ENV)
    return Path(override).resolve() if override else Path(__file__).resolve().parents[2] / "web"


def run_web_client(client: str, folder: Path, prompts: list[list[int]], greedy_tokens: int,
                   timeout_s: float = 600, threads: int = 1) -> WebRun:
    """Run ``folder`` (transformers.js layout) through transformers.js in ``client``.

    ``prompts`` are token-id lists (batch 1 each); ``greedy_tokens`` new tokens are generated
    after each. ``threads`` is onnxruntime's intra-op thread count (Node) or the WASM thread
    count (Chromium; more than 1 needs cross-origin isolation, which the server provides).
    ``timeout_s`` bounds the whole run. Raises :class:`PitError` on any failure.
    """
    if client not in CLIENTS:
        raise PitError(f"unknown web client {client!r}; choose one of {', '.join(CLIENTS)}")
    folder = Path(folder).resolve()
    _check_folder(client, folder)
    prompts = [[int(t) for t in p] for p in prompts]
    if not prompts or any(not p for p in prompts):
        raise PitError(f"{client}: {folder}: every prompt needs at least one token")
    if greedy_tokens < 0:
        raise PitError(f"{client}: greedy_tokens must be >= 0, got {greedy_tokens}")
    web = web_dir()
    check_setup(client, web)
    request = {"prompts": prompts, "greedy_tokens": int(greedy_tokens), "threads": max(1, int(threads))}
    start = time.perf_counter()
    if client == "node":
        result, blobs, notes = _run_node(web, folder, request, timeout_s)
    else:
        result, blobs, notes = _run_chromium(web, folder, request, timeout_s)
    run = _web_run(client, folder, result, blobs, prompts, greedy_tokens, notes)
    run.wall_s = time.perf_counter() - start
    return run


# --- checks -------------------------------------------------------------------------------


def _check_folder(client: str, folder: Path) -> None:
    """Refuse a folder that is not a transformers.js layout before starting any client."""
    if not folder.is_dir():
        raise PitError(f"{client}: {folder} is not a directory")
    missing = [n for n in ("config.json", "onnx") if not (folder / n).exists()]
    if missing:
        raise PitError(f"{client}: {folder} is not a transformers.js folder (no {', '.join(missing)})")


def check_setup(client: str, web: Path | None = None) -> None:
    """The node binary, the npm packages (and Chromium) are there, with the pinned version.

    Raises:
        PitError: an unknown client, or one that is not set up (what to run is in the message).
    """
    if client not in CLIENTS:
        raise PitError(f"unknown web client {client!r}; choose one of {', '.join(CLIENTS)}")
    web = web or web_dir()
    if shutil.which("node") is None:
        raise PitError(f"{client}: `node` is not on PATH; install Node.js 20+ and {SETUP_HINT}")
    pkg = web / "node_modules" / "@huggingface" / "transformers" / "package.json"
    if not pkg.is_file():
        raise PitError(f"{client}: transformers.js is not installed under {web / 'node_modules'}; {SETUP_HINT}")
    version = json.loads(pkg.read_text()).get("version")
    if version != TRANSFORMERS_JS_VERSION:
        raise PitError(f"{client}: {web / 'node_modules'} has transformers.js {version}, "
                       f"not {TRANSFORMERS_JS_VERSION}; {SETUP_HINT}")
    harness = web / "harness" / ("node_run.mjs" if client == "node" else "page.html")
    if not harness.is_file():
        raise PitError(f"{client}: the harness {harness} is missing (is {WEB_DIR_ENV} right?)")
    if client == "chromium":
        _chromium_binary()
        ort = web / "node_modules" / "onnxruntime-web" / "dist"
        if not all((ort / f).is_file() for f in _ORT_WASM_FILES):
            raise PitError(f"chromium: onnxruntime-web's WASM files are missing under {ort}; {SETUP_HINT}")


def _chromium_binary() -> str:
    """``$PIT_DEPLOY_CHROMIUM``, else ``chromium`` (Debian's) or ``chromium-browser`` on PATH."""
    override = os.environ.get(CHROMIUM_ENV)
    if override:
        found = shutil.which(override)
        if not found:
            raise PitError(f"chromium: ${CHROMIUM_ENV}={override} is not an executable")
        return found
    found = shutil.which("chromium") or shutil.which("chromium-browser")
    if not found:
        raise PitError(f"chromium: no `chromium` on PATH; {SETUP_HINT}")
    return found


def _fail(client: str, folder: Path, line: str) -> WebClientFailed:
    """The one-line error: client, folder, the client's own first error line."""
    line = " ".join(str(line).split()) or "failed without a message"
    return WebClientFailed(f"transformers.js in {client} failed on {folder}: {line}")


def _first_error_line(text: str) -> str:
    """The line of a client's stderr that says what went wrong (``error: …`` if there is one)."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in lines:
        if ln.startswith("error: "):
            return ln[len("error: "):]
    for ln in lines:
        if re.search(r"error", ln, re.I):
            return ln
    return lines[-1] if lines else ""


# --- results ------------------------------------------------------------------------------


def _web_run(client: str, folder: Path, result: dict, blobs: dict[int, bytes], prompts: list[list[int]],
             greedy_tokens: int, notes: list[str]) -> WebRun:
    """Check the client's result against the request and turn it into a :class:`WebRun`."""
    logits = []
    for i, prompt in enumerate(prompts):
        if i not in blobs:
            raise _fail(client, folder, f"no logits came back for prompt {i}")
        dims = [int(d) for d in result["logits_dims"][i]]
        arr = np.frombuffer(blobs[i], dtype="<f4")
        if len(dims) != 2 or dims[0] != len(prompt) or arr.size != dims[0] * dims[1]:
            raise _fail(client, folder, f"logits of prompt {i} have shape {dims} ({arr.size} values), "
                                        f"expected [{len(prompt)}, V]")
        logits.append(arr.reshape(dims).astype(np.float32, copy=True))
    greedy = [[int(t) for t in g] for g in result["greedy"]]
    if len(greedy) != len(prompts) or any(len(g) != greedy_tokens for g in greedy):
        raise _fail(client, folder, f"greedy tokens came back as {[len(g) for g in greedy]}, "
                                    f"expected {greedy_tokens} per prompt")
    return WebRun(
        client=client,
        logits=logits,
        greedy=greedy,
        load_ms=float(result["load_ms"]),
        prefill_ms=result.get("prefill_ms"),
        decode_ms_per_token=result.get("decode_ms_per_token"),
        versions={k: str(v) for k, v in (result.get("versions") or {}).items()},
        dtype=result.get("dtype"),
        notes=[*result.get("notes", []), *notes],
        chat_ids=result.get("chat_ids"),
        raw=result,
    )


# --- node ---------------------------------------------------------------------------------


#: what a client run hands back: the result JSON, the logits bytes per prompt, harness notes
_Raw = tuple[dict, dict[int, bytes], list[str]]


def _run_node(web: Path, folder: Path, request: dict, timeout_s: float) -> _Raw:
    """``node web/harness/node_run.mjs REQUEST.json OUT_DIR`` in a temporary directory."""
    with tempfile.TemporaryDirectory(prefix="pit-web-node-") as tmp:
        req_path, out = Path(tmp) / "request.json", Path(tmp) / "out"
        req_path.write_text(json.dumps({**request, "folder": str(folder)}))
        cmd = ["node", str(web / "harness" / "node_run.mjs"), str(req_path), str(out)]
        proc = subprocess.Popen(cmd, cwd=web, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                errors="replace", start_new_session=True)
        try:
            stdout, stderr = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            raise _fail("node", folder, f"timed out after {timeout_s:g} s") from None
        except BaseException:  # KeyboardInterrupt: leave no node behind
            _kill_group(proc)
            raise
        if proc.returncode != 0 or not (out / "result.json").is_file():
            line = ""
            if (out / "error.json").is_file():
                line = json.loads((out / "error.json").read_text()).get("message", "")
            line = line or _first_error_line(stderr + "\n" + stdout) or f"exit status {proc.returncode}"
            raise _fail("node", folder, line)
        result = json.loads((out / "result.json").read_text())
        blobs = {i: (out / f"logits_{i}.f32").read_bytes()
                 for i in range(len(request["prompts"])) if (out / f"logits_{i}.f32").is_file()}
        notes = [f"onnxruntime-node intraOpNumThreads={request['threads']}"]
        return result, blobs, notes


def _kill_group(proc: subprocess.Popen, grace_s: float = 5.0) -> None:
    """End ``proc`` and everything it started (it leads its own session/process group)."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            pass
    try:  # children (Chromium's renderers, zygote) may outlive the leader
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    try:
        proc.wait(grace_s)
    except subprocess.TimeoutExpired:
        pass


# --- chromium -----------------------------------------------------------------------------

_CONTENT_TYPES = {".html": "text/html; charset=utf-8", ".mjs": "text/javascript", ".js": "text/javascript",
                  ".wasm": "application/wasm", ".json": "application/json", ".map": "application/json"}


class _PageSession:
    """State shared between the HTTP handler threads and :func:`_run_chromium`."""

    def __init__(self, web: Path, folder: Path, request: dict):
        node_modules = web / "node_modules"
        #: URL prefix → directory served under it (read-only, no listing)
        self.roots = {
            "/models/m/": folder,
            "/harness/": web / "harness",
            "/tjs/": node_modules / "@huggingface" / "transformers" / "dist",
            "/ort/": node_modules / "onnxruntime-web" / "dist",
        }
        self.request = json.dumps(request).encode()
        self.done = threading.Event()
        self.lock = threading.Lock()
        self.result: dict | None = None
        self.error: dict | None = None
        self.blobs: dict[int, bytes] = {}
        self.progress: list[str] = []
        self.not_found: list[str] = []
        self.external: list[str] = []
        self.requests = 0


def _handler(session: _PageSession) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 — quiet server
            pass

        def end_headers(self) -> None:
            # cross-origin isolation, so SharedArrayBuffer and WASM threads are available
            self.send_header("Cross-Origin-Opener-Policy", "same-origin")
            self.send_header("Cross-Origin-Embedder-Policy", "require-corp")
            self.send_header("Cross-Origin-Resource-Policy", "same-origin")
            self.send_header("Cache-Control", "no-store")
            super().end_headers()

        def _empty(self, code: int) -> None:
            self.send_response(code)
            self.send_header("Content-Length", "0")
            self.end_headers()

        def _external(self) -> bool:
            """A request for another host, sent here because Chromium uses this server as its
            proxy: nothing may leave the machine, so it is refused and recorded."""
            if self.command == "CONNECT" or not self.path.startswith("/"):
                with session.lock:
                    session.external.append(f"{self.command} {self.path}")
                self._empty(403)
                self.close_connection = True
                return True
            return False

        def _file(self, head: bool) -> None:
            path = self.path.split("?", 1)[0]
            with session.lock:
                session.requests += 1
            if path in ("/", "/page.html"):
                target: Path | None = session.roots["/harness/"] / "page.html"
            elif path == "/request.json":
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(session.request)))
                self.end_headers()
                if not head:
                    self.wfile.write(session.request)
                return
            elif path == "/favicon.ico":
                self._empty(204)
                return
            else:
                target = None
                for prefix, root in session.roots.items():
                    if path.startswith(prefix):
                        candidate = (root / path[len(prefix):]).resolve()
                        if candidate.is_file() and candidate.is_relative_to(root.resolve()):
                            target = candidate
                        break
            if target is None or not target.is_file():
                with session.lock:
                    session.not_found.append(path)
                self._empty(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", _CONTENT_TYPES.get(target.suffix, "application/octet-stream"))
            self.send_header("Content-Length", str(target.stat().st_size))
            self.end_headers()
            if not head:
                with open(target, "rb") as fh:
                    shutil.copyfileobj(fh, self.wfile, 1 << 20)

        def do_GET(self) -> None:  # noqa: N802
            if not self._external():
                self._file(head=False)

        def do_HEAD(self) -> None:  # noqa: N802
            if not self._external():
                self._file(head=True)

        def do_CONNECT(self) -> None:  # noqa: N802
            self._external()

        def do_POST(self) -> None:  # noqa: N802
            if self._external():
                return
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            path = self.path.split("?", 1)[0]
            logits = re.fullmatch(r"/logits/(\d+)", path)
            with session.lock:
                if logits:
                    session.blobs[int(logits.group(1))] = body
                elif path == "/log":
                    session.progress.append(str(json.loads(body or b"{}").get("message", "")))
                elif path == "/result":
                    session.result = json.loads(body)
                    session.done.set()
                elif path == "/error":
                    session.error = json.loads(body or b"{}")
                    session.done.set()
                else:
                    session.not_found.append(f"POST {path}")
                    self._empty(404)
                    return
            self._empty(204)

    return Handler


class _QuietServer(http.server.ThreadingHTTPServer):
    """The page server: a connection Chromium resets when it is ended is no error worth a
    traceback on the caller's stderr."""

    daemon_threads = True

    def handle_error(self, request: Any, client_address: Any) -> None:
        pass


#: hosts of the browser's own background services (component updater, network time, sign-in):
#: their requests are refused like any other, but they say nothing about the page
_BROWSER_SERVICE_HOSTS = re.compile(r"(^|\.)(google\.com|googleapis\.com|gstatic\.com|gvt1\.com|"
                                    r"googleusercontent\.com)(:\d+)?$")


def _external_notes(requests: list[str]) -> list[str]:
    """Notes on the refused off-machine requests: one line for the browser's own background
    services (expected, harmless), one per request that the page made (a CDN fetch, say: the
    harness is meant to serve everything itself, so such a line is a finding)."""
    background, page = [], []
    for line in requests:
        host = line.split(" ", 1)[-1].split("://", 1)[-1].split("/", 1)[0]
        (background if _BROWSER_SERVICE_HOSTS.search(host) else page).append((host, line))
    notes = [f"blocked off-machine request from the page: {line[:160]}" for _, line in page]
    if background:
        hosts = sorted({h.rsplit(":", 1)[0] for h, _ in background})
        notes.append(f"blocked {len(background)} off-machine requests of the browser's own services "
                     f"({', '.join(hosts)})")
    return notes


def _chromium_args(binary: str, profile: Path, port: int, url: str) -> list[str]:
    """Headless Chromium for a container (root, no GPU, small /dev/shm), with nothing talking to
    the outside: background services off as far as flags go, and every non-loopback request
    sent to our server as a proxy, which refuses and records it (Debian's wrapper script adds
    its own flags, e.g. for extensions, so some background requests remain: they are refused)."""
    return [
        binary, "--headless=new", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
        "--no-first-run", "--no-default-browser-check", "--disable-dev-shm-usage",
        "--disable-extensions", "--disable-background-networking", "--disable-component-update",
        "--disable-sync", "--disable-default-apps", "--disable-breakpad", "--metrics-recording-only",
        "--no-pings", "--mute-audio", "--disable-domain-reliability", "--password-store=basic",
        "--disable-client-side-phishing-detection", "--disable-component-extensions-with-background-pages",
        # a headless page is never "in the background", but make sure timers are not throttled
        "--disable-background-timer-throttling", "--disable-renderer-backgrounding",
        "--disable-backgrounding-occluded-windows",
        "--disable-features=Translate,OptimizationHints,MediaRouter,DialMediaRouteProvider,"
        "AutofillServerCommunication,NetworkTimeServiceQuerying,CertificateTransparencyComponentUpdater",
        f"--proxy-server=http://127.0.0.1:{port}", "--proxy-bypass-list=127.0.0.1",
        url,
    ]


def _run_chromium(web: Path, folder: Path, request: dict, timeout_s: float) -> _Raw:
    """Serve the page and the model on 127.0.0.1, let headless Chromium run it, collect results."""
    session = _PageSession(web, folder, request)
    server = _QuietServer(("127.0.0.1", 0), _handler(session))
    port = server.server_address[1]
    thread = threading.Thread(target=server.serve_forever, name="pit-web-server", daemon=True)
    thread.start()
    tmp = Path(tempfile.mkdtemp(prefix="pit-web-chromium-"))
    proc: subprocess.Popen | None = None
    try:
        url = f"http://127.0.0.1:{port}/page.html"
        stderr_path = tmp / "chromium.log"
        with open(stderr_path, "wb") as err:
            proc = subprocess.Popen(_chromium_args(_chromium_binary(), tmp / "profile", port, url),
                                    stdin=subprocess.DEVNULL, stdout=err, stderr=err, start_new_session=True)
        deadline = time.monotonic() + timeout_s
        while not session.done.wait(0.2):
            if proc.poll() is not None:
                line = _first_error_line(stderr_path.read_text(errors="replace"))
                raise _fail("chromium", folder, f"Chromium exited with status {proc.returncode} before the "
                                                f"page reported ({line or 'no message'})")
            if time.monotonic() > deadline:
                last = session.progress[-1] if session.progress else "page never reported progress"
                raise _fail("chromium", folder, f"timed out after {timeout_s:g} s (last progress: {last})")
        with session.lock:
            if session.error is not None:
                raise _fail("chromium", folder, session.error.get("message") or json.dumps(session.error))
            result, blobs = dict(session.result or {}), dict(session.blobs)
            notes = [f"server: {session.requests} requests"]
            notes += [f"server: 404 for {p}" for p in session.not_found]
            notes += _external_notes(session.external)
        notes.append(f"wasm numThreads requested {request['threads']}, used {result.get('wasm_threads_used')} "
                     f"(crossOriginIsolated={result.get('cross_origin_isolated')})")
        return result, blobs, notes
    finally:
        if proc is not None:
            _kill_group(proc)
        server.shutdown()
        server.server_close()
        shutil.rmtree(tmp, ignore_errors=True)
