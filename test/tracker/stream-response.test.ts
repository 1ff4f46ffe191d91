/**
 * streamResponse (tracker/http.ts): an SSE answer's chunks come from a
 * generator; serveApp takes them from it directly (bodySource), a fetch
 * caller reads an ordinary stream, and cancelling that stream stops the
 * producer at once even while it waits (for a silent head).
 */
import { describe, expect, it } from 'vitest';
import { bodySource, json, serveApp, streamResponse } from '../../src/tracker/http.ts';

const utf8 = new TextEncoder();
const utf8d = new TextDecoder();

describe('streamResponse', () => {
  it('is an ordinary streamed Response to a fetch caller, pulled only as read, and its source to the hosts', async () => {
    let made = 0;
    async function* source(): AsyncGenerator<Uint8Array> {
      for (const s of ['a', 'b', 'c']) {
        made++;
        yield utf8.encode(s);
      }
    }
    const src = source();
    const res = streamResponse(src, { status: 200, headers: { 'content-type': 'text/event-stream' } });
    expect(bodySource(res)).toBe(src);
    expect(bodySource(json(200, {}))).toBeUndefined();
    await new Promise((r) => setTimeout(r, 10));
    expect(made).toBe(0); // nothing pulled before a read
    expect(res.headers.get('content-type')).toBe('text/event-stream');
    expect(await res.text()).toBe('abc');
  });

  it('stops the producer at once when the reader cancels while the source waits', async () => {
    let cancelled = 0;
    let finished = false;
    async function* source(): AsyncGenerator<Uint8Array> {
      try {
        yield utf8.encode('first');
        await new Promise(() => undefined); // a head gone silent
      } finally {
        finished = true;
      }
    }
    const res = streamResponse(source(), { status: 200 }, () => cancelled++);
    const reader = res.body!.getReader();
    expect(utf8d.decode((await reader.read()).value)).toBe('first');
    void reader.read().catch(() => undefined);
    await new Promise((r) => setTimeout(r, 10)); // the pull is now waiting inside the source
    void reader.cancel().catch(() => undefined);
    await new Promise((r) => setTimeout(r, 10));
    expect(cancelled).toBe(1);
    expect(finished).toBe(false); // return() waits behind the pending next(): why onCancel is there
  });

  it('is written from its source by serveApp, and the source is ended when the client goes away', async () => {
    let ended = false;
    let release!: () => void;
    const gate = new Promise<void>((r) => (release = r));
    async function* source(): AsyncGenerator<Uint8Array> {
      try {
        yield utf8.encode('data: 1\n\n');
        await gate;
        yield utf8.encode('data: 2\n\n');
        await new Promise((r) => setTimeout(r, 50));
        yield utf8.encode('data: 3\n\n');
      } finally {
        ended = true;
      }
    }
    const served = await serveApp(async (req) => {
      req.signal.addEventListener('abort', () => release(), { once: true });
      return streamResponse(source(), { status: 200, headers: { 'content-type': 'text/event-stream' } });
    }, 0, '127.0.0.1', 1024);
    try {
      const ctl = new AbortController();
      const res = await fetch(served.url, { signal: ctl.signal });
      const reader = res.body!.getReader();
      expect(utf8d.decode((await reader.read()).value)).toBe('data: 1\n\n');
      ctl.abort();
      await reader.cancel().catch(() => undefined);
      const deadline = Date.now() + 3000;
      while (!ended && Date.now() < deadline) await new Promise((r) => setTimeout(r, 10));
      expect(ended).toBe(true);
    } finally {
      await served.close();
    }
  });
});
