/**
 * ≥ 10,000 random and mutated frames, envelopes and registrations thrown at
 * a real relay process. The relay must not crash, must answer or close each
 * connection with a reason, and must still serve a good request afterwards.
 */
import fc from 'fast-check';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { WebSocket } from 'ws';
import { encodeCancelFrame, encodeDataFrame, encodeRequestFrame, encodeResponseFrame, hexToBytes } from '../../src/protocol/index.ts';
import { makeKeys, nextJson, RawPeer, registerMessage, RpcSocket } from '../helpers/raw-peer.ts';
import { startRelayProcess, type RelayProcess } from '../helpers/relay-process.ts';

let relay: RelayProcess;
let echo: RawPeer;
beforeAll(async () => {
  relay = await startRelayProcess(['--request-timeout-ms', '2000', '--max-body-bytes', '65536']);
  echo = await RawPeer.connect(relay.url);
});
afterAll(async () => {
  await echo.close();
  const code = await relay.stop();
  expect(code).toBe(0); // it was still alive and shut down cleanly
});

/** mulberry32: a seeded generator, so a failure replays. */
function seeded(seed: number) {
  let a = seed >>> 0;
  const next = () => {
    a = (a + 0x6d2b79f5) >>> 0;
    let t = a;
    t = Math.imul(t ^ (t >>> 15), t | 1);
    t ^= t + Math.imul(t ^ (t >>> 7), t | 61);
    return ((t ^ (t >>> 14)) >>> 0) / 4294967296;
  };
  return { nextInt: (min: number, max: number) => min + Math.floor(next() * (max - min + 1)) };
}
type Rng = ReturnType<typeof seeded>;

/** `minLength` 8 keeps the fixed head whole; shorter frames are connection errors and close the socket. */
function mutate(rng: Rng, bytes: Uint8Array, minLength: number): Uint8Array {
  const out = new Uint8Array(bytes);
  switch (rng.nextInt(0, 4)) {
    case 0: // flip a few bytes
      for (let i = rng.nextInt(1, 4); i > 0; i--) out[rng.nextInt(0, out.length - 1)] = rng.nextInt(0, 255);
      return out;
    case 1: // truncate
      return out.subarray(0, rng.nextInt(Math.min(minLength, out.length), out.length));
    case 2: // garble the meta length
      if (out.length > 26) {
        out[24] = rng.nextInt(0, 255);
        out[25] = rng.nextInt(0, 255);
      }
      return out;
    case 3: // random kind / version
      out[rng.nextInt(0, 1)] = rng.nextInt(0, 8);
      return out;
    default: {
      const tail = new Uint8Array(rng.nextInt(0, 40));
      for (let i = 0; i < tail.length; i++) tail[i] = rng.nextInt(0, 255);
      const j = new Uint8Array(out.length + tail.length);
      j.set(out);
      j.set(tail, out.length);
      return j;
    }
  }
}

async function probe(caller: RawPeer): Promise<number> {
  const r = await caller.request(echo.peerId, { path: '/probe', body: new TextEncoder().encode('probe') });
  return r.status;
}

