#!/usr/bin/env node
/**
 * Writes test/helpers/file-seconds.json: how long each vitest file held its worker in a CI run, read from
 * that run's JSON report (`node scripts/file-seconds.mjs test-results/vitest.json`). vitest.config.ts starts
 * the longest files first with it (test/helpers/longest-first.ts).
 *
 * The report gives each file's first test start and last test end, not its import or beforeAll: a file is
 * charged from the end of the file before it on the same worker to its own end. The report names no worker,
 * so the files are laid back onto two timelines (each file on the one free at its start, the one freed
 * last when both are).
 */
import { readFileSync, writeFileSync } from 'node:fs';
import { relative } from 'node:path';

const report = JSON.parse(readFileSync(process.argv[2] ?? 'test-results/vitest.json', 'utf8'));
const workers = Number(process.argv[3] ?? 2);
const root = process.argv[4] ?? process.cwd();
const files = report.testResults.map((r) => ({ name: relative(root, r.name), start: r.startTime, end: r.endTime })).sort((a, b) => a.start - b.start);
const freed = Array(workers).fill(report.startTime);
const seconds = {};
for (const f of files) {
  const free = freed.map((t, i) => [t, i]).filter(([t]) => t <= f.start + 10);
  const [t, i] = (free.length ? free : freed.map((t, i) => [t, i])).reduce((a, b) => (b[0] > a[0] ? b : a));
  seconds[f.name] = Math.round((f.end - t) / 100) / 10;
  freed[i] = f.end;
}
const sorted = Object.fromEntries(Object.entries(seconds).filter(([, s]) => s >= 3).sort((a, b) => b[1] - a[1]));
writeFileSync(new URL('../test/helpers/file-seconds.json', import.meta.url), `${JSON.stringify(sorted, null, 1)}\n`);
console.log(`${Object.keys(sorted).length} files of ${files.length} took 3 s or more (${Object.values(seconds).reduce((a, b) => a + b, 0).toFixed(0)} s in all)`);
