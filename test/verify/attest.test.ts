/**
 * Attestations (src/verify/attest.ts, attestor.ts): a hop's signature over
 * the hash chain of every step it ran verifies against an independent
 * recomputation of that chain from the bytes, and against nothing else
 * (another session, other bytes, another span, a forged signature). The
 * reference chain here hashes with node:crypto, so the pure-JS SHA-256 the
 * node core uses is checked against an independent implementation too.
 */
import { hash } from 'node:crypto';
import { describe, expect, it } from 'vitest';
import { Identity, verifyEd25519 } from '../../src/net/identity.ts';
import { appendAttestation, attestMessage, attestSeed, chainDigest, chainStep, formatAttestation, parseAttestations, sha256, tokenBytes, type AttestScope, type StepDigest } from '../../src/verify/attest.ts';
import { Attestor } from '../../src/verify/attestor.ts';

const scope: AttestScope = { model: 'm', session: 'sess.1', startLayer: 2, endLayer: 4, dtype: 'bf16' };
function bytes(n: number, seed: number): Uint8Array {
  const b = new Uint8Array(n);
  for (let i = 0; i < n; i++) b[i] = (i * 31 + seed) & 0xff;
  return b;
}

/** Waits (up to 5 s) until the session's latest attestation is out: signing runs behind the answers, a few timer turns later. */
async function latestOf(att: Attestor, session: string): Promise<string | undefined> {
  for (let i = 0; i < 500 && att.latest(session) === undefined; i++) await new Promise((r) => setTimeout(r, 10));
  return att.latest(session);
}

const nodeSha = (b: Uint8Array): Uint8Array => new Uint8Array(hash('sha256', b, 'buffer'));

function digests(steps: Array<[number, number, Uint8Array, Uint8Array]>): StepDigest[] {
  return steps.map(([position, rows, i, o]) => ({ position, rows, input: nodeSha(i), output: nodeSha(o) }));
}

/** The chain as docs/protocol.md §11 defines it, computed with node:crypto alone. */
function refChain(sc: AttestScope, steps: readonly StepDigest[]): Uint8Array {
  const tail = sc.sampling !== undefined ? `\0${sc.sampling}` : '';
  let acc = nodeSha(new TextEncoder().encode(`meshnet-attest-v1\0${sc.model}\0${sc.session}\0${sc.startLayer}:${sc.endLayer}:${sc.dtype}${tail}`));
  for (const st of steps) {
    const pr = Buffer.alloc(8);
    pr.writeUInt32LE(st.position, 0);
    pr.writeUInt32LE(st.rows, 4);
    acc = nodeSha(Buffer.concat([acc, pr, st.input, st.output]));
  }
  return acc;
}

describe('SHA-256 is the same on every host', () => {
  it('gives node:crypto\'s digest for every length around the block boundaries, views into larger buffers, and large rows', () => {
    const big = bytes(1 << 20, 5);
    for (let n = 0; n <= 200; n++) expect(sha256(big.subarray(0, n))).toEqual(nodeSha(big.subarray(0, n)));
    for (const n of [1000, 4096, 8191, 65536, 1 << 20]) expect(sha256(big.subarray(0, n))).toEqual(nodeSha(big.subarray(0, n)));
    // A view at an odd offset (rows are subarrays of one wire buffer).
    const view = big.subarray(3, 3 + 777);
    expect(sha256(view)).toEqual(nodeSha(view));
    expect(sha256(view)).toBeInstanceOf(Uint8Array);
  });

  it('chains steps exactly as docs/protocol.md §11 says (seed with and without sampling, step bytes)', () => {
    const steps = digests([[0, 3, bytes(24, 1), bytes(24, 2)], [3, 1, bytes(8, 3), tokenBytes(9, -1.5)]]);
    for (const sc of [scope, { ...scope, sampling: 'temperature=0.8;seed=7' }]) {
      expect(chainDigest(sc, steps)).toEqual(refChain(sc, steps));
      expect(chainStep(attestSeed(sc), steps[0]!)).toEqual(refChain(sc, steps.slice(0, 1)));
    }
  });
});

