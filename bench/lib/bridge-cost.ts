/**
 * The relay bridge's own cost per request: a RelayClient over an in-memory
 * socket (no network, no relay), a handler that answers at once, and the
 * time from a REQUEST frame's arrival to its RESPONSE frame's send. Host-free
 * (crypto.subtle, performance), so the same code is timed in Node.js and in
 * Chromium (bench/browser-node.ts bundles it for the page).
 */
import { encodeRequestFrame } from '../../src/protocol/frames.ts';
import { Identity, MemoryKeyStore } from '../../src/node/identity.ts';
import { RelayClient } from '../../src/node/relay-client.ts';
import type { SocketCloseEvent, SocketMessageEvent, WebSocketLike } from '../../src/node/socket.ts';

export interface BridgeCost {
  requests: number;
  bodyBytes: number;
  p50Ms: number;
  p90Ms: number;
  meanMs: number;
}

export async function measureBridgeCost(requests: number, bodyBytes: number): Promise<BridgeCost> {
  let onSent: ((data: string | Uint8Array) => void) | undefined;
  const sockets: FakeSocket[] = [];
  class FakeSocket implements WebSocketLike {
    binaryType = 'arraybuffer';
    readyState = 0;
    bufferedAmount = 0;
    onopen: ((ev: unknown) => void) | null = null;
    onmessage: ((ev: SocketMessageEvent) => void) | null = null;
    onclose: ((ev: SocketCloseEvent) => void) | null = null;
    onerror: ((ev: unknown) => void) | null = null;
    constructor(_url: string) {
      sockets.push(this);
      setTimeout(() => {
        this.readyState = 1;
        this.onopen?.({});
        this.onmessage?.({ data: JSON.stringify({ type: 'challenge', nonce: '00112233445566778899aabbccddeeff' }) });
      }, 0);
    }
    send(data: string | Uint8Array): void {
      if (typeof data === 'string' && data.includes('"register"')) {
        setTimeout(() => this.onmessage?.({ data: JSON.stringify({ type: 'registered', peer_id: identity.peerId, relay_addr: 'ws://fake/rpc/x' }) }), 0);
        return;
      }
      onSent?.(data);
    }
    close(): void {
      this.readyState = 3;
    }
  }
  const identity = await Identity.loadOrCreate(new MemoryKeyStore());
  const answer = new Uint8Array(bodyBytes).fill(7);
  const client = new RelayClient({
    relayUrl: 'ws://fake',
    WebSocket: FakeSocket,
    identity,
    handler: async () => ({ status: 200, headers: { 'content-type': 'application/octet-stream', 'x-meshnet-shape': `1,1,${bodyBytes / 2}`, 'x-meshnet-dtype': 'bf16' }, body: answer }),
  });
  client.start();
  await client.ready(5000);
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
    sockets[0]!.onmessage?.({ data: frame });
    await sent;
    if (i >= warmup) times.push(performance.now() - t0);
  }
  client.close();
  times.sort((a, b) => a - b);
  return { requests, bodyBytes, p50Ms: times[Math.floor(times.length * 0.5)]!, p90Ms: times[Math.floor(times.length * 0.9)]!, meanMs: times.reduce((a, b) => a + b, 0) / times.length };
}
