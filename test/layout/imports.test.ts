/**
 * The import graph keeps the layout of docs/architecture.md ("The layout"):
 * no file imports itself back through others (no cycles, type-only imports
 * and import() included), and each folder of src/ imports only the folders
 * below it. Read with TypeScript's own import scanner, so what it sees is
 * what the compiler resolves.
 */
import { readFileSync, readdirSync, statSync } from 'node:fs';
import { dirname, join, normalize, relative } from 'node:path';
import { fileURLToPath } from 'node:url';
import ts from 'typescript';
import { describe, expect, it } from 'vitest';

const root = fileURLToPath(new URL('../..', import.meta.url));

/** What each folder of src/ may import besides itself. */
const MAY_IMPORT: Record<string, readonly string[]> = {
  'src/protocol': [],
  'src/model': ['src/protocol'],
  'src/net': ['src/protocol'],
  // What relays and trackers of a cluster share (the NATS connection, subject names): nothing of ours below it.
  'src/cluster': [],
  'src/relay': ['src/protocol', 'src/cluster'],
  'src/shard': ['src/protocol', 'src/model'],
  // What a check is (attestations, distances, verdicts), shared by nodes and the tracker; sampling's draw from the shard.
  'src/verify': ['src/protocol', 'src/shard'],
  'src/node': ['src/protocol', 'src/model', 'src/shard', 'src/net', 'src/verify'],
  'src/host/browser': ['src/protocol', 'src/model', 'src/shard', 'src/net', 'src/node'],
  // The Node.js host's WebGPU path runs the browser host's onnxruntime-web backend on Dawn.
  'src/host/node': ['src/protocol', 'src/model', 'src/shard', 'src/net', 'src/node', 'src/host/browser'],
  // The tracker keeps its key in the Node.js host's key file.
  'src/tracker': ['src/protocol', 'src/model', 'src/net', 'src/host/node', 'src/verify', 'src/cluster'],
  'src/app': ['src/protocol', 'src/model', 'src/host/browser'],
  'src/cli': ['src/protocol', 'src/model', 'src/shard', 'src/net', 'src/node', 'src/host/browser', 'src/host/node', 'src/cluster', 'src/relay', 'src/tracker', 'src/verify'],
};

function sourceFiles(dir: string): string[] {
  const out: string[] = [];
  for (const name of readdirSync(join(root, dir))) {
    const path = join(dir, name);
    if (statSync(join(root, path)).isDirectory()) out.push(...sourceFiles(path));
    else if (/\.(ts|mjs|js)$/.test(name) && !name.endsWith('.d.ts')) out.push(path);
  }
  return out;
}

/** Every file's relative imports (static, type-only, re-exports, import()), as repository paths. */
function importGraph(dirs: readonly string[]): Map<string, string[]> {
  const graph = new Map<string, string[]>();
  for (const file of dirs.flatMap(sourceFiles)) {
    const { importedFiles } = ts.preProcessFile(readFileSync(join(root, file), 'utf8'), true, true);
    graph.set(
      file,
      importedFiles.filter((i) => i.fileName.startsWith('.')).map((i) => normalize(join(dirname(file), i.fileName))),
    );
  }
  return graph;
}

/** Strongly connected components of more than one file, or a file importing itself (Tarjan). */
function cycles(graph: Map<string, string[]>): string[][] {
  let next = 0;
  const index = new Map<string, number>();
  const low = new Map<string, number>();
  const stack: string[] = [];
  const onStack = new Set<string>();
  const found: string[][] = [];
  const visit = (v: string): void => {
    index.set(v, next);
    low.set(v, next++);
    stack.push(v);
    onStack.add(v);
    for (const w of graph.get(v) ?? []) {
      if (!graph.has(w)) continue;
      if (!index.has(w)) {
        visit(w);
        low.set(v, Math.min(low.get(v)!, low.get(w)!));
      } else if (onStack.has(w)) low.set(v, Math.min(low.get(v)!, index.get(w)!));
    }
    if (low.get(v) === index.get(v)) {
      const scc: string[] = [];
      let w: string;
      do {
        w = stack.pop()!;
        onStack.delete(w);
        scc.push(w);
      } while (w !== v);
      if (scc.length > 1 || (graph.get(v) ?? []).includes(v)) found.push(scc.sort());
    }
  };
  for (const v of graph.keys()) if (!index.has(v)) visit(v);
  return found;
}

function folderOf(file: string): string {
  const parts = file.split('/');
  return parts.slice(0, parts[1] === 'host' ? 3 : 2).join('/');
}

describe('the import graph', () => {
  const graph = importGraph(['src', 'workers', 'bench', 'e2e', 'scripts']);

  it('reads every folder of src/ and finds the imports', () => {
    const folders = new Set([...graph.keys()].filter((f) => f.startsWith('src/')).map(folderOf));
    expect([...folders].sort()).toEqual(Object.keys(MAY_IMPORT).sort());
    expect(graph.get('src/net/frame-mux.ts')).toContain('src/net/mux-bridge.ts');
    expect(graph.get('src/cli/commands/index.ts')).toContain('src/cli/commands/relay.ts'); // import()
  });

  it('has no cycles', () => {
    expect(cycles(graph)).toEqual([]);
  });

  it('finds a cycle when there is one', () => {
    const g = new Map([
      ['a.ts', ['b.ts']],
      ['b.ts', ['c.ts']],
      ['c.ts', ['a.ts']],
      ['d.ts', ['a.ts', 'd.ts']],
    ]);
    expect(cycles(g)).toEqual([['a.ts', 'b.ts', 'c.ts'], ['d.ts']]);
  });

  it('keeps each folder of src/ on the folders below it', () => {
    const wrong: string[] = [];
    for (const [file, imports] of graph) {
      if (!file.startsWith('src/')) continue;
      const from = folderOf(file);
      for (const target of imports) {
        const to = folderOf(target);
        if (to !== from && !MAY_IMPORT[from]?.includes(to)) wrong.push(`${file} imports ${relative('.', target)} (${from} may import ${MAY_IMPORT[from]?.join(', ') || 'nothing else'})`);
      }
    }
    expect(wrong).toEqual([]);
  });
});
