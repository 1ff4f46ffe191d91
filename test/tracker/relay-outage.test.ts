/**
 * A head the tracker reaches over the relay (a page: no endpoint) that the
 * tracker loses mid-chat — the relay restarting, the head reconnecting — is
 * not a failed head: the chat waits for it (relayOutageBudgetMs) and resumes
 * there, on the same route and session, asking it to go on
 * (`X-Meshnet-Resume`), and the head's failure count stays 0. Past the
 * budget the chat fails over, or fails with an error that says the relay was
 * unreachable. A head with an endpoint fails over at once, as before.
 */
import { describe, expect, it } from 'vitest';
import { MeshError } from '../../src/protocol/errors.ts';
import type { GenerateEvent } from '../../src/protocol/tracker.ts';
import type { TrackerOptions } from '../../src/tracker/options.ts';
import { FakeNode, makeTracker, scriptedTransport, tokenEvents } from '../helpers/tracker.ts';

type Script = Parameters<typeof scriptedTransport>[0][string][number];

const start = { type: 'start', prompt_tokens: 5, route: [] } as GenerateEvent;
const done = (n: number) => ({ type: 'done', finish_reason: 'stop', completion_tokens: n, prompt_tokens: 5 }) as GenerateEvent;
/** What the tracker's relay client throws when its connection to the relay drops mid-stream. */
const cut = () => new MeshError('MESH_ERR_PEER_GONE', 'relay connection lost (socket closed (code 1006)); the request may or may not have run', { reason: 'disconnected' });
const noSuchPeer = (id: string) => new MeshError('MESH_ERR_NO_SUCH_PEER', `peer ${id} is not connected to this relay`);

async function setup(o: Partial<TrackerOptions>, heads: Array<{ endpoint?: string }>) {
  const scripts: Record<string, Script[]> = {};
  const st = scriptedTransport(scripts);
  const t = await makeTracker({ random: () => 0, ...o }, st.transport);
  const nodes: FakeNode[] = [];
  for (const h of heads) {
    const n = (await FakeNode.create({ memory_budget_mb: 4096 })).withStats(1);
    n.serving = { start_layer: 0, end_layer: 12 };
    n.relayAddr = 'ws://127.0.0.1:1/rpc/x';
    if (h.endpoint) n.endpoint = h.endpoint;
    await n.register(t);
    nodes.push(n);
  }
  return { t, nodes, scripts, calls: st.calls };
}

async function chat(t: Awaited<ReturnType<typeof setup>>['t']) {
  const res = await t.app.request('/v1/chat/completions', { method: 'POST', headers: { 'content-type': 'application/json' }, body: JSON.stringify({ model: 'small', messages: [{ role: 'user', content: 'hi' }], max_tokens: 20, stream: true }) });
  let text = '';
  let error: string | undefined;
  for (const line of (await res.text()).split('\n')) {
    if (!line.startsWith('data:') || line.includes('[DONE]')) continue;
    const m = JSON.parse(line.slice(5)) as { error?: { message: string }; choices?: Array<{ delta: { content?: string } }> };
    if (m.error) error = m.error.message;
    text += m.choices?.[0]?.delta.content ?? '';
  }
  return { status: res.status, text, error };
}

