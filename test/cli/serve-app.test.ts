/** `meshnet serve-app --dir DIR` serves an app already built in DIR, as it is, with the isolation headers. */
import { mkdtempSync, readdirSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, describe, expect, it } from 'vitest';
import { spawnMeshnet } from '../helpers/mesh.ts';

describe('meshnet serve-app --dir', () => {
  const dir = mkdtempSync(join(tmpdir(), 'meshnet-built-app-'));
  afterAll(() => rmSync(dir, { recursive: true, force: true }));

  it('serves the built app in DIR without writing there', async () => {
    writeFileSync(join(dir, 'index.html'), '<!doctype html><p>a built app</p>');
    writeFileSync(join(dir, 'extra.js'), 'export {}');
    const p = spawnMeshnet(['serve-app', '--dir', dir, '--port', '0']);
    try {
      const l = await p.waitFor((e) => e.event === 'listening', 20_000);
      expect(l).toMatchObject({ role: 'app', dir });
      const res = await fetch(`${l.url as string}/`);
      expect(res.status).toBe(200);
      expect(await res.text()).toBe('<!doctype html><p>a built app</p>');
      expect(res.headers.get('cross-origin-embedder-policy')).toBe('require-corp');
      expect(readdirSync(dir).sort()).toEqual(['extra.js', 'index.html']);
    } finally {
      await p.stop();
    }
  });
});
