/**
 * ChainInbox: a chained step waits for its token by session and position;
 * a delivery, a hop's failure report, the step timeout or the generation's
 * signal ends the wait. The signal carries one listener however many steps
 * a generation waits (a listener per step was a per-token cost at the head).
 */
import { getEventListeners } from 'node:events';
import { describe, expect, it } from 'vitest';
import { ChainInbox, ChainStepError } from '../../../src/node/head/chain-driver.ts';
import { MeshError } from '../../../src/protocol/errors.ts';

const arrival = (n: number) => ({ token: JSON.stringify({ token_id: n }), rows: new Uint8Array([n]) });

describe('ChainInbox', () => {
  it('hands each step its own token, many steps on one signal with one abort listener, and cancels the pending step when the signal aborts', async () => {
    const inbox = new ChainInbox();
    const ctl = new AbortController();
    for (let pos = 0; pos < 50; pos++) {
      const w = inbox.wait('s1', pos, 5_000, ctl.signal);
      expect(inbox.deliver('s1', pos + 1, arrival(pos))).toBe(false); // not this step's position
      expect(inbox.deliver('s2', pos, arrival(pos))).toBe(false); // not this session
      expect(inbox.deliver('s1', pos, arrival(pos))).toBe(true);
      expect(await w.promise).toEqual(arrival(pos));
      expect(inbox.pending).toBe(0);
    }
    expect(getEventListeners(ctl.signal, 'abort').length).toBe(1);
    // Another generation's signal: its own listener, its own steps.
    const other = new AbortController();
    const theirs = inbox.wait('s2', 0, 5_000, other.signal);
    const ours = inbox.wait('s1', 50, 5_000, ctl.signal);
    ctl.abort();
    await expect(ours.promise).rejects.toMatchObject({ code: 'MESH_ERR_CANCELLED' });
    expect(inbox.pending).toBe(1);
    expect(inbox.deliver('s2', 0, arrival(7))).toBe(true);
    expect(await theirs.promise).toEqual(arrival(7));
    expect(inbox.pending).toBe(0);
  });

  it('rejects at once on a signal already aborted, with the hop\'s report on a failure, and MESH_ERR_TIMEOUT when nothing comes', async () => {
    const inbox = new ChainInbox();
    const gone = new AbortController();
    gone.abort();
    await expect(inbox.wait('s', 0, 5_000, gone.signal).promise).rejects.toMatchObject({ code: 'MESH_ERR_CANCELLED' });
    expect(inbox.pending).toBe(0);

    const failing = inbox.wait('s', 1, 5_000);
    expect(inbox.fail('s', 1, 'f'.repeat(32), new MeshError('MESH_ERR_BUSY', 'no room'))).toBe(true);
    const err = await failing.promise.catch((e: unknown) => e);
    expect(err).toBeInstanceOf(ChainStepError);
    expect([(err as ChainStepError).peer, (err as ChainStepError).error.code]).toEqual(['f'.repeat(32), 'MESH_ERR_BUSY']);

    await expect(inbox.wait('s', 2, 30).promise).rejects.toMatchObject({ error: { code: 'MESH_ERR_TIMEOUT' } });
    expect(inbox.pending).toBe(0);

    // A step cancelled by its caller (the hop answered an error first) leaves nothing behind, and its abort callback is gone.
    const ctl = new AbortController();
    const w = inbox.wait('s', 3, 5_000, ctl.signal);
    w.cancel();
    expect(inbox.pending).toBe(0);
    expect(inbox.deliver('s', 3, arrival(3))).toBe(false);
    ctl.abort();
    const settled = await Promise.race([w.promise.then(() => 'resolved', () => 'rejected'), new Promise((r) => setTimeout(() => r('pending'), 20))]);
    expect(settled).toBe('pending');
  });
});
