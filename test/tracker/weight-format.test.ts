/**
 * The tracker sizes a node's span by the weight format it announces
 * (`info.weight_format`): a q4 layer is ~6.4x smaller than an f32 one, so the
 * same budget holds that many more layers; f16 holds twice as many.
 */
import { describe, expect, it } from 'vitest';
import { q4Bytes } from '../../src/model/quantize.ts';
import { candidateSpans, chooseSpan, layersThatFit, rebalance } from '../../src/tracker/assignment.ts';
import { sizedFor, spanBytes } from '../../src/tracker/model-registry.ts';
import { FakeNode, MIB, makeTracker, smallSpec } from '../helpers/tracker.ts';

describe('span sizing by weight format', () => {
  const spec = smallSpec();
  // The `small` fixture: hidden 512, 8 heads of 64 (2 KV heads), intermediate 1536, vocab 2048, untied head.
  const projF32 = (2 * 512 * 512 + 2 * 128 * 512 + 3 * 1536 * 512) * 4;
  const projQ4 = 2 * q4Bytes(512, 512, 'symmetric') + 2 * q4Bytes(128, 512, 'symmetric') + 2 * q4Bytes(1536, 512, 'symmetric') + q4Bytes(512, 1536, 'symmetric');
  const norms = 2 * 512 * 4;

  it('costs a q4 layer its 4-bit projections plus f32 norms, ~6.4x less than f32; f16 half', () => {
    const q4 = sizedFor(spec, 'q4');
    const f16 = sizedFor(spec, 'f16');
    expect(sizedFor(spec, 'f32').layerBytes[3]).toBe(projF32 + norms);
    expect(sizedFor(spec, undefined).layerBytes[3]).toBe(projF32 + norms);
    expect(q4.layerBytes[3]).toBe(projQ4 + norms);
    expect(f16.layerBytes[3]).toBe((projF32 + norms) / 2);
    const ratio = spec.layerBytes[3]! / q4.layerBytes[3]!;
    expect(ratio).toBeGreaterThan(6);
    expect(ratio).toBeLessThan(7);
    // The embedding is read exactly (f32 under q4); the untied LM head is quantized, its norm is not.
    expect(q4.embedBytes).toBe(2048 * 512 * 4);
    expect(q4.headBytes).toBe(q4Bytes(2048, 512, 'symmetric') + 512 * 4);
    // KV stays f32 whatever the weights.
    expect(q4.kvBytesPerLayer).toBe(spec.kvBytesPerLayer);
    expect(spanBytes(q4, 3, 5)).toBe(2 * (projQ4 + norms + spec.kvBytesPerLayer));
  });

  it('fits many more q4 layers into the same budget', () => {
    const budget = 40 * MIB;
    const f32 = layersThatFit(spec, budget);
    const q4 = layersThatFit(sizedFor(spec, 'q4'), budget);
    const f16 = layersThatFit(sizedFor(spec, 'f16'), budget);
    expect(f32).toBe(2);
    expect(f16).toBeGreaterThanOrEqual(2 * f32);
    expect(q4).toBeGreaterThanOrEqual(4 * f32);
    const q4Span = chooseSpan(spec, budget, [], 'q4')!;
    const f32Span = chooseSpan(spec, budget, [])!;
    expect(q4Span.end - q4Span.start).toBe(q4);
    expect(f32Span.end - f32Span.start).toBe(f32);
    expect(candidateSpans(sizedFor(spec, 'q4'), budget).every((s) => spanBytes(sizedFor(spec, 'q4'), s.start, s.end) <= budget)).toBe(true);
  });

  it('rebalances each node by its own format', () => {
    const budget = 40 * MIB;
    // A q4 node alone holds 0..k; an f32 node's best move is what its f32 budget allows.
    const moves = rebalance(spec, [{ id: 'q', start: 0, end: 1, throughput: 10, budgetBytes: budget, format: 'q4', movable: true }], 1.1);
    expect(moves).toHaveLength(1);
    expect(moves[0]!.to.end - moves[0]!.to.start).toBe(layersThatFit(sizedFor(spec, 'q4'), budget));
  });
});

describe('registration with a weight format', () => {
  it('assigns a q4 node a longer span than an f32 node with the same budget, and shows the format on the dashboard', async () => {
    const t = await makeTracker();
    const f32 = await FakeNode.create({ memory_budget_mb: 40 });
    const q4 = await FakeNode.create({ memory_budget_mb: 40, weight_format: 'q4' });
    const a = (await f32.register(t)).assignment!;
    const b = (await q4.register(t)).assignment!;
    expect(a.end_layer - a.start_layer).toBe(2);
    expect(b.end_layer - b.start_layer).toBeGreaterThanOrEqual(8);
    const dash = (await (await t.app.request('/api/dashboard')).json()) as { nodes: Array<{ peer_id: string; weight_format: string }> };
    expect(dash.nodes.find((n) => n.peer_id === q4.peerId)!.weight_format).toBe('q4');
    expect(dash.nodes.find((n) => n.peer_id === f32.peerId)!.weight_format).toBe('f32');
  });

  it('sizes a node again when its heartbeat announces another format', async () => {
    const t = await makeTracker();
    const node = await FakeNode.create({ memory_budget_mb: 40 });
    const first = (await node.register(t)).assignment!;
    expect(first.end_layer - first.start_layer).toBe(2);
    node.info = { ...node.info, weight_format: 'q4' };
    const next = (await node.heartbeat(t)).assignment!;
    expect(next.end_layer - next.start_layer).toBeGreaterThanOrEqual(8);
  });

  it('refuses an unknown weight format (400) and registers nothing', async () => {
    const t = await makeTracker();
    const node = await FakeNode.create();
    const res = await node.post(t, '/api/nodes/register', t.clock.now, { info: { ...node.info, weight_format: 'q3' as never } });
    expect(res.status).toBe(400);
    expect(t.registry.nodes.size).toBe(0);
  });
});
