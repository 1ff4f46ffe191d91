/**
 * Every command's failure path, as a new user meets it: a missing or wrong
 * required option, an unreachable tracker or relay, a busy port. Each must
 * exit 1 with one line on stderr that names the problem and what to do (after
 * whatever the command logged before failing) — no stack trace unless
 * --verbose.
 */
import { spawn } from 'node:child_process';
import { existsSync, mkdtempSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { createServer, type Server } from 'node:net';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ensureModel } from '../../src/cli/models.ts';
import { startStaticServer, type StaticServer } from '../../src/cli/static-server.ts';
import { startTracker, type RunningTracker } from '../../src/tracker/server.ts';

const BIN = fileURLToPath(new URL('../../bin/meshnet.js', import.meta.url));

function run(args: string[]): Promise<{ code: number | null; stdout: string; stderr: string }> {
  return new Promise((resolve) => {
    const child = spawn(process.execPath, [BIN, ...args], { stdio: ['ignore', 'pipe', 'pipe'] });
    let stdout = '';
    let stderr = '';
    child.stdout.on('data', (d) => (stdout += d));
    child.stderr.on('data', (d) => (stderr += d));
    // A command that wrongly keeps running is stopped (and then fails the exit-code check).
    const t = setTimeout(() => child.kill('SIGKILL'), 30_000);
    child.once('exit', (code) => {
      clearTimeout(t);
      resolve({ code, stdout, stderr });
    });
  });
}

async function listen(server: Server): Promise<number> {
  await new Promise<void>((r) => server.listen(0, '127.0.0.1', r));
  return (server.address() as { port: number }).port;
}

