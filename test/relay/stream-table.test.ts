/**
 * The relay's routing without sockets: the stream table driven with
 * in-memory peer sockets and a clock of the test's own (the wire contract
 * end to end is relay.test.ts, against a real relay process).
 */
import { describe, expect, it } from 'vitest';
import pino from 'pino';
import { createRelayMetrics } from '../../src/relay/metrics.ts';
import { RELAY_DEFAULTS } from '../../src/relay/options.ts';
import { ADDRESSED_FRAME, FAST_PATH_PROTOCOL, ONE_WAY_WINDOW_MS, PeerConn, RpcCaller, StreamTable, type LinkPipe, type PeerSocket, type TableFederation } from '../../src/relay/stream-table.ts';
import {
  FLAG_CALLER_GONE,
  FLAG_END,
  FLAG_ERROR,
  FLAG_ONE_WAY,
  FrameKind,
  decodeFrame,
  encodeCancelFrame,
  encodeDataFrame,
  encodeRequestFrame,
  encodeResponseFrame,
  hexToBytes,
  type DataFrame,
  type Frame,
  type ResponseFrame,
} from '../../src/protocol/index.ts';

const utf8 = new TextEncoder();
const utf8d = new TextDecoder();

class MemorySocket implements PeerSocket {
  isOpen = true;
  bufferedAmount = 0;
  readonly sent: Array<Uint8Array | string> = [];
  closedWith: { code: number; reason: string } | undefined;
  send(data: Uint8Array | string): void {
    // The table may reuse the buffer it forwards: keep what was sent at the time.
    this.sent.push(typeof data === 'string' ? data : new Uint8Array(data));
  }
  close(code: number, reason: string): void {
    this.closedWith = { code, reason };
    this.isOpen = false;
  }
  frames(): Frame[] {
    return this.sent.filter((d): d is Uint8Array => typeof d !== 'string').map(decodeFrame);
  }
  json(): Array<Record<string, unknown>> {
    return this.sent.filter((d): d is string => typeof d === 'string').map((d) => JSON.parse(d) as Record<string, unknown>);
  }
}

function id(n: number): string {
  return n.toString(16).padStart(32, '0');
}

function setup(options: Partial<typeof RELAY_DEFAULTS> = {}) {
  let now = 1000;
  const metrics = createRelayMetrics();
  const table = new StreamTable({ options: { ...RELAY_DEFAULTS, ...options }, metrics, logger: pino({ level: 'silent' }), now: () => now });
  const peer = (n: number, fast = true): { conn: PeerConn; socket: MemorySocket } => {
    const socket = new MemorySocket();
    const conn = table.addPeer(socket, id(n), fast ? { protocols: [FAST_PATH_PROTOCOL] } : {});
    if (!('id' in conn)) throw new Error(conn.reason);
    return { conn, socket };
  };
  return { table, peer, metrics, advance: (ms: number) => (now += ms) };
}

/** A link to another relay of a cluster, in memory: addressed sends are recorded with their target. */
function memoryLink(relayId = 'r2'): { conn: PeerConn; socket: MemorySocket; addressed: Array<{ target: string; frame: Uint8Array }> } {
  const socket = new MemorySocket();
  const addressed: Array<{ target: string; frame: Uint8Array }> = [];
  const pipe: LinkPipe = { relayId, sendAddressed: (target, frame) => addressed.push({ target, frame: new Uint8Array(frame) }) };
  return { conn: new PeerConn(socket, `relay:${relayId}`, new Uint8Array(16), {}, true, pipe), socket, addressed };
}

/** What a trunk carries for a peer over there: 0xF1 · peer id · frame. */
function addressedFrame(target: number, frame: Uint8Array): Uint8Array {
  const out = new Uint8Array(17 + frame.byteLength);
  out[0] = ADDRESSED_FRAME;
  out.set(hexToBytes(id(target)), 1);
  out.set(frame, 17);
  return out;
}

function request(streamId: number, target: number, body = 'ping'): Uint8Array {
  return encodeRequestFrame({ streamId, peerId: hexToBytes(id(target)), method: 'POST', path: '/forward', headers: { 'x-meshnet-shape': '1,1,2' }, body: utf8.encode(body) });
}

