/**
 * The tracker's own API (control plane), shared by the tracker and every
 * node host. Nodes sign what they send with their relay identity (the same
 * Ed25519 key), so nobody can speak for another node; the tracker signs the
 * routes it hands to heads, so no client can point a head at arbitrary
 * endpoints. Everything here is JSON over HTTP (or over the relay, same
 * shapes), validated with these schemas on arrival.
 */
import { z } from 'zod';
import { DTYPES } from './tensor.ts';

const peerId = z.string().regex(/^[0-9a-f]{32}$/);

/** What a node offers; sent at registration and refreshed by heartbeats. */
export const nodeInfoSchema = z.object({
  /** Model id the node serves (the tracker's model registry key). */
  model: z.string().min(1).max(200),
  backend: z.enum(['webgpu', 'wasm', 'onnxruntime-node', 'cpu']).or(z.string().max(40)),
  /** Memory the donor gives, MiB (weights + KV reserve). */
  memory_budget_mb: z.number().positive().max(1 << 24),
  host: z.enum(['browser', 'node']),
  version: z.string().max(40).optional(),
  /**
   * The format the node holds its weights in (WEIGHT_FORMATS of the model's weight-format module, spelled out
   * so the relay's bundle loads no model code); the tracker sizes its span by it. Absent: f32.
   */
  weight_format: z.enum(['f32', 'f16', 'q4']).optional(),
  /**
   * The node serves a span its operator fixed (`meshnet node --layers`): the tracker adopts what it serves
   * and never moves it, since the node would not follow. Absent: false.
   */
  pinned: z.boolean().optional(),
  /**
   * The donor's cap on the device's busy time (0.05..1): the node rests between its steps, and its
   * `stats.layer_ms` already counts the cap (measured step time ÷ duty_cycle). For the dashboard. Absent: 1.
   */
  duty_cycle: z.number().min(0.05).max(1).optional(),
});
export type NodeInfo = z.infer<typeof nodeInfoSchema>;

/** The paths a hop can take (net/contract.ts TransportKind): a data channel, the relay's fast path, /rpc, a direct link, direct HTTP. */
export const HOP_PATHS = ['rtc', 'fast', 'rpc', 'link', 'direct'] as const;
/** A data channel's state towards one peer (net/rtc-pool.ts RtcState). */
export const RTC_STATES = ['open', 'connecting', 'failed', 'unsupported', 'none'] as const;
const count = z.number().int().nonnegative();
const hopCountsSchema = z.object({ rtc: count.optional(), fast: count.optional(), rpc: count.optional(), link: count.optional(), direct: count.optional() });

/** Rolling stats a heartbeat carries (ADR-0013). */
export const nodeStatsSchema = z.object({
  /** Requests answered in the last 60 s. */
  rpm: z.number().nonnegative(),
  /** Median compute time per layer per decode step, ms. */
  layer_ms: z.number().nonnegative(),
  queue_depth: z.number().int().nonnegative(),
  /** KV bytes a new session can get now (the budget less what live sessions hold). */
  kv_free_bytes: z.number().nonnegative(),
  tokens_served: z.number().int().nonnegative(),
  /** The KV budget: the memory budget less the weights held. Optional: older nodes do not send it. */
  kv_budget_bytes: z.number().nonnegative().optional(),
  /** KV bytes reserved by the sessions held now. */
  kv_used_bytes: z.number().nonnegative().optional(),
  kv_sessions: z.number().int().nonnegative().optional(),
  /** Bytes one position of one session costs on this node (every held layer, keys and values). */
  kv_bytes_per_token: z.number().int().positive().optional(),
  /** KV room is granted in blocks of this many positions. */
  kv_block_tokens: z.number().int().positive().optional(),
  /** Positions one session may reach on this node (its context). */
  kv_max_tokens: z.number().int().positive().optional(),
  /** Forward runs by batch size since the span loaded: batch_sizes[n] = runs of n sessions' steps (index 0 unused). */
  batch_sizes: z.array(z.number().int().nonnegative()).max(1025).optional(),
  /** A head's speculative decoding since its span loaded: tokens drafted and accepted, trips through the mesh, tokens those trips gave. */
  speculation: z
    .object({ drafted: z.number().int().nonnegative(), accepted: z.number().int().nonnegative(), trips: z.number().int().nonnegative(), tokens: z.number().int().nonnegative() })
    .optional(),
  /** Requests (and one-way pushes) this node sent to other nodes since it started, per path (docs/protocol.md §12). */
  hops_sent: hopCountsSchema.optional(),
  /** Per peer this node sent hops to (the most recent 32): the path the last one took, and its data channel's state. */
  hop_paths: z
    .array(z.object({ peer_id: z.string().regex(/^[0-9a-f]{32}$/), path: z.enum(HOP_PATHS), rtc: z.enum(RTC_STATES).optional(), sent: hopCountsSchema }))
    .max(32)
    .optional(),
});
export type NodeStats = z.infer<typeof nodeStatsSchema>;

