/** `meshnet tracker` as a real process: listening line, model sizing over HTTP, restart healed by heartbeats. */
import { spawn, type ChildProcess } from 'node:child_process';
import { mkdtemp, rm } from 'node:fs/promises';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { createInterface } from 'node:readline';
import { fileURLToPath } from 'node:url';
import { afterEach, describe, expect, it } from 'vitest';
import { ensureModel } from '../../src/cli/models.ts';
import { startStaticServer } from '../../src/cli/static-server.ts';
import { Identity } from '../../src/net/identity.ts';
import { encodeBase64Url } from '../../src/protocol/base64.ts';
import type { NodeMessage, RegisterAnswer } from '../../src/protocol/tracker.ts';
import { signBody } from '../../src/tracker/signing.ts';

const BIN = fileURLToPath(new URL('../../bin/meshnet.js', import.meta.url));
const cleanups: Array<() => Promise<unknown> | void> = [];
afterEach(async () => {
  for (const c of cleanups.splice(0).reverse()) await c();
});

interface Listening {
  event: string;
  role: string;
  url: string;
  port: number;
  public_key: string;
}

async function startTrackerProcess(args: string[]): Promise<{ child: ChildProcess; line: Listening; stop(): Promise<number | null> }> {
  const child = spawn(process.execPath, [BIN, 'tracker', '--log-level', 'warn', ...args], { stdio: ['ignore', 'pipe', 'pipe'] });
  let err = '';
  child.stderr!.on('data', (d) => (err += d));
  const lines = createInterface({ input: child.stdout! });
  const first = await new Promise<string>((resolve, reject) => {
    const t = setTimeout(() => reject(new Error(`tracker did not start: ${err}`)), 20_000);
    lines.once('line', (l) => {
      clearTimeout(t);
      resolve(l);
    });
    child.once('exit', (code) => reject(new Error(`tracker exited with ${code}: ${err}`)));
  });
  const stop = () =>
    new Promise<number | null>((resolve) => {
      if (child.exitCode !== null) return resolve(child.exitCode);
      child.once('exit', (code) => resolve(code));
      child.kill('SIGTERM');
    });
  cleanups.push(stop);
  return { child, line: JSON.parse(first) as Listening, stop };
}

/** What a node host does: register, heartbeat, and register again on 404. */
function nodeAgent(identity: Identity, trackerUrl: () => string, intervalMs: number) {
  let serving: { start_layer: number; end_layer: number } | null = null;
  let registrations = 0;
  let stopped = false;
  const message = (): NodeMessage => ({
    peer_id: identity.peerId,
    public_key: encodeBase64Url(identity.publicKey),
    info: { model: 'tiny', backend: 'cpu', memory_budget_mb: 1024, host: 'node' },
    serving,
    timestamp: Date.now(),
  });
  const post = async (path: string) => fetch(trackerUrl() + path, { method: 'POST', body: JSON.stringify(await signBody(identity, message())) });
  const loop = async () => {
    while (!stopped) {
      try {
        let res = await post('/api/nodes/heartbeat');
        if (res.status === 404) {
          res = await post('/api/nodes/register');
          registrations++;
        }
        if (res.status === 200) {
          const a = ((await res.json()) as RegisterAnswer).assignment;
          serving = a && { start_layer: a.start_layer, end_layer: a.end_layer };
        }
      } catch {
        // tracker down: keep trying
      }
      await new Promise((r) => setTimeout(r, intervalMs));
    }
  };
  const done = loop();
  cleanups.push(async () => {
    stopped = true;
    await done;
  });
  return { registrations: () => registrations, serving: () => serving };
}

describe('meshnet tracker process', () => {
  it('prints the listening line, sizes the model from its URL, and heals after a restart from heartbeats alone', async () => {
    const dir = await mkdtemp(join(tmpdir(), 'meshnet-tracker-'));
    cleanups.push(() => rm(dir, { recursive: true, force: true }));
    const modelDir = await ensureModel('tiny', join(dir, 'tiny'));
    const files = await startStaticServer({ root: modelDir });
    cleanups.push(() => files.close());
    const keyFile = join(dir, 'tracker-key.json');
    const args = ['--model', `tiny=${files.url}/`, '--heartbeat-interval-ms', '300', '--key-file', keyFile];

    const first = await startTrackerProcess(['--port', '0', ...args]);
    expect(first.line).toMatchObject({ event: 'listening', role: 'tracker', port: expect.any(Number) });
    const url = first.line.url;
    const models = (await (await fetch(`${url}/v1/models`)).json()) as { data: Array<{ id: string; meshnet: { num_layers: number } }> };
    expect(models.data[0]!.id).toBe('tiny');
    expect(models.data[0]!.meshnet.num_layers).toBeGreaterThan(0);
    const info = (await (await fetch(`${url}/api/tracker`)).json()) as { public_key: string };
    expect(info.public_key).toBe(first.line.public_key);

    const agent = nodeAgent(await Identity.generate(), () => url, 300);
    const until = async (cond: () => Promise<boolean>, ms: number) => {
      const deadline = Date.now() + ms;
      while (Date.now() < deadline) {
        if (await cond()) return true;
        await new Promise((r) => setTimeout(r, 100));
      }
      return false;
    };
    const complete = async () => {
      try {
        const av = (await (await fetch(`${url}/api/availability`)).json()) as { models: Array<{ complete: boolean }> };
        return av.models[0]!.complete;
      } catch {
        return false;
      }
    };
    expect(await until(complete, 5000)).toBe(true);
    expect(agent.registrations()).toBe(1);
    const spanBefore = agent.serving();

    expect(await first.stop()).toBe(0);
    const second = await startTrackerProcess(['--port', String(first.line.port), ...args]);
    // Same key file, same key: heads keep verifying routes.
    expect(second.line.public_key).toBe(first.line.public_key);
    const t0 = Date.now();
    expect(await until(complete, 10_000)).toBe(true);
    expect(Date.now() - t0).toBeLessThan(10_000);
    expect(agent.registrations()).toBe(2);
    expect(agent.serving()).toEqual(spanBefore);
    const metrics = await (await fetch(`${url}/metrics`)).text();
    expect(metrics).toMatch(/meshnet_tracker_registrations_total\{kind="register",result="ok"\} 1/);
    expect(metrics).toMatch(/meshnet_tracker_nodes\{model="tiny",status="serving"\} 1/);
  });

  it('refuses a bad --model argument with a clear message', async () => {
    const child = spawn(process.execPath, [BIN, 'tracker', '--model', 'nourl'], { stdio: ['ignore', 'pipe', 'pipe'] });
    let err = '';
    child.stderr!.on('data', (d) => (err += d));
    const code = await new Promise<number | null>((r) => child.once('exit', r));
    expect(code).not.toBe(0);
    expect(err).toMatch(/NAME=URL/);
  });
});
