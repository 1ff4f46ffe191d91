/**
 * The CLI runs from an esbuild bundle of its TypeScript entry, cached under
 * node_modules/.cache and rebuilt whenever a bundled source file changed
 * (size or mtime of every input esbuild read): the TypeScript stays the one
 * source of truth, with nothing stale to forget.
 *
 * Why not tsx in the process: its module hooks run on a loader thread with
 * its own V8 heap, ~35 MB of RSS before any of our code, and an idle relay
 * must stay under 60 MB. The bundle is code-split, so each command's code is
 * a chunk of its own, loaded only when that command runs.
 *
 * Checking the cache costs one stat per input (~150 files, ~2 ms); a rebuild
 * ~0.5 s. Builds land in a fresh folder and the manifest that names them is
 * swapped in by rename, so concurrent first runs (parallel tests) never see a
 * half-written build; old builds are removed a day later (a process started
 * from one may still load its chunks).
 */
import { existsSync, mkdirSync, readFileSync, readdirSync, renameSync, rmSync, statSync, writeFileSync } from 'node:fs';
import { builtinModules } from 'node:module';
import { dirname, join } from 'node:path';
import { pathToFileURL } from 'node:url';

/** Bump when the build settings below change: every cached build is then stale. */
const FORMAT = 3;

/**
 * Pure-JS packages an idle relay or tracker loads, bundled in (with what they
 * import): one parsed file instead of ~100 CommonJS modules each wrapped and
 * cached by Node's loader, ~9 MB less RSS for an idle relay. Everything else
 * (onnxruntime, Playwright, vite, native addons) stays a runtime import.
 */
const INLINE = new Set(['commander', 'ws', 'pino', 'prom-client', 'zod']);
/** Optional native addons some inlined packages try to require: always runtime imports. */
const NATIVE = new Set(['bufferutil', 'utf-8-validate']);
const BUILTINS = new Set(builtinModules);

function packageName(specifier) {
  const parts = specifier.split('/');
  return specifier.startsWith('@') ? parts.slice(0, 2).join('/') : parts[0];
}

const chooseExternals = {
  name: 'meshnet:externals',
  setup(build) {
    build.onResolve({ filter: /^[^./]/ }, (args) => {
      const name = packageName(args.path);
      if (args.path.startsWith('node:') || BUILTINS.has(name)) return { path: args.path, external: true };
      if (NATIVE.has(name)) return { path: args.path, external: true };
      const fromPackage = args.importer.includes(`${'/'}node_modules${'/'}`);
      return fromPackage || INLINE.has(name) ? undefined : { path: args.path, external: true };
    });
  },
};
const KEEP_OLD_BUILDS_MS = 24 * 3600 * 1000;

function fingerprint(path) {
  const s = statSync(path);
  return `${s.size}:${s.mtimeMs}`;
}

/** The cached build's entry file when every input is unchanged, else undefined. */
export function cachedEntry(root, cacheDir) {
  let m;
  try {
    m = JSON.parse(readFileSync(join(cacheDir, 'manifest.json'), 'utf8'));
  } catch {
    return undefined;
  }
  if (m.format !== FORMAT || typeof m.entry !== 'string' || typeof m.inputs !== 'object') return undefined;
  for (const [file, fp] of Object.entries(m.inputs)) {
    try {
      if (fingerprint(join(root, file)) !== fp) return undefined;
    } catch {
      return undefined;
    }
  }
  const entry = join(cacheDir, m.entry);
  return existsSync(entry) ? entry : undefined;
}

/**
 * esbuild writes the bundle elsewhere, so each bundled file's idea of where it
 * lives is pinned to where it really is: `import.meta.url` (dirname,
 * filename) in our sources, `__dirname`/`__filename` in bundled CommonJS
 * packages. Code that finds files next to itself keeps finding them.
 */