export const assignmentSchema = z.object({
  model: z.string(),
  start_layer: z.number().int().nonnegative(),
  /** Exclusive. */
  end_layer: z.number().int().positive(),
  /** Base URL of the HF-layout checkpoint to fetch the layers from. */
  model_url: z.string(),
  /**
   * The model's wire dtype (X-Meshnet-Dtype of every hop): a head sends it on
   * every hop, a hop accepts only it. Optional: older trackers do not send it
   * (then bf16 is sent and all three are accepted).
   */
  wire_dtype: z.enum(DTYPES).optional(),
});
export type Assignment = z.infer<typeof assignmentSchema>;

/** Body of POST /api/nodes/register and /api/nodes/heartbeat, before signing. */
export const nodeMessageSchema = z.object({
  peer_id: peerId,
  /** base64url raw Ed25519 public key; peer_id must be its sha256 prefix. */
  public_key: z.string().min(40).max(64),
  relay_addr: z.string().max(500).optional(),
  /** Direct HTTP base URL (Node.js nodes). */
  endpoint: z.string().max(500).optional(),
  info: nodeInfoSchema,
  stats: nodeStatsSchema.optional(),
  /** The span the node currently holds and serves (may differ while it loads a new assignment). */
  serving: z.object({ start_layer: z.number().int().nonnegative(), end_layer: z.number().int().positive() }).nullable().optional(),
  /**
   * Whether the node's relay connection is registered now (false while it
   * reconnects after losing it; it beats at once when it is back). Absent: a
   * node without a relay, or an older one. The dashboard shows a node only the
   * relay reaches as unreachable meanwhile.
   */
  relay_connected: z.boolean().optional(),
  /**
   * The node takes no new sessions (the donor paused it, the page is being frozen or closed): the
   * tracker routes no new chat, replacement or failover through it from this message on, while the
   * sessions in flight may finish. It keeps its assignment and `serving`. Absent: false.
   */
  draining: z.boolean().optional(),
  /** The span whose weights the node keeps in its own storage (a page's IndexedDB): a fresh registration may get it back with no download. */
  stored: z.object({ start_layer: z.number().int().nonnegative(), end_layer: z.number().int().positive() }).nullable().optional(),
  /**
   * ms since epoch; the tracker refuses messages more than 60 s off (replay guard). A node's messages
   * are applied in timestamp order: an older one than the last applied is answered and ignored; at an
   * equal timestamp `draining: true` holds (a drain beacon signed with its heartbeat's timestamp).
   */
  timestamp: z.number().int(),
});
export type NodeMessage = z.infer<typeof nodeMessageSchema>;

/**
 * The fields a heartbeat may leave out when they are as in the last message
 * of this node the tracker applied, naming them in `same` (docs/protocol.md
 * §9): what a node resends unchanged on nearly every beat. `serving`,
 * `draining`, `relay_connected`, `timestamp` and `peer_id` always travel.
 */
export const SAME_FIELDS = ['public_key', 'info', 'relay_addr', 'endpoint', 'stored', 'stats'] as const;
export type SameField = (typeof SAME_FIELDS)[number];

/**
 * Body of a heartbeat (`POST /api/nodes/heartbeat`, a relay beat, a batched
 * one): a NodeMessage, or one whose `same` names fields it leaves out. No
 * `same`: a NodeMessage exactly. A registration never carries `same`.
 */
