/**
 * How the tracker opens `POST /generate` on a head: direct HTTP when the
 * head has an endpoint (Node.js nodes), the relay's fast path otherwise; a
 * direct attempt that cannot connect falls back to the relay when the head
 * has both. The answer is the head's NDJSON as raw chunks (head-proxy.ts
 * splits and checks the lines).
 *
 * The direct path is node:http with a keep-alive agent, not fetch: at many
 * chats the tracker reads one chunk per token per chat, and undici's fetch
 * body goes through web streams (a ReadableStream read, its promises and a
 * pull per chunk) where an IncomingMessage hands the chunk over from the
 * socket. The idle timeout is one timer per generation that wakes once per
 * idle period, not a timer and a Promise.race per chunk (idleWatch below).
 */
import { Agent as HttpAgent, request as httpRequest, type IncomingMessage } from 'node:http';
import { Agent as HttpsAgent, request as httpsRequest } from 'node:https';
import { MeshError, remoteError } from '../protocol/errors.ts';
import { concatBytes } from '../protocol/bytes.ts';
import type { RelayClient } from '../net/relay-client.ts';

export interface HeadTarget {
  peerId: string;
  endpoint?: string;
  relayAddr?: string;
}

export interface OpenOptions {
  signal: AbortSignal;
  /** Longest wait for the answer's head and for each later chunk, ms. */
  idleTimeoutMs: number;
}

/** Opens `POST /generate` on a head and yields the raw NDJSON bytes; a non-200 answer throws its MeshError. */
export interface HeadTransport {
  open(head: HeadTarget, headers: Record<string, string>, body: Uint8Array, o: OpenOptions): Promise<AsyncIterable<Uint8Array>>;
}

async function collect(body: AsyncIterable<Uint8Array>, max = 64 * 1024): Promise<Uint8Array> {
  const parts: Uint8Array[] = [];
  let n = 0;
  for await (const c of body) {
    parts.push(c);
    n += c.byteLength;
    if (n > max) break;
  }
  return parts.length === 0 ? new Uint8Array(0) : concatBytes(parts);
}

/**
 * "Silent for `ms` while we wait" without a timer per wait: `waiting()`
 * marks the start of a wait, `got()` its end, and one timer checks at most
 * once per `ms`. When it fires during a wait that began less than `ms` ago
 * (or while the reader holds a chunk: time the consumer takes is not the
 * head's silence) it re-arms for the rest; a wait that reached `ms` calls
 * `onIdle`. So a silent head is cut after `ms` of waiting, exactly as a
 * per-wait timer would, at the cost of a clock read per chunk.
 */
function idleWatch(ms: number, onIdle: () => void): { waiting(): void; got(): void; stop(): void } {
  let since = -1;
  let timer: ReturnType<typeof setTimeout> | undefined;
  const check = (): void => {
    const waited = since < 0 ? 0 : performance.now() - since;
    if (since >= 0 && waited >= ms) {
      timer = undefined;
      onIdle();
      return;
    }
    timer = setTimeout(check, ms - waited);
  };
  timer = setTimeout(check, ms);
  return {
    waiting: () => {
      since = performance.now();
    },
    got: () => {
      since = -1;
    },
    stop: () => {
      clearTimeout(timer);
      timer = undefined;
    },
  };
}

/**
 * Direct HTTP to a head. A connection that fails, or no answer's head within
 * the idle timeout, is MESH_ERR_PEER_GONE (another path may reach it); a
 * non-200 answer throws the head's error; later, silence past the idle
 * timeout is MESH_ERR_TIMEOUT and a broken stream MESH_ERR_PEER_GONE. The
 * signal, or the reader stopping early, closes the connection: the head
 * sees its client gone and cancels the generation.
 */
