/**
 * A hand-written check of the usual NodeMessage, heartbeat body (with or
 * without `same`) and relay `beats` message, for the tracker's hot path
 * (thousands of heartbeats a second): it accepts only what the zod schemas
 * (tracker.ts nodeMessageSchema / nodeBeatSchema, beat-batch.ts
 * beatBatchSchema) accept *and* would give back unchanged — no key they do not
 * know, no field this check does not cover. Anything else answers undefined,
 * and the caller runs the schema, whose verdict and error message stand. So
 * a malformed message still gets its clear MESH_ERR_BAD_REQUEST from zod;
 * this only skips zod's work (a third of a beat's cost at the tracker) for
 * messages that are plainly fine. test/protocol/node-message-check.test.ts
 * holds the two to the same answers over mutated messages.
 */
import { MAX_BEATS_PER_BATCH } from './beat-batch.ts';
import { HOP_PATHS, RTC_STATES, SAME_FIELDS, type NodeBeat, type NodeMessage } from './tracker.ts';

type Obj = Record<string, unknown>;

const PEER_ID = /^[0-9a-f]{32}$/;

const isObj = (v: unknown): v is Obj => typeof v === 'object' && v !== null && !Array.isArray(v);
const num = (v: unknown): v is number => typeof v === 'number' && Number.isFinite(v);
const nonNeg = (v: unknown) => num(v) && v >= 0;
const intNonNeg = (v: unknown) => Number.isSafeInteger(v) && (v as number) >= 0;
const intPos = (v: unknown) => Number.isSafeInteger(v) && (v as number) > 0;
const str = (v: unknown, min: number, max: number) => typeof v === 'string' && v.length >= min && v.length <= max;

/** `check(key, value)` for every own key of `o`: false at the first key it does not know or value it does not take. */
function every(o: Obj, check: (k: string, v: unknown) => boolean): boolean {
  for (const k in o) {
    if (!Object.hasOwn(o, k)) return false;
    // An explicit undefined (never from JSON) is left to the schema.
    const v = o[k];
    if (v === undefined || !check(k, v)) return false;
  }
  return true;
}

const span = (v: unknown) => v === null || (isObj(v) && every(v, (k, x) => (k === 'start_layer' ? intNonNeg(x) : k === 'end_layer' ? intPos(x) : false)) && 'start_layer' in v && 'end_layer' in v);

function info(v: unknown): boolean {
  if (!isObj(v) || !('model' in v && 'backend' in v && 'memory_budget_mb' in v && 'host' in v)) return false;
  return every(v, (k, x) => {
    switch (k) {
      case 'model':
        return str(x, 1, 200);
      case 'backend':
        return str(x, 0, 40);
      case 'memory_budget_mb':
        return num(x) && x > 0 && x <= 1 << 24;
      case 'host':
        return x === 'browser' || x === 'node';
      case 'version':
        return str(x, 0, 40);
      case 'weight_format':
        return x === 'f32' || x === 'f16' || x === 'q4';
      case 'pinned':
        return typeof x === 'boolean';
      case 'duty_cycle':
        return num(x) && x >= 0.05 && x <= 1;
      default:
        return false;
    }
  });
}

const HOP_PATH_SET: ReadonlySet<unknown> = new Set(HOP_PATHS);
const RTC_STATE_SET: ReadonlySet<unknown> = new Set(RTC_STATES);

/** hopCountsSchema: a count per path, each optional. */
const hopCounts = (v: unknown) => isObj(v) && every(v, (k, x) => HOP_PATH_SET.has(k) && intNonNeg(x));

/** One of `hop_paths`: the peer, the path its last hop took, its data channel's state, the hops sent it. */
const hopPath = (v: unknown) =>
  isObj(v) &&
  'peer_id' in v &&
  'path' in v &&
  'sent' in v &&
  every(v, (k, x) => {
    switch (k) {
      case 'peer_id':
        return typeof x === 'string' && PEER_ID.test(x);
      case 'path':
        return HOP_PATH_SET.has(x);
      case 'rtc':
        return RTC_STATE_SET.has(x);
      case 'sent':
        return hopCounts(x);
      default:
        return false;
    }
  });

/** A head's speculation counters: all four, counts. */
const speculation = (v: unknown) => isObj(v) && 'drafted' in v && 'accepted' in v && 'trips' in v && 'tokens' in v && every(v, (k, x) => (k === 'drafted' || k === 'accepted' || k === 'trips' || k === 'tokens') && intNonNeg(x));