/** The error code in an error RESPONSE's body, or in a DATA|END|ERROR frame's. */
function errorCode(f: Frame): string {
  return (JSON.parse(utf8d.decode((f as ResponseFrame | DataFrame).body)) as { error: { code: string } }).error.code;
}

describe('StreamTable', () => {
  it('forwards a REQUEST with source and stream id rewritten in place, and the answer back under the caller\'s id', () => {
    const { table, peer } = setup();
    const a = peer(1);
    const b = peer(2);
    const frame = request(77, 2);
    table.onBinary(a.conn, frame);
    expect(b.socket.sent[0]).toEqual(frame); // the very bytes, rewritten where they lay
    const got = decodeFrame(b.socket.sent[0] as Uint8Array);
    expect(got).toMatchObject({ kind: FrameKind.Request, peerId: hexToBytes(id(1)), path: '/forward' });
    expect(got.streamId).not.toBe(77);
    expect(table.inFlight).toBe(1);
    table.onBinary(b.conn, encodeResponseFrame({ streamId: got.streamId, status: 200, headers: {}, body: utf8.encode('pong') }));
    const answer = a.socket.frames()[0] as ResponseFrame;
    expect([answer.kind, answer.streamId, answer.status, utf8d.decode(answer.body)]).toEqual([FrameKind.Response, 77, 200, 'pong']);
    expect(table.inFlight).toBe(0);
  });

  it('gives two callers using one stream id their own relay ids and their own answers', () => {
    const { table, peer } = setup();
    const [a, c, b] = [peer(1), peer(3), peer(2)];
    table.onBinary(a.conn, request(5, 2, 'from a'));
    table.onBinary(c.conn, request(5, 2, 'from c'));
    const [fa, fc] = b.socket.frames();
    expect(fa!.streamId).not.toBe(fc!.streamId);
    // Answer c's first.
    table.onBinary(b.conn, encodeResponseFrame({ streamId: fc!.streamId, status: 200, headers: {}, body: utf8.encode('to c') }));
    table.onBinary(b.conn, encodeResponseFrame({ streamId: fa!.streamId, status: 200, headers: {}, body: utf8.encode('to a') }));
    expect(utf8d.decode((a.socket.frames()[0] as ResponseFrame).body)).toBe('to a');
    expect(utf8d.decode((c.socket.frames()[0] as ResponseFrame).body)).toBe('to c');
  });

  it('keeps a streamed answer open until END, and drops frames for streams it no longer knows', () => {
    const { table, peer } = setup();
    const [a, b] = [peer(1), peer(2)];
    table.onBinary(a.conn, request(9, 2));
    const sid = b.socket.frames()[0]!.streamId;
    table.onBinary(b.conn, encodeResponseFrame({ streamId: sid, status: 200, headers: {}, end: false }));
    table.onBinary(b.conn, encodeDataFrame(sid, utf8.encode('1'), false));
    expect(table.inFlight).toBe(1);
    table.onBinary(b.conn, encodeDataFrame(sid, new Uint8Array(0), true));
    table.onBinary(b.conn, encodeDataFrame(sid, utf8.encode('late'), true));
    expect(a.socket.frames().map((f) => [f.kind, f.streamId, f.flags & FLAG_END])).toEqual([
      [FrameKind.Response, 9, 0],
      [FrameKind.Data, 9, 0],
      [FrameKind.Data, 9, FLAG_END],
    ]);
    expect(table.inFlight).toBe(0);
  });

  it('answers 404 for an unknown target, 413 over the body limit, 503 at the in-flight limit and over the high-water mark', () => {
    const { table, peer } = setup({ maxBodyBytes: 8, maxInFlightPerPeer: 1, highWaterBytes: 100 });
    const [a, b] = [peer(1), peer(2)];
    table.onBinary(a.conn, request(1, 9));
    table.onBinary(a.conn, request(2, 2, 'more than eight bytes'));
    table.onBinary(a.conn, request(3, 2));
    table.onBinary(a.conn, request(4, 2));
    b.socket.bufferedAmount = 101;
    const c = peer(3);
    table.onBinary(c.conn, request(1, 1));
    a.socket.bufferedAmount = 101;
    table.onBinary(c.conn, request(2, 1));
    const answers = a.socket.frames().filter((f) => f.kind === FrameKind.Response);
    expect(answers.map((f) => [f.streamId, (f as ResponseFrame).status, errorCode(f)])).toEqual([
      [1, 404, 'MESH_ERR_NO_SUCH_PEER'],
      [2, 413, 'MESH_ERR_TOO_LARGE'],
      [4, 503, 'MESH_ERR_BACKPRESSURE'],
    ]);
    // c's first request reached a (under its mark then); the second found a over it.
    expect(a.socket.frames().filter((f) => f.kind === FrameKind.Request)).toHaveLength(1);
    expect([c.socket.frames()[0]!.streamId, errorCode(c.socket.frames()[0]!)]).toEqual([2, 'MESH_ERR_BACKPRESSURE']);
    expect(b.socket.frames()).toHaveLength(1);
  });

  it('answers 504 past the request timeout, sends the target CANCEL, and drops its late answer', () => {
    const { table, peer, advance } = setup({ requestTimeoutMs: 1000 });
    const [a, b] = [peer(1), peer(2)];
    table.onBinary(a.conn, request(3, 2));
    const sid = b.socket.frames()[0]!.streamId;
    advance(999);
    table.sweep();
    expect(a.socket.sent).toHaveLength(0);
    advance(1);
    table.sweep();
    expect([a.socket.frames()[0]!.streamId, errorCode(a.socket.frames()[0]!)]).toEqual([3, 'MESH_ERR_TIMEOUT']);
    expect(b.socket.frames()[1]).toMatchObject({ kind: FrameKind.Cancel, streamId: sid });
    table.onBinary(b.conn, encodeResponseFrame({ streamId: sid, status: 200, headers: {}, body: utf8.encode('late') }));
    expect(a.socket.sent).toHaveLength(1);
  });

  it('ends a streamed answer that already has its RESPONSE head with a DATA|END|ERROR frame, never a second RESPONSE (timeout, target gone)', () => {
    const { table, peer, advance } = setup({ requestTimeoutMs: 1000 });
    const [a, b] = [peer(1), peer(2)];
    table.onBinary(a.conn, request(3, 2));
    table.onBinary(a.conn, request(4, 2));
    const [s3, s4] = b.socket.frames().map((f) => f.streamId);
    for (const sid of [s3!, s4!]) {
      table.onBinary(b.conn, encodeResponseFrame({ streamId: sid, status: 200, headers: {}, end: false }));
      table.onBinary(b.conn, encodeDataFrame(sid, utf8.encode('{"type":"token"}\n'), false));
    }
    // Stream 3 goes silent past the timeout; stream 4's target leaves.
    advance(600);
    table.onBinary(b.conn, encodeDataFrame(s4!, utf8.encode('{"type":"token"}\n'), false));
    advance(400);
    table.sweep();
    table.removePeer(b.conn);
    const frames = a.socket.frames();
    const of = (sid: number) => frames.filter((f) => f.streamId === sid).map((f) => [f.kind, f.flags]);
    const ended = [FrameKind.Data, FLAG_END | FLAG_ERROR];
    expect(of(3)).toEqual([[FrameKind.Response, 0], [FrameKind.Data, 0], ended]);
    expect(of(4)).toEqual([[FrameKind.Response, 0], [FrameKind.Data, 0], [FrameKind.Data, 0], ended]);
    const code = (sid: number) => errorCode(frames.filter((f) => f.streamId === sid).at(-1)!);
    expect([code(3), code(4)]).toEqual(['MESH_ERR_TIMEOUT', 'MESH_ERR_PEER_GONE']);
    expect(table.inFlight).toBe(0);
  });

  it('ends a stream whose target sends a second RESPONSE head (with an error the caller can read), and cancels it on the target', () => {
    const { table, peer } = setup();
    const [a, b] = [peer(1), peer(2)];
    table.onBinary(a.conn, request(7, 2));
    const sid = b.socket.frames()[0]!.streamId;
    table.onBinary(b.conn, encodeResponseFrame({ streamId: sid, status: 200, headers: {}, end: false }));
    table.onBinary(b.conn, encodeResponseFrame({ streamId: sid, status: 200, headers: {}, body: utf8.encode('again') }));
    expect(a.socket.frames().map((f) => [f.kind, f.flags])).toEqual([
      [FrameKind.Response, 0],
      [FrameKind.Data, FLAG_END | FLAG_ERROR],
    ]);
    expect(b.socket.frames().at(-1)).toMatchObject({ kind: FrameKind.Cancel, streamId: sid });
    expect(table.inFlight).toBe(0);
  });

  it('forwards a one-way REQUEST (FLAG_ONE_WAY) and forgets it silently after its window; a target leaving within it is reported to the caller', () => {
    const { table, peer, advance } = setup({ requestTimeoutMs: 30_000 });
    const [a, b] = [peer(1), peer(2)];
    const oneWay = (streamId: number) => encodeRequestFrame({ streamId, peerId: hexToBytes(id(2)), method: 'POST', path: '/forward', body: utf8.encode('push'), flags: FLAG_END | FLAG_ONE_WAY });
    table.onBinary(a.conn, oneWay(5));
    expect(b.socket.frames()[0]).toMatchObject({ kind: FrameKind.Request, flags: FLAG_END | FLAG_ONE_WAY });
    advance(ONE_WAY_WINDOW_MS);
    table.sweep();
    // No 504 (nobody waits for one), no CANCEL to the target (it keeps no stream for it either).
    expect(a.socket.sent).toHaveLength(0);
    expect(b.socket.frames()).toHaveLength(1);
    expect(table.inFlight).toBe(0);
    table.onBinary(a.conn, oneWay(6));
    table.removePeer(b.conn);
    expect([a.socket.frames()[0]!.streamId, errorCode(a.socket.frames()[0]!)]).toEqual([6, 'MESH_ERR_PEER_GONE']);
    // Each one-way request is one message; the relay's report of the gone target is one more.
    const hot = (table as unknown as { metrics: { hot: { messages: number; oneWay: number } } }).metrics.hot;
    expect([hot.oneWay, hot.messages]).toEqual([2, 3]);
  });

  it('does not count one-way requests against the in-flight limit, and past its own cap forwards them without a window', () => {
    const { table, peer } = setup({ maxInFlightPerPeer: 2 });
    const [a, b] = [peer(1), peer(2)];
    const oneWay = (streamId: number) => encodeRequestFrame({ streamId, peerId: hexToBytes(id(2)), method: 'POST', path: '/forward', body: utf8.encode('push'), flags: FLAG_END | FLAG_ONE_WAY });
    for (const sid of [1, 2, 3]) table.onBinary(a.conn, oneWay(sid));
    expect(b.socket.frames().map((f) => f.kind)).toEqual([FrameKind.Request, FrameKind.Request, FrameKind.Request]);
    expect(table.inFlight).toBe(2);
    // Two ordinary requests still get in; the third is over the limit.
    for (const sid of [4, 5, 6]) table.onBinary(a.conn, request(sid, 2));
    expect(b.socket.frames()).toHaveLength(5);
    expect([a.socket.frames()[0]!.streamId, errorCode(a.socket.frames()[0]!)]).toEqual([6, 'MESH_ERR_BACKPRESSURE']);
  });

  it('answers 502 when the target leaves, and cancels on the target when the caller leaves or cancels', () => {
    const { table, peer } = setup();
    const [a, b] = [peer(1), peer(2)];
    table.onBinary(a.conn, request(1, 2));
    table.onBinary(a.conn, request(2, 2));
    table.onBinary(a.conn, request(3, 2));
    const [s1, s2] = b.socket.frames().map((f) => f.streamId);
    table.onBinary(a.conn, encodeCancelFrame(1));
    expect(b.socket.frames()[3]).toMatchObject({ kind: FrameKind.Cancel, streamId: s1 });
    table.removePeer(a.conn);
    // The caller's CANCEL was its own; the relay's, for a caller whose connection dropped, says so (FLAG_CALLER_GONE).
    expect(b.socket.frames()[3]!.flags & FLAG_CALLER_GONE).toBe(0);
    expect(b.socket.frames().slice(4).map((f) => [f.kind, f.streamId, f.flags & FLAG_CALLER_GONE])).toEqual([
      [FrameKind.Cancel, s2, FLAG_CALLER_GONE],
      [FrameKind.Cancel, b.socket.frames()[2]!.streamId, FLAG_CALLER_GONE],
    ]);
    const c = peer(3);
    table.onBinary(c.conn, request(8, 2));
    table.removePeer(b.conn);
    expect([c.socket.frames()[0]!.streamId, errorCode(c.socket.frames()[0]!)]).toEqual([8, 'MESH_ERR_PEER_GONE']);
    expect(table.inFlight).toBe(0);
  });

  it('disconnects a caller that lets more than maxBufferedBytes pile up unread (4004)', () => {
    const { table, peer } = setup({ maxBufferedBytes: 1000 });
    const [a, b] = [peer(1), peer(2)];
    table.onBinary(a.conn, request(1, 2));
    a.socket.bufferedAmount = 1001;
    table.onBinary(b.conn, encodeResponseFrame({ streamId: b.socket.frames()[0]!.streamId, status: 200, headers: {}, body: utf8.encode('x') }));
    expect(a.socket.closedWith?.code).toBe(4004);
    expect(a.socket.sent).toHaveLength(0);
  });

  it('translates a fast-path request for an ADR-era peer into an envelope, and its envelope answer into a RESPONSE frame', () => {
    const { table, peer } = setup();
    const a = peer(1);
    const old = peer(2, false);
    table.onBinary(a.conn, request(4, 2, 'hello'));
    const env = old.socket.json()[0]!;
    expect(env).toMatchObject({ type: 'relay-http-request', method: 'POST', path: '/forward', headers: { 'x-meshnet-shape': '1,1,2' } });
    expect(Buffer.from(env.body_base64 as string, 'base64').toString()).toBe('hello');
    table.onText(old.conn, JSON.stringify({ type: 'relay-http-response', request_id: env.request_id, status: 201, headers: { 'Content-Type': 'text/plain' }, body: 'hi' }));
    const f = a.socket.frames()[0] as ResponseFrame;
    expect([f.streamId, f.status, f.headers['content-type'], utf8d.decode(f.body)]).toEqual([4, 201, 'text/plain', 'hi']);
    // An answer naming an id this peer was not asked under is not delivered.
    table.onText(peer(3).conn, JSON.stringify({ type: 'relay-http-response', request_id: env.request_id, status: 200 }));
    expect(a.socket.sent).toHaveLength(1);
  });

  it('serves /rpc callers by envelope under its own ids, refusing a duplicate request_id with 400', () => {
    const { table, peer } = setup();
    const b = peer(2);
    const rpcSocket = new MemorySocket();
    const rpc = new RpcCaller(rpcSocket, id(2));
    table.onRpcMessage(rpc, JSON.stringify({ request_id: 'r1', method: 'post', path: '/forward', body: 'x' }));
    table.onRpcMessage(rpc, JSON.stringify({ request_id: 'r1', method: 'post', path: '/forward', body: 'y' }));
    const env = b.socket.json()[0]!;
    expect(env.request_id).not.toBe('r1');
    expect(env).toMatchObject({ method: 'POST', body: 'x' });
    expect(rpcSocket.json()[0]).toMatchObject({ request_id: 'r1', status: 400 });
    table.onText(b.conn, JSON.stringify({ type: 'relay-http-response', request_id: env.request_id, status: 200, body: 'ok' }));
    expect(rpcSocket.json()[1]).toEqual({ request_id: 'r1', status: 200, headers: {}, body: 'ok' });
  });

  it('replaces an older connection with the same key: closed 4002, its callers answered 502', () => {
    const { table, peer } = setup();
    const a = peer(1);
    const b = peer(2);
    table.onBinary(a.conn, request(6, 2));
    const b2 = peer(2);
    expect(b.socket.closedWith?.code).toBe(4002);
    expect([a.socket.frames()[0]!.streamId, errorCode(a.socket.frames()[0]!)]).toEqual([6, 'MESH_ERR_PEER_GONE']);
    table.onBinary(a.conn, request(7, 2));
    expect(b2.socket.frames()).toHaveLength(1);
    expect(table.peers.size).toBe(2);
  });

  it('refuses registrations beyond maxPeers and new requests while closing, and says when the last stream drains', () => {
    const { table, peer } = setup({ maxPeers: 2 });
    const [a, b] = [peer(1), peer(2)];
    expect(table.addPeer(new MemorySocket(), id(3), {})).toMatchObject({ close: 1013 });
    table.onBinary(a.conn, request(1, 2));
    let drained = 0;
    table.closing = true;
    table.onDrained = () => drained++;
    table.onBinary(a.conn, request(2, 2));
    expect([a.socket.frames()[0]!.streamId, errorCode(a.socket.frames()[0]!)]).toEqual([2, 'MESH_ERR_SHUTTING_DOWN']);
    table.onBinary(b.conn, encodeResponseFrame({ streamId: b.socket.frames()[0]!.streamId, status: 200, headers: {}, body: new Uint8Array(0) }));
    expect(drained).toBe(1);
  });

  it('closes a connection whose frame is shorter than its head (1002) and answers unknown versions and kinds 400', () => {
    const { table, peer } = setup();
    const a = peer(1);
    const bad = request(3, 2);
    bad[0] = 9;
    table.onBinary(a.conn, bad);
    const unknownKind = encodeCancelFrame(4);
    unknownKind[1] = 7;
    table.onBinary(a.conn, unknownKind);
    expect(a.socket.frames().map((f) => [f.streamId, errorCode(f)])).toEqual([
      [3, 'MESH_ERR_BAD_FRAME'],
      [4, 'MESH_ERR_BAD_FRAME'],
    ]);
    table.onBinary(a.conn, new Uint8Array(5));
    expect(a.socket.closedWith?.code).toBe(1002);
  });

  describe('links to other relays of a cluster', () => {
    function federated(link: ReturnType<typeof memoryLink> | undefined) {
      const t = setup({ requestTimeoutMs: 5_000 });
      const seen = { added: [] as string[], removed: [] as string[], forgotten: [] as string[] };
      const fed: TableFederation = {
        linkFor: () => link?.conn,
        forget: (p) => seen.forgotten.push(p),
        peerAdded: (p) => seen.added.push(p.id),
        peerRemoved: (p) => seen.removed.push(p.id),
      };
      t.table.federation = fed;
      return { ...t, seen };
    }

    it('sends a request for a peer it does not hold over the link, addressed, source stamped, stream renamed; the answer comes back under the caller\'s id', () => {
      const link = memoryLink();
      const { table, peer } = federated(link);
      const a = peer(1);
      table.onBinary(a.conn, request(77, 9, 'over there'));
      expect(link.addressed).toHaveLength(1);
      expect(link.addressed[0]!.target).toBe(id(9));
      const sent = decodeFrame(link.addressed[0]!.frame);
      expect(sent.kind).toBe(FrameKind.Request);
      expect(Buffer.from((sent as { peerId: Uint8Array }).peerId).toString('hex')).toBe(id(1));
      const linkStream = sent.streamId;
      expect(linkStream).not.toBe(77);
      table.onBinary(link.conn, encodeResponseFrame({ streamId: linkStream, status: 200, headers: {}, body: utf8.encode('pong') }));
      const back = a.socket.frames()[0]!;
      expect(back).toMatchObject({ kind: FrameKind.Response, streamId: 77, status: 200 });
      expect(table.inFlight).toBe(0);
    });

    it('delivers an addressed request from a link to its local target with the source the other relay stamped, and answers on the link', () => {
      const { table, peer } = federated(undefined);
      const b = peer(2);
      const link = memoryLink();
      // The far relay wrote the caller's id (5) in the peer id field.
      table.onBinary(link.conn, addressedFrame(2, request(31, 5, 'hi')));
      const got = b.socket.frames()[0]!;
      expect(got.kind).toBe(FrameKind.Request);
      expect(Buffer.from((got as { peerId: Uint8Array }).peerId).toString('hex')).toBe(id(5));
      table.onBinary(b.conn, encodeResponseFrame({ streamId: got.streamId, status: 200, headers: {}, body: utf8.encode('ok') }));
      expect(link.socket.frames()[0]).toMatchObject({ kind: FrameKind.Response, streamId: 31, status: 200 });
    });

    it('never passes a link\'s request on to another link: an unknown target is 404 back on the link', () => {
      const other = memoryLink('r3');
      const { table } = federated(other);
      const link = memoryLink();
      table.onBinary(link.conn, addressedFrame(8, request(4, 1)));
      expect(other.addressed).toHaveLength(0);
      const err = link.socket.frames()[0]!;
      expect(err).toMatchObject({ kind: FrameKind.Response, streamId: 4, status: 404 });
      expect(errorCode(err)).toBe('MESH_ERR_NO_SUCH_PEER');
    });

    it('answers 404 naming the cluster when no relay holds the peer, and forgets a location a link answered 404 for', () => {
      const none = federated(undefined);
      const a = none.peer(1);
      none.table.onBinary(a.conn, request(5, 9));
      const err = a.socket.frames()[0]!;
      expect(err).toMatchObject({ status: 404 });
      expect((JSON.parse(utf8d.decode((err as ResponseFrame).body)) as { error: { message: string } }).error.message).toMatch(/any relay of its cluster/);
      const link = memoryLink();
      const some = federated(link);
      const c = some.peer(1);
      some.table.onBinary(c.conn, request(6, 9));
      const linkStream = decodeFrame(link.addressed[0]!.frame).streamId;
      some.table.onBinary(link.conn, encodeResponseFrame({ streamId: linkStream, status: 404, headers: { 'content-type': 'application/json' }, body: utf8.encode('{"error":{"code":"MESH_ERR_NO_SUCH_PEER","message":"gone"}}') }));
      expect(some.seen.forgotten).toEqual([id(9)]);
      expect(c.socket.frames()[0]).toMatchObject({ streamId: 6, status: 404 });
    });

    it('a lost link ends the streams through it (502 to callers) and cancels the targets of the streams it called', () => {
      const link = memoryLink();
      const { table, peer } = federated(link);
      const a = peer(1);
      const b = peer(2);
      table.onBinary(a.conn, request(10, 9));
      table.onBinary(link.conn, addressedFrame(2, request(20, 7)));
      const toB = b.socket.frames()[0]!;
      table.removePeer(link.conn);
      expect(a.socket.frames()[0]).toMatchObject({ streamId: 10, status: 502 });
      expect(b.socket.frames()[1]).toMatchObject({ kind: FrameKind.Cancel, streamId: toB.streamId });
      expect(table.inFlight).toBe(0);
    });

    it('a caller\'s CANCEL reaches the link addressed to the target; a one-way request crosses and is forgotten silently', () => {
      const link = memoryLink();
      const { table, peer, advance } = federated(link);
      const a = peer(1);
      table.onBinary(a.conn, request(11, 9));
      table.onBinary(a.conn, encodeCancelFrame(11));
      expect(link.addressed).toHaveLength(2);
      expect(link.addressed[1]!.target).toBe(id(9));
      expect(decodeFrame(link.addressed[1]!.frame)).toMatchObject({ kind: FrameKind.Cancel, streamId: decodeFrame(link.addressed[0]!.frame).streamId });
      const push = encodeRequestFrame({ streamId: 12, peerId: hexToBytes(id(9)), method: 'POST', path: '/forward', headers: {}, body: utf8.encode('x'), flags: FLAG_END | FLAG_ONE_WAY });
      table.onBinary(a.conn, push);
      expect(decodeFrame(link.addressed[2]!.frame).flags & FLAG_ONE_WAY).toBe(FLAG_ONE_WAY);
      advance(ONE_WAY_WINDOW_MS + 2_000);
      table.sweep();
      expect(a.socket.frames()).toHaveLength(0);
      expect(table.inFlight).toBe(0);
    });

    it('drops and counts what a link sends that is no frame, and keeps the link', async () => {
      const { table, metrics } = federated(undefined);
      const link = memoryLink();
      table.onBinary(link.conn, new Uint8Array([ADDRESSED_FRAME, 1, 2]));
      table.onBinary(link.conn, new Uint8Array([1, 2, 3]));
      table.onBinary(link.conn, addressedFrame(2, encodeDataFrame(3, utf8.encode('stray'), true)));
      expect(link.socket.closedWith).toBeUndefined();
      const dropped = (await metrics.clusterDropped.get()).values.reduce((n, v) => n + v.value, 0);
      expect(dropped).toBe(3);
    });

    it('tells the federation of local peers coming and going, not of links', () => {
      const { table, peer, seen } = federated(undefined);
      const a = peer(1);
      table.removePeer(a.conn);
      table.removePeer(memoryLink().conn);
      expect(seen.added).toEqual([id(1)]);
      expect(seen.removed).toEqual([id(1)]);
    });
  });
});
