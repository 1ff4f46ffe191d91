/**
 * The published Llama 3.1 and Qwen3 tokenizers and chat templates end to
 * end: a relay, a tracker and two `meshnet node` processes serve a
 * random-weight checkpoint on the real vocabulary (128,256 / 151,936 ids);
 * the official openai client chats through the tracker. The head renders the
 * conversation with the checkpoint's own template, the greedy token ids equal
 * the float64 reference on the same rendered prompt, and generation stops on
 * the end-of-turn token (<|eot_id|> / <|im_end|>) without emitting it.
 */
import OpenAI from 'openai';
import { afterAll, describe, expect, it } from 'vitest';
import { ensureModel } from '../../src/cli/models.ts';
import { startStaticServer, type StaticServer } from '../../src/cli/static-server.ts';
import { ReferenceModel } from '../../src/model/reference.ts';
import { ModelTokenizer, type ChatMessage } from '../../src/model/tokenizer.ts';
import { memoryFetch } from '../../src/model/memory-fetch.ts';
import { fixture } from '../helpers/shard.ts';
import { startRelayProcess, type RelayProcess } from '../helpers/relay-process.ts';
import { startNode, startTrackerProc, stopMesh, until, type NodeProc, type TrackerProc } from '../helpers/mesh.ts';

const MAX_TOKENS = 24;
// The second conversation reaches the end-of-turn token within a few steps on both presets' weights (checked below).
const CHATS: ChatMessage[][] = [
  [
    { role: 'system', content: 'Be brief.' },
    { role: 'user', content: 'Tell me about the quick brown fox.' },
  ],
  [{ role: 'user', content: 'What is 2 + 2?' }],
];

type Chunk = { choices: Array<{ delta: { content?: string | null }; finish_reason: string | null; token_ids?: number[] }> };

for (const preset of ['llama3-real-vocab', 'qwen3-real-vocab'] as const) {
  describe(`${preset}: real tokenizer and chat template through a mesh of meshnet node processes`, () => {
    let st: StaticServer | undefined;
    let relay: RelayProcess | undefined;
    let tracker: TrackerProc | undefined;
    const nodes: NodeProc[] = [];

    afterAll(() => stopMesh({ nodes, tracker, relay, st }));

    it('streams the reference greedy ids for the template-rendered chat and stops on the end-of-turn token', async () => {
      const f = fixture(preset);
      // As the head loads it: tokenizer files plus config.json's and generation_config.json's eos ids.
      const tok = await ModelTokenizer.load(memoryFetch(f.files), 'mem://m/', { extraEosTokenIds: f.cfg.eosTokenIds });
      const endOfTurn = preset === 'llama3-real-vocab' ? 128009 : 151645;
      expect(tok.isEos(endOfTurn)).toBe(true);
      const ref = new ReferenceModel(f.cfg, f.weights);
      const wants = CHATS.map((messages) => {
        const all = ref.greedy(tok.encodeChat(messages), MAX_TOKENS);
        const eos = all.findIndex((t) => tok.isEos(t));
        return { ids: eos >= 0 ? all.slice(0, eos) : all, stopId: eos >= 0 ? all[eos]! : null };
      });
      expect(wants[0]!.ids.length).toBeGreaterThan(8);
      expect(wants[1]!.stopId).toBe(endOfTurn);
      // Qwen3 with thinking off (chat_template_kwargs): computed before the mesh starts, so that no long pause
      // between requests lets a kept-alive socket time out under load.
      const noThink = tok.encodeChat(CHATS[0]!, { extra: { enable_thinking: false } });
      const noThinkAll = preset === 'qwen3-real-vocab' ? ref.greedy(noThink, MAX_TOKENS) : [];
      const noThinkEos = noThinkAll.findIndex((t) => tok.isEos(t));
      const noThinkWant = noThinkEos >= 0 ? noThinkAll.slice(0, noThinkEos) : noThinkAll;

      st = await startStaticServer({ root: await ensureModel(preset) });
      relay = await startRelayProcess();
      tracker = await startTrackerProc(['--model', `${preset}=${st.url}`, '--relay', relay.url, '--heartbeat-interval-ms', '1000']);
      // 48 MiB holds one embedding-sized matrix (the embedding at layer 0, the tied head's copy at the last layer: 31-37 MiB
      // in f32) but not both: the tracker's rebalancing cannot widen a pinned node's span to the whole model, which would
      // leave that node "loading" in the tracker's eyes (a pinned node never follows its assignment).
      const common = ['--relay', relay.url, '--tracker', tracker.url, '--model', preset, '--model-url', st.url, '--budget-mb', '48', '--max-context', '256'];
      nodes.push(...(await Promise.all([startNode([...common, '--layers', '0-1']), startNode([...common, '--layers', '1-2'])])));
      await until(async () => (await fetch(`${tracker!.url}/api/route?model=${preset}`)).ok, 30_000, 'a complete route');
      const client = new OpenAI({ baseURL: `${tracker.url}/v1`, apiKey: 'unused', maxRetries: 0, timeout: 120_000 });

      for (const [i, messages] of CHATS.entries()) {
        const want = wants[i]!;
        const stream = await client.chat.completions.create({ model: preset, messages: messages as OpenAI.ChatCompletionMessageParam[], max_tokens: MAX_TOKENS, temperature: 0, stream: true });
        const ids: number[] = [];
        let text = '';
        let finish: string | null = null;
        for await (const c of stream as AsyncIterable<Chunk>) {
          const ch = c.choices[0];
          if (!ch) continue;
          ids.push(...(ch.token_ids ?? []));
          text += ch.delta.content ?? '';
          finish = ch.finish_reason ?? finish;
        }
        expect(ids).toEqual(want.ids);
        expect(finish).toBe(want.stopId === null ? 'length' : 'stop');
        // The text is the stream decoder's over exactly those ids: special tokens never leak into it.
        const dec = tok.streamDecoder({ skipSpecialTokens: true });
        expect(text).toBe(want.ids.map((t) => dec.push(t)).join('') + dec.flush());
        expect(text).not.toMatch(/<\|(eot_id|im_end|end_of_text|endoftext)\|>/);
      }

      if (preset === 'qwen3-real-vocab') {
        // chat_template_kwargs reach the head's template: enable_thinking=false renders the empty think block.
        const messages = CHATS[0]!;
        expect(noThink.length).toBeGreaterThan(tok.encodeChat(messages).length);
        const res = await fetch(`${tracker.url}/v1/chat/completions`, { method: 'POST', body: JSON.stringify({ model: preset, messages, max_tokens: MAX_TOKENS, temperature: 0, chat_template_kwargs: { enable_thinking: false } }) });
        expect(res.status).toBe(200);
        const body = (await res.json()) as { choices: Array<{ token_ids: number[] }>; usage: { prompt_tokens: number } };
        expect(body.usage.prompt_tokens).toBe(noThink.length);
        expect(body.choices[0]!.token_ids).toEqual(noThinkWant);
        const bad = await fetch(`${tracker.url}/v1/chat/completions`, { method: 'POST', body: JSON.stringify({ model: preset, messages, chat_template_kwargs: { messages: [] } }) });
        expect(bad.status).toBe(400);
      }
    }, 240_000);
  });
}
