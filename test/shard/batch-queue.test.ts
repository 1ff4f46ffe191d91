/**
 * The batch queue on its own (src/shard/batch-queue.ts), over a recording
 * runner: what forms a batch (same key, one request per session, never
 * overtaking a session's earlier request, up to maxBatch), that nothing
 * waits for a batch to fill, per-member answers, a whole-batch failure, and
 * the batch size counts.
 */
import { describe, expect, it } from 'vitest';
import { BatchQueue, type BatchRunner } from '../../src/shard/batch-queue.ts';

interface Req {
  id: string;
  session?: string;
  key?: string;
  bad?: boolean;
}

function recorder(opts: { throwBatch?: boolean } = {}) {
  const runs: string[][] = [];
  let release: (() => void) | null = null;
  let gate: Promise<void> | null = null;
  const runner: BatchRunner<Req, string> = {
    batchKey: (r) => r.key,
    sessionOf: (r) => r.session,
    async runOne(r) {
      runs.push([r.id]);
      if (gate) await gate;
      if (r.bad) throw new Error(`bad ${r.id}`);
      return `done ${r.id}`;
    },
    async runBatch(rs) {
      runs.push(rs.map((r) => r.id));
      if (gate) await gate;
      if (opts.throwBatch) throw new Error('backend failed');
      return rs.map((r) => (r.bad ? new Error(`bad ${r.id}`) : `done ${r.id}`));
    },
  };
  return {
    runner,
    runs,
    /** Hold every run until `open()`. */
    hold() {
      gate = new Promise<void>((r) => (release = r));
    },
    open() {
      gate = null;
      release?.();
    },
  };
}

