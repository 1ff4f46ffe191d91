/**
 * bench/swarm.ts's chat load: streamed chats through the 3-node mesh beside
 * the swarm, one after another, so the window measures the control plane
 * while it also routes real work (a chat that fails is counted, not fatal).
 */

const sleep = (ms: number) => new Promise<void>((r) => setTimeout(r, ms));

export interface Chats {
  ok: number;
  failed: number;
  tokensPerS: number[];
  ttftMs: number[];
  errors: string[];
  stop(): Promise<void>;
}

/** Streamed chats one after another, through each tracker in turn, until stopped. */
export function chatLoop(trackerUrls: string[]): Chats {
  const c: Chats = { ok: 0, failed: 0, tokensPerS: [], ttftMs: [], errors: [], stop: async () => {} };
  let running = true;
  const done = (async () => {
    for (let i = 0; running; i++) {
      const t0 = performance.now();
      const trackerUrl = trackerUrls[i % trackerUrls.length]!;
      try {
        const res = await fetch(`${trackerUrl}/v1/chat/completions`, {
          method: 'POST',
          headers: { 'content-type': 'application/json' },
          body: JSON.stringify({ model: 'small', messages: [{ role: 'user', content: `Tell me about swarm number ${i}.` }], max_tokens: 16, temperature: 0, stream: true, stream_options: { include_usage: true } }),
        });
        if (res.status !== 200 || !res.body) throw new Error(`HTTP ${res.status}: ${(await res.text()).slice(0, 200)}`);
        let first = 0;
        let tokens = 0;
        let buf = '';
        const dec = new TextDecoder();
        for await (const chunk of res.body as unknown as AsyncIterable<Uint8Array>) {
          if (!first) first = performance.now();
          buf += dec.decode(chunk, { stream: true });
          let k: number;
          while ((k = buf.indexOf('\n\n')) >= 0) {
            const line = buf.slice(0, k).trim();
            buf = buf.slice(k + 2);
            if (!line.startsWith('data:') || line.includes('[DONE]')) continue;
            const msg = JSON.parse(line.slice(5)) as { error?: { message: string }; usage?: { completion_tokens: number } };
            if (msg.error) throw new Error(msg.error.message);
            if (msg.usage) tokens = msg.usage.completion_tokens;
          }
        }
        const end = performance.now();
        c.ok++;
        c.ttftMs.push(first - t0);
        if (tokens > 1) c.tokensPerS.push(((tokens - 1) * 1000) / (end - first));
      } catch (e) {
        c.failed++;
        if (c.errors.length < 5) c.errors.push((e as Error).message);
        await sleep(500);
      }
    }
  })();
  c.stop = async () => {
    running = false;
    await done;
  };
  return c;
}
