/**
 * The browser node's warm-up of a new executor (src/host/browser/warm-up.ts): it
 * runs the span's own code paths for the asked number of layer runs, stops at
 * its time limit, leaves no session or state behind, and lets the event loop
 * run while it works. Over onnxruntime-node: the warm-up is host-agnostic.
 */
import { describe, expect, it } from 'vitest';
import { warmUp } from '../../../src/host/browser/warm-up.ts';
import type { ShardExecutor } from '../../../src/shard/executor.ts';
import { executor, fixture } from '../../helpers/shard.ts';

const f = fixture('tiny');
const L = f.cfg.numLayers;

describe('warmUp', () => {
  it.each([
    ['a head span (token ids)', 0, 2],
    ['a middle span (activations through the forward handler)', 1, 3],
    ['a span holding the LM head (sampling)', 2, L],
    ['the whole model', 0, L],
  ])('runs %s for the asked layer runs and leaves no session behind', async (_name, start, end) => {
    const ex = await executor(f, start, end);
    const done = await warmUp(ex, { layerRuns: 40, maxMs: 60_000 });
    const layers = end - start;
    expect(done.layerRuns).toBeGreaterThanOrEqual(40);
    expect(done.layerRuns).toBeLessThanOrEqual(40 + 2 * layers);
    expect(done.steps * layers).toBe(done.layerRuns);
    expect(ex.kvStats().sessions).toBe(0);
    await ex.release();
  });

  it('changes nothing a request sees: a warmed executor answers as a fresh one', async () => {
    const fresh = await executor(f, 0, L);
    const warmed = await executor(f, 0, L);
    await warmUp(warmed, { layerRuns: 20, maxMs: 60_000 });
    const ids = [5, 9, 11];
    const a = await fresh.forward({ session: 's', position: 0, tokenIds: ids, sampling: { temperature: 0 } });
    const b = await warmed.forward({ session: 's', position: 0, tokenIds: ids, sampling: { temperature: 0 } });
    expect(b.kind).toBe('token');
    expect(a.kind === 'token' && b.kind === 'token' && a.tokenId === b.tokenId).toBe(true);
    expect(warmed.kvStats().sessions).toBe(1);
    await fresh.release();
    await warmed.release();
  });

  it('stops at maxMs after at least one step', async () => {
    const ex = await executor(f, 1, 3);
    let t = 0;
    // Each reading of the clock moves it 10 ms: the first step's check already passes a 1 ms limit.
    const done = await warmUp(ex, { layerRuns: 10_000, maxMs: 1, now: () => (t += 10) });
    expect(done.steps).toBe(1);
    expect(ex.kvStats().sessions).toBe(0);
    await ex.release();
  });

  it('hands the event loop back while it runs, though every step settles in microtasks', async () => {
    // Like onnxruntime-web's WASM build, whose runs finish inside their promises: without the
    // warm-up's own yields, no timer, socket or page message would run until it ended.
    const h = f.cfg.hiddenSize;
    const sync = {
      config: f.cfg,
      startLayer: 0,
      endLayer: 2,
      maxContext: 256,
      holdsHead: false,
      forward: async () => ({ kind: 'activation', data: new Float32Array(h), shape: [1, 1, h] }),
      dropSession: () => true,
    } as unknown as ShardExecutor;
    let t = 0;
    let fired = false;
    setTimeout(() => (fired = true), 0);
    let firedBeforeEnd = false;
    // A clock that moves 20 ms per reading: every step is past the warm-up's slice.
    const done = await warmUp(sync, {
      layerRuns: 6,
      maxMs: 60_000,
      now: () => {
        if (fired) firedBeforeEnd = true;
        return (t += 20);
      },
    });
    expect(done.steps).toBeGreaterThan(1);
    expect(firedBeforeEnd).toBe(true);
  });
});
