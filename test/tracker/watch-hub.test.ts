/**
 * The nodes' watch streams served on Node's http objects (watch-hub.ts):
 * over a real socket a watch gets its `hello` (with CORS for browser
 * nodes), is counted while open and forgotten once the node goes away, and
 * ends when the tracker closes; keep-alive comments go only to the streams
 * that are due, spread by when each opened.
 */
import { request, type IncomingMessage } from 'node:http';
import { afterEach, describe, expect, it } from 'vitest';
import { startTracker, type RunningTracker } from '../../src/tracker/server.ts';
import { WatchHub, type WatchSink } from '../../src/tracker/watch-hub.ts';
import { smallSpec } from '../helpers/tracker.ts';

const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));
async function until(cond: () => boolean, ms = 3000): Promise<void> {
  const deadline = Date.now() + ms;
  while (!cond()) {
    if (Date.now() > deadline) throw new Error('condition not met in time');
    await sleep(10);
  }
}

const cleanups: Array<() => Promise<void> | void> = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

/** Open a watch; resolves with the response and the text read so far (kept up to date). */
function openWatch(url: string): Promise<{ res: IncomingMessage; text: () => string; ended: Promise<void>; close(): void }> {
  return new Promise((resolve, reject) => {
    const req = request(`${url}/api/nodes/watch?from=test`, { agent: false, headers: { accept: 'text/event-stream' } }, (res) => {
      let text = '';
      res.setEncoding('utf8');
      const ended = new Promise<void>((r) => {
        res.on('end', r);
        res.on('error', () => r());
        res.on('close', r);
      });
      res.on('data', (d: string) => (text += d));
      resolve({ res, text: () => text, ended, close: () => req.destroy() });
    });
    req.on('error', reject);
    req.end();
  });
}

describe('watch streams on Node\'s http objects', () => {
  let tracker: RunningTracker;

  it('says hello, counts open streams, forgets closed ones and ends them all when the tracker closes', async () => {
    tracker = await startTracker({ port: 0, logLevel: 'silent' }, { modelSpecs: [smallSpec()] });
    let closed = false;
    cleanups.push(() => (closed ? undefined : tracker.close()));
    const a = await openWatch(tracker.url);
    const b = await openWatch(tracker.url);
    expect(a.res.statusCode).toBe(200);
    expect(a.res.headers['content-type']).toMatch(/^text\/event-stream/);
    expect(a.res.headers['access-control-allow-origin']).toBe('*');
    await until(() => a.text().includes('\n\n'));
    const hello = /^event: hello\ndata: (.*)\n\n/.exec(a.text());
    expect(JSON.parse(hello![1]!)).toEqual({ tracker_public_key: tracker.publicKey, started_at: expect.any(Number), heartbeat_interval_ms: 5000 });
    expect(tracker.watch.size).toBe(2);
    // A node that goes away is forgotten.
    b.close();
    await until(() => tracker.watch.size === 1);
    // The fetch-style app still answers a watch (the relay bridge, tests): the same hello.
    const viaApp = await tracker.app.request('/api/nodes/watch');
    const reader = viaApp.body!.getReader();
    expect(new TextDecoder().decode((await reader.read()).value)).toBe(`event: hello\ndata: ${tracker.watch.hello()}\n\n`);
    await reader.cancel();
    // The tracker goes away: the stream's end is the news.
    closed = true;
    await tracker.close();
    await a.ended;
    expect(tracker.watch.size).toBe(0);
  });

  it('sends keep-alive comments only to the streams that are due', () => {
    let now = 0;
    const hub = new WatchHub({ hello: () => '{}', keepAliveMs: 20_000, now: () => now });
    const sinks = [0, 5_000, 10_000].map((at) => {
      now = at;
      const s = { writes: [] as string[], onClose: undefined as (() => void) | undefined, write: (c: Uint8Array) => (s.writes.push(Buffer.from(c).toString()), true), end: () => s.onClose?.(), once: (_: 'close', l: () => void) => (s.onClose = l) };
      hub.add(s satisfies WatchSink);
      return s;
    });
    const keepAlives = () => sinks.map((s) => s.writes.filter((w) => w.startsWith(': keep-alive')).length);
    now = 19_000;
    hub.tick();
    expect(keepAlives()).toEqual([0, 0, 0]);
    now = 20_000;
    hub.tick();
    expect(keepAlives()).toEqual([1, 0, 0]);
    now = 26_000;
    hub.tick();
    expect(keepAlives()).toEqual([1, 1, 0]);
    sinks[2]!.onClose!();
    expect(hub.size).toBe(2);
    now = 40_000;
    hub.tick();
    expect(keepAlives()).toEqual([2, 1, 0]);
    hub.close();
  });
});
