/**
 * Runs a freshly built executor before it serves, so its first real requests
 * run at full speed.
 *
 * V8 compiles onnxruntime-web's WASM module with its baseline compiler
 * (Liftoff) and moves each function to the optimizing one (TurboFan) only
 * after that function alone has run ~13 MB of code (V8's dynamic tiering
 * budget). A page serving 4 of 12 layers reaches that 3× later than a page
 * serving all 12, and meanwhile it runs slower code and compiles on
 * background threads that take the machine's cores from the other pages:
 * measured on the 2-core dev box, a 3-page mesh still spent 0.3-0.65 s of
 * renderer CPU per 32-token chat compiling WASM after a warm-up chat, layers
 * ran ~1.3-1.7 ms instead of ~1.2 ms, and it took ~200 tokens to settle.
 *
 * So a new executor first runs one-token steps on a throwaway session, through
 * the same code paths as serving (the forward handler for a span that takes
 * activations, the executor and the wire encoding for a head), until its
 * layers have run `layerRuns` times or `maxMs` has passed. Every new executor
 * (a new session per graph) also pays its first-run setup here instead of on
 * a request.
 *
 * The steps settle through microtasks only (onnxruntime-web's WASM runs
 * synchronously inside its promises), so the loop hands the event loop back
 * every few ms: relay frames, tracker heartbeats, the page's status calls and,
 * when a serving node loads a new span beside its old one, the old span's
 * requests all go on meanwhile.
 */
import { H } from '../../protocol/headers.ts';
import { encodeTensor } from '../../protocol/tensor.ts';
import { createForwardHandler } from '../../node/hop/forward-handler.ts';
import type { SpanExecutor } from '../../shard/span-executor.ts';

export interface WarmUpOptions {
  /** Stop once the span's layers have run this many times in all (a step over n layers counts n). */
  layerRuns: number;
  /** Stop after this long whatever the count (slow devices, big spans). */
  maxMs: number;
  now?: () => number;
}

export interface WarmUpResult {
  steps: number;
  layerRuns: number;
  ms: number;
}

/** Longest stretch the warm-up keeps the worker's event loop, ms. */
const SLICE_MS = 15;

const yieldToEventLoop = () => new Promise<void>((resolve) => setTimeout(resolve, 0));

/** Tokens of the first step: a short prefill, so the many-row kernels are compiled and set up too. */
const PREFILL = 8;

export async function warmUp(executor: SpanExecutor, o: WarmUpOptions): Promise<WarmUpResult> {
  const now = o.now ?? (() => performance.now());
  const t0 = now();
  const cfg = executor.config;
  const layers = executor.endLayer - executor.startLayer;
  const session = `warm-up-${Math.random().toString(36).slice(2, 10)}`;
  const sampling = { temperature: 0 };
  // A span that starts at layer 0 takes token ids (the head's own forward in the pipeline); any other
  // takes activations through the forward handler, as relay requests do.
  const handler = executor.startLayer === 0 ? undefined : createForwardHandler(executor, { model: 'warm-up', backend: 'warm-up' });
  const row = new Float32Array(PREFILL * cfg.hiddenSize);
  for (let i = 0; i < row.length; i++) row[i] = Math.sin(i * 0.37) * 0.5;
  const maxSteps = Math.min(executor.maxContext - PREFILL, Math.ceil(o.layerRuns / Math.max(1, layers)) + 1);
  const declared = PREFILL + maxSteps;
  let steps = 0;
  let position = 0;
  let slice = now();
  try {
    while (steps < maxSteps && (steps === 0 || now() - t0 < o.maxMs)) {
      if (now() - slice >= SLICE_MS) {
        await yieldToEventLoop();
        slice = now();
      }
      const seq = steps === 0 ? PREFILL : 1;
      if (handler) {
        const res = await handler({
          method: 'POST',
          path: '/forward',
          headers: {
            [H.shape]: `1,${seq},${cfg.hiddenSize}`,
            [H.dtype]: 'bf16',
            [H.session]: session,
            [H.position]: String(position),
            // Declared like a head's session, so the warm-up takes its KV room once instead of growing it.
            ...(position === 0 ? { [H.sessionTokens]: String(declared) } : {}),
            ...(executor.holdsHead ? { [H.sampling]: JSON.stringify(sampling) } : {}),
          },
          body: encodeTensor(row.subarray(0, seq * cfg.hiddenSize), 'bf16'),
        });
        if (res.status !== 200) throw new Error(`warm-up forward answered ${res.status}`);
      } else {
        const ids = Array.from({ length: seq }, (_, i) => (position + i + 1) % cfg.vocabSize);
        const out = await executor.forward({ session, position, sessionTokens: declared, tokenIds: ids, ...(executor.holdsHead ? { sampling } : {}) });
        if (out.kind === 'activation') encodeTensor(out.data, 'bf16');
      }
      position += seq;
      steps++;
    }
  } finally {
    executor.dropSession(session);
  }
  return { steps, layerRuns: steps * layers, ms: now() - t0 };
}
