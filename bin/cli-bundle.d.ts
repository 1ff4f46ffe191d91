/** Types of bin/cli-bundle.js (plain JS: it runs before any TypeScript loader). */
export function cachedEntry(root: string, cacheDir: string): string | undefined;
export function buildBundle(root: string, entry: string, cacheDir: string): Promise<string>;
export function bundledEntry(root: string, entry: string, cacheDir?: string): Promise<string | undefined>;
