/**
 * Speculative decoding on the WebGPU path in Node (Dawn over SwiftShader,
 * correctness only): the fused executor with KV in GPU buffers verifies
 * drafts (greedy from the head graph's ArgMax per row: the logits stay on
 * the device; at T > 0 over the judged rows' logits), the next step's
 * rollback cuts the rejected rows, and the graph-capture lane serves a
 * session cut back while it held it (by a rollback and by truncateSession):
 * every token the float64 reference's.
 */
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import type { OnnxBackend } from '../../src/shard/backend.ts';
import type { ForwardRequest } from '../../src/shard/contract.ts';
import type { FusedShardExecutor } from '../../src/shard/fused-executor.ts';
import { ReferenceModel } from '../../src/model/reference.ts';
import { fixture, prompts } from '../helpers/shard.ts';
import { sharedWebGpu } from '../helpers/webgpu-backend.ts';

const { FusedShardExecutor: Fused } = await import('../../src/shard/fused-executor.ts');

const f = fixture('tiny');
const ref = new ReferenceModel(f.cfg, f.weights);
const PROMPT = prompts(f.cfg.vocabSize, 3, 7)[2]!;
const P = PROMPT.length;
const R = ref.greedy(PROMPT, 14);
const wrong = (t: number) => (t + 1) % f.cfg.vocabSize;

let gpu: OnnxBackend;

beforeAll(async () => {
  gpu = (await sharedWebGpu()).backend;
}, 600_000);

async function token(ex: FusedShardExecutor, req: ForwardRequest) {
  const r = await ex.forward({ sampling: {}, ...req });
  if (r.kind !== 'token') throw new Error('expected a token');
  return r;
}

describe('speculative decoding on WebGPU (fused graphs, KV on the device)', () => {
  // One executor for both (each load compiles its programs again on SwiftShader): graph capture on, which
  // only one-row steps of a whole span use; verifications run uncaptured.
  let ex: FusedShardExecutor;
  beforeAll(async () => {
    ex = await Fused.create({ config: f.cfg, backend: gpu, weights: () => f.weights, startLayer: 0, endLayer: f.cfg.numLayers, projections: 'f32', maxContext: 96, graphCapture: true });
  }, 600_000);
  afterAll(async () => {
    await ex?.release();
  });

  it('verifies on the device (ArgMax per row), cuts back by the next step\'s rollback, and samples at T > 0 over the judged rows', async () => {
    {
      expect(ex.onDevice).toBe(true);
      let r = await token(ex, { session: 's', position: 0, tokenIds: [...PROMPT, R[0]!, R[1]!, wrong(R[2]!)], draft: { ids: [R[0]!, R[1]!, wrong(R[2]!)] } });
      expect(r.spec).toMatchObject({ accepted: 2, tokenIds: R.slice(0, 3) });
      // The logits never came down for a greedy verification.
      expect(r.logits.length).toBe(0);
      r = await token(ex, { session: 's', position: P + 2, rollbackFrom: P + 3, tokenIds: [R[2]!, R[3]!, R[4]!], draft: { ids: [R[3]!, R[4]!] } });
      expect(r.spec).toMatchObject({ accepted: 2, tokenIds: R.slice(3, 6) });
      r = await token(ex, { session: 's', position: P + 5, tokenIds: [R[5]!, wrong(R[6]!)], draft: { ids: [wrong(R[6]!)] } });
      expect(r.spec).toMatchObject({ accepted: 0, tokenIds: [R[6]] });
      r = await token(ex, { session: 's', position: P + 6, rollbackFrom: P + 7, tokenIds: [R[6]!] });
      expect(r.tokenId).toBe(R[7]);
      // T = 0.8: drafts that are speculation off's own draws are all accepted, and the bonus is its next draw.
      const sampling = { temperature: 0.8, seed: 3 };
      const off: number[] = [];
      let o = await token(ex, { session: 'off', position: 0, tokenIds: PROMPT, sampling });
      for (let i = 0; i < 4; i++) {
        off.push(o.tokenId);
        o = await token(ex, { session: 'off', position: P + i, tokenIds: [o.tokenId], sampling });
      }
      off.push(o.tokenId);
      const v = await token(ex, { session: 'on', position: 0, tokenIds: [...PROMPT, ...off.slice(0, 4)], sampling, draft: { ids: off.slice(0, 4) } });
      expect(v.spec).toMatchObject({ accepted: 4, tokenIds: off });
      for (const id of ['s', 'off', 'on']) ex.dropSession(id);
    }
  }, 600_000);

  it('the capture lane serves a session cut back while it held it (rollback, then truncateSession)', async () => {
    {
      await token(ex, { session: 'c', position: 0, tokenIds: PROMPT });
      // Captured one-token steps: the lane holds the session.
      for (let i = 0; i < 3; i++) expect((await token(ex, { session: 'c', position: P + i, tokenIds: [R[i]!] })).tokenId).toBe(R[i + 1]);
      const steps = ex.captureStats()!.steps;
      // A verification runs uncaptured (the lane hands the rows back first), one draft rejected.
      const r = await token(ex, { session: 'c', position: P + 3, tokenIds: [R[3]!, R[4]!, wrong(R[5]!)], draft: { ids: [R[4]!, wrong(R[5]!)] } });
      expect(r.spec).toMatchObject({ accepted: 1, tokenIds: [R[4], R[5]] });
      // Back on the lane after the rollback: the rejected row is not among the rows it takes in.
      expect((await token(ex, { session: 'c', position: P + 5, rollbackFrom: P + 6, tokenIds: [R[5]!] })).tokenId).toBe(R[6]);
      expect((await token(ex, { session: 'c', position: P + 6, tokenIds: [R[6]!] })).tokenId).toBe(R[7]);
      // Cut back while the lane holds it, and on from there.
      expect(ex.truncateSession('c', P + 4)).toBe(true);
      expect((await token(ex, { session: 'c', position: P + 4, tokenIds: [R[4]!] })).tokenId).toBe(R[5]);
      expect((await token(ex, { session: 'c', position: P + 5, tokenIds: [R[5]!] })).tokenId).toBe(R[6]);
      expect(ex.captureStats()!.steps).toBeGreaterThan(steps + 2);
    }
  }, 600_000);
});