describe('BatchQueue', () => {
  it('runs what is queued together when the runner frees: same key, one request per session, in order', async () => {
    const rec = recorder();
    const q = new BatchQueue(rec.runner, 16);
    rec.hold();
    const first = q.submit({ id: 'p', session: 'x' }); // no key: alone
    await Promise.resolve();
    await Promise.resolve();
    const later = [
      q.submit({ id: 'a1', session: 'a', key: 'k' }),
      q.submit({ id: 'b1', session: 'b', key: 'k' }),
      q.submit({ id: 'a2', session: 'a', key: 'k' }), // a again: next batch
      q.submit({ id: 'c1', session: 'c', key: 'other' }), // another key: its own run
      q.submit({ id: 'd1', session: 'd', key: 'k' }),
    ];
    rec.open();
    expect(await first).toBe('done p');
    expect(await Promise.all(later)).toEqual(['done a1', 'done b1', 'done a2', 'done c1', 'done d1']);
    expect(rec.runs).toEqual([['p'], ['a1', 'b1', 'd1'], ['a2'], ['c1']]);
    expect(q.stats()).toMatchObject({ batches: 4, requests: 6 });
    expect(q.stats().sizes.slice(0, 4)).toEqual([0, 3, 0, 1]);
  });

  it('never lets a session overtake its own earlier request, even one that runs alone', async () => {
    const rec = recorder();
    const q = new BatchQueue(rec.runner, 16);
    await Promise.all([q.submit({ id: 'h', session: 'h', key: 'k' }), q.submit({ id: 'a-prompt', session: 'a' }), q.submit({ id: 'a-step', session: 'a', key: 'k' }), q.submit({ id: 'b-step', session: 'b', key: 'k' })]);
    expect(rec.runs).toEqual([['h', 'b-step'], ['a-prompt'], ['a-step']]);
  });

  it('does not wait for a batch to fill, and caps a batch at maxBatch', async () => {
    const rec = recorder();
    const q = new BatchQueue(rec.runner, 2);
    expect(await q.submit({ id: 'only', session: 's', key: 'k' })).toBe('done only');
    await Promise.all(['a', 'b', 'c', 'd', 'e'].map((s) => q.submit({ id: s, session: s, key: 'k' })));
    expect(rec.runs).toEqual([['only'], ['a', 'b'], ['c', 'd'], ['e']]);
  });

  it('fails a bad member alone, and every member when the batch as a whole fails; keeps serving after', async () => {
    const rec = recorder();
    const q = new BatchQueue(rec.runner, 16);
    const got = await Promise.allSettled([q.submit({ id: 'a', session: 'a', key: 'k' }), q.submit({ id: 'b', session: 'b', key: 'k', bad: true }), q.submit({ id: 'c', session: 'c', key: 'k' })]);
    expect(got.map((r) => (r.status === 'fulfilled' ? r.value : (r.reason as Error).message))).toEqual(['done a', 'bad b', 'done c']);

    const broken = recorder({ throwBatch: true });
    const q2 = new BatchQueue(broken.runner, 16);
    const all = await Promise.allSettled([q2.submit({ id: 'a', session: 'a', key: 'k' }), q2.submit({ id: 'b', session: 'b', key: 'k' })]);
    expect(all.map((r) => r.status)).toEqual(['rejected', 'rejected']);
    expect(await q2.submit({ id: 'alone', session: 'z' })).toBe('done alone');
  });

  it('maxBatch 1 runs every request alone', async () => {
    const rec = recorder();
    const q = new BatchQueue(rec.runner, 1);
    await Promise.all(['a', 'b', 'c'].map((s) => q.submit({ id: s, session: s, key: 'k' })));
    expect(rec.runs).toEqual([['a'], ['b'], ['c']]);
    expect(q.stats()).toMatchObject({ maxBatch: 1, batches: 3, requests: 3, sizes: [0, 3] });
    expect(() => new BatchQueue(rec.runner, 0)).toThrow(RangeError);
  });

  it('idle() settles once nothing is queued or running', async () => {
    const rec = recorder();
    const q = new BatchQueue(rec.runner, 4);
    rec.hold();
    const p = q.submit({ id: 'a', session: 'a', key: 'k' });
    let idle = false;
    const waiting = q.idle().then(() => (idle = true));
    await new Promise((r) => setTimeout(r, 5));
    expect(idle).toBe(false);
    rec.open();
    await p;
    await waiting;
    expect(idle).toBe(true);
  });

  it('hands a running batch the queued requests that may join it, in order, up to maxBatch', async () => {
    const joinedBy: string[][] = [];
    let joinNow: (() => void) | null = null;
    const runner: BatchRunner<Req, string> = {
      batchKey: (r) => r.key,
      sessionOf: (r) => r.session,
      runOne: async (r) => `done ${r.id}`,
      async runBatch(rs, join) {
        // Mid-run (between two layers of a real batch): take what may join, answer it ourselves.
        if (joinedBy.length === 0) await new Promise<void>((r) => (joinNow = r));
        const js = join!(new Set(rs.map((r) => r.session!)));
        joinedBy.push(js.map((j) => j.req.id));
        for (const j of js) j.resolve(`joined ${j.req.id}`);
        return rs.map((r) => `done ${r.id}`);
      },
    };
    const q = new BatchQueue(runner, 5);
    const batch = [q.submit({ id: 'a', session: 'a', key: 'k' }), q.submit({ id: 'b', session: 'b', key: 'k' })];
    await new Promise((r) => setTimeout(r, 0));
    const late = [
      q.submit({ id: 'a2', session: 'a', key: 'k' }), // a is in the batch: its next step waits
      q.submit({ id: 'c', session: 'c', key: 'k' }),
      q.submit({ id: 'x', session: 'x', key: 'other' }), // another key: waits
      q.submit({ id: 'd1', session: 'd', key: 'other' }),
      q.submit({ id: 'd2', session: 'd', key: 'k' }), // behind d's earlier request: waits
      q.submit({ id: 'e', session: 'e', key: 'k' }),
      q.submit({ id: 'f', session: 'f', key: 'k' }),
      q.submit({ id: 'g', session: 'g', key: 'k' }), // past maxBatch 5 (a, b, c, e, f)
    ];
    joinNow!();
    expect(await Promise.all(batch)).toEqual(['done a', 'done b']);
    expect(joinedBy[0]).toEqual(['c', 'e', 'f']);
    const answers = await Promise.all(late);
    expect([answers[1], answers[5], answers[6]]).toEqual(['joined c', 'joined e', 'joined f']);
    // The ones left behind ran after the batch, each answered once.
    expect(answers.filter((_, i) => ![1, 5, 6].includes(i)).every((a) => /^(done|joined) /.test(a))).toBe(true);
    expect(q.stats().joined).toBe(joinedBy.flat().length);
    expect(q.stats().requests).toBe(q.stats().sizes.reduce((n, runs, size) => n + runs * size, 0));
  });
});
