#!/usr/bin/env node
// `npm run bench`: every benchmark in turn (never in parallel: they share two
// cores), each printing its table and writing bench/results/<name>.json.
// `npm run bench -- relay-hop shard` runs a subset; `--quick` is passed on.
import { spawnSync } from 'node:child_process';
import { readdirSync } from 'node:fs';

const args = process.argv.slice(2);
const quick = args.includes('--quick');
const names = args.filter((a) => !a.startsWith('--'));
const all = readdirSync(new URL('.', import.meta.url)).filter((f) => f.endsWith('.ts')).map((f) => f.slice(0, -3)).sort();
const chosen = names.length ? names : all;
let failed = 0;
for (const name of chosen) {
  if (!all.includes(name)) {
    console.error(`no benchmark bench/${name}.ts (have: ${all.join(', ')})`);
    failed++;
    continue;
  }
  console.log(`\n=== bench/${name}.ts`);
  const r = spawnSync('npx', ['tsx', `bench/${name}.ts`, ...(quick ? ['--quick'] : [])], { stdio: 'inherit' });
  if (r.status !== 0) failed++;
}
process.exit(failed ? 1 : 0);
