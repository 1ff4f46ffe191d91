/**
 * A model whose checkpoint cannot be read at start (host down, typo'd URL)
 * is retried with backoff while the tracker serves the others, and joins once
 * it loads: the ModelCatalog on its own, then a real `meshnet tracker`.
 */
import { createServer } from 'node:net';
import { afterEach, describe, expect, it } from 'vitest';
import { ensureModel } from '../../src/cli/models.ts';
import { startStaticServer } from '../../src/cli/static-server.ts';
import { ModelCatalog, type ModelSpec } from '../../src/tracker/model-registry.ts';
import { spawnMeshnet } from '../helpers/mesh.ts';
import { smallSpec } from '../helpers/tracker.ts';

const cleanups: Array<() => Promise<unknown> | unknown> = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

async function freePort(): Promise<number> {
  const s = createServer();
  await new Promise<void>((r) => s.listen(0, '127.0.0.1', r));
  const port = (s.address() as { port: number }).port;
  await new Promise((r) => s.close(r));
  return port;
}

describe('ModelCatalog', () => {
  it('serves what loads at once, retries a failing model with doubling, capped delays, and hands it over when it loads', async () => {
    let failuresLeft = 4;
    const errors: Array<{ name: string; url: string; attempts: number; retryInMs: number }> = [];
    const loaded: Array<{ spec: ModelSpec; attempts: number }> = [];
    const catalog = new ModelCatalog(
      async (name, url) => {
        if (name === 'flaky' && failuresLeft-- > 0) throw new Error(`cannot fetch ${url}config.json (connect ECONNREFUSED)`);
        return smallSpec(name);
      },
      { onError: (name, url, _e, attempts, retryInMs) => errors.push({ name, url, attempts, retryInMs }), onLoaded: (spec, attempts) => loaded.push({ spec, attempts }) },
      { initialDelayMs: 20, maxDelayMs: 80 },
      () => 0.5, // no jitter
    );
    cleanups.push(() => catalog.close());
    const first = await catalog.start([
      { name: 'good', url: 'http://a/' },
      { name: 'flaky', url: 'http://b/' },
    ]);
    expect(first.map((m) => m.name)).toEqual(['good']);
    expect([...catalog.pending.keys()]).toEqual(['flaky']);
    const deadline = Date.now() + 5000;
    while (loaded.length === 0 && Date.now() < deadline) await new Promise((r) => setTimeout(r, 10));
    expect(errors).toEqual([20, 40, 80, 80].map((retryInMs, i) => ({ name: 'flaky', url: 'http://b/', attempts: i + 1, retryInMs })));
    expect(loaded.map((l) => [l.spec.name, l.attempts])).toEqual([['flaky', 5]]);
    expect(catalog.pending.size).toBe(0);
  });

  it('stops retrying when closed', async () => {
    let calls = 0;
    const catalog = new ModelCatalog(
      async () => {
        calls++;
        throw new Error('down');
      },
      {},
      { initialDelayMs: 10, maxDelayMs: 10 },
    );
    await catalog.start([{ name: 'x', url: 'http://x/' }]);
    catalog.close();
    const before = calls;
    await new Promise((r) => setTimeout(r, 60));
    expect(calls).toBe(before);
  });
});

describe('meshnet tracker with an unreachable model URL', () => {
  it('says which model and URL failed, serves the others, and picks the model up once its URL answers', async () => {
    const files = await startStaticServer({ root: await ensureModel('tiny') });
    cleanups.push(() => files.close());
    const port = await freePort();
    const lateUrl = `http://127.0.0.1:${port}/`;
    const tracker = spawnMeshnet(['tracker', '--port', '0', '--model', `tiny=${files.url}/`, '--model', `late=${lateUrl}`, '--log-level', 'warn']);
    cleanups.push(() => tracker.stop());
    const listening = await tracker.waitFor((e) => e.event === 'listening', 20_000);
    const url = listening.url as string;

    const models = async () => ((await (await fetch(`${url}/v1/models`)).json()) as { data: Array<{ id: string }> }).data.map((m) => m.id).sort();
    expect(await models()).toEqual(['tiny']);
    expect(((await (await fetch(`${url}/api/tracker`)).json()) as { models_pending: string[] }).models_pending).toEqual(['late']);
    const warned = tracker.stderr().split('\n').find((l) => l.includes('late') && l.includes(lateUrl));
    expect(warned).toBeDefined();
    expect(warned).toMatch(/retrying in/);
    expect(tracker.stderr()).not.toMatch(/\n\s+at /); // no stack trace
    const chat = await fetch(`${url}/v1/chat/completions`, { method: 'POST', body: JSON.stringify({ model: 'late', messages: [{ role: 'user', content: 'hi' }] }) });
    expect(chat.status).toBe(503);
    expect(((await chat.json()) as { error: { code: string; message: string } }).error).toMatchObject({ code: 'model_not_loaded', message: expect.stringContaining(lateUrl) });

    // The late model's host comes up: the next retry (≈1 s, then 2 s…) loads it.
    const late = await startStaticServer({ root: await ensureModel('tiny'), port, host: '127.0.0.1' });
    cleanups.push(() => late.close());
    const deadline = Date.now() + 10_000;
    while ((await models()).length < 2 && Date.now() < deadline) await new Promise((r) => setTimeout(r, 100));
    expect(await models()).toEqual(['late', 'tiny']);
    expect(((await (await fetch(`${url}/api/tracker`)).json()) as { models_pending: string[] }).models_pending).toEqual([]);
  });
});
