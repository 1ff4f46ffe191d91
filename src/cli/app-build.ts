/**
 * The donor page to serve. The project's own `dist/` is built with vite when
 * missing; a directory given by the user is served only if it already holds a
 * built app, and never built into: `vite build` empties its output folder,
 * and a folder the project did not create is not ours to empty.
 */
import { existsSync, readdirSync, statSync } from 'node:fs';
import { join, resolve } from 'node:path';
import { CliError } from './failure.ts';
import { REPO_ROOT } from './paths.ts';

export const APP_DIST = join(REPO_ROOT, 'dist');

export interface BuiltAppOptions {
  /** A built app to serve as it is. */
  dir?: string;
  /** Rebuild the project's dist/ even when it exists. */
  rebuild?: boolean;
  /** Progress lines (the build takes a while). */
  log?(message: string): void;
}

/** The directory holding the built app: `dir`, checked, or the project's dist/, built when needed. */
export async function builtApp(o: BuiltAppOptions = {}): Promise<string> {
  if (o.dir !== undefined && resolve(o.dir) !== APP_DIST) {
    if (o.rebuild) throw new CliError(`--rebuild rebuilds the project's own dist/ and cannot build into ${o.dir}: drop --dir, or build elsewhere and serve that folder`);
    const dir = resolve(o.dir);
    if (!existsSync(dir) || !statSync(dir).isDirectory()) throw new CliError(`${o.dir} is not a directory: give --dir a built app (a folder with index.html), or drop --dir to serve the project's dist/`);
    if (!existsSync(join(dir, 'index.html'))) throw new CliError(`${o.dir} holds no built app (no index.html); it is left untouched: run \`npm run build:app\` and drop --dir to serve the project's dist/, or point --dir at a built app`);
    return dir;
  }
  const stale = !o.rebuild && existsSync(join(APP_DIST, 'index.html')) && appSourcesNewerThan(statSync(join(APP_DIST, 'index.html')).mtimeMs);
  if (o.rebuild || stale || !existsSync(join(APP_DIST, 'index.html'))) {
    o.log?.(`building the donor page into ${APP_DIST} (vite build${stale ? ': sources changed since the last build' : ''})…`);
    // vite is a dev dependency: imported only when a build is needed.
    const { build } = await import('vite');
    await build({ root: REPO_ROOT, logLevel: 'warn', build: { outDir: APP_DIST } });
  }
  return APP_DIST;
}

/** What the page is built from: the sources it bundles and the build's own inputs. */
const APP_INPUTS = ['src', 'workers', 'index.html', 'vite.config.ts', 'package-lock.json', 'public'];

/**
 * True when a page input changed after `builtAt`: a dist/ left by an older
 * checkout would otherwise serve an old page (new URL parameters ignored,
 * old protocol) beside new Node.js code.
 */
export function appSourcesNewerThan(builtAt: number, root = REPO_ROOT): boolean {
  const newer = (path: string): boolean => {
    if (!existsSync(path)) return false;
    const st = statSync(path);
    if (!st.isDirectory()) return st.mtimeMs > builtAt;
    return readdirSync(path).some((name) => newer(join(path, name)));
  };
  return APP_INPUTS.some((p) => newer(join(root, p)));
}