describe('a hop attests every step it ran', () => {
  it('signs the chain of its steps; the signature verifies against the chain recomputed from the bytes, and nothing else', async () => {
    const id = await Identity.generate();
    const att = new Attestor({ peerId: id.peerId, sign: (b) => id.sign(b) });
    const steps: Array<[number, number, Uint8Array, Uint8Array]> = [
      [0, 5, bytes(5 * 8, 1), bytes(5 * 8, 2)],
      [5, 1, bytes(8, 3), bytes(8, 4)],
      [6, 1, bytes(8, 5), tokenBytes(17, -0.25)],
    ];
    for (const [p, n, i, o] of steps) att.record(scope, p, n, i, o);
    const entry = await att.finish(scope.session);
    const [a] = parseAttestations(entry);
    expect(a).toMatchObject({ peer: id.peerId, rows: 7 });
    const acc = refChain(scope, digests(steps));
    expect(await verifyEd25519(id.publicKey, attestMessage(scope.session, 7, acc), a!.signature)).toBe(true);
    // Another session, another output byte, another span: no.
    expect(await verifyEd25519(id.publicKey, attestMessage('sess.2', 7, acc), a!.signature)).toBe(false);
    const tampered = steps.map((s) => [...s] as typeof s);
    tampered[1]![3] = bytes(8, 99);
    expect(await verifyEd25519(id.publicKey, attestMessage(scope.session, 7, refChain(scope, digests(tampered))), a!.signature)).toBe(false);
    expect(await verifyEd25519(id.publicKey, attestMessage(scope.session, 7, refChain({ ...scope, endLayer: 5 }, digests(steps))), a!.signature)).toBe(false);
    // The session is forgotten once finished.
    expect(att.sessions).toBe(0);
  });

  it('hands out the latest finished attestation while the session runs, and restarts the chain on a replay from 0', async () => {
    const id = await Identity.generate();
    const att = new Attestor({ peerId: id.peerId, sign: (b) => id.sign(b), signEvery: 1 });
    att.record(scope, 0, 3, bytes(24, 1), bytes(24, 2));
    expect(att.latest(scope.session)).toBeUndefined(); // signing runs behind the answer
    expect(parseAttestations(await latestOf(att, scope.session))[0]!.rows).toBe(3);
    // A replay from position 0 (after a 409): the chain starts over, covering only what was replayed.
    att.record(scope, 0, 2, bytes(16, 7), bytes(16, 8));
    const [a] = parseAttestations(await att.finish(scope.session));
    expect(a!.rows).toBe(2);
    const acc = refChain(scope, digests([[0, 2, bytes(16, 7), bytes(16, 8)]]));
    expect(await verifyEd25519(id.publicKey, attestMessage(scope.session, 2, acc), a!.signature)).toBe(true);
  });

  it('signs once every signEvery steps over the chain head, and the final signature covers every step', async () => {
    const id = await Identity.generate();
    const signed: number[] = [];
    const att = new Attestor({ peerId: id.peerId, sign: (b) => (signed.push(1), id.sign(b)), signEvery: 4 });
    const steps: Array<[number, number, Uint8Array, Uint8Array]> = [[0, 6, bytes(48, 1), bytes(48, 2)]];
    for (let p = 6; p < 15; p++) steps.push([p, 1, bytes(8, p), bytes(8, p + 50)]);
    for (const [p, n, i, o] of steps.slice(0, 3)) att.record(scope, p, n, i, o);
    await new Promise((r) => setTimeout(r, 30));
    expect(att.latest(scope.session)).toBeUndefined(); // 3 steps: nothing signed yet
    expect(signed).toHaveLength(0);
    att.record(scope, ...steps[3]!);
    // The 4th step: one signature over the chain head, vouching for all 4 steps (9 rows).
    const [mid] = parseAttestations(await latestOf(att, scope.session));
    expect(mid!.rows).toBe(9);
    expect(await verifyEd25519(id.publicKey, attestMessage(scope.session, 9, refChain(scope, digests(steps.slice(0, 4)))), mid!.signature)).toBe(true);
    for (const s of steps.slice(4)) att.record(scope, ...s);
    const [fin] = parseAttestations(await att.finish(scope.session));
    expect(fin!.rows).toBe(15);
    expect(await verifyEd25519(id.publicKey, attestMessage(scope.session, 15, refChain(scope, digests(steps))), fin!.signature)).toBe(true);
    // 10 steps: one signature after steps 4 and 8, one at the end.
    expect(signed).toHaveLength(3);
  });

  it('signs a long prompt at once (signBytes)', async () => {
    const id = await Identity.generate();
    const att = new Attestor({ peerId: id.peerId, sign: (b) => id.sign(b), signBytes: 1000 });
    const prompt: [number, number, Uint8Array, Uint8Array] = [0, 80, bytes(640, 3), bytes(640, 4)];
    att.record(scope, ...prompt);
    const [a] = parseAttestations(await latestOf(att, scope.session));
    expect(a!.rows).toBe(80);
    expect(await verifyEd25519(id.publicKey, attestMessage(scope.session, 80, refChain(scope, digests([prompt]))), a!.signature)).toBe(true);
  });

  it('hashes a long prompt in pieces (between turns of the event loop) to the same chain', async () => {
    const id = await Identity.generate();
    const att = new Attestor({ peerId: id.peerId, sign: (b) => id.sign(b), signEvery: 2 });
    // 1 MiB in and out (a 128-row prompt of a 4096-wide bf16 model), then a decode step.
    const steps: Array<[number, number, Uint8Array, Uint8Array]> = [[0, 128, bytes(1 << 20, 1), bytes(1 << 20, 2)], [128, 1, bytes(8192, 3), bytes(8192, 4)]];
    for (const s of steps) att.record(scope, ...s);
    const [a] = parseAttestations(await att.finish(scope.session));
    expect(a!.rows).toBe(129);
    expect(await verifyEd25519(id.publicKey, attestMessage(scope.session, 129, refChain(scope, digests(steps))), a!.signature)).toBe(true);
  });

  it('chains a step that starts before the previous one ended (rows cut back) as computed: it covers every computed row', async () => {
    const id = await Identity.generate();
    const att = new Attestor({ peerId: id.peerId, sign: (b) => id.sign(b) });
    // A prompt of 4, a verification of 5 rows [4, 9) of which 2 were kept, the next step at 6.
    const steps: Array<[number, number, Uint8Array, Uint8Array]> = [
      [0, 4, bytes(32, 1), bytes(32, 2)],
      [4, 5, bytes(40, 3), bytes(40, 4)],
      [6, 3, bytes(24, 5), bytes(24, 6)],
    ];
    for (const s of steps) att.record(scope, ...s);
    const [a] = parseAttestations(await att.finish(scope.session));
    expect(a!.rows).toBe(12);
    expect(await verifyEd25519(id.publicKey, attestMessage(scope.session, 12, refChain(scope, digests(steps))), a!.signature)).toBe(true);
  });

  it('signs nothing for a step that does not follow the chain (it could not be verified)', async () => {
    const id = await Identity.generate();
    const att = new Attestor({ peerId: id.peerId, sign: (b) => id.sign(b) });
    att.record(scope, 4, 1, bytes(8, 1), bytes(8, 2));
    expect(await att.finish(scope.session)).toBeUndefined();
    att.record(scope, 0, 2, bytes(16, 1), bytes(16, 2));
    att.record(scope, 5, 1, bytes(8, 1), bytes(8, 2)); // a gap: the chain is dropped
    expect(await att.finish(scope.session)).toBeUndefined();
  });

  it('keeps at most maxSessions chains, the least recently used dropped first', async () => {
    const id = await Identity.generate();
    const att = new Attestor({ peerId: id.peerId, sign: (b) => id.sign(b), maxSessions: 2 });
    for (const s of ['a', 'b', 'c']) att.record({ ...scope, session: s }, 0, 1, bytes(8, 1), bytes(8, 2));
    expect(att.sessions).toBe(2);
    expect(await att.finish('a')).toBeUndefined();
    expect(await att.finish('c')).toBeDefined();
  });
});

describe('the X-Meshnet-Attest header', () => {
  it('lists one entry per hop and skips malformed ones', () => {
    const sig = new Uint8Array(64).fill(7);
    const e1 = formatAttestation({ peer: 'a'.repeat(32), rows: 12, signature: sig });
    const e2 = formatAttestation({ peer: 'b'.repeat(32), rows: 3, signature: sig });
    const v = appendAttestation(appendAttestation(undefined, e1), e2);
    expect(parseAttestations(v).map((a) => [a.peer[0], a.rows])).toEqual([['a', 12], ['b', 3]]);
    expect(parseAttestations(`${e1};garbage;${'c'.repeat(32)}.1.short;${e2}`)).toHaveLength(2);
    expect(parseAttestations(undefined)).toEqual([]);
  });
});
