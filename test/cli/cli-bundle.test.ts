/**
 * bin/cli-bundle.js: the CLI runs from a cached esbuild bundle that must
 * never go stale. A throwaway project: built once, reused while its sources
 * are unchanged, rebuilt when one changes, `import.meta.url` still the
 * source file's own, and undefined (run the sources instead) when the
 * sources do not build.
 */
import { mkdirSync, mkdtempSync, readFileSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { dirname, join } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { afterAll, describe, expect, it } from 'vitest';
import { bundledEntry, cachedEntry } from '../../bin/cli-bundle.js';

describe('the CLI bundle cache', () => {
  const root = mkdtempSync(join(tmpdir(), 'meshnet-bundle-'));
  const cache = join(root, 'cache');
  afterAll(() => rmSync(root, { recursive: true, force: true }));
  mkdirSync(join(root, 'src'));
  const write = (file: string, text: string) => writeFileSync(join(root, 'src', file), text);
  write('main.ts', "import { here, word } from './where.ts';\nexport const out: { here: string; word: string } = { here, word };\n");
  write('where.ts', "export const here: string = import.meta.url;\nexport const word = 'one';\n");
  const load = async (entry: string) => ((await import(`${pathToFileURL(entry).href}?t=${Math.random()}`)) as { out: { here: string; word: string } }).out;

  it('builds once, keeps import.meta.url of each source, and reuses the build while nothing changed', async () => {
    const first = await bundledEntry(root, 'src/main.ts', cache);
    expect(first).toBeDefined();
    expect(first!.startsWith(cache)).toBe(true);
    expect(await load(first!)).toEqual({ here: pathToFileURL(join(root, 'src', 'where.ts')).href, word: 'one' });
    expect(cachedEntry(root, cache)).toBe(first);
    expect(await bundledEntry(root, 'src/main.ts', cache)).toBe(first);
    expect(readdirSync(cache).filter((d) => d.startsWith('build-'))).toHaveLength(1);
  });

  it('rebuilds when a source file changes, and the new build runs the new code', async () => {
    const before = cachedEntry(root, cache);
    write('where.ts', "export const here: string = import.meta.url;\nexport const word = 'two!';\n");
    expect(cachedEntry(root, cache)).toBeUndefined();
    const after = await bundledEntry(root, 'src/main.ts', cache);
    expect(after).toBeDefined();
    expect(after).not.toBe(before);
    expect((await load(after!)).word).toBe('two!');
  });

  it('answers undefined when the sources do not build (the CLI then runs them under tsx)', async () => {
    write('where.ts', 'export const here: string = ;\n');
    expect(await bundledEntry(root, 'src/main.ts', cache)).toBeUndefined();
  });
});

/** Files and packages a bundle file imports statically (what loads with it), relative to the bundle. */
function staticImports(file: string): string[] {
  const src = readFileSync(file, 'utf8');
  return [...src.matchAll(/^(?:import|export)\s[^;]*?from\s*"([^"]+)";?|^import\s*"([^"]+)";?/gms)].map((m) => (m[1] ?? m[2])!);
}

describe('the real CLI bundle', () => {
  it('loads nothing of onnxruntime, Playwright, vite or the tracker for `meshnet relay`', async () => {
    const root = fileURLToPath(new URL('../..', import.meta.url));
    const entry = await bundledEntry(root, 'src/cli/main.ts');
    expect(entry).toBeDefined();
    const main = readFileSync(entry!, 'utf8');
    const relayChunk = /import\("(\.\/chunks\/relay-[^"]+)"\)/.exec(main)?.[1];
    expect(relayChunk).toBeDefined();
    // Everything `meshnet relay` loads before its action runs, and its action's static imports.
    const seen = new Set<string>();
    const packages = new Set<string>();
    const visit = (file: string) => {
      if (seen.has(file)) return;
      seen.add(file);
      for (const spec of staticImports(file)) {
        if (spec.startsWith('.')) visit(join(dirname(file), spec));
        else packages.add(spec);
      }
    };
    visit(entry!);
    visit(join(dirname(entry!), relayChunk!));
    const serverChunk = /import\("(\.\/chunk-[^"]+|\.\/server-[^"]+)"\)/.exec(readFileSync(join(dirname(entry!), relayChunk!), 'utf8'))?.[1];
    expect(serverChunk).toBeDefined();
    visit(join(dirname(entry!), 'chunks', serverChunk!));
    const names = [...packages].map((p) => p.replace(/^node:/, ''));
    for (const heavy of ['onnxruntime-node', 'onnxruntime-web', 'webgpu', 'playwright-core', 'vite', 'esbuild', 'tsx']) expect(names).not.toContain(heavy);
    const sources = [...seen].map((f) => readFileSync(`${f}.map`, 'utf8')).join('\n');
    expect(sources).toContain('src/relay/server.ts');
    for (const other of ['src/tracker/', 'src/shard/', 'src/host/', 'src/node/runtime/', 'src/cli/browser-mesh.ts', 'src/model/']) expect(sources).not.toContain(other);
  });
});
