/**
 * bench/heap-diff — where a process's heap grew between two heap snapshots
 * (V8 .heapsnapshot files, e.g. the pair `bench/swarm.ts --heap-snapshot DIR`
 * writes before the ramp and after the window).
 *
 * Sums self size and count per (node type, constructor or function name) in
 * each snapshot and prints the largest growths, optionally per unit (per
 * donor: `--per N`).
 *
 *   npx tsx bench/heap-diff.ts BEFORE.heapsnapshot AFTER.heapsnapshot [--per 5000] [--top 40]
 */
import { readFileSync } from 'node:fs';

interface Snapshot {
  snapshot: { meta: { node_fields: string[]; node_types: [string[], ...unknown[]] } };
  nodes: number[];
  strings: string[];
}

type Totals = Map<string, { size: number; count: number }>;

function totals(file: string): { byKey: Totals; all: number } {
  const s = JSON.parse(readFileSync(file, 'utf8')) as Snapshot;
  const f = s.snapshot.meta.node_fields;
  const width = f.length;
  const iType = f.indexOf('type');
  const iName = f.indexOf('name');
  const iSize = f.indexOf('self_size');
  const types = s.snapshot.meta.node_types[0];
  const byKey: Totals = new Map();
  let all = 0;
  for (let i = 0; i < s.nodes.length; i += width) {
    const type = types[s.nodes[i + iType]!]!;
    const size = s.nodes[i + iSize]!;
    // Strings and code by kind; objects, closures and arrays by their constructor or function name.
    const name = type === 'string' || type === 'concatenated string' || type === 'sliced string' || type === 'number' ? '' : s.strings[s.nodes[i + iName]!]!.slice(0, 60);
    const key = `${type} ${name}`.trim();
    const t = byKey.get(key) ?? { size: 0, count: 0 };
    t.size += size;
    t.count++;
    byKey.set(key, t);
    all += size;
  }
  return { byKey, all };
}

const argv = process.argv.slice(2);
const opt = (name: string) => {
  const i = argv.indexOf(`--${name}`);
  return i >= 0 ? argv[i + 1] : undefined;
};
const [a, b] = argv.filter((x, i) => !x.startsWith('--') && !argv[i - 1]?.startsWith('--'));
if (!a || !b) {
  console.error('usage: bench/heap-diff.ts BEFORE.heapsnapshot AFTER.heapsnapshot [--per N] [--top 40]');
  process.exit(2);
}
const per = Number(opt('per') ?? 1);
const top = Number(opt('top') ?? 40);
const before = totals(a);
const after = totals(b);
const rows = [...new Set([...before.byKey.keys(), ...after.byKey.keys()])].map((k) => {
  const x = before.byKey.get(k) ?? { size: 0, count: 0 };
  const y = after.byKey.get(k) ?? { size: 0, count: 0 };
  return { k, dSize: y.size - x.size, dCount: y.count - x.count };
});
rows.sort((p, q) => q.dSize - p.dSize);
const unit = per === 1 ? '' : ` per ${per === 1 ? '' : 'unit'}`;
console.log(`heap self size: ${(before.all / 2 ** 20).toFixed(1)} MiB → ${(after.all / 2 ** 20).toFixed(1)} MiB, growth ${((after.all - before.all) / 1024 / per).toFixed(2)} KiB${unit}`);
console.log(`${'bytes' + unit}`.padStart(14), `${'objects' + unit}`.padStart(16), '  type and name');
for (const r of rows.slice(0, top)) console.log((r.dSize / per).toFixed(0).padStart(14), (r.dCount / per).toFixed(2).padStart(16), ' ', r.k);
