import { getEventListeners } from 'node:events';
import { afterEach, describe, expect, it } from 'vitest';
import {
  FLAG_END,
  FLAG_ERROR,
  FrameKind,
  MeshError,
  decodeBase64,
  decodeFrame,
  encodeDataFrame,
  encodeErrorFrame,
  encodeRequestFrame,
  encodeResponseFrame,
  encodeStreamErrorFrame,
  encodeCancelFrame,
  hexToBytes,
  registrationMessage,
  type Frame,
  type MeshRequest,
  type MeshResponse,
  type ResponseFrame,
} from '../../src/protocol/index.ts';
import { verifyEd25519 } from '../../src/net/identity.ts';
import { RelayClientState, relayWsUrl, type RelayStateEvent } from '../../src/net/relay-client.ts';
import { FakeSocket, NONCE, flush, registeredClient, until, type Harness } from '../helpers/fake-socket.ts';

const utf8 = new TextEncoder();
const utf8d = new TextDecoder();
const SOURCE = hexToBytes('0123456789abcdef0123456789abcdef');
const TARGET = 'fedcba9876543210fedcba9876543210';

const echo = async (req: MeshRequest): Promise<MeshResponse> => ({ status: 200, headers: { 'x-path': req.path, ...req.headers }, body: req.body });

function requestFrame(streamId: number, body: Uint8Array = utf8.encode('hi'), path = '/forward'): Uint8Array {
  return encodeRequestFrame({ streamId, peerId: SOURCE, method: 'POST', path, headers: { 'x-meshnet-shape': '1,1,1' }, body });
}
function framesOn(h: Harness, streamId: number): Frame[] {
  return h.socket.sentFrames().map(decodeFrame).filter((f) => f.streamId === streamId);
}
function errorCode(body: Uint8Array): string {
  return (JSON.parse(utf8d.decode(body)) as { error: { code: string } }).error.code;
}

let harnesses: Harness[] = [];
async function client(init: Parameters<typeof registeredClient>[0] = {}, registered: Record<string, unknown> = {}): Promise<Harness> {
  const h = await registeredClient(init, registered);
  harnesses.push(h);
  return h;
}
afterEach(() => {
  for (const h of harnesses) h.client.close();
  harnesses = [];
});

describe('relayWsUrl', () => {
  it('appends /ws to a bare relay URL and maps http to ws', () => {
    expect(relayWsUrl('ws://r:1')).toBe('ws://r:1/ws');
    expect(relayWsUrl('https://r.example/')).toBe('wss://r.example/ws');
    expect(relayWsUrl('ws://r:1/ws')).toBe('ws://r:1/ws');
    expect(() => relayWsUrl('ftp://r')).toThrow(TypeError);
  });
});

describe('registration', () => {
  it('answers the challenge with its raw public key, a valid signature of meshnet-register:<nonce>, and the fast-path protocol', async () => {
    const h = await client({ info: { model: 'fixture' } });
    expect(h.socket.url).toBe('ws://relay.test/ws');
    expect(h.socket.binaryType).toBe('arraybuffer');
    const reg = h.register as { type: string; public_key: string; signature: string; info: Record<string, unknown> };
    expect(reg.type).toBe('register');
    expect(reg.public_key).not.toMatch(/[+/=]/); // base64url, unpadded
    expect(decodeBase64(reg.public_key)).toEqual(h.identity.publicKey);
    expect(reg.info).toEqual({ model: 'fixture', protocols: ['mesh-frames/1'] });
    expect(await verifyEd25519(h.identity.publicKey, registrationMessage(NONCE), decodeBase64(reg.signature))).toBe(true);
    expect(await verifyEd25519(h.identity.publicKey, registrationMessage('ff' + NONCE.slice(2)), decodeBase64(reg.signature))).toBe(false);
  });

  it('reports registered with the relay_addr the relay gave', async () => {
    const h = await client({ info: { layers: [0, 4] } });
    expect(h.client.state).toBe(RelayClientState.Registered);
    expect(h.client.relayAddr).toBe(`ws://relay.test/rpc/${h.identity.peerId}`);
  });

  it('counts a relay that never registers it as a failed attempt and retries', async () => {
    const states: RelayStateEvent[] = [];
    const h = await client({ registerTimeoutMs: 30, minBackoffMs: 5, maxBackoffMs: 10 });
    h.client.on('state', (e) => states.push(e));
    const before = FakeSocket.instances.length;
    h.socket.drop();
    await until(() => FakeSocket.instances.length > before);
    const s2 = FakeSocket.instances[before]!;
    s2.open(); // opens but never challenges
    await until(() => FakeSocket.instances.length > before + 1);
    expect(s2.closedWith?.reason).toMatch(/not registered within 30 ms/);
    expect(states.map((s) => s.state)).toEqual(['disconnected', 'connecting', 'disconnected', 'connecting']);
  });
});

