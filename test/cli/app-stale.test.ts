/**
 * A dist/ older than the page's sources is rebuilt: one left by an older
 * checkout served an old page (a new `?hop=` parameter was silently ignored
 * by a benchmark's pages).
 */
import { mkdirSync, mkdtempSync, rmSync, utimesSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { appSourcesNewerThan } from '../../src/cli/app-build.ts';

describe('appSourcesNewerThan', () => {
  const root = mkdtempSync(join(tmpdir(), 'meshnet-app-stale-'));
  afterAll(() => rmSync(root, { recursive: true, force: true }));
  mkdirSync(join(root, 'src', 'app'), { recursive: true });
  mkdirSync(join(root, 'workers'));
  const at = (path: string, s: number) => utimesSync(path, s, s);
  for (const f of ['src/app/main.ts', 'workers/node.worker.ts', 'index.html']) writeFileSync(join(root, f), 'x');
  for (const f of ['src/app/main.ts', 'workers/node.worker.ts', 'index.html']) at(join(root, f), 1000);

  it('is false when every input is older than the build', () => {
    expect(appSourcesNewerThan(2000 * 1000, root)).toBe(false);
  });

  it('is true when a source deep in src/ or a worker changed after the build', () => {
    at(join(root, 'src/app/main.ts'), 3000);
    expect(appSourcesNewerThan(2000 * 1000, root)).toBe(true);
    at(join(root, 'src/app/main.ts'), 1000);
    at(join(root, 'workers/node.worker.ts'), 3000);
    expect(appSourcesNewerThan(2000 * 1000, root)).toBe(true);
  });
});
