/**
 * Many chats at once on real processes (relay, tracker, three `meshnet node`
 * processes on `tiny`), with budgets that leave each node KV room for two
 * short chats: more chats than that arrive together. Each either succeeds
 * with the text it gets alone (temperature 0) or is answered 429 with
 * Retry-After; none ends in a 5xx, and no node's log shows a replay (the
 * 409 storm of evicted live sessions this replaces).
 */
import { afterAll, describe, expect, it } from 'vitest';
import { ensureModel } from '../../src/cli/models.ts';
import { startStaticServer, type StaticServer } from '../../src/cli/static-server.ts';
import { startRelayProcess, type RelayProcess } from '../helpers/relay-process.ts';
import { startNode, startTrackerProc, stopMesh, until, type NodeProc, type TrackerProc } from '../helpers/mesh.ts';

type Dashboard = { queue: { length: number; running: number }; nodes: Array<{ peer_id: string; status: string; kv: { budget_bytes: number; used_bytes: number } | null }> };

describe('many chats at once through the tracker', () => {
  let st: StaticServer | undefined;
  let relay: RelayProcess | undefined;
  let tracker: TrackerProc | undefined;
  const nodes: NodeProc[] = [];

  afterAll(() => stopMesh({ nodes, tracker, relay, st }));

  async function chat(): Promise<{ status: number; text: string; retryAfter: string | null }> {
    const res = await fetch(`${tracker!.url}/v1/chat/completions`, {
      method: 'POST',
      headers: { 'content-type': 'application/json' },
      body: JSON.stringify({ model: 'tiny', messages: [{ role: 'user', content: 'Tell me about the quick brown fox.' }], max_tokens: 8, temperature: 0 }),
    });
    const body = (await res.json()) as { choices?: Array<{ message: { content: string } }>; error?: { message: string } };
    return { status: res.status, text: body.choices?.[0]?.message.content ?? body.error?.message ?? '', retryAfter: res.headers.get('retry-after') };
  }

  it('each chat succeeds with its alone text or gets 429 + Retry-After; no 5xx, no replay', async () => {
    st = await startStaticServer({ root: await ensureModel('tiny') });
    relay = await startRelayProcess();
    // Spans are sized with a 128-token KV reserve: 0.5 MiB holds two of tiny's four layers and leaves
    // ~90 KiB of KV, room for two 64-position blocks (one short chat each).
    tracker = await startTrackerProc(['--model', `tiny=${st.url}`, '--relay', relay.url, '--heartbeat-interval-ms', '300', '--kv-context', '128', '--queue-max-length', '3']);
    const common = ['--relay', relay.url, '--tracker', tracker.url, '--model', 'tiny', '--budget-mb', '0.5', '--max-context', '256'];
    for (let i = 0; i < 3; i++) {
      nodes.push(await startNode(common));
      await nodes[i]!.waitFor((e) => e.event === 'serving', 30_000);
    }
    const dashboard = async () => (await (await fetch(`${tracker!.url}/api/dashboard`)).json()) as Dashboard;
    // Route by KV only once every node has reported it.
    await until(async () => {
      const d = await dashboard();
      return d.nodes.length === 3 && d.nodes.every((n) => n.status === 'serving' && n.kv !== null);
    }, 20_000, 'three serving nodes reporting their KV');
    const kv = (await dashboard()).nodes.map((n) => n.kv!);
    for (const k of kv) expect(k.budget_bytes).toBeGreaterThan(0);

    const alone = await chat();
    expect(alone.status).toBe(200);
    expect(alone.text.length).toBeGreaterThan(0);

    const results = await Promise.all(Array.from({ length: 10 }, () => chat()));
    const statuses = results.map((r) => r.status);
    expect(statuses.every((s) => s === 200 || s === 429), statuses.join(',')).toBe(true);
    // Two run, three wait: at least five are turned away at once, the rest succeed.
    expect(statuses.filter((s) => s === 429).length).toBeGreaterThanOrEqual(1);
    expect(statuses.filter((s) => s === 200).length).toBeGreaterThanOrEqual(2);
    for (const r of results) {
      if (r.status === 200) expect(r.text).toBe(alone.text);
      else expect(r.retryAfter).toMatch(/^[1-9]\d*$/);
    }

    const metrics = await (await fetch(`${tracker.url}/metrics`)).text();
    expect(metrics).not.toMatch(/meshnet_tracker_requests_total\{endpoint="chat",status="5\d\d"\}/);
    expect(metrics).toMatch(/meshnet_tracker_queue_rejections_total\{reason="queue_full"\} [1-9]/);
    expect(metrics).toMatch(/meshnet_tracker_node_kv_bytes\{peer_id="[0-9a-f]{32}",model="tiny",kind="budget"\} [1-9]/);
    for (const n of nodes) expect(n.stderr()).not.toMatch(/replaying|409/);
    // Every session was given back on every node.
    await until(async () => (await dashboard()).queue.running === 0, 5_000, 'no chat running');
    for (const n of nodes) {
      const info = (await (await fetch(`${n.endpoint}/info`)).json()) as { weight_bytes: number; kv: { sessions: number; evictions: number; budget_bytes: number } };
      expect(info.kv).toMatchObject({ sessions: 0, evictions: 0 });
      // The budget means weights + KV: the KV caches got exactly what the weights left.
      expect(info.weight_bytes + info.kv.budget_bytes).toBe(Math.floor(0.5 * 2 ** 20));
    }
  }, 120_000);
});