function directOpen(agents: { http: HttpAgent; https: HttpsAgent }, endpoint: string, headers: Record<string, string>, body: Uint8Array, o: OpenOptions): Promise<AsyncIterable<Uint8Array>> {
  const url = new URL(endpoint.replace(/\/+$/, '') + '/generate');
  const tls = url.protocol === 'https:';
  return new Promise((resolve, reject) => {
    if (o.signal.aborted) {
      reject(new MeshError('MESH_ERR_CANCELLED', 'the generation was cancelled'));
      return;
    }
    let res: IncomingMessage | undefined;
    let opened = false;
    const cannotReach = (why: string) => new MeshError('MESH_ERR_PEER_GONE', `cannot reach head at ${endpoint} (${why})`);
    const fail = (err: MeshError): void => {
      if (res) res.destroy(err);
      else req.destroy(err);
    };
    const watch = idleWatch(o.idleTimeoutMs, () => fail(opened ? new MeshError('MESH_ERR_TIMEOUT', `head silent for ${o.idleTimeoutMs} ms`) : cannotReach(`no answer in ${o.idleTimeoutMs} ms`)));
    const onAbort = (): void => fail(new MeshError('MESH_ERR_CANCELLED', 'the generation was cancelled'));
    o.signal.addEventListener('abort', onAbort, { once: true });
    const done = (): void => {
      watch.stop();
      o.signal.removeEventListener('abort', onAbort);
    };
    const req = (tls ? httpsRequest : httpRequest)(url, { method: 'POST', headers: { ...headers, 'content-length': String(body.byteLength) }, agent: tls ? agents.https : agents.http });
    req.on('error', (e) => {
      if (opened) return; // after the answer's head, errors reach the reader through the response
      done();
      reject(e instanceof MeshError ? e : o.signal.aborted ? new MeshError('MESH_ERR_CANCELLED', 'the generation was cancelled') : cannotReach(e.message));
    });
    req.on('response', (r: IncomingMessage) => {
      opened = true;
      res = r;
      watch.got();
      // Errors reach the reader through its iterator; one that comes before the reader starts must not go unhandled.
      r.on('error', () => {});
      const chunks = read(r, watch, endpoint, done);
      if (r.statusCode === 200) {
        resolve(chunks);
        return;
      }
      const status = r.statusCode ?? 502;
      void collect(chunks)
        .catch(() => new Uint8Array(0))
        .then((bytes) => {
          done();
          r.destroy();
          reject(remoteError(status, bytes));
        });
    });
    watch.waiting();
    req.end(body);
  });
}

/** The answer's chunks, each wait watched; a stream that breaks is the head gone, unless it was cut on purpose (timeout, cancel). */
async function* read(res: IncomingMessage, watch: { waiting(): void; got(): void }, endpoint: string, done: () => void): AsyncGenerator<Uint8Array> {
  const it = res[Symbol.asyncIterator]() as AsyncIterator<Buffer>;
  try {
    for (;;) {
      watch.waiting();
      let r: IteratorResult<Buffer>;
      try {
        r = await it.next();
      } catch (e) {
        throw e instanceof MeshError ? e : new MeshError('MESH_ERR_PEER_GONE', `head at ${endpoint} broke its stream (${(e as Error).message})`);
      }
      watch.got();
      if (r.done) return;
      yield r.value;
    }
  } finally {
    // Leaving early (the client went away, a stop string, max_tokens) closes the connection: the head cancels.
    if (!res.complete) res.destroy();
    done();
  }
}

export function createHeadTransport(deps: { relay?: RelayClient }): HeadTransport {
  // Keep-alive: a chat's /generate reuses a connection another chat finished with.
  const agents = { http: new HttpAgent({ keepAlive: true, noDelay: true }), https: new HttpsAgent({ keepAlive: true, noDelay: true }) };

  async function viaRelay(head: HeadTarget, headers: Record<string, string>, body: Uint8Array, o: OpenOptions): Promise<AsyncIterable<Uint8Array>> {
    if (!deps.relay) throw new MeshError('MESH_ERR_UNAVAILABLE', `head ${head.peerId} has no endpoint and the tracker has no relay`);
    const reply = await deps.relay.requestStream(head.peerId, { method: 'POST', path: '/generate', headers, body }, { timeoutMs: o.idleTimeoutMs, signal: o.signal });
    if (reply.status !== 200) throw remoteError(reply.status, await collect(reply.body));
    return reply.body;
  }

  return {
    async open(head, headers, body, o) {
      if (head.endpoint) {
        try {
          return await directOpen(agents, head.endpoint, headers, body, o);
        } catch (e) {
          // Only a connection failure is worth another path; an answered error is the head's word.
          if (!(e instanceof MeshError && e.code === 'MESH_ERR_PEER_GONE' && deps.relay && head.relayAddr)) throw e;
        }
      }
      return viaRelay(head, headers, body, o);
    },
  };
}