describe('reconnect backoff', () => {
  it('doubles the delay ceiling per failure up to maxBackoffMs, with full jitter, and resets after registering', async () => {
    const states: RelayStateEvent[] = [];
    const h = await client({ minBackoffMs: 4, maxBackoffMs: 16, random: () => 0.999 });
    h.client.on('state', (e) => states.push(e));
    for (let i = 0; i < 4; i++) {
      const n = FakeSocket.instances.length;
      FakeSocket.instances[n - 1]!.drop();
      await until(() => FakeSocket.instances.length > n);
    }
    const delays = states.filter((s) => s.state === 'disconnected').map((s) => s.retryInMs);
    // first drop follows a registration: attempt 0 → ceiling 4; then 8, 16, capped at 16
    expect(delays).toEqual([3, 7, 15, 15]);
  });

  it('re-registers the same peer id on the new connection', async () => {
    const h = await client({ minBackoffMs: 1, maxBackoffMs: 2 });
    const n = FakeSocket.instances.length;
    h.socket.drop();
    await until(() => FakeSocket.instances.length > n);
    const s2 = FakeSocket.instances[n]!;
    s2.open();
    s2.text({ type: 'challenge', nonce: 'abcdefabcdefabcd' });
    await until(() => s2.sent.length > 0);
    const reg = s2.sentJson()[0]!;
    expect(reg.type).toBe('register');
    expect(decodeBase64(reg.public_key as string)).toEqual(h.identity.publicKey);
    const ready = h.client.ready(1000);
    s2.text({ type: 'registered', peer_id: h.identity.peerId, relay_addr: 'ws://relay.test/rpc/x' });
    expect((await ready).peerId).toBe(h.identity.peerId);
  });
});

