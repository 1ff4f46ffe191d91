/**
 * A relay of a cluster says `registered` only once NATS has the peer's
 * subscription (a flush). The peers registering in one turn of the event
 * loop share one flush: a relay taking back the 5,000 donors of a restarted
 * one spent a tenth of that burst in a flush (a PING and a write) per donor
 * (docs/benchmarks.md, session 9).
 */
import pino from 'pino';
import type { NatsConnection } from '@nats-io/transport-node';
import { describe, expect, it } from 'vitest';
import { Federation } from '../../src/relay/federation.ts';
import { createRelayMetrics } from '../../src/relay/metrics.ts';
import { RELAY_DEFAULTS } from '../../src/relay/options.ts';
import { StreamTable } from '../../src/relay/stream-table.ts';
import { Corker } from '../../src/relay/ws-socket.ts';

function setup(status: () => 'connected' | 'reconnecting' = () => 'connected') {
  const flushes: Array<() => void> = [];
  // Only what announced() touches: a flush the test settles by hand.
  const nc = { flush: () => new Promise<void>((r) => flushes.push(r)) } as unknown as NatsConnection;
  const metrics = createRelayMetrics();
  const logger = pino({ level: 'silent' });
  const table = new StreamTable({ options: RELAY_DEFAULTS, metrics, logger });
  const fed = new Federation({ nc, natsStatus: status, cluster: 'test', relayId: 'ab'.repeat(8), publicUrl: 'ws://127.0.0.1:1', path: 'link', table, metrics, logger, corker: new Corker(), maxPayload: 1 << 20, pingIntervalMs: 5_000 });
  return { fed, flushes };
}

const turn = () => new Promise((r) => setImmediate(r));

describe('registrations of one event-loop turn', () => {
  it('share one NATS flush, started after all of them, and each is told once it is done', async () => {
    const { fed, flushes } = setup();
    const done: number[] = [];
    const first = Array.from({ length: 50 }, (_, i) => fed.announced().then(() => done.push(i)));
    expect(flushes).toHaveLength(0); // not before the turn ends: a later registration of it must be covered too
    await turn();
    expect(flushes).toHaveLength(1);

    // One more in the next turn gets a flush of its own (the first one may have been written before its subscription).
    const late = fed.announced().then(() => done.push(99));
    await turn();
    expect(flushes).toHaveLength(2);
    flushes[1]!();
    await late;
    expect(done).toEqual([99]);

    flushes[0]!();
    await Promise.all(first);
    expect(done.slice(1).sort((a, b) => a - b)).toEqual(Array.from({ length: 50 }, (_, i) => i));
  });

  it('are not held past 1 s by a flush that never ends, nor at all while NATS is down', async () => {
    const { fed, flushes } = setup();
    const t0 = Date.now();
    await fed.announced();
    expect(flushes).toHaveLength(1);
    expect(Date.now() - t0).toBeGreaterThanOrEqual(950);

    const down = setup(() => 'reconnecting');
    await down.fed.announced();
    expect(down.flushes).toHaveLength(0);
  });
});
