// The browser client: the same job as node_run.mjs, with onnxruntime-web (WASM) inside
// transformers.js's browser bundle. Served by pit_deploy/runtime/web_clients.py, which also
// serves the model folder under /models/m/, the bundle under /tjs/, onnxruntime-web's WASM
// files under /ort/, and takes the results back:
//   GET  /request.json      {prompts, greedy_tokens, threads, dtype?}
//   POST /logits/{i}        float32 bytes of prompt i's logits, row-major [len, V]
//   POST /result            the result JSON (after every logits POST has been answered)
//   POST /error             {kind, message, stack} (also from page.html's global handlers)
//   POST /log               {message} progress, so a timeout can say how far the page got

import * as T from "/tjs/transformers.js";
import { firstLine, runRequest } from "/harness/core.mjs";

const logEl = document.getElementById("log");

async function post(path, body, type = "application/json") {
  const res = await fetch(path, { method: "POST", headers: { "Content-Type": type }, body });
  if (!res.ok) throw new Error(`POST ${path} answered ${res.status}`);
}

function log(message) {
  logEl.textContent += message + "\n";
  post("/log", JSON.stringify({ message })).catch(() => {});
}

async function main() {
  const req = await (await fetch("/request.json")).json();
  log(`crossOriginIsolated=${self.crossOriginIsolated}`);

  T.env.allowRemoteModels = false;
  T.env.allowLocalModels = true;
  T.env.localModelPath = "/models/";
  T.env.useBrowserCache = false; // fetch the folder afresh every run, store nothing
  T.env.useWasmCache = false; // load the WASM from /ort/ directly (no Cache Storage, no blob URL)
  const wasm = T.env.backends.onnx.wasm;
  // transformers.js points these at jsDelivr by default; serve them from web/node_modules instead
  wasm.wasmPaths = {
    mjs: new URL("/ort/ort-wasm-simd-threaded.asyncify.mjs", location.href).href,
    wasm: new URL("/ort/ort-wasm-simd-threaded.asyncify.wasm", location.href).href,
  };
  const threads = Math.max(1, req.threads | 0 || 1);
  wasm.numThreads = threads;
  wasm.proxy = false;

  const result = await runRequest(T, req, {
    modelId: "m",
    device: "wasm",
    log,
    now: () => performance.now(),
    onLogits: (i, data) => post(`/logits/${i}`, new Blob([data]), "application/octet-stream"),
  });
  result.client = "chromium";
  result.runtime = navigator.userAgent;
  result.threads = threads;
  result.cross_origin_isolated = self.crossOriginIsolated;
  result.wasm_threads_used = wasm.numThreads;
  await post("/result", JSON.stringify(result));
  log("done");
}

main().catch((e) => window.__report("thrown", firstLine(e), e?.stack));
