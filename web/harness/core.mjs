// The job both clients run (Node: node_run.mjs, Chromium: page.mjs), kept in one place so that
// the two clients differ only in how transformers.js is loaded and where results go.
//
// For each prompt (a list of token ids, batch 1):
//   1. one forward over the whole prompt with no past -> full logits [len, V] (float32);
//   2. transformers.js's own `generate` loop, greedy, for exactly `greedy_tokens` new tokens.
//      EOS neither ends the loop (eos_token_id: null drops EosTokenCriteria) nor is suppressed
//      (min_length/min_new_tokens processors are only added when eos_token_id is set, and are
//      zeroed as well); every other logits processor is switched off, so the chosen token is
//      the plain argmax of the last row of the logits. A streamer timestamps each new token:
//      the first one gives the prefill time, the rest the decode time per token.
//
// The module takes the transformers.js module object as an argument (Node imports the package,
// the page imports the browser bundle) and never touches the file system or the network itself.

/** Generation settings that make `generate` a plain greedy loop of exactly n tokens. */
export function greedyConfig(n) {
  return {
    max_new_tokens: n,
    max_length: null, // recomputed by generate from max_new_tokens
    min_length: 0,
    min_new_tokens: null,
    do_sample: false,
    num_beams: 1,
    num_beam_groups: 1,
    temperature: 1,
    top_k: 0,
    top_p: 1,
    repetition_penalty: 1,
    no_repeat_ngram_size: 0,
    bad_words_ids: null,
    force_words_ids: null,
    forced_bos_token_id: null,
    forced_eos_token_id: null,
    suppress_tokens: null,
    begin_suppress_tokens: null,
    forced_decoder_ids: null,
    guidance_scale: null,
    max_time: null,
    eos_token_id: null, // no EosTokenCriteria: generation never stops at EOS
    num_return_sequences: 1,
    return_dict_in_generate: false,
  };
}

/** A streamer that records when each generated token arrives (the first put is the prompt). */
class TimingStreamer {
  constructor(now) {
    this.now = now;
    this.puts = 0;
    this.times = [];
  }
  put(_value) {
    if (this.puts++ > 0) this.times.push(this.now());
  }
  end() {}
}

const mean = (xs) => (xs.length ? xs.reduce((a, b) => a + b, 0) / xs.length : null);

/**
 * Run `req` ({prompts, greedy_tokens, threads, dtype?}) on model `modelId`.
 *
 * @param {object} T the transformers.js module
 * @param {object} req the request
 * @param {object} io {modelId, device, sessionOptions, onLogits(i, Float32Array, dims), log(msg), now()}
 * @returns {Promise<object>} the result JSON (without the logits, which go through onLogits)
 */
export async function runRequest(T, req, io) {
  const now = io.now ?? (() => performance.now());
  const log = io.log ?? (() => {});
  const notes = [];

  log("loading model");
  const t0 = now();
  const options = { device: io.device };
  if (req.dtype) options.dtype = req.dtype; // else transformers.js takes config's transformers.js_config.dtype
  if (io.sessionOptions) options.session_options = io.sessionOptions;
  const model = await T.AutoModelForCausalLM.from_pretrained(io.modelId, options);
  const load_ms = now() - t0;
  const session = model.sessions?.model ?? Object.values(model.sessions ?? {})[0];
  const dtype = session?.config?.dtype ?? null;
  const device = session?.config?.device ?? null;
  log(`loaded (${dtype}, ${device}) in ${load_ms.toFixed(0)} ms`);

  // The tokenizer is not needed for token-id prompts, but loading it (and rendering the chat
  // template) checks that the folder's tokenizer files work in transformers.js too.
  let chat_ids = null;
  if (req.check_tokenizer !== false) {
    try {
      const tok = await T.AutoTokenizer.from_pretrained(io.modelId);
      if (tok.chat_template) {
        const messages = req.chat_messages ?? [{ role: "user", content: "hello" }];
        const r = tok.apply_chat_template(messages, {
          add_generation_prompt: true, tokenize: true, return_tensor: false,
        });
        chat_ids = Array.from(r?.input_ids ?? r, (x) => Number(x));
        notes.push(`tokenizer loaded; chat template renders ${chat_ids.length} tokens`);
      } else {
        notes.push("tokenizer loaded; no chat template");
      }
    } catch (e) {
      notes.push(`tokenizer failed to load: ${firstLine(e)}`);
    }
  }

  const greedy = [];
  const logits_dims = [];
  const prefill = [];
  const decode = [];
  const n = req.greedy_tokens | 0;
  for (let i = 0; i < req.prompts.length; ++i) {
    const ids = req.prompts[i].map((x) => BigInt(x));
    const L = ids.length;
    const input_ids = new T.Tensor("int64", BigInt64Array.from(ids), [1, L]);
    const attention_mask = new T.Tensor("int64", new BigInt64Array(L).fill(1n), [1, L]);

    log(`prompt ${i}: forward over ${L} tokens`);
    const out = await model({ input_ids, attention_mask });
    let logits = out.logits;
    if (logits.type !== "float32") logits = logits.to("float32");
    const dims = logits.dims.slice(1); // [L, V]
    logits_dims.push(dims);
    await io.onLogits(i, logits.data, dims);
    for (const t of Object.values(out)) t?.dispose?.();

    if (n > 0) {
      log(`prompt ${i}: generate ${n} tokens`);
      const streamer = new TimingStreamer(now);
      const start = now();
      const seq = await model.generate({
        input_ids,
        attention_mask,
        generation_config: greedyConfig(n),
        streamer,
      });
      const all = Array.from(seq.data, (x) => Number(x));
      const gen = all.slice(L);
      if (gen.length !== n) {
        throw new Error(`generate returned ${gen.length} new tokens, asked for ${n}`);
      }
      greedy.push(gen);
      if (streamer.times.length) prefill.push(streamer.times[0] - start);
      if (streamer.times.length > 1) {
        decode.push((streamer.times.at(-1) - streamer.times[0]) / (streamer.times.length - 1));
      }
    } else {
      greedy.push([]);
    }
  }

  return {
    ok: true,
    versions: {
      "transformers.js": T.env?.version ?? null,
      ...Object.fromEntries(
        Object.entries(T.env?.backends?.onnx?.versions ?? {}).map(([k, v]) => [`onnxruntime-${k}`, v]),
      ),
    },
    dtype,
    device,
    load_ms,
    prefill_ms: mean(prefill),
    decode_ms_per_token: mean(decode),
    prefill_ms_each: prefill,
    decode_ms_per_token_each: decode,
    greedy,
    logits_dims,
    chat_ids,
    notes,
  };
}

/** The first line of an error's message (what a one-line report shows). */
export function firstLine(e) {
  const text = e instanceof Error ? e.message || String(e) : typeof e === "string" ? e : JSON.stringify(e);
  return (text ?? "").split("\n").map((s) => s.trim()).find((s) => s) ?? String(e);
}
