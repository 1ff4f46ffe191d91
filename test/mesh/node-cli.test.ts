/** `meshnet node` as a process: its stdout lines, its identity file, its refusals. */
import { mkdtempSync, rmSync, statSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ensureModel } from '../../src/cli/models.ts';
import { startStaticServer, type StaticServer } from '../../src/cli/static-server.ts';
import { startTracker } from '../../src/tracker/server.ts';
import { spawnMeshnet, startNode } from '../helpers/mesh.ts';

describe('meshnet node', () => {
  let st: StaticServer;
  const work = mkdtempSync(join(tmpdir(), 'meshnet-node-cli-'));
  beforeAll(async () => {
    st = await startStaticServer({ root: await ensureModel('tiny') });
  });
  afterAll(async () => {
    await st.close();
    rmSync(work, { recursive: true, force: true });
  });

  it('prints listening then serving, keeps its peer id across restarts through --key-file (mode 0600), and serves /info for its span', async () => {
    const keyFile = join(work, 'node.key');
    const args = ['--model-url', st.url, '--model', 'tiny', '--layers', '1-3', '--tracker-key', 'A'.repeat(43), '--key-file', keyFile];
    const a = await startNode(args);
    expect(a.events[0]).toMatchObject({ event: 'listening', role: 'node', peer_id: expect.stringMatching(/^[0-9a-f]{32}$/), endpoint: expect.stringMatching(/^http:\/\/127\.0\.0\.1:\d+$/) });
    expect(a.events.find((e) => e.event === 'serving')).toMatchObject({ start_layer: 1, end_layer: 3 });
    const info = (await (await fetch(`${a.endpoint}/info`)).json()) as Record<string, unknown>;
    expect(info).toMatchObject({ start_layer: 1, end_layer: 3, holds_embedding: false, holds_head: false, peer_id: a.peerId, backend: 'onnxruntime-node/cpu' });
    expect(await a.stop()).toBe(0);
    expect(statSync(keyFile).mode & 0o777).toBe(0o600);
    const b = await startNode(args);
    expect(b.peerId).toBe(a.peerId);
    await b.stop();
  });

  it('without --model joins the tracker\'s only model, and with several exits with one line listing them', async () => {
    const one = await startTracker({ port: 0, logLevel: 'silent', models: [{ name: 'tiny', url: st.url }] });
    const node = spawnMeshnet(['node', '--port', '0', '--threads', '1', '--tracker', one.url, '--budget-mb', '64']);
    try {
      const registered = await node.waitFor((e) => e.event === 'registered', 30_000);
      expect(registered.assignment).toMatchObject({ model: 'tiny', start_layer: 0 });
      await node.waitFor((e) => e.event === 'serving', 30_000);
      expect(node.stderr()).toMatch(/joining model \\"tiny\\"/);
      expect(node.stderr()).not.toMatch(/unknown model/);
    } finally {
      await node.stop();
      await one.close();
    }
    const two = await startTracker({ port: 0, logLevel: 'silent', models: [{ name: 'alpha', url: st.url }, { name: 'beta', url: st.url }] });
    try {
      const p = spawnMeshnet(['node', '--port', '0', '--tracker', two.url]);
      const code = await new Promise<number | null>((resolve) => p.child.once('exit', resolve));
      expect(code).toBe(1);
      const lines = p.stderr().trim().split('\n');
      expect(lines).toHaveLength(1);
      expect(lines[0]).toMatch(/^meshnet node: .*2 models \(alpha, beta\): choose one with --model$/);
    } finally {
      await two.close();
    }
  });

  it('refuses to start without --tracker or --layers', async () => {
    const p = spawnMeshnet(['node', '--port', '0']);
    const code = await new Promise<number | null>((resolve) => p.child.once('exit', resolve));
    expect(code).not.toBe(0);
    expect(p.stderr()).toMatch(/--tracker, or --layers/);
  });
});