const keepLocation = {
  name: 'meshnet:keep-location',
  setup(build) {
    build.onLoad({ filter: /\.[cm]?[jt]s$/ }, (args) => {
      const src = readFileSync(args.path, 'utf8');
      const loader = /\.[cm]?ts$/.test(args.path) ? 'ts' : 'js';
      if (args.path.includes(`${'/'}node_modules${'/'}`)) {
        if (!/\b__(dirname|filename)\b/.test(src)) return undefined;
        const pin = `var __dirname = ${JSON.stringify(dirname(args.path))}, __filename = ${JSON.stringify(args.path)};\n`;
        const shebang = src.startsWith('#!') ? src.indexOf('\n') + 1 : 0;
        return { contents: src.slice(0, shebang) + pin + src.slice(shebang), loader, resolveDir: dirname(args.path) };
      }
      if (!src.includes('import.meta.')) return undefined;
      const contents = src
        .replaceAll('import.meta.url', JSON.stringify(pathToFileURL(args.path).href))
        .replaceAll('import.meta.dirname', JSON.stringify(dirname(args.path)))
        .replaceAll('import.meta.filename', JSON.stringify(args.path));
      return { contents, loader, resolveDir: dirname(args.path) };
    });
  },
};

/** Bundle `entry` (relative to `root`) into a new folder of `cacheDir`; returns the bundle's entry file. */
export async function buildBundle(root, entry, cacheDir) {
  const esbuild = await import('esbuild');
  const dir = `build-${Date.now().toString(36)}-${process.pid}-${Math.random().toString(36).slice(2, 8)}`;
  const outdir = join(cacheDir, dir);
  mkdirSync(cacheDir, { recursive: true });
  let result;
  try {
    result = await esbuild.build({
      absWorkingDir: root,
      entryPoints: [entry],
      bundle: true,
      splitting: true,
      format: 'esm',
      platform: 'node',
      target: 'node20',
      // Other packages resolve from node_modules at run time, as under tsx (the cache lives inside node_modules);
      // CommonJS code bundled in calls `require` for builtins and addons: give it Node's.
      banner: { js: "import { createRequire as __meshnetRequire } from 'node:module'; const require = __meshnetRequire(import.meta.url);" },
      outdir,
      entryNames: '[name]',
      chunkNames: 'chunks/[name]-[hash]',
      sourcemap: 'linked',
      metafile: true,
      logLevel: 'silent',
      plugins: [chooseExternals, keepLocation],
    });
  } finally {
    await esbuild.stop?.();
  }
  const inputs = {};
  for (const file of Object.keys(result.metafile.inputs)) inputs[file] = fingerprint(join(root, file));
  const out = Object.entries(result.metafile.outputs).find(([, o]) => o.entryPoint === entry);
  if (!out) throw new Error(`esbuild wrote no output for ${entry}`);
  // Output paths in the metafile are relative to absWorkingDir.
  const entryFile = join(root, out[0]);
  const manifest = { format: FORMAT, entry: join(dir, entryFile.slice(outdir.length + 1)), inputs };
  const tmp = join(cacheDir, `manifest.${process.pid}.${Math.random().toString(36).slice(2)}.tmp`);
  writeFileSync(tmp, JSON.stringify(manifest));
  renameSync(tmp, join(cacheDir, 'manifest.json'));
  removeOldBuilds(cacheDir, dir);
  return entryFile;
}

function removeOldBuilds(cacheDir, keep) {
  const now = Date.now();
  for (const name of readdirSync(cacheDir)) {
    if (!name.startsWith('build-') || name === keep) continue;
    try {
      if (now - statSync(join(cacheDir, name)).mtimeMs > KEEP_OLD_BUILDS_MS) rmSync(join(cacheDir, name), { recursive: true, force: true });
    } catch {
      // another process removed it first
    }
  }
}

/** The entry to import: the cached bundle, rebuilt when stale; undefined when no bundle can be had (then run the sources under tsx). */
export async function bundledEntry(root, entry, cacheDir = process.env.MESHNET_CLI_CACHE || join(root, 'node_modules', '.cache', 'meshnet-cli')) {
  const cached = cachedEntry(root, cacheDir);
  if (cached) return cached;
  try {
    return await buildBundle(root, entry, cacheDir);
  } catch (e) {
    if (process.env.MESHNET_DEBUG) process.stderr.write(`meshnet: no bundle (${e.message}); running the sources under tsx\n`);
    return undefined;
  }
}