describe('meshnet failures: one line that says what to do', () => {
  const work = mkdtempSync(join(tmpdir(), 'meshnet-failures-'));
  const busy = createServer();
  let busyPort: number;
  let closedPort: number;
  let models: StaticServer;
  let tracker: RunningTracker;
  let notAnApp: string;
  let builtApp: string;

  beforeAll(async () => {
    busyPort = await listen(busy);
    const closed = createServer();
    closedPort = await listen(closed);
    await new Promise((r) => closed.close(r));
    models = await startStaticServer({ root: await ensureModel('tiny') });
    tracker = await startTracker({ port: 0, logLevel: 'silent', models: [{ name: 'tiny', url: `${models.url}/` }] });
    await ensureModel('small'); // `demo --preset small` sizes it before refusing a budget
    notAnApp = join(work, 'my-files');
    builtApp = join(work, 'built');
    for (const d of [notAnApp, builtApp]) rmSync(d, { recursive: true, force: true });
    await import('node:fs/promises').then(async (fs) => {
      await fs.mkdir(notAnApp);
      await fs.mkdir(builtApp);
    });
    writeFileSync(join(notAnApp, 'notes.txt'), 'mine');
    writeFileSync(join(builtApp, 'index.html'), '<!doctype html><p>app</p>');
  }, 120_000);

  afterAll(async () => {
    await tracker?.close();
    await models?.close();
    await new Promise((r) => busy.close(r));
    rmSync(work, { recursive: true, force: true });
  });

  const closedHttp = () => `http://127.0.0.1:${closedPort}`;
  const closedWs = () => `ws://127.0.0.1:${closedPort}`;
  const cases: Array<[string, () => string[], RegExp]> = [
    ['relay: a malformed --port', () => ['relay', '--port', 'abc'], /--port .*expected a non-negative integer/],
    ['relay: a busy port', () => ['relay', '--port', String(busyPort)], /127\.0\.0\.1:\d+ is already in use: .*--port/],
    ['tracker: no --model', () => ['tracker'], /required option '--model <NAME=URL>'/],
    ['tracker: --model without a URL', () => ['tracker', '--model', 'nourl'], /NAME=URL/],
    ['tracker: a malformed hub id', () => ['tracker', '--model', 'tiny=hf:justone'], /expected hf:ORG\/REPO\[@REVISION\]/],
    ['tracker: an unreachable relay', () => ['tracker', '--model', `tiny=${models.url}/`, '--relay', closedWs()], /cannot reach the relay at ws:\/\/127\.0\.0\.1:\d+ \(connection refused\): start `meshnet relay` there, or fix --relay/],
    ['tracker: a busy port', () => ['tracker', '--model', `tiny=${models.url}/`, '--port', String(busyPort)], /already in use/],
    ['tracker: an unknown wire dtype', () => ['tracker', '--model', `tiny=${models.url}/`, '--wire-dtype', 'f64'], /--wire-dtype .*expected \[NAME=\]DTYPE with DTYPE one of bf16, f16, f32, got "f64"/],
    ['tracker: a wire dtype for a model it does not serve', () => ['tracker', '--model', `tiny=${models.url}/`, '--wire-dtype', 'small=f32'], /--wire-dtype names model "small", which no --model serves/],
    ['node: --wire-dtype without a static span', () => ['node', '--tracker', tracker.url, '--wire-dtype', 'f32'], /--wire-dtype is for a static span \(--layers\): a tracker gives its nodes the model's wire dtype/],
    ['node: neither --tracker nor --layers', () => ['node'], /give --tracker, or --layers with --model-url/],
    ['node: --layers without --model-url', () => ['node', '--layers', '0-2'], /--layers needs --model-url/],
    ['node: a malformed hub id', () => ['node', '--layers', '0-2', '--model-url', 'hf:a/b/c'], /--model-url: .*expected hf:ORG\/REPO\[@REVISION\]/],
    ['node: an unreachable tracker', () => ['node', '--tracker', closedHttp()], /cannot reach the tracker at http:\/\/127\.0\.0\.1:\d+ \(connection refused\): start `meshnet tracker` there, or fix --tracker/],
    ['node: a tracker URL that is not one', () => ['node', '--tracker', 'tracker.example'], /--tracker tracker\.example is not a URL/],
    ['node: a URL that is no tracker', () => ['node', '--tracker', `${models.url}/`], /does not answer like a meshnet tracker .*fix --tracker/],
    ['node: an unreachable relay', () => ['node', '--tracker', tracker.url, '--relay', closedWs()], /cannot reach the relay at .*fix --relay/],
    ['node: a model the tracker does not serve', () => ['node', '--tracker', tracker.url, '--model', 'nope'], /serves no model "nope" \(it serves: tiny\): fix --model/],
    ['make-model: no --preset', () => ['make-model', '--out', join(work, 'm')], /required option '--preset <name>'/],
    ['make-model: an unknown preset', () => ['make-model', '--preset', 'huge', '--out', join(work, 'm')], /unknown preset "huge" \(have: /],
    ['serve-app: a folder with no built app', () => ['serve-app', '--dir', notAnApp], /holds no built app \(no index\.html\); it is left untouched/],
    ['serve-app: a folder that does not exist', () => ['serve-app', '--dir', join(work, 'nowhere')], /is not a directory/],
    ['serve-app: a busy port', () => ['serve-app', '--dir', builtApp, '--port', String(busyPort)], /already in use/],
    ['mesh: no --nodes', () => ['mesh', '--tracker', tracker.url, '--relay', closedWs()], /required option '--nodes <n>'/],
    ['mesh: an unreachable tracker', () => ['mesh', '--nodes', '2', '--tracker', closedHttp(), '--relay', closedWs()], /cannot reach the tracker .*fix --tracker/],
    ['mesh: an unreachable relay', () => ['mesh', '--nodes', '2', '--tracker', tracker.url, '--relay', closedWs()], /cannot reach the relay .*fix --relay/],
    ['demo: --nodes 0', () => ['demo', '--nodes', '0'], /--nodes .*expected a positive integer/],
    ['demo: a budget too small for the pages asked for', () => ['demo', '--nodes', '2', '--budget', '10'], /2 pages of 10 MiB leave layers [\d–, ]+ of "fortunes-tiny" without a node: give --budget 26 or more/],
    ['demo: the same for a generated preset', () => ['demo', '--preset', 'small', '--nodes', '2', '--budget', '60'], /2 pages of 60 MiB leave layers 8–11 of "small" without a node: give --budget \d+ or more/],
    ['demo: an unknown model', () => ['demo', '--preset', 'huge'], /--preset must be one of fortunes-tiny, small, tiny, got "huge"/],
    ['an unknown command', () => ['serve'], /unknown command 'serve'/],
  ];

  it.each(cases)('%s', async (_name, args, message) => {
    const a = args();
    const r = await run(a);
    expect(r.code, r.stderr).toBe(1);
    // The failure is the last line; before it only the command's own JSON log lines (a tracker logs its models first).
    const lines = r.stderr.trimEnd().split('\n');
    const last = lines[lines.length - 1]!;
    expect(lines.slice(0, -1).every((l) => l.startsWith('{"level"')), r.stderr).toBe(true);
    const command = ['relay', 'tracker', 'node', 'make-model', 'serve-app', 'mesh', 'demo'].includes(a[0]!) ? `meshnet ${a[0]}` : 'meshnet';
    expect(last.startsWith(`${command}: `), last).toBe(true);
    expect(last).toMatch(message);
    expect(r.stdout + r.stderr).not.toMatch(/\n\s+at /);
  });

  it('leaves a --dir with no built app exactly as it was', () => {
    expect(readdirSync(notAnApp)).toEqual(['notes.txt']);
    expect(existsSync(join(notAnApp, 'index.html'))).toBe(false);
  });

  it('prints the stack trace too with --verbose', async () => {
    const r = await run(['node', '--verbose', '--tracker', closedHttp()]);
    expect(r.code).toBe(1);
    const lines = r.stderr.trimEnd().split('\n');
    expect(lines[0]).toMatch(/^meshnet node: cannot reach the tracker/);
    expect(lines.length).toBeGreaterThan(2);
    expect(r.stderr).toMatch(/\n\s+at .*preflight\.ts/);
  });
});