describe('fuzzing the relay', () => {
  it('survives 6,000 random and mutated binary frames from a registered peer', async () => {
    const rng = seeded(42);
    let caller = await RawPeer.connect(relay.url);
    const target = hexToBytes(echo.peerId);
    let closes = 0;
    for (let batch = 0; batch < 30; batch++) {
      // Every tenth batch may cut frames below the 8-byte head: those must close the socket with a reason.
      const minLength = batch % 10 === 9 ? 0 : 8;
      for (let i = 0; i < 200; i++) {
        const kind = rng.nextInt(0, 5);
        const streamId = 1_000_000 + batch * 1000 + i;
        const base =
          kind === 0
            ? encodeRequestFrame({ streamId, peerId: rng.nextInt(0, 1) ? target : hexToBytes('ab'.repeat(16)), method: 'POST', path: '/forward', headers: { 'x-meshnet-shape': '1,1,4' }, body: new Uint8Array(rng.nextInt(0, 64)) })
            : kind === 1
              ? encodeResponseFrame({ streamId, status: 200, body: new Uint8Array(8) })
              : kind === 2
                ? encodeDataFrame(streamId, new Uint8Array(16), rng.nextInt(0, 1) === 1)
                : kind === 3
                  ? encodeCancelFrame(streamId)
                  : new Uint8Array(Array.from({ length: rng.nextInt(minLength, 40) }, () => rng.nextInt(0, 255)));
        const frame = kind === 4 ? base : mutate(rng, base, minLength);
        if (caller.ws.readyState !== WebSocket.OPEN) break;
        caller.ws.send(frame);
      }
      // After each batch the connection is either still answering, or was closed with a code and a reason.
      await new Promise((r) => setTimeout(r, 20));
      if (caller.ws.readyState === WebSocket.OPEN) {
        expect(await probe(caller)).toBe(200);
      } else {
        await new Promise((r) => setTimeout(r, 20));
        expect(caller.closed).not.toBeNull();
        expect(caller.closed!.code).not.toBe(1006);
        expect(caller.closed!.reason.length).toBeGreaterThan(0);
        closes++;
        caller = await RawPeer.connect(relay.url);
      }
    }
    expect(closes).toBeGreaterThanOrEqual(1);
    expect(closes).toBeLessThanOrEqual(3); // garbage with a readable head is answered on its stream, not by hanging up
    expect(await probe(caller)).toBe(200);
    await caller.close();
  });

  it('answers each of 3,000 random and mutated /rpc messages exactly once', async () => {
    const rpc = await RpcSocket.open(echo.relayAddr);
    let answers = 0;
    rpc.ws.on('message', () => answers++);
    const valid = fc.record({
      request_id: fc.string({ minLength: 1, maxLength: 20 }),
      method: fc.constantFrom('POST', 'GET', 'post'),
      path: fc.constantFrom('/forward', '/health'),
      headers: fc.dictionary(fc.string({ maxLength: 10 }), fc.string({ maxLength: 10 }), { maxKeys: 3 }),
      body_base64: fc.base64String({ maxLength: 40 }),
    });
    const messages = fc.sample(
      fc.oneof(
        valid.map((v) => JSON.stringify(v)),
        valid.map((v) => JSON.stringify({ ...v, path: 42 })),
        valid.map((v) => JSON.stringify({ ...v, body_base64: '!!!' })),
        valid.map((v) => JSON.stringify(v).slice(0, 15)),
        fc.jsonValue().map((j) => JSON.stringify(j)),
        fc.string({ maxLength: 60 }),
      ),
      { numRuns: 3000, seed: 7 },
    );
    // Unique request ids so "exactly once" can be counted; duplicates in flight are refused with 400, also one answer.
    let sent = 0;
    for (const m of messages) {
      rpc.sendRaw(m);
      sent++;
      if (sent % 250 === 0) await new Promise((r) => setTimeout(r, 5));
    }
    const deadline = Date.now() + 15_000;
    while (answers < sent && Date.now() < deadline) await new Promise((r) => setTimeout(r, 20));
    expect(answers).toBe(sent);
    expect(rpc.ws.readyState).toBe(WebSocket.OPEN);
    rpc.close();
  });

  it('closes each of 1,000 connections that register with garbage, with a reason, and registers none', async () => {
    const before = ((await (await fetch(`${relay.httpUrl}/peers`)).json()) as { peers: unknown[] }).peers.length;
    const samples = fc.sample(
      fc.oneof(
        fc.string({ maxLength: 80 }),
        fc.jsonValue().map((j) => JSON.stringify(j)),
        fc.record({ type: fc.constant('register'), public_key: fc.base64String({ maxLength: 60 }), signature: fc.base64String({ maxLength: 100 }), info: fc.object() }).map((j) => JSON.stringify(j)),
      ),
      { numRuns: 1000, seed: 11 },
    );
    const keys = makeKeys();
    let closedWithReason = 0;
    for (let i = 0; i < samples.length; i += 50) {
      await Promise.all(
        samples.slice(i, i + 50).map(async (s, j) => {
          const ws = new WebSocket(`${relay.url}/ws`);
          const challenge = await nextJson(ws);
          const closed = new Promise<[number, string]>((res) => ws.once('close', (c, r) => res([c, r.toString()])));
          // every tenth: a real key signing the wrong nonce
          ws.send(j % 10 === 0 ? JSON.stringify(registerMessage(keys, `${challenge.nonce as string}00`)) : s);
          const [code, reason] = await closed;
          if (code !== 1006 && reason.length > 0) closedWithReason++;
        }),
      );
    }
    expect(closedWithReason).toBe(1000);
    const after = ((await (await fetch(`${relay.httpUrl}/peers`)).json()) as { peers: unknown[] }).peers.length;
    expect(after).toBe(before);
    const h = await fetch(`${relay.httpUrl}/healthz`);
    expect(h.status).toBe(200);
  });
});
