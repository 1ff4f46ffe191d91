/**
 * Fixture checkpoints on disk for the Node host: generated once per
 * preset + seed under `.models/<preset>` and reused by tests, benchmarks and
 * the demo (the small preset takes seconds to make, ~75 MB).
 */
import { mkdir, readFile, rename, rm, writeFile } from 'node:fs/promises';
import { existsSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { FIXTURE_VERSION, makeModel } from '../model/fixture.ts';
import type { FixturePreset } from '../model/fixture.ts';
import { REPO_ROOT } from './paths.ts';
import { fixtureTokenizerFiles } from './real-tokenizers.ts';

export const MARKER_FILE = '.meshnet-fixture.json';

interface Marker {
  preset: string;
  seed: number;
  version: number;
  files: string[];
}

export { REPO_ROOT };

export function defaultModelDir(preset: FixturePreset, seed = 0): string {
  return join(REPO_ROOT, '.models', seed === 0 ? preset : `${preset}-seed${seed}`);
}

async function readMarker(dir: string): Promise<Marker | null> {
  try {
    return JSON.parse(await readFile(join(dir, MARKER_FILE), 'utf8')) as Marker;
  } catch {
    return null;
  }
}

/** True when `dir` already holds exactly this preset + seed from this generator version. */
export async function hasModel(dir: string, preset: FixturePreset, seed = 0): Promise<boolean> {
  const m = await readMarker(dir);
  return m !== null && m.preset === preset && m.seed === seed && m.version === FIXTURE_VERSION && Array.isArray(m.files) && m.files.every((f) => existsSync(join(dir, f)));
}

/**
 * Write the preset's files into `dir` unless it already holds them. Each file
 * lands by rename and the marker goes last, so a concurrent reader (parallel
 * test workers) never sees a half-written checkpoint as complete.
 */
export async function writeModel(preset: FixturePreset, dir: string, seed = 0): Promise<{ dir: string; skipped: boolean; files: string[] }> {
  if (await hasModel(dir, preset, seed)) {
    const m = (await readMarker(dir))!;
    return { dir, skipped: true, files: m.files };
  }
  await mkdir(dir, { recursive: true });
  const old = await readMarker(dir);
  await rm(join(dir, MARKER_FILE), { force: true });
  // Files of a previous, different fixture would confuse discovery (a stale index.json).
  if (old) await Promise.all(old.files.map((f) => rm(join(dir, f), { force: true })));
  const tokenizerFiles = fixtureTokenizerFiles(preset);
  const files = makeModel(preset, seed, tokenizerFiles ? { tokenizerFiles } : {});
  const tag = `${process.pid}-${Math.random().toString(36).slice(2)}`;
  for (const [name, bytes] of files) {
    const tmp = join(dir, `.${name}.${tag}.tmp`);
    await writeFile(tmp, bytes);
    await rename(tmp, join(dir, name));
  }
  const marker: Marker = { preset, seed, version: FIXTURE_VERSION, files: [...files.keys()] };
  const tmp = join(dir, `${MARKER_FILE}.${tag}.tmp`);
  await writeFile(tmp, JSON.stringify(marker, null, 2) + '\n');
  await rename(tmp, join(dir, MARKER_FILE));
  return { dir, skipped: false, files: marker.files };
}

/** Directory holding the preset's checkpoint, generated on first use. */
export async function ensureModel(preset: FixturePreset, dir?: string, seed = 0): Promise<string> {
  const target = resolve(dir ?? defaultModelDir(preset, seed));
  await writeModel(preset, target, seed);
  return target;
}
