/**
 * The policy of device-recovery.ts on a real SpanSlot: a lost device
 * rebuilds the same span with the loss count the host chooses by, a failed
 * rebuild tries the next fallback, an allocation failure halves the budget
 * the load started under (never twice for one shrink), and a pinned span
 * only logs. The spans are bare records here: the GPU side runs for real in
 * test/gpu/device-loss-mesh.test.ts.
 */
import { describe, expect, it } from 'vitest';
import { MeshError } from '../../../src/protocol/errors.ts';
import { DeviceRecovery, MAX_REBUILDS } from '../../../src/node/runtime/device-recovery.ts';
import type { DeviceLoss, SpanSpec } from '../../../src/node/runtime/host.ts';
import { SpanSlot, type LoadedSpan } from '../../../src/node/runtime/span.ts';

const MiB = 2 ** 20;
const spec = (start: number, end: number): SpanSpec => ({ model: 'm', modelUrl: 'http://x/', startLayer: start, endLayer: end });
const oom = () => new MeshError('MESH_ERR_DEVICE_MEMORY', 'the GPU could not allocate 1000 bytes: test');

interface Built {
  span: LoadedSpan;
  loss: DeviceLoss | undefined;
  lose(reason: string): void;
}

function harness(o: { pinned?: boolean; fail?: (n: number, loss: DeviceLoss | undefined) => Error | undefined } = {}) {
  let budget = 64 * MiB;
  const logs: string[] = [];
  const built: Built[] = [];
  const handled: boolean[] = [];
  // eslint-disable-next-line prefer-const
  let recovery: DeviceRecovery;
  const slot = new SpanSlot(
    async (s) => {
      recovery.loading(s);
      const loss = recovery.lossFor();
      const err = o.fail?.(built.length, loss);
      if (err) {
        built.push({ span: undefined!, loss, lose: () => undefined });
        throw err;
      }
      let lose!: (r: string) => void;
      const deviceLost = new Promise<string>((r) => (lose = r));
      const span = { spec: { ...s }, executor: { release: async () => undefined }, deviceLost } as unknown as LoadedSpan;
      built.push({ span, loss, lose });
      return span;
    },
    {
      onSwap: (next) => recovery.watch(next),
      onFailure: (e, s) => handled.push(recovery.loadFailed(s, e)),
    },
  );
  recovery = new DeviceRecovery({ slot, budget: () => budget, setBudget: (b) => (budget = b), pinned: o.pinned ?? false, log: (_l, m) => logs.push(m) });
  return { slot, recovery, built, handled, logs, budget: () => budget };
}

const settle = async (slot: SpanSlot) => {
  for (let i = 0; i < 5; i++) {
    await new Promise((r) => setTimeout(r, 0));
    await slot.idle();
  }
};