export const nodeBeatSchema = nodeMessageSchema
  .extend({
    public_key: nodeMessageSchema.shape.public_key.optional(),
    info: nodeInfoSchema.optional(),
    same: z.array(z.enum(SAME_FIELDS)).min(1).max(SAME_FIELDS.length).optional(),
  })
  .superRefine((m, ctx) => {
    const same = m.same ?? [];
    same.forEach((name, i) => {
      if (same.indexOf(name) !== i) ctx.addIssue({ code: 'custom', path: ['same', i], message: `"${name}" is listed twice` });
      else if (m[name] !== undefined) ctx.addIssue({ code: 'custom', path: ['same', i], message: `"${name}" is both sent and listed in "same": send it, or list it and leave it out` });
    });
    if (m.public_key === undefined && !same.includes('public_key')) ctx.addIssue({ code: 'custom', path: ['public_key'], message: 'required unless listed in "same"' });
    if (m.info === undefined && !same.includes('info')) ctx.addIssue({ code: 'custom', path: ['info'], message: 'required unless listed in "same"' });
  });
export type NodeBeat = z.infer<typeof nodeBeatSchema>;

/** A signed message: `signature` is base64url Ed25519 over canonicalJson(body). */
export const signedSchema = <T extends z.ZodTypeAny>(body: T) => z.object({ body, signature: z.string().min(40).max(200) });

/** An operator's certificate of a tracker key: Ed25519 by `operator_key` over trackerCertMessage(key, expires_at). */
export const trackerCertSchema = z.object({
  operator_key: z.string().min(40).max(64),
  expires_at: z.number().int(),
  signature: z.string().min(40).max(200),
});
export type TrackerCert = z.infer<typeof trackerCertSchema>;

/** One tracker of a cluster as nodes learn it: its route-signing key, certified by the operator when the cluster has one. */
export const trackerKeySchema = z.object({
  public_key: z.string().min(40).max(64),
  cert: trackerCertSchema.optional(),
});
export type TrackerKey = z.infer<typeof trackerKeySchema>;

/**
 * What an operator signs to make a key one of its trackers:
 * `tracker-cert-v1:` + the tracker's base64url public key + `:` + expires_at.
 * A node that knows the operator key accepts routes signed by any key so
 * certified (docs/protocol.md §9, "Clusters of trackers").
 */
export function trackerCertMessage(trackerPublicKey: string, expiresAt: number): Uint8Array {
  return new TextEncoder().encode(`tracker-cert-v1:${trackerPublicKey}:${expiresAt}`);
}

export const registerAnswerSchema = z.object({
  assignment: assignmentSchema.nullable(),
  heartbeat_interval_ms: z.number().int().positive(),
  /** base64url raw Ed25519 key the tracker signs routes with. */
  tracker_public_key: z.string(),
  /**
   * Nodes under quarantine now (found lying by a check, docs/verification.md): a head stops using them
   * at once (it replaces the hop by its usual replay). Optional: older trackers send none.
   */
  distrust: z.array(z.object({ peer_id: peerId, until: z.number().int() })).max(10_000).optional(),
  /** The tracker takes heartbeats with `same` (nodeBeatSchema): a node sends them only to one that says so. Absent: an older tracker. */
  takes_same: z.literal(true).optional(),
  /** The answering tracker's peer id: heartbeats may go to it over the relay (optional: older trackers). */
  tracker_peer_id: peerId.optional(),
  /** Every tracker of its cluster (a tracker alone: absent). A route signed by any of them is the cluster's. */
  tracker_keys: z.array(trackerKeySchema).max(64).optional(),
});
export type RegisterAnswer = z.infer<typeof registerAnswerSchema>;

/** One downstream hop, as in the ADR's tracker injection plus our fields. */
export const routeHopSchema = z.object({
  peer_id: peerId,
  start_layer: z.number().int().nonnegative(),
  end_layer: z.number().int().positive(),
  endpoint: z.string().optional(),
  relay_addr: z.string().optional(),
});
export type RouteHop = z.infer<typeof routeHopSchema>;
/**
 * The hops after the head, in order (the ADR's "downstream hops"). Each hop
 * runs [start_layer, end_layer): `start_layer` may lie inside the node's
 * range (ADR-0012: the previous hop already ran the overlap), `end_layer` is
 * where it stops (send it as X-Meshnet-End-Layer). The head runs
 * [0, route[0].start_layer); an empty list means the head holds every layer.
 */
export const routeSchema = z.array(routeHopSchema).max(256);

/**
 * The head's view of a route: `X-Meshnet-Route` is JSON of the downstream
 * hops; `X-Meshnet-Route-Signature` is the tracker's signature over
 * `route-v1:` + head peer id + `:` + expires_at + `:` + the header's exact text,
 * sent with `X-Meshnet-Route-Expires` so a captured route cannot be reused
 * for long or on another head.
 */
