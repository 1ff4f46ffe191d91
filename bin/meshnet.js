#!/usr/bin/env node
// The CLI runs from a cached esbuild bundle of src/cli/main.ts, rebuilt when a
// source changes (bin/cli-bundle.js says why); under tsx when no bundle can be
// written, or with MESHNET_TSX=1.
import { dirname, join } from 'node:path';
import { fileURLToPath, pathToFileURL } from 'node:url';
import { bundledEntry } from './cli-bundle.js';

const root = join(dirname(fileURLToPath(import.meta.url)), '..');
// Stack traces point into the TypeScript when asked for.
if (process.argv.includes('--verbose')) process.setSourceMapsEnabled(true);
const entry = process.env.MESHNET_TSX ? undefined : await bundledEntry(root, 'src/cli/main.ts');
if (entry) await import(pathToFileURL(entry).href);
else {
  const { register } = await import('tsx/esm/api');
  register();
  await import('../src/cli/main.ts');
}