describe('bridge: incoming requests', () => {
  it('answers a REQUEST frame with one RESPONSE frame carrying the handler answer bit-exact', async () => {
    const seen: MeshRequest[] = [];
    const h = await client({ handler: async (req) => (seen.push(req), echo(req)) });
    const body = new Uint8Array([0, 255, 1, 128, 7]);
    h.socket.binary(requestFrame(42, body));
    await until(() => h.socket.sent.length === 1);
    expect(seen[0]).toMatchObject({ method: 'POST', path: '/forward', headers: { 'x-meshnet-shape': '1,1,1' } });
    expect(seen[0]!.signal).toBeInstanceOf(AbortSignal);
    const [f] = framesOn(h, 42) as ResponseFrame[];
    expect(f!.kind).toBe(FrameKind.Response);
    expect(f!.flags & FLAG_END).toBe(FLAG_END);
    expect(f!.status).toBe(200);
    expect(f!.headers['x-path']).toBe('/forward');
    expect([...f!.body]).toEqual([...body]);
  });

  it('answers a relay-http-request envelope with relay-http-response, binary as body_base64 and JSON as body', async () => {
    const h = await client({
      handler: async (req): Promise<MeshResponse> =>
        req.path === '/json' ? { status: 201, headers: { 'Content-Type': 'application/json' }, body: utf8.encode('{"ok":true}') } : { status: 200, headers: { 'content-type': 'application/octet-stream' }, body: req.body },
    });
    h.socket.text({ type: 'relay-http-request', request_id: 'a1', method: 'post', path: '/bin', headers: { 'X-Meshnet-Shape': '1,1,2' }, body_base64: 'AAH/gA==' });
    h.socket.text({ type: 'relay-http-request', request_id: 'a2', method: 'GET', path: '/json' });
    await until(() => h.socket.sent.length === 2);
    const byId = Object.fromEntries(h.socket.sentJson().map((m) => [m.request_id, m]));
    expect(byId.a1).toEqual({ type: 'relay-http-response', request_id: 'a1', status: 200, headers: { 'content-type': 'application/octet-stream' }, body_base64: 'AAH/gA==' });
    expect(byId.a2).toEqual({ type: 'relay-http-response', request_id: 'a2', status: 201, headers: { 'content-type': 'application/json' }, body: '{"ok":true}' });
  });

  it('streams an AsyncIterable body as RESPONSE(no END), DATA frames, then an empty DATA with END', async () => {
    const h = await client({
      handler: async () => ({
        status: 200,
        headers: { 'content-type': 'text/event-stream' },
        body: (async function* () {
          yield utf8.encode('a');
          yield utf8.encode('bc');
        })(),
      }),
    });
    h.socket.binary(requestFrame(7));
    await until(() => h.socket.sent.length === 4);
    const fs = framesOn(h, 7);
    expect(fs.map((f) => [f.kind, f.flags & FLAG_END])).toEqual([
      [FrameKind.Response, 0],
      [FrameKind.Data, 0],
      [FrameKind.Data, 0],
      [FrameKind.Data, FLAG_END],
    ]);
    expect(fs.slice(1).map((f) => utf8d.decode((f as { body: Uint8Array }).body))).toEqual(['a', 'bc', '']);
  });

  it('ends a stream that fails midway with a DATA frame flagged END|ERROR carrying the error code', async () => {
    const h = await client({
      handler: async () => ({
        status: 200,
        headers: {},
        body: (async function* () {
          yield utf8.encode('a');
          throw new MeshError('MESH_ERR_NON_FINITE', 'NaN in layer 3');
        })(),
      }),
    });
    h.socket.binary(requestFrame(8));
    await until(() => h.socket.sent.length === 3);
    const last = framesOn(h, 8)[2] as { flags: number; body: Uint8Array };
    expect(last.flags).toBe(FLAG_END | FLAG_ERROR);
    expect(errorCode(last.body)).toBe('MESH_ERR_NON_FINITE');
  });

  it('aborts the handler on CANCEL and sends nothing on that stream afterwards', async () => {
    let signal: AbortSignal | undefined;
    let release!: () => void;
    const h = await client({
      handler: async (req) => {
        signal = req.signal;
        await new Promise<void>((r) => (release = r));
        return echo(req);
      },
    });
    h.socket.binary(requestFrame(9));
    await until(() => signal !== undefined);
    h.socket.binary(encodeCancelFrame(9));
    expect(signal!.aborted).toBe(true);
    expect((signal!.reason as MeshError).code).toBe('MESH_ERR_CANCELLED');
    release();
    await flush();
    await flush();
    expect(h.socket.sent).toHaveLength(0);
    // the stream id is free again
    h.client.setHandler(echo);
    h.socket.binary(requestFrame(9));
    await until(() => h.socket.sent.length === 1);
    expect((framesOn(h, 9)[0] as ResponseFrame).status).toBe(200);
  });

  it('stops pulling a streamed answer when it is cancelled', async () => {
    let pulled = 0;
    let finalized = false;
    const h = await client({
      handler: async () => ({
        status: 200,
        headers: {},
        body: (async function* () {
          try {
            for (;;) {
              pulled++;
              yield utf8.encode('tok');
              await new Promise((r) => setTimeout(r, 2));
            }
          } finally {
            finalized = true;
          }
        })(),
      }),
    });
    h.socket.binary(requestFrame(10));
    await until(() => pulled >= 3);
    h.socket.binary(encodeCancelFrame(10));
    await until(() => finalized);
    const sentAfter = h.socket.sent.length;
    await new Promise((r) => setTimeout(r, 20));
    expect(h.socket.sent.length).toBe(sentAfter);
    expect(framesOn(h, 10).every((f) => (f.flags & FLAG_END) === 0)).toBe(true);
  });

  it('answers 500 MESH_ERR_INTERNAL without leaking the message when the handler throws, and keeps a MeshError status and code', async () => {
    const h = await client({
      handler: async (req) => {
        if (req.path === '/boom') throw new Error('secret stack detail');
        throw new MeshError('MESH_ERR_LAYER_RANGE', 'layer 40 is outside 0..12');
      },
    });
    h.socket.binary(requestFrame(1, undefined, '/boom'));
    h.socket.binary(requestFrame(2, undefined, '/range'));
    h.socket.text({ type: 'relay-http-request', request_id: 'e1', method: 'POST', path: '/boom' });
    await until(() => h.socket.sent.length === 3);
    const r1 = framesOn(h, 1)[0] as ResponseFrame;
    const r2 = framesOn(h, 2)[0] as ResponseFrame;
    expect([r1.status, errorCode(r1.body)]).toEqual([500, 'MESH_ERR_INTERNAL']);
    expect(utf8d.decode(r1.body)).not.toContain('secret');
    expect([r2.status, errorCode(r2.body)]).toEqual([416, 'MESH_ERR_LAYER_RANGE']);
    const env = h.socket.sentJson()[0]!;
    expect(env).toMatchObject({ request_id: 'e1', status: 500, headers: { 'content-type': 'application/json' } });
    expect(JSON.parse(env.body as string).error.code).toBe('MESH_ERR_INTERNAL');
    expect(h.logs.some((l) => l.event === 'handler-error' && l.message.includes('secret stack detail'))).toBe(true);
  });

  it('answers a synchronously throwing handler and a handler returning garbage with 500', async () => {
    const h = await client({
      handler: ((req: MeshRequest) => {
        if (req.path === '/sync') throw new Error('sync');
        return Promise.resolve({ status: 'ok' });
      }) as unknown as (req: MeshRequest) => Promise<MeshResponse>,
    });
    h.socket.binary(requestFrame(1, undefined, '/sync'));
    h.socket.binary(requestFrame(2, undefined, '/garbage'));
    await until(() => h.socket.sent.length === 2);
    expect((framesOn(h, 1)[0] as ResponseFrame).status).toBe(500);
    expect((framesOn(h, 2)[0] as ResponseFrame).status).toBe(500);
  });

  it('answers 500 concurrent requests (frames and envelopes) exactly once each', async () => {
    const h = await client({
      handler: async (req) => {
        await new Promise((r) => setTimeout(r, Math.random() * 20));
        return { status: 200, headers: { 'content-type': 'application/octet-stream' }, body: req.body };
      },
    });
    for (let i = 1; i <= 250; i++) h.socket.binary(requestFrame(i, utf8.encode(`f${i}`)));
    for (let i = 1; i <= 250; i++) h.socket.text({ type: 'relay-http-request', request_id: `r${i}`, method: 'POST', path: '/x', body: `e${i}` });
    expect(h.client.pendingIncoming).toBe(500);
    await until(() => h.socket.sent.length >= 500);
    await new Promise((r) => setTimeout(r, 30));
    expect(h.socket.sent).toHaveLength(500);
    const frames = h.socket.sentFrames().map(decodeFrame) as ResponseFrame[];
    expect(new Set(frames.map((f) => f.streamId)).size).toBe(250);
    for (const f of frames) expect(utf8d.decode(f.body)).toBe(`f${f.streamId}`);
    const envs = h.socket.sentJson();
    expect(new Set(envs.map((e) => e.request_id)).size).toBe(250);
    for (const e of envs) expect(utf8d.decode(decodeBase64(e.body_base64 as string))).toBe(`e${(e.request_id as string).slice(1)}`);
    expect(h.client.pendingIncoming).toBe(0);
  });

  it('answers 400 to a REQUEST frame that cannot be decoded but names a stream, and ignores a frame too short to name one', async () => {
    const h = await client({ handler: echo });
    const bad = requestFrame(77);
    bad[26] = 99; // unknown method code
    h.socket.binary(bad);
    h.socket.binary(new Uint8Array([1, 1, 0]));
    await until(() => h.socket.sent.length === 1);
    const r = framesOn(h, 77)[0] as ResponseFrame;
    expect([r.status, errorCode(r.body)]).toEqual([400, 'MESH_ERR_BAD_FRAME']);
    expect(h.logs.some((l) => l.event === 'ignored' && /shorter than a frame head/.test(l.message))).toBe(true);
  });

  it('answers 400 to an envelope that fails validation when its request_id is readable', async () => {
    const h = await client({ handler: echo });
    h.socket.text({ type: 'relay-http-request', request_id: 'm1', method: 'POST' });
    h.socket.text({ type: 'relay-http-request', request_id: 'm2', method: 'POST', path: '/x', body_base64: '!!!' });
    h.socket.text({ type: 'relay-http-request', method: 'POST', path: '/x' });
    h.socket.text('{not json');
    await until(() => h.socket.sent.length === 2);
    await flush();
    expect(h.socket.sentJson().map((m) => [m.request_id, m.status])).toEqual([
      ['m1', 400],
      ['m2', 400],
    ]);
    expect(h.logs.filter((l) => l.event === 'ignored').map((l) => l.message)).toEqual(expect.arrayContaining([expect.stringMatching(/without a readable request_id/), expect.stringMatching(/not JSON/)]));
  });

  it('answers 429 beyond maxConcurrentRequests', async () => {
    let release!: () => void;
    const gate = new Promise<void>((r) => (release = r));
    const h = await client({ maxConcurrentRequests: 2, handler: async (req) => (await gate, echo(req)) });
    for (let i = 1; i <= 3; i++) h.socket.binary(requestFrame(i));
    await until(() => h.socket.sent.length === 1);
    expect((framesOn(h, 3)[0] as ResponseFrame).status).toBe(429);
    release();
    await until(() => h.socket.sent.length === 3);
  });

  it('answers 504 and aborts a handler that runs past handlerTimeoutMs, then frees the stream id', async () => {
    let signal: AbortSignal | undefined;
    const h = await client({ handlerTimeoutMs: 20, handler: (req) => ((signal = req.signal), new Promise<MeshResponse>(() => {})) });
    h.socket.binary(requestFrame(5));
    await until(() => h.socket.sent.length === 1);
    expect((framesOn(h, 5)[0] as ResponseFrame).status).toBe(504);
    expect(signal!.aborted).toBe(true);
    h.client.setHandler(echo);
    h.socket.binary(requestFrame(5));
    await until(() => h.socket.sent.length === 2);
    expect((framesOn(h, 5)[1] as ResponseFrame).status).toBe(200);
  });

  it('times out each never-answering handler on its own deadline while the others answer (one sweep timer for all)', async () => {
    const signals = new Map<string, AbortSignal>();
    const h = await client({
      handlerTimeoutMs: 60,
      handler: (req) => {
        signals.set(req.path, req.signal!);
        return req.path.startsWith('/hang') ? new Promise<MeshResponse>(() => {}) : echo(req);
      },
    });
    const t0 = Date.now();
    h.socket.binary(requestFrame(1, utf8.encode('a'), '/hang-a'));
    for (let i = 10; i < 20; i++) h.socket.binary(requestFrame(i, utf8.encode(String(i)), '/ok'));
    await new Promise((r) => setTimeout(r, 35));
    h.socket.binary(requestFrame(2, utf8.encode('b'), '/hang-b'));
    await until(() => framesOn(h, 1).length === 1);
    const aAt = Date.now() - t0;
    expect(aAt).toBeGreaterThanOrEqual(55);
    expect((framesOn(h, 1)[0] as ResponseFrame).status).toBe(504);
    expect(errorCode((framesOn(h, 1)[0] as ResponseFrame).body)).toBe('MESH_ERR_TIMEOUT');
    expect(signals.get('/hang-a')!.aborted).toBe(true);
    // b came 35 ms later: it still has its own 60 ms.
    expect(framesOn(h, 2)).toHaveLength(0);
    expect(signals.get('/hang-b')!.aborted).toBe(false);
    await until(() => framesOn(h, 2).length === 1);
    expect(Date.now() - t0).toBeGreaterThanOrEqual(35 + 55);
    expect((framesOn(h, 2)[0] as ResponseFrame).status).toBe(504);
    for (let i = 10; i < 20; i++) expect(framesOn(h, i).map((f) => (f as ResponseFrame).status)).toEqual([200]);
    expect(h.client.pendingIncoming).toBe(0);
  });

  it('aborts running handlers when the connection drops, and sends nothing on the old socket', async () => {
    let signal: AbortSignal | undefined;
    const h = await client({ minBackoffMs: 1000, maxBackoffMs: 1000, handler: (req) => ((signal = req.signal), new Promise<MeshResponse>(() => {})) });
    h.socket.binary(requestFrame(5));
    await until(() => signal !== undefined);
    h.socket.drop();
    expect(signal!.aborted).toBe(true);
    expect(h.client.state).toBe(RelayClientState.Disconnected);
  });
});