export function routeSigningMessage(headPeerId: string, expiresAt: number, routeHeader: string): Uint8Array {
  return new TextEncoder().encode(`route-v1:${headPeerId}:${expiresAt}:${routeHeader}`);
}

/**
 * What the tracker signs so chain hops may trust a head's reply address
 * (`X-Meshnet-Chain-Reply`, JSON {relay_addr?, endpoint?} as the head
 * registered them): `chain-reply-v1:` + head peer id + `:` + the route's
 * expires_at + `:` + the reply text. A separate signature (not a new route
 * signature), so ADR-era heads and hops verify routes as before.
 */
export function chainReplySigningMessage(headPeerId: string, expiresAt: number, replyText: string): Uint8Array {
  return new TextEncoder().encode(`chain-reply-v1:${headPeerId}:${expiresAt}:${replyText}`);
}

/** JSON with sorted keys, no spaces: what signatures cover. */
export function canonicalJson(value: unknown): string {
  if (value === null || typeof value !== 'object') return JSON.stringify(value);
  if (Array.isArray(value)) return `[${value.map(canonicalJson).join(',')}]`;
  const entries = Object.entries(value as Record<string, unknown>)
    .filter(([, v]) => v !== undefined)
    .sort(([a], [b]) => (a < b ? -1 : a > b ? 1 : 0));
  return `{${entries.map(([k, v]) => `${JSON.stringify(k)}:${canonicalJson(v)}`).join(',')}}`;
}

/** Template variables a client may set: scalars under plain names, never what the renderer itself provides. */
const TEMPLATE_RESERVED = new Set(['messages', 'add_generation_prompt', 'bos_token', 'eos_token', 'pad_token', 'unk_token']);
export const chatTemplateKwargsSchema = z
  .record(z.string().regex(/^[A-Za-z_][A-Za-z0-9_]{0,63}$/), z.union([z.boolean(), z.number(), z.string().max(1000), z.null()]))
  .refine((r) => Object.keys(r).length <= 16 && !Object.keys(r).some((k) => TEMPLATE_RESERVED.has(k)), { message: `at most 16 variables, none of ${[...TEMPLATE_RESERVED].join(', ')}` });

/**
 * The request a tracker sends to a head node: `POST /generate` with the
 * route headers. The head answers a stream of NDJSON lines, one
 * `GenerateEvent` per line (over the fast path as DATA frames).
 */
export const generateRequestSchema = z.object({
  /** Chat messages (rendered with the model's chat template) or a raw prompt. */
  messages: z.array(z.object({ role: z.string(), content: z.string() })).optional(),
  /** Extra variables for the chat template (vLLM's `chat_template_kwargs`, e.g. Qwen3's `enable_thinking`). */
  chat_template_kwargs: chatTemplateKwargsSchema.optional(),
  prompt: z.string().optional(),
  /** A prompt given as token ids (OpenAI's completions API allows it): fed as they are, no chat template, no tokenizer. */
  prompt_token_ids: z.array(z.number().int().nonnegative()).min(1).optional(),
  /**
   * Tokens already generated (failover: a new head continues from here).
   * The head replays them into the caches without emitting them again;
   * `index` of the next token event is prefix_token_ids.length, and
   * max_tokens counts the prefix too (it is the original request's limit).
   */
  prefix_token_ids: z.array(z.number().int().nonnegative()).default([]),
  max_tokens: z.number().int().positive(),
  temperature: z.number().min(0).max(2).default(1),
  top_p: z.number().gt(0).max(1).default(1),
  top_k: z.number().int().nonnegative().default(0),
  seed: z.number().int().optional(),
  stop: z.array(z.string()).default([]),
  session_id: z.string().min(1).max(100),
  /**
   * Speculative decoding (docs/architecture.md): false turns it off for this
   * generation; absent or true leaves it to the head (drafts where they pay).
   */
  speculative: z.boolean().optional(),
  /** Drafted tokens per trip, fixed (0: none); absent: adapted to the measured acceptance. */
  speculative_k: z.number().int().min(0).max(16).optional(),
  /** The draft model to draft with, by the name the head loaded it under (`meshnet node --draft`); absent: the head's choice. */
  draft_model: z.string().min(1).max(200).optional(),
  /** Text the answer is expected to resemble (OpenAI's Predicted Outputs): drafted from first. */
  prediction: z.string().max(1 << 20).optional(),
  /** The same as token ids (fed as they are). */
  prediction_token_ids: z.array(z.number().int().nonnegative()).max(1 << 17).optional(),
});
export type GenerateRequest = z.infer<typeof generateRequestSchema>;

