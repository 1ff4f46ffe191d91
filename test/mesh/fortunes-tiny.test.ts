/**
 * The shipped `fortunes-tiny` (learned weights) on a mesh of real `meshnet
 * node` processes behind a real tracker, over direct HTTP: three nodes with
 * the demo's budget for three pages split its 6 layers, and the chat through
 * the OpenAI API is the float64 reference's greedy answer, token for token.
 * The tracker runs with `--wire-dtype f32`: the dtype reaches every node with
 * its assignment (each hop's /info lists only f32) and the head sends it.
 */
import OpenAI from 'openai';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { pageBudget } from '../../src/cli/demo.ts';
import { startStaticServer, type StaticServer } from '../../src/cli/static-server.ts';
import { loadModelSpec } from '../../src/tracker/model-registry.ts';
import { resolveTrackerOptions } from '../../src/tracker/options.ts';
import { FORTUNES_DIR, fortunesTiny } from '../helpers/fortunes-tiny.ts';
import { startNode, startTrackerProc, until, type NodeProc, type TrackerProc } from '../helpers/mesh.ts';

const PROMPTS = ['Tell me a fortune about science.', 'Tell me a short story about a fox who shares her GPU.'];
const MAX_TOKENS = 48;

describe('fortunes-tiny on three Node.js nodes behind a tracker (f32 on the wire)', () => {
  let st: StaticServer;
  let tracker: TrackerProc;
  let nodes: NodeProc[] = [];
  let client: OpenAI;
  let wants: Array<{ ids: number[]; text: string }> = [];

  beforeAll(async () => {
    // The references before any socket opens: seconds of synchronous float64 work later would block the
    // event loop past the server's keep-alive timeout, and the client would reuse a closed socket.
    wants = PROMPTS.map((p) => fortunesTiny().greedy(p, MAX_TOKENS));
    st = await startStaticServer({ root: FORTUNES_DIR });
    const budget = pageBudget(await loadModelSpec('fortunes-tiny', `${st.url}/`, fetch, resolveTrackerOptions({})), 3, undefined);
    tracker = await startTrackerProc(['--model', `fortunes-tiny=${st.url}`, '--wire-dtype', 'f32', '--heartbeat-interval-ms', '1000']);
    // One after another: each assignment depends on the spans already given.
    for (let i = 0; i < 3; i++) {
      const n = await startNode(['--tracker', tracker.url, '--budget-mb', String(budget), '--max-context', '256']);
      await n.waitFor((e) => e.event === 'serving', 60_000);
      nodes.push(n);
    }
    await until(async () => (await fetch(`${tracker.url}/api/route?model=fortunes-tiny`)).ok, 20_000, 'a complete route');
    client = new OpenAI({ baseURL: `${tracker.url}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 60_000 });
  }, 180_000);

  afterAll(async () => {
    await Promise.all(nodes.map((n) => n.stop()));
    nodes = [];
    await tracker?.stop();
    await st?.close();
  });

  it('splits the 6 layers over the three nodes, each taking only f32 from the tracker\'s assignment', async () => {
    const infos = await Promise.all(nodes.map(async (n) => (await (await fetch(`${n.endpoint}/info`)).json()) as { start_layer: number; end_layer: number; wire_dtypes: string[] }));
    // Each holds a share (the budget is the least with which three do); which share depends on timing (rebalancing).
    const held = new Set<number>();
    for (const i of infos) {
      expect(i.end_layer - i.start_layer).toBeGreaterThan(0);
      expect(i.end_layer - i.start_layer).toBeLessThan(6);
      for (let l = i.start_layer; l < i.end_layer; l++) held.add(l);
      expect(i.wire_dtypes).toEqual(['f32']);
    }
    expect(held.size).toBe(6);
  });

  it('answers each prompt with the float64 reference\'s greedy tokens (English, stopped at <|im_end|>)', async () => {
    for (const [k, prompt] of PROMPTS.entries()) {
      const want = wants[k]!;
      const stream = await client.chat.completions.create({ model: 'fortunes-tiny', messages: [{ role: 'user', content: prompt }], max_tokens: MAX_TOKENS, temperature: 0, stream: true });
      const ids: number[] = [];
      let text = '';
      let finish: string | null = null;
      for await (const c of stream) {
        const ch = c.choices[0] as (OpenAI.Chat.Completions.ChatCompletionChunk.Choice & { token_ids?: number[] }) | undefined;
        ids.push(...(ch?.token_ids ?? []));
        text += ch?.delta.content ?? '';
        finish = ch?.finish_reason ?? finish;
      }
      console.log(`[fortunes-tiny, 3 Node.js nodes] ${JSON.stringify(prompt)} → ${JSON.stringify(text)}`);
      expect(ids).toEqual(want.ids);
      expect(text).toBe(want.text);
      expect(finish).toBe('stop');
      expect(text).toMatch(/^[A-Z][A-Za-z]* [A-Za-z]+ [a-z]+/);
    }
    // The chat crossed all three nodes.
    const d = (await (await fetch(`${tracker.url}/api/dashboard`)).json()) as { models: Array<{ wire_dtype: string }>; recent_routes: Array<{ kind: string; hops: unknown[] }> };
    expect(d.recent_routes.find((r) => r.kind === 'generate')?.hops).toHaveLength(3);
    expect(d.models[0]!.wire_dtype).toBe('f32');
  });
});
