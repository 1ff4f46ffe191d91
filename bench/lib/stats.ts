import { mkdirSync, writeFileSync } from 'node:fs';
import { cpus, loadavg } from 'node:os';
import { dirname } from 'node:path';

export function quantile(sorted: number[], q: number): number {
  if (sorted.length === 0) return NaN;
  const i = Math.min(sorted.length - 1, Math.max(0, Math.round(q * (sorted.length - 1))));
  return sorted[i]!;
}

/** Median (the mean of the two middle values for an even count). */
export function median(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  const m = s.length >> 1;
  return s.length % 2 ? s[m]! : (s[m - 1]! + s[m]!) / 2;
}

/** Index of the first token where two generations differ; null when they are equal. */
export function firstDivergence(a: number[], b: number[]): number | null {
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; i++) if (a[i] !== b[i]) return i;
  return a.length === b.length ? null : n;
}

export function summarize(samples: number[]): { n: number; p50: number; p99: number; mean: number } {
  const s = [...samples].sort((a, b) => a - b);
  return { n: s.length, p50: quantile(s, 0.5), p99: quantile(s, 0.99), mean: s.reduce((a, b) => a + b, 0) / Math.max(1, s.length) };
}

export function printTable(title: string, header: string[], rows: Array<Array<string | number>>): void {
  const cells = [header, ...rows.map((r) => r.map((c) => (typeof c === 'number' ? fmt(c) : c)))];
  const widths = header.map((_, i) => Math.max(...cells.map((r) => String(r[i] ?? '').length)));
  console.log(`\n${title}`);
  for (const [k, r] of cells.entries()) {
    console.log(`  ${r.map((c, i) => String(c).padStart(widths[i]!)).join('  ')}`);
    if (k === 0) console.log(`  ${widths.map((w) => '-'.repeat(w)).join('  ')}`);
  }
}

export function fmt(n: number): string {
  if (!Number.isFinite(n)) return String(n);
  if (Math.abs(n) >= 100) return n.toFixed(0);
  if (Math.abs(n) >= 10) return n.toFixed(1);
  if (Math.abs(n) >= 1) return n.toFixed(2);
  if (n === 0) return '0';
  return Math.abs(n) >= 0.01 ? n.toFixed(3) : n.toPrecision(2);
}

/** The machine's 1-minute load average when a bench began (`before`, from `loadavg()[0]`) and now: how shared the machine was. */
export function loadAverage1m(before: number): { before: number; after: number } {
  return { before: +before.toFixed(2), after: +loadavg()[0]!.toFixed(2) };
}

/** Writes a bench's JSON result; `date` and `machine` (cores, CPU, Node) are added here. */
export function writeResult(file: string, data: unknown): void {
  mkdirSync(dirname(file), { recursive: true });
  const machine = { cpus: cpus().length, cpu: cpus()[0]?.model ?? 'unknown', node: process.version };
  writeFileSync(file, `${JSON.stringify({ date: new Date().toISOString(), machine, ...(data as object) }, null, 2)}\n`);
  console.log(`\nwrote ${file}`);
}
