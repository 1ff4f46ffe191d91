/**
 * The wire dtype, end to end on real `meshnet node` processes serving the
 * `small` fixture (12 layers, hidden 512): a 3-node split with f32 between
 * hops gives the un-split greedy tokens exactly; with bf16 (the default) the
 * split rounds every hop's activation and may flip a near-tie, which is
 * reported here, not asserted. A hop configured for one dtype refuses any
 * other with a clear 400 and keeps serving.
 *
 * Nodes: the un-split head [0,12); two heads [0,4) (f32 and default bf16);
 * a lenient middle [4,8) (no --wire-dtype: accepts all three, answers in
 * kind); two tails [8,12), one strict f32, one lenient.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ensureModel } from '../../src/cli/models.ts';
import { startStaticServer, type StaticServer } from '../../src/cli/static-server.ts';
import { encodeTensor } from '../../src/protocol/tensor.ts';
import type { GenerateEvent } from '../../src/protocol/tracker.ts';
import { collectEvents, generateDirect, hopOf, startNode, testSigner, tokenIds, type NodeProc } from '../helpers/mesh.ts';

const NEW_TOKENS = 64;
const HIDDEN = 512;
// The prompt of bench/mesh-node.ts, whose bf16 3-node split first differed from the un-split run at token 47.
const MESSAGES = [{ role: 'user', content: 'Write a short story about a lighthouse keeper and a storm at sea.' }];

function firstDivergence(a: number[], b: number[]): number | null {
  const n = Math.min(a.length, b.length);
  for (let i = 0; i < n; i++) if (a[i] !== b[i]) return i;
  return a.length === b.length ? null : n;
}

describe('wire dtype between hops (small, 3-node split)', () => {
  let st: StaticServer;
  let signer: Awaited<ReturnType<typeof testSigner>>;
  let whole: NodeProc, headF32: NodeProc, headBf16: NodeProc, middle: NodeProc, tailF32: NodeProc, tail: NodeProc;

  const generate = async (head: NodeProc, hops: ReturnType<typeof hopOf>[]): Promise<GenerateEvent[]> =>
    collectEvents(generateDirect(head.endpoint, await signer.sign(head.peerId, hops), { messages: MESSAGES, max_tokens: NEW_TOKENS, temperature: 0, session_id: 'wire-dtype' }));

  beforeAll(async () => {
    st = await startStaticServer({ root: await ensureModel('small') });
    signer = await testSigner();
    const common = ['--model-url', st.url, '--tracker-key', signer.publicKey, '--budget-mb', '512', '--max-context', '256', '--no-links'];
    // Two at a time: loading is CPU-bound and this machine may have two cores.
    [whole, headF32] = await Promise.all([startNode([...common, '--layers', '0-12']), startNode([...common, '--layers', '0-4', '--wire-dtype', 'f32'])]);
    [headBf16, middle] = await Promise.all([startNode([...common, '--layers', '0-4']), startNode([...common, '--layers', '4-8'])]);
    [tailF32, tail] = await Promise.all([startNode([...common, '--layers', '8-12', '--wire-dtype', 'f32']), startNode([...common, '--layers', '8-12'])]);
  }, 240_000);

  afterAll(async () => {
    await Promise.all([whole, headF32, headBf16, middle, tailF32, tail].filter(Boolean).map((n) => n.stop()));
    await st?.close();
  });

  it('gives the un-split greedy tokens exactly with f32 on the wire; bf16 is reported', async () => {
    const unsplit = tokenIds(await generate(whole, []));
    expect(unsplit).toHaveLength(NEW_TOKENS);
    const f32 = tokenIds(await generate(headF32, [hopOf(middle, 4, 8, 'direct'), hopOf(tailF32, 8, 12, 'direct')]));
    expect(f32).toEqual(unsplit);
    const bf16Events = await generate(headBf16, [hopOf(middle, 4, 8, 'direct'), hopOf(tail, 8, 12, 'direct')]);
    const bf16 = tokenIds(bf16Events);
    expect(bf16Events.at(-1)?.type).toBe('done');
    expect(bf16).toHaveLength(NEW_TOKENS);
    const d = firstDivergence(bf16, unsplit);
    console.log(`[wire-dtype] ${NEW_TOKENS} greedy tokens, 3-node split vs un-split: f32 first divergence none; bf16 first divergence ${d ?? 'none'}`);
  });

  it('refuses, with a 400 that names the dtypes, a body in another dtype than the hop expects or a length that does not match dtype × shape, and keeps serving', async () => {
    const row = new Float32Array(HIDDEN).map((_, i) => Math.sin(i) * 0.1);
    const post = (node: NodeProc, dtype: string, body: Uint8Array<ArrayBuffer>) =>
      fetch(`${node.endpoint}/forward`, { method: 'POST', headers: { 'content-type': 'application/octet-stream', 'x-meshnet-shape': `1,1,${HIDDEN}`, 'x-meshnet-dtype': dtype }, body });
    const err = async (res: Response) => ((await res.json()) as { error: { code: string; message: string } }).error;

    const wrongDtype = await post(tailF32, 'bf16', encodeTensor(row, 'bf16') as Uint8Array<ArrayBuffer>);
    expect(wrongDtype.status).toBe(400);
    const e1 = await err(wrongDtype);
    expect(e1.code).toBe('MESH_ERR_BAD_REQUEST');
    expect(e1.message).toMatch(/x-meshnet-dtype is bf16.*sends f32/);

    // f32 announced, bf16 bytes: half the length the shape needs.
    const short = await post(tailF32, 'f32', encodeTensor(row, 'bf16') as Uint8Array<ArrayBuffer>);
    expect(short.status).toBe(400);
    const e2 = await err(short);
    expect(e2.code).toBe('MESH_ERR_BAD_SHAPE');
    expect(e2.message).toContain(`needs ${HIDDEN * 4}`);

    const unknown = await post(middle, 'f64', new Uint8Array(HIDDEN * 8));
    expect(unknown.status).toBe(400);
    expect((await err(unknown)).message).toMatch(/not one of bf16, f16, f32/);

    // /info says what the hop takes.
    expect(((await (await fetch(`${tailF32.endpoint}/info`)).json()) as { wire_dtypes: string[] }).wire_dtypes).toEqual(['f32']);
    expect(((await (await fetch(`${middle.endpoint}/info`)).json()) as { wire_dtypes: string[] }).wire_dtypes).toEqual(['bf16', 'f16', 'f32']);

    // A bf16 head routed through the strict f32 tail: the generation ends with an error that says why (no tracker here to replace the hop).
    const mixed = await generate(headBf16, [hopOf(middle, 4, 8, 'direct'), hopOf(tailF32, 8, 12, 'direct')]);
    const last = mixed.at(-1)!;
    expect(last.type).toBe('error');
    expect(last.type === 'error' && last.message).toMatch(/sends f32/);

    // Still serving: a right request right after.
    const ok = await post(tailF32, 'f32', encodeTensor(row, 'f32') as Uint8Array<ArrayBuffer>);
    expect(ok.status).toBe(200);
    expect(((await ok.json()) as { token_id: number }).token_id).toBeGreaterThanOrEqual(0);
  });
});
