#!/usr/bin/env node
// `npm test`: typecheck, lint, unit + integration (vitest), e2e (Playwright in
// Debian Chromium). Every runner's counts are summed into one closing line,
// `N passed, N failed`, which CI reads.
import { spawn, spawnSync } from 'node:child_process';
import { existsSync, mkdirSync, readFileSync, rmSync } from 'node:fs';
import { ensureChromium, ensureClusterTools } from './setup.mjs';

const only = process.argv.slice(2); // e.g. `npm test -- unit e2e`
const want = (name) => only.length === 0 || only.includes(name);
let passed = 0;
let failed = 0;
let skipped = 0;
const rows = [];

function run(name, cmd, args, env = {}) {
  const t0 = Date.now();
  console.log(`\n▶ ${name}: ${cmd} ${args.join(' ')}`);
  const r = spawnSync(cmd, args, { stdio: 'inherit', env: { ...process.env, ...env } });
  return { ok: r.status === 0, seconds: ((Date.now() - t0) / 1000).toFixed(1) };
}

/** A check run beside others (its output buffered, printed whole when it ends); resolves with its row. */
function checkAsync(name, cmd, args) {
  const t0 = Date.now();
  return new Promise((resolve) => {
    const child = spawn(cmd, args, { stdio: ['ignore', 'pipe', 'pipe'] });
    let out = '';
    child.stdout.on('data', (d) => (out += d));
    child.stderr.on('data', (d) => (out += d));
    child.on('close', (code) => {
      const ok = code === 0;
      console.log(`\n▶ ${name}: ${cmd} ${args.join(' ')}\n${out}`);
      if (ok) passed++;
      else failed++;
      resolve(`${name.padEnd(10)} ${ok ? 'ok' : 'FAILED'} (${((Date.now() - t0) / 1000).toFixed(1)}s)`);
    });
  });
}

mkdirSync('test-results', { recursive: true });
// Typecheck and lint are one thread each: side by side they take the time of the longer one.
const checks = [];
if (want('typecheck')) checks.push(checkAsync('typecheck', 'npx', ['tsc', '-p', 'tsconfig.json', '--noEmit']));
if (want('lint')) checks.push(checkAsync('lint', 'npx', ['eslint', '.']));
rows.push(...(await Promise.all(checks)));

if (want('unit')) {
  // The cluster suites start real nats-server and haproxy processes.
  ensureClusterTools();
  rmSync('test-results/vitest.json', { force: true });
  const r = run('unit', 'npx', ['vitest', 'run', '--reporter=default', '--reporter=json', '--outputFile.json=test-results/vitest.json']);
  if (existsSync('test-results/vitest.json')) {
    const j = JSON.parse(readFileSync('test-results/vitest.json', 'utf8'));
    passed += j.numPassedTests;
    failed += j.numFailedTests;
    skipped += (j.numPendingTests ?? 0) + (j.numTodoTests ?? 0);
    rows.push(`unit       ${j.numPassedTests} passed, ${j.numFailedTests} failed, ${j.numFailedTestSuites ?? 0} suites failed (${r.seconds}s)`);
    if (!r.ok && j.numFailedTests === 0) failed++; // a suite that failed to load has no failed tests
  } else {
    failed++;
    rows.push(`unit       runner crashed (${r.seconds}s)`);
  }
}

if (want('e2e') && existsSync('playwright.config.ts')) {
  ensureChromium();
  rmSync('test-results/e2e.json', { force: true });
  // Inside a network namespace of its own: the pages' WebRTC data channels need an interface that is not
  // loopback, and must not reach past the machine (scripts/netns-run.sh; without root it runs as is, and
  // the data-channel specs skip, saying why).
  const r = run('e2e', 'sh', ['scripts/netns-run.sh', 'npx', 'playwright', 'test'], { PLAYWRIGHT_JSON_OUTPUT_NAME: 'test-results/e2e.json' });
  if (existsSync('test-results/e2e.json')) {
    const s = JSON.parse(readFileSync('test-results/e2e.json', 'utf8')).stats ?? {};
    passed += (s.expected ?? 0) + (s.flaky ?? 0);
    failed += s.unexpected ?? 0;
    skipped += s.skipped ?? 0;
    rows.push(`e2e        ${(s.expected ?? 0) + (s.flaky ?? 0)} passed, ${s.unexpected ?? 0} failed, ${s.flaky ?? 0} flaky (${r.seconds}s)`);
    if (!r.ok && !s.unexpected) failed++;
  } else {
    failed++;
    rows.push(`e2e        runner crashed (${r.seconds}s)`);
  }
}

console.log('\nSummary');
for (const row of rows) console.log(`  ${row}`);
console.log(`${passed} passed, ${failed} failed${skipped ? `, ${skipped} skipped` : ''}`);
process.exit(failed === 0 ? 0 : 1);