describe('outgoing requests', () => {
  function lastRequest(h: Harness) {
    const f = decodeFrame(h.socket.sentFrames().at(-1)!);
    if (f.kind !== FrameKind.Request) throw new Error('not a request');
    return f;
  }

  it('sends a REQUEST frame to the target peer id and resolves with the RESPONSE as a zero-copy view', async () => {
    const h = await client();
    const p = h.client.request(TARGET, { method: 'POST', path: '/forward', headers: { 'X-Meshnet-Shape': '1,1,2' }, body: new Uint8Array([1, 2]) });
    const req = lastRequest(h);
    expect([...req.peerId]).toEqual([...hexToBytes(TARGET)]);
    expect(req).toMatchObject({ method: 'POST', path: '/forward', headers: { 'x-meshnet-shape': '1,1,2' } });
    h.socket.binary(encodeResponseFrame({ streamId: req.streamId, status: 200, headers: { 'x-meshnet-shape': '1,1,2' }, body: new Uint8Array([3, 4]) }));
    const reply = await p;
    expect(reply.status).toBe(200);
    expect([...reply.body]).toEqual([3, 4]);
    expect(reply.body.byteOffset).toBeGreaterThan(0); // a view into the received frame
    expect(h.client.pendingOutgoing).toBe(0);
  });

  it('keeps many requests in flight on one connection and matches out-of-order answers by stream id', async () => {
    const h = await client();
    const ps = Array.from({ length: 50 }, (_, i) => h.client.request(TARGET, { method: 'POST', path: `/${i}` }));
    const reqs = h.socket.sentFrames().map(decodeFrame) as Array<Extract<Frame, { kind: 1 }>>;
    expect(new Set(reqs.map((r) => r.streamId)).size).toBe(50);
    for (const r of [...reqs].reverse()) h.socket.binary(encodeResponseFrame({ streamId: r.streamId, status: 200, body: utf8.encode(r.path) }));
    const replies = await Promise.all(ps);
    expect(replies.map((r) => utf8d.decode(r.body))).toEqual(Array.from({ length: 50 }, (_, i) => `/${i}`));
  });

  it('collects a streamed answer into one body', async () => {
    const h = await client();
    const p = h.client.request(TARGET, { method: 'GET', path: '/s' });
    const { streamId } = lastRequest(h);
    h.socket.binary(encodeResponseFrame({ streamId, status: 200, body: utf8.encode('a'), end: false }));
    h.socket.binary(encodeDataFrame(streamId, utf8.encode('bc'), false));
    h.socket.binary(encodeDataFrame(streamId, utf8.encode('d'), true));
    expect(utf8d.decode((await p).body)).toBe('abcd');
  });

  it('requestStream gives the head, then chunks as they arrive; leaving early sends CANCEL', async () => {
    const h = await client();
    const p = h.client.requestStream(TARGET, { method: 'GET', path: '/s' });
    const { streamId } = lastRequest(h);
    h.socket.binary(encodeResponseFrame({ streamId, status: 206, headers: { 'content-type': 'text/plain' }, end: false }));
    const reply = await p;
    expect(reply.status).toBe(206);
    const it = reply.body[Symbol.asyncIterator]();
    const first = it.next();
    h.socket.binary(encodeDataFrame(streamId, utf8.encode('x'), false));
    expect(utf8d.decode((await first).value as Uint8Array)).toBe('x');
    h.socket.binary(encodeDataFrame(streamId, utf8.encode('y'), false));
    h.socket.binary(encodeDataFrame(streamId, utf8.encode('z'), false));
    const got: string[] = [];
    for await (const c of reply.body) {
      got.push(utf8d.decode(c));
      if (got.length === 2) break;
    }
    expect(got).toEqual(['y', 'z']);
    const cancel = decodeFrame(h.socket.sentFrames().at(-1)!);
    expect([cancel.kind, cancel.streamId]).toEqual([FrameKind.Cancel, streamId]);
    expect(h.client.pendingOutgoing).toBe(0);
  });

  it('requestStream ends normally on END and throws the remote error code on an END|ERROR frame', async () => {
    const h = await client();
    const p1 = h.client.requestStream(TARGET, { method: 'GET', path: '/ok' });
    const s1 = lastRequest(h).streamId;
    const p2 = h.client.requestStream(TARGET, { method: 'GET', path: '/bad' });
    const s2 = lastRequest(h).streamId;
    h.socket.binary(encodeResponseFrame({ streamId: s1, status: 200, end: false }));
    h.socket.binary(encodeDataFrame(s1, utf8.encode('1'), false));
    h.socket.binary(encodeDataFrame(s1, new Uint8Array(0), true));
    h.socket.binary(encodeResponseFrame({ streamId: s2, status: 200, end: false }));
    h.socket.binary(encodeStreamErrorFrame(s2, new MeshError('MESH_ERR_NON_FINITE', 'NaN')));
    const chunks: string[] = [];
    for await (const c of (await p1).body) chunks.push(utf8d.decode(c));
    expect(chunks).toEqual(['1']);
    const r2 = await p2;
    await expect(r2.body.next()).rejects.toMatchObject({ code: 'MESH_ERR_NON_FINITE' });
  });

  it('returns relay error answers (404, 503, 413 …) as replies with their status, not as throws', async () => {
    const h = await client();
    for (const [code, status] of [
      ['MESH_ERR_NO_SUCH_PEER', 404],
      ['MESH_ERR_BACKPRESSURE', 503],
      ['MESH_ERR_TOO_LARGE', 413],
      ['MESH_ERR_TIMEOUT', 504],
      ['MESH_ERR_PEER_GONE', 502],
    ] as const) {
      const p = h.client.request(TARGET, { method: 'POST', path: '/forward' });
      h.socket.binary(encodeErrorFrame(lastRequest(h).streamId, new MeshError(code, 'x')));
      const r = await p;
      expect([r.status, errorCode(r.body)]).toEqual([status, code]);
    }
  });

  it('rejects with MESH_ERR_TIMEOUT and sends CANCEL when no answer frame comes in time', async () => {
    const h = await client();
    const t0 = Date.now();
    const p = h.client.request(TARGET, { method: 'POST', path: '/slow' }, { timeoutMs: 30 });
    const { streamId } = lastRequest(h);
    await expect(p).rejects.toMatchObject({ name: 'MeshError', code: 'MESH_ERR_TIMEOUT' });
    expect(Date.now() - t0).toBeGreaterThanOrEqual(25);
    const cancel = decodeFrame(h.socket.sentFrames().at(-1)!);
    expect([cancel.kind, cancel.streamId]).toEqual([FrameKind.Cancel, streamId]);
    // a late answer is ignored, not delivered to anyone
    h.socket.binary(encodeResponseFrame({ streamId, status: 200 }));
    expect(h.logs.some((l) => l.event === 'ignored' && l.streamId === streamId)).toBe(true);
  });

  it('times out the one request whose answer never comes, among many answered ones', async () => {
    const h = await client();
    const ps: Array<Promise<unknown>> = [];
    const ids: number[] = [];
    for (let i = 0; i < 20; i++) {
      ps.push(h.client.request(TARGET, { method: 'POST', path: '/x' }, { timeoutMs: 50 }));
      ids.push(lastRequest(h).streamId);
    }
    for (const id of ids.slice(0, 19)) h.socket.binary(encodeResponseFrame({ streamId: id, status: 200 }));
    const results = await Promise.allSettled(ps);
    expect(results.slice(0, 19).every((r) => r.status === 'fulfilled')).toBe(true);
    expect(results[19]).toMatchObject({ status: 'rejected', reason: { code: 'MESH_ERR_TIMEOUT' } });
    const cancel = decodeFrame(h.socket.sentFrames().at(-1)!);
    expect([cancel.kind, cancel.streamId]).toEqual([FrameKind.Cancel, ids[19]]);
    expect(h.client.pendingOutgoing).toBe(0);
  });

  it('a short timeout sent after long ones still fires on time, and the long ones keep waiting', async () => {
    const h = await client();
    const long = h.client.request(TARGET, { method: 'POST', path: '/long' }, { timeoutMs: 10_000 });
    const longId = lastRequest(h).streamId;
    const none = h.client.request(TARGET, { method: 'POST', path: '/forever' }, { timeoutMs: 0 });
    const noneId = lastRequest(h).streamId;
    const t0 = Date.now();
    await expect(h.client.request(TARGET, { method: 'POST', path: '/short' }, { timeoutMs: 30 })).rejects.toMatchObject({ code: 'MESH_ERR_TIMEOUT' });
    const took = Date.now() - t0;
    expect(took).toBeGreaterThanOrEqual(25);
    expect(took).toBeLessThan(1000);
    expect(h.client.pendingOutgoing).toBe(2);
    h.socket.binary(encodeResponseFrame({ streamId: longId, status: 200 }));
    h.socket.binary(encodeResponseFrame({ streamId: noneId, status: 201 }));
    expect((await long).status).toBe(200);
    expect((await none).status).toBe(201);
  });

  it('holds no timer once nothing is pending (an idle client keeps no process alive)', async () => {
    const h = await client({ handlerTimeoutMs: 1000 });
    const conn = () => (h.client as unknown as { mux: { sweepTimer: unknown } }).mux;
    const p = h.client.request(TARGET, { method: 'POST', path: '/x' }, { timeoutMs: 1000 });
    expect(conn().sweepTimer).toBeDefined();
    h.socket.binary(encodeResponseFrame({ streamId: lastRequest(h).streamId, status: 200 }));
    await p;
    expect(conn().sweepTimer).toBeUndefined();
    h.client.setHandler(echo);
    h.socket.binary(requestFrame(3));
    await until(() => framesOn(h, 3).length === 1);
    await flush();
    expect(conn().sweepTimer).toBeUndefined();
  });

  it('treats the timeout as an idle timeout on streamed answers', async () => {
    const h = await client();
    const p = h.client.request(TARGET, { method: 'GET', path: '/s' }, { timeoutMs: 40 });
    const { streamId } = lastRequest(h);
    h.socket.binary(encodeResponseFrame({ streamId, status: 200, end: false }));
    for (let i = 0; i < 4; i++) {
      await new Promise((r) => setTimeout(r, 20));
      h.socket.binary(encodeDataFrame(streamId, utf8.encode(String(i)), false));
    }
    h.socket.binary(encodeDataFrame(streamId, new Uint8Array(0), true));
    expect(utf8d.decode((await p).body)).toBe('0123');
  });

  it('rejects with MESH_ERR_CANCELLED and sends CANCEL when the signal aborts', async () => {
    const h = await client();
    const ac = new AbortController();
    const p = h.client.request(TARGET, { method: 'POST', path: '/x' }, { signal: ac.signal });
    const { streamId } = lastRequest(h);
    ac.abort('user');
    await expect(p).rejects.toMatchObject({ code: 'MESH_ERR_CANCELLED' });
    const cancel = decodeFrame(h.socket.sentFrames().at(-1)!);
    expect([cancel.kind, cancel.streamId]).toEqual([FrameKind.Cancel, streamId]);
    await expect(h.client.request(TARGET, { method: 'POST', path: '/x' }, { signal: ac.signal })).rejects.toMatchObject({ code: 'MESH_ERR_CANCELLED' });
  });

  it('rejects every pending request with MESH_ERR_PEER_GONE when the connection drops', async () => {
    const h = await client({ minBackoffMs: 1000, maxBackoffMs: 1000 });
    const ps = Array.from({ length: 20 }, () => h.client.request(TARGET, { method: 'POST', path: '/x' }));
    const streaming = h.client.requestStream(TARGET, { method: 'GET', path: '/s' });
    const sid = lastRequest(h).streamId;
    h.socket.binary(encodeResponseFrame({ streamId: sid, status: 200, end: false }));
    const reply = await streaming;
    const pendingChunk = reply.body.next();
    h.socket.drop();
    const results = await Promise.allSettled([...ps, pendingChunk]);
    for (const r of results) {
      expect(r.status).toBe('rejected');
      expect((r as PromiseRejectedResult).reason).toMatchObject({ name: 'MeshError', code: 'MESH_ERR_PEER_GONE' });
    }
    await expect(h.client.request(TARGET, { method: 'POST', path: '/x' })).rejects.toMatchObject({ code: 'MESH_ERR_UNAVAILABLE' });
  });

  it('rejects a malformed peer id without sending', async () => {
    const h = await client();
    await expect(h.client.request('not-a-peer', { method: 'GET', path: '/' })).rejects.toMatchObject({ code: 'MESH_ERR_BAD_REQUEST' });
    expect(h.socket.sent).toHaveLength(0);
  });

  it('waits while bufferedAmount is over the high-water mark and sends once it drains', async () => {
    const h = await client({ highWaterBytes: 1000 });
    h.socket.bufferedAmount = 5000;
    const p = h.client.request(TARGET, { method: 'POST', path: '/x' });
    await new Promise((r) => setTimeout(r, 15));
    expect(h.socket.sent).toHaveLength(0);
    h.socket.bufferedAmount = 0;
    await until(() => h.socket.sent.length === 1);
    h.socket.binary(encodeResponseFrame({ streamId: lastRequest(h).streamId, status: 200 }));
    expect((await p).status).toBe(200);
  });

  it('fails a send with MESH_ERR_BACKPRESSURE after maxSendWaitMs instead of buffering without bound', async () => {
    const h = await client({ highWaterBytes: 1000, maxSendWaitMs: 30 });
    h.socket.bufferedAmount = 5000;
    await expect(h.client.request(TARGET, { method: 'POST', path: '/x' })).rejects.toMatchObject({ code: 'MESH_ERR_BACKPRESSURE' });
    expect(h.socket.sent).toHaveLength(0);
    expect(h.client.pendingOutgoing).toBe(0);
  });

  it('holds a streamed answer while the socket is over the high-water mark', async () => {
    let yielded = 0;
    const h = await client({
      highWaterBytes: 1000,
      handler: async () => ({
        status: 200,
        headers: {},
        body: (async function* () {
          for (let i = 0; i < 5; i++) {
            yielded++;
            yield new Uint8Array(10);
            await new Promise((r) => setTimeout(r, 3));
          }
        })(),
      }),
    });
    h.socket.binary(requestFrame(3));
    await until(() => h.socket.sent.length >= 2);
    h.socket.bufferedAmount = 5000;
    const yieldedBefore = yielded;
    const sent = h.socket.sent.length;
    await new Promise((r) => setTimeout(r, 20));
    expect(h.socket.sent.length).toBeLessThanOrEqual(sent + 1);
    expect(yielded).toBeLessThanOrEqual(yieldedBefore + 1);
    h.socket.bufferedAmount = 0;
    await until(() => h.socket.sent.length === 7);
    expect(framesOn(h, 3).at(-1)!.flags & FLAG_END).toBe(FLAG_END);
  });
});

describe('one-way pushes', () => {
  it('a push holds no abort listener on the caller\'s signal for its window (a generation pushes ~100 steps a second); a two-way request does until answered', async () => {
    const h = await client({ handler: echo }, { features: ['one-way'] });
    const ac = new AbortController();
    const p = h.client.push(TARGET, { method: 'POST', path: '/forward' }, { timeoutMs: 20, signal: ac.signal })!;
    expect(getEventListeners(ac.signal, 'abort')).toHaveLength(0);
    const r = h.client.request(TARGET, { method: 'POST', path: '/forward' }, { timeoutMs: 1000, signal: ac.signal });
    expect(getEventListeners(ac.signal, 'abort')).toHaveLength(1);
    ac.abort();
    await expect(r).rejects.toMatchObject({ code: 'MESH_ERR_CANCELLED' });
    expect((await p).status).toBe(202);
  });
});

