/**
 * A head's generation whose stream is lost with the connection (the relay
 * restarting; abort reason `disconnected`) is parked, not ended: no step runs
 * while nobody reads it, and the tracker's `X-Meshnet-Resume` for the same
 * session and route gets every event again and the rest, token for token what
 * an uninterrupted run gives. Not asked for within parkMs, or stopped by a
 * plain CANCEL, it ends and drops its session: no orphaned work.
 */
import { beforeAll, describe, expect, it } from 'vitest';
import { createHeadHandler } from '../../../src/node/head/head-handler.ts';
import { HopTransport } from '../../../src/net/hop-transport.ts';
import { Identity } from '../../../src/net/identity.ts';
import { PipelineDriver, type HeadExecutor, type HeadTokenizer } from '../../../src/node/head/pipeline.ts';
import { ModelTokenizer } from '../../../src/model/tokenizer.ts';
import { encodeBase64Url } from '../../../src/protocol/base64.ts';
import type { MeshRequest, MeshResponse } from '../../../src/protocol/envelopes.ts';
import { MeshError } from '../../../src/protocol/errors.ts';
import { routeSigningMessage, type GenerateEvent } from '../../../src/protocol/tracker.ts';
import { executor, fixture } from '../../helpers/shard.ts';

const f = fixture('tiny');
const utf8 = new TextEncoder();
const utf8d = new TextDecoder();
const tok = ModelTokenizer.fromJson(JSON.parse(utf8d.decode(f.files.get('tokenizer.json')!)), JSON.parse(utf8d.decode(f.files.get('tokenizer_config.json')!)), { extraEosTokenIds: f.cfg.eosTokenIds });
const HEAD = 'a'.repeat(32);
const sleep = (ms: number) => new Promise((r) => setTimeout(r, ms));
const DISCONNECTED = new MeshError('MESH_ERR_PEER_GONE', 'relay connection lost (socket closed (code 1006)); the request may or may not have run', { reason: 'disconnected' });

function body(session: string, maxTokens = 8): Uint8Array {
  // A prompt whose greedy run does not stop early on tiny's random weights.
  return utf8.encode(JSON.stringify({ prompt_token_ids: [5, 17, 42, 7], max_tokens: maxTokens, temperature: 0, session_id: session }));
}

/** Read a streamed answer line by line, as the relay bridge does (next(), and return() when the stream is cut). */
function reader(res: MeshResponse) {
  const it = (res.body as AsyncIterable<Uint8Array>)[Symbol.asyncIterator]();
  return {
    async next(): Promise<GenerateEvent | undefined> {
      const r = await it.next();
      return r.done ? undefined : (JSON.parse(utf8d.decode(r.value)) as GenerateEvent);
    },
    async all(): Promise<GenerateEvent[]> {
      const out: GenerateEvent[] = [];
      for (let e = await this.next(); e; e = await this.next()) out.push(e);
      return out;
    },
    cut: () => it.return?.(undefined),
  };
}

/** The executor's session ids are the tracker's with a suffix of the head's. */
const droppedOf = (dropped: string[], session: string) => dropped.filter((d) => d.startsWith(`${session}.`)).length;
const ids = (evs: GenerateEvent[]) => evs.flatMap((e) => (e.type === 'token' ? [e.token_id] : []));