export const generateEventSchema = z.discriminatedUnion('type', [
  z.object({ type: z.literal('start'), prompt_tokens: z.number().int(), route: z.array(z.string()) }),
  z.object({
    type: z.literal('token'),
    index: z.number().int(),
    token_id: z.number().int(),
    text: z.string(),
    logprob: z.number(),
    /** On the first token of a speculative trip: tokens the trip drafted, and how many of them were accepted. */
    drafted: z.number().int().nonnegative().optional(),
    accepted: z.number().int().nonnegative().optional(),
    /**
     * On the first token of such a trip: a sampling draft model drafted it (T > 0), so Leviathan's rule drew
     * its tokens from drafts only the head holds — a head audit's replay cannot confirm them.
     */
    drafts_sampled: z.literal(true).optional(),
  }),
  z.object({ type: z.literal('recovered'), failed_peer_id: z.string(), replacement_peer_id: z.string(), recovery_ms: z.number() }),
  z.object({
    type: z.literal('done'),
    finish_reason: z.enum(['stop', 'length']),
    completion_tokens: z.number().int(),
    prompt_tokens: z.number().int(),
    /** Speculative decoding over the whole generation (this head's part of it): tokens drafted, accepted, and trips through the mesh. */
    drafted: z.number().int().nonnegative().optional(),
    accepted: z.number().int().nonnegative().optional(),
    trips: z.number().int().nonnegative().optional(),
  }),
  z.object({
    type: z.literal('error'),
    code: z.string(),
    message: z.string(),
    /** The node that refused or failed (MESH_ERR_BUSY names the node without KV room). */
    peer_id: z.string().optional(),
    /** MESH_ERR_BUSY: when that node suggests trying again, ms. */
    retry_after_ms: z.number().nonnegative().optional(),
  }),
]);
export type GenerateEvent = z.infer<typeof generateEventSchema>;

/** POST /api/route/replace: a head asks for a span to replace a failed hop (signed by the head). */
export const replaceRequestSchema = z.object({
  head_peer_id: peerId,
  failed_peer_id: peerId,
  start_layer: z.number().int().nonnegative(),
  end_layer: z.number().int().positive(),
  model: z.string(),
  timestamp: z.number().int(),
  /**
   * The head's downstream hops as it runs them now (the failed one among
   * them): with it, the tracker also signs the whole route with the
   * replacement in place (ReplaceAnswer.chain), so the head can chain again.
   * Optional: ADR-era heads send none, ADR-era trackers ignore it.
   */
  route: z.array(z.object({ peer_id: peerId, start_layer: z.number().int().nonnegative(), end_layer: z.number().int().positive() })).max(256).optional(),
});
export type ReplaceRequest = z.infer<typeof replaceRequestSchema>;

/**
 * The tracker's answer to POST /api/route/replace: hops covering exactly
 * [start_layer, end_layer) of the failed hop, signed like a route header
 * (`route` is the JSON text of a RouteHop list, `signature` is over
 * routeSigningMessage(head_peer_id, expires_at, route)), so a head accepts
 * replacement endpoints only from the tracker. 503 when no node covers the
 * span yet (the head retries with backoff).
 */
export const replaceAnswerSchema = z.object({
  route: z.string().min(2).max(64_000),
  /** ms since epoch, as X-Meshnet-Route-Expires. */
  expires_at: z.number().int(),
  signature: z.string().min(40).max(200),
  /**
   * When the request gave its route: the head's whole downstream route with
   * the replacement in place, signed as a route header, and the head's reply
   * address signed for it (as on /generate), for chained hops.
   */
  chain: z
    .object({
      route: z.string().min(2).max(64_000),
      expires_at: z.number().int(),
      signature: z.string().min(40).max(200),
      reply: z.string().max(2048).optional(),
      reply_signature: z.string().min(40).max(200).optional(),
    })
    .optional(),
  /**
   * No other node holds the layers, and the failed node answered the
   * tracker just now: the route names it on purpose (it was away for a
   * moment), and the head resumes on it, replaying where its cache is gone.
   * Absent: a route naming the failed node means the tracker has not
   * noticed the failure yet (the head asks again).
   */
  failed_reachable: z.boolean().optional(),
});
export type ReplaceAnswer = z.infer<typeof replaceAnswerSchema>;
