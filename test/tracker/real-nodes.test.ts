/**
 * Assignment with real `meshnet node` processes: nodes start with nothing
 * but a memory budget, the tracker decides their spans, they load them, and
 * chats flow; a node dies, the tracker moves another one onto its layers,
 * and chats flow again with the same greedy text.
 */
import OpenAI from 'openai';
import { afterAll, describe, expect, it } from 'vitest';
import { ensureModel } from '../../src/cli/models.ts';
import { startStaticServer, type StaticServer } from '../../src/cli/static-server.ts';
import { startRelayProcess, type RelayProcess } from '../helpers/relay-process.ts';
import { startNode, startTrackerProc, stopMesh, until, type NodeProc, type TrackerProc } from '../helpers/mesh.ts';

type Availability = { models: Array<{ complete: boolean; missing_layers: number[]; nodes: Array<{ peer_id: string; status: string; serving: { start_layer: number; end_layer: number } | null; assignment: { start_layer: number; end_layer: number } | null }> }> };

describe('tracker assignment with meshnet node processes', () => {
  let st: StaticServer | undefined;
  let relay: RelayProcess | undefined;
  let tracker: TrackerProc | undefined;
  const nodes: NodeProc[] = [];

  afterAll(() => stopMesh({ nodes, tracker, relay, st }));

  const availability = async () => ((await (await fetch(`${tracker!.url}/api/availability?model=tiny`)).json()) as Availability).models[0]!;

  async function chat(client: OpenAI): Promise<string> {
    const stream = await client.chat.completions.create({ model: 'tiny', messages: [{ role: 'user', content: 'Tell me about the quick brown fox.' }], max_tokens: 12, temperature: 0, stream: true });
    let text = '';
    for await (const c of stream) text += c.choices[0]?.delta.content ?? '';
    return text;
  }

  it('splits the model over budget-limited nodes, then heals a dead node\'s layers by reassignment', async () => {
    st = await startStaticServer({ root: await ensureModel('tiny') });
    relay = await startRelayProcess();
    // tiny: 4 layers; a span of 2 costs ≈1.41 MiB at the tracker's sizing (f32 weights + 2048-token KV reserve), 3 do not fit 1.45 MiB.
    tracker = await startTrackerProc(['--model', `tiny=${st.url}`, '--relay', relay.url, '--heartbeat-interval-ms', '300']);
    const common = ['--relay', relay.url, '--tracker', tracker.url, '--model', 'tiny', '--budget-mb', '1.45', '--max-context', '256'];
    for (let i = 0; i < 3; i++) {
      nodes.push(await startNode(common));
      // One at a time, so each sees the previous ones' assignments.
      await nodes[i]!.waitFor((e) => e.event === 'serving', 30_000);
    }
    // A node's 'serving' event is local; the tracker learns of it at that node's next heartbeat, so wait for all three to be reported.
    const allServing = (a: Availability['models'][number], n: number) => a.complete && a.nodes.length === n && a.nodes.every((x) => x.serving !== null);
    await until(async () => allServing(await availability(), 3), 20_000, 'complete coverage, every node serving');
    const av = await availability();
    const spans = av.nodes.map((n) => n.serving!);
    for (const s of spans) expect(s.end_layer - s.start_layer).toBe(2);
    expect(spans.filter((s) => s.start_layer === 0).length + spans.filter((s) => s.start_layer === 2).length).toBe(3);

    const client = new OpenAI({ baseURL: `${tracker.url}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 60_000 });
    const before = await chat(client);
    expect(before.length).toBeGreaterThan(0);

    // Kill the only holder of some layers.
    const counts = new Map<number, number>();
    for (const s of spans) counts.set(s.start_layer, (counts.get(s.start_layer) ?? 0) + 1);
    const soleStart = [...counts].find(([, c]) => c === 1)![0];
    const soleId = av.nodes.find((n) => n.serving!.start_layer === soleStart)!.peer_id;
    const victim = nodes.find((n) => n.peerId === soleId)!;
    await victim.stop('SIGKILL');
    nodes.splice(nodes.indexOf(victim), 1);

    // Removed after 3 missed heartbeats; a duplicate holder is moved onto the bare layers and loads them.
    await until(async () => {
      const a = await availability();
      return !a.nodes.some((n) => n.peer_id === soleId) && allServing(a, 2);
    }, 30_000, 'reassignment after the node died');
    const healed = await availability();
    expect(healed.nodes.length).toBe(2);
    expect(healed.nodes.map((n) => n.serving!.start_layer).sort()).toEqual([0, 2]);
    expect(await chat(client)).toBe(before);
    const dash = (await (await fetch(`${tracker.url}/api/dashboard`)).json()) as { recent_routes: unknown[]; nodes: Array<{ backend: string }> };
    expect(dash.recent_routes.length).toBeGreaterThanOrEqual(2);
    expect(dash.nodes.every((n) => n.backend === 'onnxruntime-node')).toBe(true);
    const metrics = await (await fetch(`${tracker.url}/metrics`)).text();
    expect(metrics).toMatch(/meshnet_tracker_reassignments_total [1-9]/);
  }, 180_000);
});
