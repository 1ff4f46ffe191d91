/**
 * A hop's JavaScript per chained step without a network or onnxruntime:
 * the chain handler (route check, the forward handler's parsing and
 * tensor coding, the push's headers and frame) over a fake executor that
 * answers at once and a transport whose push encodes the REQUEST frame and
 * resolves. µs per step, median of batches. What bench/hop-trace.ts shows as
 * a middle hop's "other" time, minus scheduling.
 *
 *   npx tsx bench/lib/hop-js-cost.ts
 */
import { createChainHop } from '../../src/node/hop/chain-hop.ts';
import { createForwardHandler } from '../../src/node/hop/forward-handler.ts';
import { Identity } from '../../src/net/identity.ts';
import { encodeBase64Url } from '../../src/protocol/base64.ts';
import { encodeRequestFrame, decodeFrame, FLAG_END, FLAG_ONE_WAY } from '../../src/protocol/frames.ts';
import { hexToBytes } from '../../src/protocol/ids.ts';
import { encodeTensor } from '../../src/protocol/tensor.ts';
import { chainReplySigningMessage, routeSigningMessage, type RouteHop } from '../../src/protocol/tracker.ts';
import type { MeshRequest } from '../../src/protocol/envelopes.ts';
import { NO_NEWS } from '../../src/net/mux-caller.ts';

const hidden = 512;
const key = await Identity.generate();
const [head, mid, tail] = ['a'.repeat(32), 'b'.repeat(32), 'c'.repeat(32)];
const hops: RouteHop[] = [
  { peer_id: mid, start_layer: 4, end_layer: 8, relay_addr: `ws://127.0.0.1:40000/rpc/${mid}` },
  { peer_id: tail, start_layer: 8, end_layer: 12, relay_addr: `ws://127.0.0.1:40000/rpc/${tail}` },
];
const route = JSON.stringify(hops);
const expires = Date.now() + 3_600_000;
const reply = JSON.stringify({ relay_addr: `ws://127.0.0.1:40000/rpc/${head}` });
const headers: Record<string, string> = {
  'x-meshnet-shape': `1,1,${hidden}`,
  'x-meshnet-dtype': 'bf16',
  'x-meshnet-session': 'trace-1.1ckqs6j',
  'x-meshnet-position': '40',
  'x-meshnet-start-layer': '4',
  'x-meshnet-end-layer': '8',
  'x-meshnet-sampling': JSON.stringify({ temperature: 0, top_p: 1, top_k: 0 }),
  'x-meshnet-route': route,
  'x-meshnet-route-expires': String(expires),
  'x-meshnet-route-signature': encodeBase64Url(await key.sign(routeSigningMessage(head, expires, route))),
  'x-meshnet-chain-head': head,
  'x-meshnet-chain-index': '0',
  'x-meshnet-chain-budget-ms': '10000',
  'x-meshnet-chain-reply': reply,
  'x-meshnet-chain-reply-signature': encodeBase64Url(await key.sign(chainReplySigningMessage(head, expires, reply))),
  'content-type': 'application/octet-stream',
};
const body = encodeTensor(new Float32Array(hidden).map((_, i) => Math.sin(i)), 'bf16');
const config = { hiddenSize: hidden, numLayers: 12 } as never;
const out = new Float32Array(hidden).map((_, i) => Math.cos(i));
const executor = {
  config, startLayer: 4, endLayer: 8, holdsEmbedding: false, holdsHead: false, maxContext: 512, dtype: 'f32', weightBytes: 0,
  sessionLength: () => 0, dropSession: () => true, kvStats: () => ({}) as never,
  forward: async () => ({ kind: 'activation' as const, data: out, shape: [1, 1, hidden] }),
};
const local = createForwardHandler(executor as never, { model: 'small', backend: 'fake' });
let frames = 0;
const transport = {
  send: () => Promise.reject(new Error('unused')),
  push: (hop: RouteHop, req: { method: string; path: string; headers: Record<string, string>; body: Uint8Array }) => {
    frames += encodeRequestFrame({ streamId: 1, peerId: hexToBytes(hop.peer_id), method: req.method, path: req.path, headers: req.headers, body: req.body, flags: FLAG_END | FLAG_ONE_WAY }).byteLength;
    return Promise.resolve(NO_NEWS);
  },
};
const hop = createChainHop({ peerId: mid, trackerKey: () => key.publicKey, transport: transport as never, local });
const wire = encodeRequestFrame({ streamId: 7, peerId: hexToBytes(mid), method: 'POST', path: '/forward', headers, body, flags: FLAG_END | FLAG_ONE_WAY });

async function one(): Promise<void> {
  const f = decodeFrame(wire) as { method: string; path: string; headers: Record<string, string>; body: Uint8Array };
  const req: MeshRequest = { method: f.method, path: f.path, headers: f.headers, body: f.body };
  const res = await hop(req);
  if (res.status !== 202) throw new Error(`status ${res.status}: ${new TextDecoder().decode(res.body as Uint8Array)}`);
}
const early: number[] = [];
for (let i = 0; i < 3000; i++) {
  const t0 = performance.now();
  await one();
  early.push((performance.now() - t0) * 1000);
}
const at = (a: number, b: number) => [...early.slice(a, b)].sort((x, y) => x - y)[(b - a) >> 1]!.toFixed(1);
console.log(`first calls (median µs): 1-10 ${at(0, 10)}, 10-50 ${at(10, 50)}, 50-200 ${at(50, 200)}, 200-500 ${at(200, 500)}, 500-1000 ${at(500, 1000)}, 1000-3000 ${at(1000, 3000)}`);
const per: number[] = [];
for (let b = 0; b < 15; b++) {
  const t0 = performance.now();
  for (let i = 0; i < 1000; i++) await one();
  per.push(((performance.now() - t0) / 1000) * 1000);
}
per.sort((a, b) => a - b);
// Between steps a hop runs onnxruntime over megabytes of weights: caches hold none of this path after it.
const thrash = new Float32Array(8 << 20);
let sink = 0;
const cold: number[] = [];
for (let i = 0; i < 300; i++) {
  for (let j = 0; j < thrash.length; j += 16) sink += thrash[j]!++;
  const t0 = performance.now();
  await one();
  cold.push((performance.now() - t0) * 1000);
}
cold.sort((a, b) => a - b);
console.log(`after sweeping 32 MB between steps: ${cold[150]!.toFixed(1)} µs per step (p90 ${cold[270]!.toFixed(1)}) ${sink > 0 ? '' : ' '}`);
console.log(`middle hop JS per chained step (decode frame → push frame encoded): ${per[7]!.toFixed(1)} µs (min ${per[0]!.toFixed(1)}); ${frames > 0 ? 'frames encoded' : ''}`);
