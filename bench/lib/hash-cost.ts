/**
 * What a hop's attestation hashing costs per step, host-free so the same code
 * runs in Node.js and in a page (bench/attest-hash.ts bundles it for
 * Chromium). A step hashes its input rows, its output rows and one 104-byte
 * chain step (src/verify/attest.ts); `sync` implementations run the three in
 * a row, WebCrypto as the attestor used to (the two row digests together,
 * then the chain step, each awaited).
 */
import { sha256 as nobleSha256 } from '@noble/hashes/sha2.js';

export interface HashCostCase {
  name: string;
  /** Bytes of one step's input (and output) rows. */
  bytes: number;
}

export interface HashCostRow {
  impl: string;
  case: string;
  bytes: number;
  /** Median over repeats of the wall time per step, µs. */
  usPerStep: number;
}

type Sync = (b: Uint8Array) => Uint8Array;

function filled(n: number, seed: number): Uint8Array {
  const b = new Uint8Array(n);
  for (let i = 0; i < n; i++) b[i] = (i * 31 + seed) & 0xff;
  return b;
}

function median(xs: number[]): number {
  const s = [...xs].sort((a, b) => a - b);
  const m = s.length >> 1;
  return s.length % 2 ? s[m]! : (s[m - 1]! + s[m]!) / 2;
}

/** Steps per timed repeat: about `budgetBytes` hashed, at least 50 steps. */
const stepsFor = (bytes: number, budgetBytes: number) => Math.max(50, Math.floor(budgetBytes / (2 * bytes + 104)));

/**
 * Time each implementation on each case, alternating implementations within
 * every repeat (they share the machine's load), medians over `repeats`.
 */
export async function measureHashCost(cases: readonly HashCostCase[], sync: Record<string, Sync>, opts: { repeats: number; budgetBytes: number; webCrypto: boolean }): Promise<HashCostRow[]> {
  const subtle = opts.webCrypto ? globalThis.crypto?.subtle : undefined;
  const impls: Array<[string, (input: Uint8Array, output: Uint8Array, chain: Uint8Array) => unknown]> = Object.entries(sync).map(([name, h]) => [name, (i, o, c) => (h(i), h(o), h(c))]);
  if (subtle) {
    const d = (b: Uint8Array) => subtle.digest('SHA-256', b as Uint8Array<ArrayBuffer>);
    impls.push(['WebCrypto (awaited)', async (i, o, c) => (await Promise.all([d(i), d(o)]), await d(c))]);
  }
  const rows: HashCostRow[] = [];
  for (const k of cases) {
    const input = filled(k.bytes, 1);
    const output = filled(k.bytes, 2);
    const chain = filled(104, 3);
    const steps = stepsFor(k.bytes, opts.budgetBytes);
    const got = new Map<string, number[]>(impls.map(([n]) => [n, []]));
    for (let r = 0; r <= opts.repeats; r++) {
      for (const [name, step] of impls) {
        const t0 = performance.now();
        for (let s = 0; s < steps; s++) {
          const p = step(input, output, chain);
          if (p instanceof Promise) await p;
        }
        // The first repeat warms the JIT and is dropped.
        if (r > 0) got.get(name)!.push(((performance.now() - t0) * 1000) / steps);
      }
    }
    for (const [name] of impls) rows.push({ impl: name, case: k.name, bytes: k.bytes, usPerStep: median(got.get(name)!) });
  }
  return rows;
}

/** The node core's SHA-256 (src/verify/attest.ts uses the same package). */
export const nobleSha: Sync = (b) => nobleSha256(b);