describe('a head lost over the relay', () => {
  it('resumes the chat on the same head, route and session once it is back (X-Meshnet-Resume), counting no failure', async () => {
    const { t, nodes, scripts, calls } = await setup({}, [{}, {}]);
    const [a] = nodes as [FakeNode, FakeNode];
    const first: Script = async function* () {
      yield start;
      yield* tokenEvents(['one', ' two']);
      throw cut();
    };
    // The head is not back on the relay yet, then it is: it sends everything again from the start, then goes on.
    const notYet: Script = () => {
      throw noSuchPeer(a.peerId);
    };
    const resumed: Script = () => [start, ...tokenEvents(['one', ' two', ' three', ' four']), done(4)];
    scripts[a.peerId] = [first, notYet, notYet, resumed];
    const r = await chat(t);
    expect(r.error).toBeUndefined();
    expect(r.text).toBe('one two three four');
    expect(calls.map((c) => c.head)).toEqual([a.peerId, a.peerId, a.peerId, a.peerId]);
    expect(new Set(calls.map((c) => c.body.session_id)).size).toBe(1);
    expect(calls.map((c) => c.headers['x-meshnet-resume'])).toEqual([undefined, '1', '1', '1']);
    // The route stays the one the chat started on (the same signed hops), and the head's count stays clean.
    expect(new Set(calls.map((c) => c.headers['x-meshnet-route'])).size).toBe(1);
    expect(t.registry.nodes.get(a.peerId)!.failures).toBe(0);
    const metrics = await (await t.app.request('/metrics')).text();
    expect(metrics).toMatch(/meshnet_tracker_head_failovers_total 0/);
  });

  it('the dashboard shows the head unreachable (and why) while the tracker cannot reach it, and reachable again once the chat resumed', async () => {
    const { t, nodes, scripts } = await setup({}, [{}]);
    const [a] = nodes as [FakeNode];
    const reach = async () => ((await (await t.app.request('/api/dashboard')).json()) as { nodes: Array<{ peer_id: string; reachable: boolean; unreachable_reason?: string }> }).nodes.find((n) => n.peer_id === a.peerId)!;
    expect((await reach()).reachable).toBe(true);
    const first: Script = async function* () {
      yield start;
      yield* tokenEvents(['a']);
      throw cut();
    };
    const notYet: Script = () => {
      throw noSuchPeer(a.peerId);
    };
    scripts[a.peerId] = [first, notYet, notYet, notYet, notYet, () => [start, ...tokenEvents(['a', 'b']), done(2)]];
    const answer = chat(t);
    let seen: { reachable: boolean; unreachable_reason?: string } = await reach();
    for (let i = 0; i < 100 && seen.reachable; i++) {
      await new Promise((r) => setTimeout(r, 10));
      seen = await reach();
    }
    expect(seen).toMatchObject({ reachable: false, unreachable_reason: expect.stringMatching(/relay connection lost/) });
    expect((await answer).text).toBe('ab');
    expect((await reach()).reachable).toBe(true);
    // A node that says its relay connection is down is unreachable until it says it is back.
    await a.post(t, '/api/nodes/heartbeat', t.clock.now, { relay_connected: false });
    expect(await reach()).toMatchObject({ reachable: false, unreachable_reason: expect.stringMatching(/its relay connection is down/) });
    await a.post(t, '/api/nodes/heartbeat', t.clock.now, { relay_connected: true });
    expect((await reach()).reachable).toBe(true);
  });

  it('a head started fresh on the retry (it lost the parked generation) continues from the prefix: no token twice', async () => {
    const { t, nodes, scripts, calls } = await setup({}, [{}]);
    const [a] = nodes as [FakeNode];
    const first: Script = async function* () {
      yield start;
      yield* tokenEvents(['a', 'b']);
      throw cut();
    };
    const fresh: Script = ({ body }) => {
      const prefix = (body as { prefix_token_ids: number[] }).prefix_token_ids;
      return [start, ...tokenEvents(['c'], prefix.length), done(1)];
    };
    scripts[a.peerId] = [first, fresh];
    const r = await chat(t);
    expect(r.text).toBe('abc');
    expect(calls[1]!.body.prefix_token_ids).toEqual([100, 101]);
  });

  it('past the budget it fails over to another head, and with none left says the relay was unreachable', async () => {
    const { t, nodes, scripts, calls } = await setup({ relayOutageBudgetMs: 600, maxHeadFailovers: 0 }, [{}]);
    const [a] = nodes as [FakeNode];
    const first: Script = async function* () {
      yield start;
      yield* tokenEvents(['x']);
      throw cut();
    };
    const gone: Script = () => {
      throw noSuchPeer(a.peerId);
    };
    scripts[a.peerId] = [first, ...Array.from({ length: 40 }, () => gone)];
    const t0 = performance.now();
    const r = await chat(t);
    const ms = performance.now() - t0;
    expect(r.text).toBe('x');
    expect(r.error).toMatch(/unreachable over the relay for \d+ ms/);
    expect(ms).toBeGreaterThanOrEqual(550);
    expect(ms).toBeLessThan(3_000);
    expect(calls.length).toBeGreaterThan(2);
    // Unreachable is not proof of a failed head.
    expect(t.registry.nodes.get(a.peerId)!.failures).toBe(0);
  });

  it('a head with an endpoint (reached directly) fails over at once, as a failed head', async () => {
    const { t, nodes, scripts, calls } = await setup({}, [{ endpoint: 'http://127.0.0.1:1' }, { endpoint: 'http://127.0.0.1:2' }]);
    let n = 0;
    const either: Script = async function* ({ body }) {
      if (n++ === 0) {
        yield start;
        yield* tokenEvents(['one']);
        throw new MeshError('MESH_ERR_PEER_GONE', 'head at http://127.0.0.1:1 broke its stream (socket hang up)');
      }
      const prefix = (body as { prefix_token_ids: number[] }).prefix_token_ids;
      yield start;
      yield* tokenEvents([' two'], prefix.length);
      yield done(1);
    };
    for (const node of nodes) scripts[node.peerId] = [either, either];
    const r = await chat(t);
    expect(r.text).toBe('one two');
    expect(calls.length).toBe(2);
    expect(calls[1]!.head).not.toBe(calls[0]!.head);
    expect(calls[1]!.headers['x-meshnet-resume']).toBeUndefined();
    expect(t.registry.nodes.get(calls[0]!.head)!.failures).toBe(1);
  });
});
