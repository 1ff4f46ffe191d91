/**
 * `meshnet demo --nodes 2` (a new user's `npm start` with fewer pages): the
 * demo gives each page the budget that covers the model with two pages, the
 * two headless pages split `small` between them, and one chat crosses both.
 * It crashed after 30 s with a stack trace when each page got 60 MiB.
 */
import { spawn } from 'node:child_process';
import { fileURLToPath } from 'node:url';
import { expect, test } from '@playwright/test';

const BIN = fileURLToPath(new URL('../bin/meshnet.js', import.meta.url));

test('demo --nodes 2 sizes the pages to hold the whole model between them and streams a chat across both', async () => {
  test.setTimeout(240_000);
  const child = spawn(process.execPath, [BIN, 'demo', '--nodes', '2', '--exit', '--max-tokens', '4', ...(process.env.MESHNET_CHROMIUM ? ['--chromium', process.env.MESHNET_CHROMIUM] : [])], { stdio: ['ignore', 'pipe', 'pipe'] });
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
  expect(code, `${out}\n${err}`).toBe(0);
  const budget = /starting 2 headless browser nodes \((\d+) MiB each\)/.exec(out);
  expect(budget, out).not.toBeNull();
  expect(Number(budget![1])).toBeGreaterThan(60);
  expect(out).toMatch(/every layer is served/);
  expect(out).toMatch(/\] 4 tokens in /);
  // One route over both pages: a head for the first half, the other page for the rest.
  expect(out).toMatch(/route: [0-9a-f]{8} \[layers 0-5\] → [0-9a-f]{8} \[layers 6-11\]/);
  expect(out + err).not.toMatch(/\n\s+at /);
});