describe('parked generations', () => {
  let tracker: Identity;
  let route: Record<string, string>;
  let forwards = 0;
  /** Steps wait for this (a test holds one step in flight). */
  let hold: Promise<void> = Promise.resolve();
  const dropped: string[] = [];
  let head: (parkMs: number) => (r: MeshRequest) => Promise<MeshResponse>;

  beforeAll(async () => {
    tracker = await Identity.generate();
    const expires = Date.now() + 600_000;
    route = { 'x-meshnet-route': '[]', 'x-meshnet-route-expires': String(expires), 'x-meshnet-route-signature': encodeBase64Url(await tracker.sign(routeSigningMessage(HEAD, expires, '[]'))) };
    const ex = await executor(f, 0, 4);
    // Count the work the head does, and the sessions it drops.
    const counted: HeadExecutor = {
      config: ex.config,
      startLayer: ex.startLayer,
      endLayer: ex.endLayer,
      maxContext: ex.maxContext,
      forward: async (r) => {
        forwards++;
        await hold;
        return ex.forward(r);
      },
      dropSession: (id) => (dropped.push(id), ex.dropSession(id)),
    };
    const driver = new PipelineDriver({ executor: counted, tokenizer: tok as HeadTokenizer, transport: new HopTransport({}) });
    head = (parkMs) => createHeadHandler({ forward: async () => ({ status: 404, headers: {}, body: new Uint8Array(0) }), peerId: HEAD, trackerKey: () => tracker.publicKey, pipeline: () => driver, parkMs });
  });

  const request = (session: string, extra: Record<string, string> = {}, signal?: AbortSignal): MeshRequest => ({ method: 'POST', path: '/generate', headers: { ...route, ...extra }, body: body(session), ...(signal ? { signal } : {}) });

  it('parks a generation cut with the connection, runs no step meanwhile, and a resume gets every event again and the rest: the same tokens as an uninterrupted run', async () => {
    const handle = head(5_000);
    const whole = await reader(await handle(request('whole'))).all();
    expect(whole.at(-1)!.type).toBe('done');
    const want = ids(whole);
    expect(want.length).toBeGreaterThanOrEqual(3);

    const ctl = new AbortController();
    const first = reader(await handle(request('cut', {}, ctl.signal)));
    const got = [await first.next(), await first.next(), await first.next()];
    expect(got.map((e) => e!.type)).toEqual(['start', 'token', 'token']);
    // The connection drops: the bridge aborts the handler's signal and stops reading.
    ctl.abort(DISCONNECTED);
    await first.cut();
    const before = forwards;
    await sleep(300);
    expect(forwards).toBe(before); // parked: pull-driven, nothing runs
    expect(droppedOf(dropped, 'cut')).toBe(0);

    const again = await reader(await handle(request('cut', { 'x-meshnet-resume': '1' }))).all();
    expect(again[0]!.type).toBe('start');
    expect(again.at(-1)!.type).toBe('done');
    // The two tokens already sent come again (the tracker skips the indexes it has), then the rest.
    const tokens = again.filter((e) => e.type === 'token') as Array<GenerateEvent & { index: number; token_id: number }>;
    expect(tokens.map((t) => t.index)).toEqual(want.map((_, i) => i));
    expect(ids(again)).toEqual(want);
    expect(droppedOf(dropped, 'cut')).toBe(1);
  });

  it('a resume that comes while the lost reading still waits for a step takes that very step over: every token once, in order', async () => {
    const handle = head(5_000);
    const want = ids(await reader(await handle(request('whole2'))).all());
    const ctl = new AbortController();
    const first = reader(await handle(request('mid', {}, ctl.signal)));
    await first.next();
    await first.next();
    // The next step hangs (a hop held by a relay outage); the connection drops meanwhile: the old reading still waits.
    let release!: () => void;
    hold = new Promise<void>((r) => (release = r));
    const pending = first.next();
    await sleep(50);
    ctl.abort(DISCONNECTED);
    const resumed = reader(await handle(request('mid', { 'x-meshnet-resume': '1' })));
    const all = resumed.all();
    await sleep(50);
    release();
    hold = Promise.resolve();
    const again = await all;
    // The old reading got its event too, but sends nothing more: the resumed one owns the generation.
    await pending;
    expect(await first.next()).toBeUndefined();
    const tokens = again.filter((e) => e.type === 'token') as Array<GenerateEvent & { index: number }>;
    expect(tokens.map((t) => t.index)).toEqual(want.map((_, i) => i));
    expect(ids(again)).toEqual(want);
  });

  it('ends a parked generation nobody asks for within parkMs, and drops its session; a plain CANCEL ends it at once', async () => {
    const handle = head(200);
    const ctl = new AbortController();
    const r = reader(await handle(request('left', {}, ctl.signal)));
    await r.next();
    await r.next();
    ctl.abort(DISCONNECTED);
    await r.cut();
    await sleep(400);
    expect(droppedOf(dropped, 'left')).toBe(1);
    const n = forwards;
    await sleep(200);
    expect(forwards).toBe(n);
    // Asked for after that: a fresh generation (with the prefix the tracker sends), not the old one.
    const fresh = await reader(await handle(request('left', { 'x-meshnet-resume': '1' }))).all();
    expect(fresh.at(-1)!.type).toBe('done');

    const stop = new AbortController();
    const s = reader(await handle(request('stopped', {}, stop.signal)));
    await s.next();
    await s.next();
    stop.abort(new MeshError('MESH_ERR_CANCELLED', 'the caller cancelled the request'));
    await s.cut();
    await sleep(50);
    expect(droppedOf(dropped, 'stopped')).toBe(1);
  });

  it('a resume naming another route is a new generation, and the old one ends', async () => {
    const handle = head(5_000);
    const ctl = new AbortController();
    const r = reader(await handle(request('moved', {}, ctl.signal)));
    await r.next();
    await r.next();
    ctl.abort(DISCONNECTED);
    await r.cut();
    const expires = Date.now() + 600_000;
    const other = { 'x-meshnet-route': '[ ]', 'x-meshnet-route-expires': String(expires), 'x-meshnet-route-signature': encodeBase64Url(await tracker.sign(routeSigningMessage(HEAD, expires, '[ ]'))) };
    const res = await handle({ method: 'POST', path: '/generate', headers: { ...other, 'x-meshnet-resume': '1' }, body: body('moved') });
    expect(res.status).toBe(200);
    await reader(res).all();
    expect(droppedOf(dropped, 'moved')).toBe(2);
  });
});
