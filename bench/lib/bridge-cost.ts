/**
 * The bridge's own cost per request: a FrameMux over an in-memory socket (no
 * network, no relay), a handler that answers at once, and the time from a
 * REQUEST frame's arrival to its RESPONSE frame's send. Host-free
 * (performance only), so the same code is timed in Node.js and in Chromium
 * (bench/browser-node.ts bundles it for the page).
 */
import { encodeRequestFrame } from '../../src/protocol/frames.ts';
import { FrameMux } from '../../src/net/frame-mux.ts';
import { resolveRelayClientOptions } from '../../src/net/relay-options.ts';
import type { WebSocketLike } from '../../src/net/socket.ts';

export interface BridgeCost {
  requests: number;
  bodyBytes: number;
  p50Ms: number;
  p90Ms: number;
  meanMs: number;
}

export async function measureBridgeCost(requests: number, bodyBytes: number): Promise<BridgeCost> {
  let onSent: ((data: string | Uint8Array) => void) | undefined;
  const socket: WebSocketLike = {
    binaryType: 'arraybuffer',
    readyState: 1,
    bufferedAmount: 0,
    onopen: null,
    onmessage: null,
    onclose: null,
    onerror: null,
    send: (data: string | Uint8Array) => onSent?.(data),
    close() {},
  };
  const answer = new Uint8Array(bodyBytes).fill(7);
  const mux = new FrameMux(socket, {
    options: resolveRelayClientOptions({}),
    handler: async () => ({ status: 200, headers: { 'content-type': 'application/octet-stream', 'x-meshnet-shape': `1,1,${bodyBytes / 2}`, 'x-meshnet-dtype': 'bf16' }, body: answer }),
  });
  const source = new Uint8Array(16).fill(0xab);
  const body = new Uint8Array(bodyBytes).fill(3);
  const headers = { 'x-meshnet-shape': `1,1,${bodyBytes / 2}`, 'x-meshnet-dtype': 'bf16', 'x-meshnet-session': 'bench', 'x-meshnet-position': '0' };
  const warmup = Math.min(200, requests);
  const times: number[] = [];
  for (let i = 0; i < requests + warmup; i++) {
    // A fresh ArrayBuffer per message, as a socket delivers it.
    const frame = encodeRequestFrame({ streamId: i + 1, peerId: source, method: 'POST', path: '/forward', headers, body }).buffer;
    const sent = new Promise<void>((resolve) => (onSent = () => resolve()));
    const t0 = performance.now();
    socket.onmessage?.({ data: frame });
    await sent;
    if (i >= warmup) times.push(performance.now() - t0);
  }
  mux.close('done');
  times.sort((a, b) => a - b);
  return { requests, bodyBytes, p50Ms: times[Math.floor(times.length * 0.5)]!, p90Ms: times[Math.floor(times.length * 0.9)]!, meanMs: times.reduce((a, b) => a + b, 0) / times.length };
}
