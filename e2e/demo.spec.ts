/**
 * `meshnet demo --nodes N` (a new user's `npm start`, with fewer pages): the
 * demo serves the shipped `fortunes-tiny`, gives each page the least budget
 * with which N pages hold the whole model between them, and one chat crosses
 * every page and prints the model's English answer (the float64 reference's
 * greedy one) with what the model is. With 60 MiB per page and `small`, two
 * pages once crashed after 30 s with a stack trace.
 */
import { spawn } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { expect, test } from '@playwright/test';
import { fortunesTiny } from '../test/helpers/fortunes-tiny.ts';

const BIN = fileURLToPath(new URL('../bin/meshnet.js', import.meta.url));

async function demo(args: string[]): Promise<{ code: number | null; out: string; err: string }> {
  const child = spawn(process.execPath, [BIN, 'demo', '--exit', ...args, ...(process.env.MESHNET_CHROMIUM ? ['--chromium', process.env.MESHNET_CHROMIUM] : [])], { stdio: ['ignore', 'pipe', 'pipe'] });
  let out = '';
  let err = '';
  child.stdout.on('data', (d) => (out += d));
  child.stderr.on('data', (d) => (err += d));
  const code = await new Promise<number | null>((resolve) => {
    const t = setTimeout(() => child.kill('SIGKILL'), 220_000);
    child.once('exit', (c) => {
      clearTimeout(t);
      resolve(c);
    });
  });
  return { code, out, err };
}

const PROMPT = 'Tell me a fortune about science.';

// One route over every page: a head from layer 0, the last page up to layer 5, each starting where the previous stopped.
for (const [nodes, route] of [
  [2, /route: [0-9a-f]{8} \[layers 0-(\d)\] → [0-9a-f]{8} \[layers (\d)-5\]\n/],
  [1, /route: [0-9a-f]{8} \[layers 0-5\]\n/],
] as const) {
  test(`demo --nodes ${nodes} sizes the pages to hold fortunes-tiny between them and prints its English answer, saying what the model is`, async () => {
    test.setTimeout(240_000);
    const want = fortunesTiny().greedy(PROMPT, 48);
    const { code, out, err } = await demo(['--nodes', String(nodes), '--prompt', PROMPT]);
    expect(code, `${out}\n${err}`).toBe(0);
    expect(out).toMatch(new RegExp(`starting ${nodes} headless browser nodes? \\(\\d+ MiB each\\)`));
    expect(out).toMatch(/model "fortunes-tiny": 7\.8M parameters, 6 layers, hidden 320; .*trained on Debian's fortune cookies/);
    expect(out).toMatch(/every layer is served/);
    expect(out).toContain(`> ${PROMPT}\n${want.text}\n`);
    expect(out).toMatch(new RegExp(`\\] ${want.ids.length} tokens in `));
    const r = route.exec(out);
    expect(r, out).not.toBeNull();
    if (r?.[2] !== undefined) expect(Number(r[2])).toBe(Number(r[1]) + 1);
    expect(out + err).not.toMatch(/\n\s+at /);
  });
}
