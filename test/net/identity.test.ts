import { createHash } from 'node:crypto';
import { describe, expect, it } from 'vitest';
import { Identity, MemoryKeyStore, verifyEd25519 } from '../../src/net/identity.ts';
import { MeshError, registrationMessage } from '../../src/protocol/index.ts';

describe('Identity', () => {
  it('derives the peer id as hex of the first 16 bytes of SHA-256 of the raw 32-byte public key', async () => {
    const id = await Identity.generate();
    expect(id.publicKey.byteLength).toBe(32);
    expect(id.peerId).toBe(createHash('sha256').update(id.publicKey).digest().subarray(0, 16).toString('hex'));
  });

  it('signs so that the public key verifies, and a changed message does not', async () => {
    const id = await Identity.generate();
    const sig = await id.sign(registrationMessage('abcd'));
    expect(sig.byteLength).toBe(64);
    expect(await verifyEd25519(id.publicKey, registrationMessage('abcd'), sig)).toBe(true);
    expect(await verifyEd25519(id.publicKey, registrationMessage('abce'), sig)).toBe(false);
  });

  it.each(['jwk', 'pkcs8'] as const)('round-trips through %s with the same peer id and a working key', async (format) => {
    const id = await Identity.generate();
    const stored = JSON.parse(JSON.stringify(await id.export(format)));
    const back = await Identity.fromStored(stored);
    expect(back.peerId).toBe(id.peerId);
    expect(await verifyEd25519(id.publicKey, registrationMessage('x1'), await back.sign(registrationMessage('x1')))).toBe(true);
  });

  it('keeps its peer id across loadOrCreate calls on the same store', async () => {
    const store = new MemoryKeyStore();
    const a = await Identity.loadOrCreate(store);
    const b = await Identity.loadOrCreate(store);
    expect(b.peerId).toBe(a.peerId);
    expect((await Identity.loadOrCreate(new MemoryKeyStore())).peerId).not.toBe(a.peerId);
  });

  it('refuses a stored key whose halves do not match, with a MeshError saying what to do', async () => {
    const a = await Identity.generate();
    const b = await Identity.generate();
    const pa = (await a.export('pkcs8')) as { format: 'pkcs8'; pkcs8: string; publicKey: string };
    const pb = (await b.export('pkcs8')) as { format: 'pkcs8'; pkcs8: string; publicKey: string };
    const err = await Identity.fromStored({ ...pa, publicKey: pb.publicKey }).catch((e: unknown) => e);
    expect(err).toBeInstanceOf(MeshError);
    expect((err as MeshError).message).toMatch(/does not match/);
    // JWK import checks the pair itself (Node says "Invalid JWK"); either way it is refused.
    const ja = (await a.export('jwk')) as { format: 'jwk'; jwk: JsonWebKey };
    const jb = (await b.export('jwk')) as { format: 'jwk'; jwk: JsonWebKey };
    await expect(Identity.fromStored({ format: 'jwk', jwk: { ...ja.jwk, x: jb.jwk.x } })).rejects.toBeInstanceOf(MeshError);
    await expect(Identity.fromStored({ format: 'pkcs8', pkcs8: 'AAAA', publicKey: 'AAAA' })).rejects.toThrow(/delete it/);
  });
});