function stats(v: unknown): boolean {
  if (!isObj(v) || !('rpm' in v && 'layer_ms' in v && 'queue_depth' in v && 'kv_free_bytes' in v && 'tokens_served' in v)) return false;
  return every(v, (k, x) => {
    switch (k) {
      case 'rpm':
      case 'layer_ms':
      case 'kv_free_bytes':
      case 'kv_budget_bytes':
      case 'kv_used_bytes':
        return nonNeg(x);
      case 'queue_depth':
      case 'tokens_served':
      case 'kv_sessions':
        return intNonNeg(x);
      case 'kv_bytes_per_token':
      case 'kv_block_tokens':
      case 'kv_max_tokens':
        return intPos(x);
      case 'batch_sizes':
        return Array.isArray(x) && x.length <= 1025 && x.every(intNonNeg);
      // What a serving node sends once it has sent hops, and a head's speculation: a real node's beat takes this path too.
      case 'hops_sent':
        return hopCounts(x);
      case 'hop_paths':
        return Array.isArray(x) && x.length <= 32 && x.every(hopPath);
      case 'speculation':
        return speculation(x);
      // Anything new: the schema's.
      default:
        return false;
    }
  });
}

const SAME_SET: ReadonlySet<unknown> = new Set(SAME_FIELDS);

/**
 * A heartbeat's `same`: known names, each once, none of them also sent (the
 * schema's rules). `lists` gets which of `public_key` / `info` it names: the
 * two the body may then lack.
 */
function sameList(raw: Obj, v: unknown, lists: { public_key: boolean; info: boolean }): boolean {
  if (!Array.isArray(v) || v.length < 1 || v.length > SAME_FIELDS.length) return false;
  for (let i = 0; i < v.length; i++) {
    const name = v[i] as unknown;
    if (!SAME_SET.has(name) || v.indexOf(name) !== i || Object.hasOwn(raw, name as string)) return false;
    if (name === 'public_key') lists.public_key = true;
    else if (name === 'info') lists.info = true;
  }
  return true;
}

/**
 * `raw` itself, typed, when it is a heartbeat body nodeBeatSchema takes as
 * is (and would return equal), `same` or not; undefined when the schema
 * must decide.
 */
export function plainNodeBeat(raw: unknown): NodeBeat | undefined {
  if (!isObj(raw) || !('peer_id' in raw && 'timestamp' in raw)) return undefined;
  const lists = { public_key: false, info: false };
  if ('same' in raw && !sameList(raw, raw.same, lists)) return undefined;
  if (!(lists.public_key || 'public_key' in raw) || !(lists.info || 'info' in raw)) return undefined;
  const ok = every(raw, (k, x) => {
    switch (k) {
      case 'peer_id':
        return typeof x === 'string' && PEER_ID.test(x);
      case 'public_key':
        return str(x, 40, 64);
      case 'relay_addr':
      case 'endpoint':
        return str(x, 0, 500);
      case 'info':
        return info(x);
      case 'stats':
        return stats(x);
      case 'serving':
      case 'stored':
        return span(x);
      case 'relay_connected':
      case 'draining':
        return typeof x === 'boolean';
      case 'timestamp':
        return Number.isSafeInteger(x);
      case 'same':
        // Checked above.
        return true;
      default:
        return false;
    }
  });
  return ok ? (raw as NodeBeat) : undefined;
}

/**
 * `raw` itself, typed, when it is a NodeMessage nodeMessageSchema takes as is
 * (and would return equal); undefined when the schema must decide.
 */
export function plainNodeMessage(raw: unknown): NodeMessage | undefined {
  return isObj(raw) && !('same' in raw) ? (plainNodeBeat(raw) as NodeMessage | undefined) : undefined;
}

/** A relay's `beats` message as beatBatchSchema would give it; undefined when the schema must decide. */
export function plainBeatBatch(msg: unknown): { batch: number; beats: ReadonlyArray<{ from: string; body: unknown }> } | undefined {
  if (!isObj(msg) || msg.type !== 'beats' || !('batch' in msg && 'beats' in msg)) return undefined;
  const { batch, beats } = msg;
  if (!Number.isSafeInteger(batch) || (batch as number) < 0 || (batch as number) > 0xffffffff) return undefined;
  if (!Array.isArray(beats) || beats.length > MAX_BEATS_PER_BATCH) return undefined;
  for (const b of beats as unknown[]) {
    if (!isObj(b) || !('body' in b) || b.body === undefined) return undefined;
    if (typeof b.from !== 'string' || !PEER_ID.test(b.from)) return undefined;
    for (const k in b) if (k !== 'from' && k !== 'body') return undefined;
  }
  for (const k in msg) if (k !== 'type' && k !== 'batch' && k !== 'beats') return undefined;
  return { batch: batch as number, beats: beats as Array<{ from: string; body: unknown }> };
}