describe('device recovery', () => {
  it('rebuilds the same span after each loss, counting losses, and tries the next fallback when a rebuild fails', async () => {
    // The third build (the rebuild after the second loss) fails once: the next one gets losses + 1.
    const h = harness({ fail: (n) => (n === 2 ? new Error('no fresh device') : undefined) });
    await h.slot.assign(spec(2, 4));
    expect(h.built).toHaveLength(1);
    expect(h.built[0]!.loss).toBeUndefined();

    h.built[0]!.lose('destroyed: device was destroyed');
    await settle(h.slot);
    expect(h.built).toHaveLength(2);
    expect(h.built[1]!.loss).toEqual({ reason: 'destroyed: device was destroyed', losses: 1 });
    expect(h.slot.current).toBe(h.built[1]!.span);
    expect(h.slot.current!.spec).toMatchObject({ startLayer: 2, endLayer: 4 });

    h.built[1]!.lose('unknown: reset');
    await settle(h.slot);
    expect(h.handled).toEqual([true]);
    expect(h.built).toHaveLength(4);
    expect(h.built[2]!.loss?.losses).toBe(2);
    expect(h.built[3]!.loss?.losses).toBe(3);
    expect(h.built[3]!.loss?.reason).toMatch(/rebuilding failed: no fresh device/);
    expect(h.slot.current).toBe(h.built[3]!.span);
    expect(h.logs.filter((l) => /was lost .*rebuilding the span/.test(l))).toHaveLength(2);
  });

  it(`gives up after ${MAX_REBUILDS} failed rebuilds in a row (the runtime's usual load failure then stands)`, async () => {
    const h = harness({ fail: (n) => (n >= 1 ? new Error('nothing works') : undefined) });
    await h.slot.assign(spec(0, 2));
    h.built[0]!.lose('destroyed');
    await settle(h.slot);
    expect(h.handled).toEqual([...Array(MAX_REBUILDS - 1).fill(true), false]);
    expect(h.built).toHaveLength(1 + MAX_REBUILDS);
    expect(h.logs.at(-1)).toMatch(/failed 3 times; giving up/);
  });

  it('a span given up on is not announced, and the next assignment loads it afresh (once a load works it serves again)', async () => {
    let broken = true;
    const h = harness({ fail: (n) => (n >= 1 && broken ? new Error('nothing works') : undefined) });
    await h.slot.assign(spec(0, 2));
    const dead = h.slot.current!;
    expect(h.recovery.gaveUp(dead)).toBe(false);
    h.built[0]!.lose('destroyed');
    await settle(h.slot);
    // While rebuilds are still tried, the span is not given up on (the runtime keeps announcing it, answering 503).
    expect(h.handled).toEqual([...Array(MAX_REBUILDS - 1).fill(true), false]);
    expect(h.slot.current).toBe(dead);
    expect(h.recovery.gaveUp(dead)).toBe(true);
    expect(h.recovery.gaveUp(undefined)).toBe(false);

    // The tracker's next assignment of the same layers: kept as is without a reload, so the runtime asks for one.
    await h.slot.assign(spec(0, 2), h.recovery.gaveUp(h.slot.current));
    await settle(h.slot);
    expect(h.built).toHaveLength(2 + MAX_REBUILDS);
    expect(h.logs.filter((l) => /giving up/.test(l))).toHaveLength(1);
    broken = false;
    await h.slot.assign(spec(0, 2), h.recovery.gaveUp(h.slot.current));
    await settle(h.slot);
    expect(h.slot.current).not.toBe(dead);
    expect(h.slot.current).toBe(h.built.at(-1)!.span);
    expect(h.recovery.gaveUp(h.slot.current)).toBe(false);
    // Without the flag the same spec would have been kept: that is what the runtime's reload avoids.
    await h.slot.assign(spec(0, 2));
    await settle(h.slot);
    expect(h.built).toHaveLength(3 + MAX_REBUILDS);
  });

  it('a span that does not fit the device halves the budget it was loaded under, once per shrink', async () => {
    const h = harness({ fail: () => oom() });
    // A load that starts under 64 MiB and fails only after the shrink below (it was queued before it).
    const stale = spec(0, 4);
    h.recovery.loading(stale);
    await h.slot.assign(spec(0, 4));
    expect(h.handled).toEqual([true]);
    expect(h.budget()).toBe(32 * MiB);
    expect(h.logs.at(-1)).toMatch(/announcing 32 MiB instead of 64 MiB so that the tracker assigns a smaller span/);

    // It halves nothing more.
    expect(h.recovery.loadFailed(stale, oom())).toBe(true);
    expect(h.budget()).toBe(32 * MiB);

    // The tracker's next, smaller span fails too: half of 32.
    await h.slot.assign(spec(0, 2));
    expect(h.budget()).toBe(16 * MiB);
  });

  it('an assignment of layers that already did not fit, made before the tracker saw the smaller budget, halves nothing more', async () => {
    const h = harness({ fail: (_n) => oom() });
    await h.slot.assign(spec(0, 4));
    expect(h.budget()).toBe(32 * MiB);
    // A heartbeat's answer that was in flight assigns [0, 4) again, loaded under the 32 MiB now announced.
    await h.slot.assign(spec(0, 4));
    expect(h.built).toHaveLength(2);
    expect(h.budget()).toBe(32 * MiB);
    expect(h.logs.filter((l) => /announcing/.test(l))).toHaveLength(1);
    // Smaller layers that fail are news: half again.
    await h.slot.assign(spec(0, 2));
    expect(h.budget()).toBe(16 * MiB);
    // [0, 4) failing once more, under less than it asked for: still no news.
    h.recovery.loadFailed(spec(0, 4), oom());
    expect(h.budget()).toBe(16 * MiB);
  });

  it('a KV cache the device cannot allocate (507) asks for a smaller span once per span; other statuses do nothing', async () => {
    const h = harness();
    await h.slot.assign(spec(0, 4));
    const span = h.slot.current!;
    h.recovery.requestFailed(span, 503);
    expect(h.budget()).toBe(64 * MiB);
    h.recovery.requestFailed(span, 507);
    h.recovery.requestFailed(span, 507);
    expect(h.budget()).toBe(32 * MiB);
  });

  it('a pinned span is not the tracker\'s to shrink: the failure is logged and left to the runtime', async () => {
    const h = harness({ pinned: true, fail: () => oom() });
    await h.slot.assign(spec(0, 4));
    expect(h.handled).toEqual([false]);
    expect(h.budget()).toBe(64 * MiB);
    expect(h.logs.at(-1)).toMatch(/pinned \(--layers\), so it keeps answering 507/);
  });
});
