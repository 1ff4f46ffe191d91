/**
 * The lying modes (test/helpers/faults.ts) are test code that no production
 * build and no command can switch on (docs/verification.md §8): the CLI's
 * bundle holds none of it, nothing under src/ imports it or sets the span
 * hooks it needs, no environment variable reaches them, and `meshnet node
 * --help` offers no such option.
 */
import { execFileSync } from 'node:child_process';
import { readdirSync, readFileSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { fileURLToPath } from 'node:url';
import { describe, expect, it } from 'vitest';
import { bundledEntry } from '../../bin/cli-bundle.js';

const root = fileURLToPath(new URL('../..', import.meta.url));

function files(dir: string, ext: RegExp): string[] {
  const out: string[] = [];
  for (const name of readdirSync(dir)) {
    const p = join(dir, name);
    if (statSync(p).isDirectory()) out.push(...files(p, ext));
    else if (ext.test(name)) out.push(p);
  }
  return out;
}

/** Words only the fault module has: its mode names and functions. */
const FAULT_MARKS = ['honest-then-noise', 'one-in-20', 'q4-as-f32', 'lyingForward', 'lyingWeights', 'onFirstLie', 'test/helpers/faults'];

describe('lying modes are test-only', () => {
  it('the CLI bundle holds no fault code', async () => {
    const entry = await bundledEntry(root, 'src/cli/main.ts');
    expect(entry).toBeDefined();
    const dir = join(entry!, '..');
    const bundle = files(dir, /\.(js|mjs)$/).map((f) => readFileSync(f, 'utf8')).join('\n');
    expect(bundle.length).toBeGreaterThan(10_000);
    // The bundle does carry the node host (a sanity check that the search looks in the right place).
    expect(bundle).toContain('startNodeHost');
    for (const mark of FAULT_MARKS) expect(bundle, mark).not.toContain(mark);
  }, 120_000);

  it('nothing under src/ imports the fault module, sets span hooks, or reads a variable that would', () => {
    const sources = files(join(root, 'src'), /\.ts$/);
    for (const f of sources) {
      const text = readFileSync(f, 'utf8');
      expect(text, f).not.toMatch(/helpers\/faults|lying-node/);
      for (const mark of FAULT_MARKS.slice(0, 6)) expect(text, `${f}: ${mark}`).not.toContain(mark);
    }
    // Only the host's plumbing mentions spanHooks: its type, the option, and handing it on — never a value.
    const setters = sources.filter((f) => /spanHooks\s*:/.test(readFileSync(f, 'utf8')) && !/spanHooks\s*:\s*o\.spanHooks/.test(readFileSync(f, 'utf8')));
    for (const f of setters) expect(readFileSync(f, 'utf8'), f).not.toMatch(/spanHooks\s*:\s*\{/);
    // The `meshnet node` command never passes span hooks.
    expect(readFileSync(join(root, 'src/cli/commands/node.ts'), 'utf8')).not.toContain('spanHooks');
  });

  it('`meshnet node --help` offers no way to lie', () => {
    const help = execFileSync(process.execPath, [join(root, 'bin/meshnet.js'), 'node', '--help'], { encoding: 'utf8' });
    expect(help).toContain('--layers');
    expect(help).not.toMatch(/\b(lie|lying|fault|noise|tamper|span-hook)/i);
  }, 60_000);
});
