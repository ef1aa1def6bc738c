// node web/harness/node_run.mjs REQUEST.json OUT_DIR
//
// Runs a transformers.js-layout ONNX folder through transformers.js in Node (onnxruntime-node,
// CPU) and writes OUT_DIR/result.json plus OUT_DIR/logits_{i}.f32 (float32, row-major [len, V]).
// On failure it writes OUT_DIR/error.json ({message, stack}) and exits 1, so the caller
// (pit_deploy/runtime/web_clients.py) can report the client's own first error line.
//
// REQUEST.json: {"folder": "/abs/path/to/FOLDER", "prompts": [[ids...], ...],
//                "greedy_tokens": N, "threads": 1, "dtype": null}

import { mkdir, readFile, writeFile } from "node:fs/promises";
import path from "node:path";
import { performance } from "node:perf_hooks";

import { firstLine, runRequest } from "./core.mjs";

const [reqPath, outDir] = process.argv.slice(2);
if (!reqPath || !outDir) {
  console.error("usage: node web/harness/node_run.mjs REQUEST.json OUT_DIR");
  process.exit(2);
}

async function fail(e) {
  const message = firstLine(e);
  try {
    await mkdir(outDir, { recursive: true });
    await writeFile(path.join(outDir, "error.json"), JSON.stringify({ message, stack: e?.stack ?? null }));
  } catch {}
  console.error(`error: ${message}`);
  process.exit(1);
}
process.on("unhandledRejection", fail);
process.on("uncaughtException", fail);

try {
  const req = JSON.parse(await readFile(reqPath, "utf8"));
  await mkdir(outDir, { recursive: true });
  const T = await import("@huggingface/transformers");
  const folder = path.resolve(req.folder);
  // Only the local folder: localModelPath is its parent, the model id its name.
  T.env.allowRemoteModels = false;
  T.env.allowLocalModels = true;
  T.env.useFSCache = false;
  T.env.localModelPath = path.dirname(folder) + path.sep;
  const threads = Math.max(1, req.threads | 0 || 1);
  const result = await runRequest(T, req, {
    modelId: path.basename(folder),
    device: "cpu",
    sessionOptions: { intraOpNumThreads: threads, interOpNumThreads: 1 },
    now: () => performance.now(),
    log: (msg) => { if (req.verbose) console.error(`[node_run] ${msg}`); },
    onLogits: async (i, data) => {
      const bytes = new Uint8Array(data.buffer, data.byteOffset, data.byteLength);
      await writeFile(path.join(outDir, `logits_${i}.f32`), bytes);
    },
  });
  result.client = "node";
  result.runtime = `node ${process.version}`;
  result.threads = threads;
  await writeFile(path.join(outDir, "result.json"), JSON.stringify(result));
} catch (e) {
  await fail(e);
}
