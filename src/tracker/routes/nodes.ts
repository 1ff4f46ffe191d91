/**
 * The nodes' side of the tracker: signed registration and heartbeats.
 *
 *   POST /api/nodes/register    signed NodeMessage → RegisterAnswer (assignment)
 *   POST /api/nodes/heartbeat   signed NodeMessage → RegisterAnswer; 404 when unknown (register again)
 *   GET  /api/nodes/watch       an SSE stream held open by each node: it ends when this tracker goes
 *                               away, so nodes notice a restart at once and register again
 */
import { MeshError } from '../../protocol/errors.ts';
import { plainNodeBeat } from '../../protocol/node-message-check.ts';
import { nodeBeatSchema, nodeMessageSchema, signedSchema, type NodeBeat, type NodeMessage, type RegisterAnswer } from '../../protocol/tracker.ts';
import { filledBeat, notRegistered } from '../beat-delta.ts';
import { notLoadedYet, type TrackerContext } from '../context.ts';
import { wireDtypeOf } from '../options.ts';
import { json, readJson, streamResponse, type App } from '../http.ts';
import type { NodeRecord } from '../registry.ts';
import { WATCH_HEADERS } from '../watch-hub.ts';

const nodeMessage = signedSchema(nodeMessageSchema);
const signedBeat = signedSchema(nodeBeatSchema);
const utf8 = new TextEncoder();
const utf8Decoder = new TextDecoder();
/** A comment on each watch stream this often, ms (below the idle timeouts of common proxies). */
const WATCH_KEEPALIVE_MS = 20_000;

/** The parts of one batch's answers that are the same for every node (sharedAnswer). */
interface SharedAnswer {
  interval: number;
  /** From `,"heartbeat_interval_ms":` to `"tracker_peer_id":`. */
  mid: string;
  /** The tracker keys, if any, and the closing brace. */
  tail: string;
  /** Per model: the assignment's text around its two layer numbers. */
  assignments: Map<string, { head: string; tail: string }>;
}

export function nodeRoutes(app: App, ctx: TrackerContext): void {
  const { options: o, registry, metrics, logger } = ctx;

  function answerFor(n: NodeRecord): RegisterAnswer {
    const model = registry.models.get(n.info.model)!;
    // Longer than configured while the tracker is behind (load.ts); the node's deadline counts in what it was told.
    const interval = ctx.load.intervalMs();
    registry.toldInterval(n, interval);
    const keys = ctx.cluster?.trackerKeys();
    return {
      assignment: n.assignment && { model: model.name, start_layer: n.assignment.start, end_layer: n.assignment.end, model_url: model.url, wire_dtype: wireDtypeOf(o, model.name) },
      heartbeat_interval_ms: interval,
      tracker_public_key: ctx.publicKey,
      ...(ctx.verification.enabled ? { distrust: distrustNow() } : {}),
      takes_same: true,
      // In a cluster: a tracker on the node's own relay, so its beats never cross between relays.
      tracker_peer_id: ctx.cluster?.beatTarget(n) ?? ctx.identity.peerId,
      ...(keys ? { tracker_keys: keys } : {}),
    };
  }

  function distrustNow(): Array<{ peer_id: string; until: number }> {
    return ctx.verification.distrusted().map((d) => ({ peer_id: d.peer_id, until: d.until }));
  }

  /**
   * What every answer of one batch holds alike, as JSON text, made once a
   * batch: the period, the tracker's key, the distrust list and the cluster's
   * tracker keys were rebuilt and stringified for every beat (the distrust
   * list by a walk of the quarantines), though a synchronous pass cannot see
   * them change. The tracker keys' text is kept until the list changes
   * (tracker-peers.ts keeps the same array till then).
   */
  function sharedAnswer(): SharedAnswer {
    const interval = ctx.load.intervalMs();
    const keys = ctx.cluster?.trackerKeys();
    if (keys !== keysText.of) keysText = { of: keys, text: keys ? `,"tracker_keys":${JSON.stringify(keys)}}` : '}' };
    return {
      interval,
      mid: `,"heartbeat_interval_ms":${interval},"tracker_public_key":${JSON.stringify(ctx.publicKey)}${ctx.verification.enabled ? `,"distrust":${JSON.stringify(distrustNow())}` : ''},"takes_same":true,"tracker_peer_id":`,
      tail: keysText.text,
      assignments: new Map(),
    };
  }
  let keysText: { of: unknown; text: string } = { of: null, text: '}' };

  /** answerFor(n) as JSON text, character for character (test/tracker/beat-answer-text.test.ts), from a batch's shared parts. */
  function answerText(n: NodeRecord, shared: SharedAnswer): string {
    registry.toldInterval(n, shared.interval);
    const a = n.assignment;
    let assignment = 'null';
    if (a) {
      let parts = shared.assignments.get(n.info.model);
      if (!parts) {
        const model = registry.models.get(n.info.model)!;
        const dtype = wireDtypeOf(o, model.name);
        parts = { head: `{"model":${JSON.stringify(model.name)},"start_layer":`, tail: `,"model_url":${JSON.stringify(model.url)}${dtype !== undefined ? `,"wire_dtype":${JSON.stringify(dtype)}` : ''}}` };
        shared.assignments.set(n.info.model, parts);
      }
      assignment = `${parts.head}${a.start},"end_layer":${a.end}${parts.tail}`;
    }
    return `{"assignment":${assignment}${shared.mid}${JSON.stringify(ctx.cluster?.beatTarget(n) ?? ctx.identity.peerId)}${shared.tail}`;
  }

  async function signedNodeMessage(req: Request, kind: 'register' | 'heartbeat', admit?: (peerId: string) => void): Promise<NodeMessage> {
    const raw = await readJson(req, o.maxBodyBytes);
    const parsed = (kind === 'register' ? nodeMessage : signedBeat).safeParse(raw);
    if (!parsed.success) {
      metrics.registrations.inc({ kind, result: 'malformed' });
      const issue = parsed.error.issues[0]!;
      throw new MeshError('MESH_ERR_BAD_REQUEST', `field "${issue.path.join('.') || '(root)'}": ${issue.message}; expected {body: NodeMessage, signature}`);
    }
    const signedBody = (raw as { body: unknown }).body;
    // The schema would strip it and the signature covers it: say so rather than register from half a message.
    if (kind === 'register' && Object.hasOwn(signedBody as object, 'same')) {
      metrics.registrations.inc({ kind, result: 'malformed' });
      throw new MeshError('MESH_ERR_BAD_REQUEST', 'field "body.same": a registration sends every field; "same" is for heartbeats');
    }
    admit?.(parsed.data.body.peer_id);
    const body = parsed.data.body as NodeBeat;
    let msg: NodeMessage;
    try {
      // Fields listed in `same` from the record (its key among them: the signature is checked against the registered one).
      msg = filledBeat(body, body.same === undefined ? undefined : registry.nodes.get(body.peer_id));
    } catch (e) {
      metrics.registrations.inc({ kind, result: 'unknown' });
      throw e;
    }
    try {
      // Over the body as sent: fields a newer node adds (and this schema strips) are signed too.
      ctx.nodeKeys.verifyNodeMessage({ body: msg, signature: parsed.data.signature }, o.now(), o.maxClockSkewMs, signedBody);
    } catch (e) {
      metrics.registrations.inc({ kind, result: 'refused' });
      logger.warn({ peer_id: msg.peer_id, kind, err: (e as Error).message }, 'signed node message refused');
      throw e;
    }
    return msg;
  }

  app.post('/api/nodes/register', async ({ req }) => {
    const msg = await signedNodeMessage(req, 'register', (peer) => {
      if (!ctx.load.saturated || registry.nodes.has(peer)) return;
      // Behind even at the longest heartbeat period: a newcomer can wait (before its signature is checked); the nodes here keep their beats.
      metrics.registrations.inc({ kind: 'register', result: 'shed' });
      throw new MeshError('MESH_ERR_UNAVAILABLE', 'the tracker is overloaded; register again after Retry-After', { retry_after_ms: ctx.load.retryAfterMs() });
    });
    if (!registry.models.has(msg.info.model)) {
      const pending = notLoadedYet(ctx.pendingModels, msg.info.model);
      if (pending) throw pending;
    }
    const n = registry.register(msg);
    // In a cluster the stored registration is the answer: another tracker may have decided this node's span first.
    await ctx.cluster?.commitRegistration(n);
    metrics.registrations.inc({ kind: 'register', result: 'ok' });
    logger.info({ peer_id: n.peerId, model: n.info.model, budget_mb: n.info.memory_budget_mb, assignment: n.assignment, serving: n.serving, ...(n.draining ? { draining: true } : {}) }, 'node registered');
    ctx.updateNodeGauge();
    ctx.admission.kick();
    return json(200, answerFor(n));
  });

  // Node's http host serves this route from ctx.watch (watch-hub.ts); this one answers other hosts (the relay bridge, tests).
  app.get('/api/nodes/watch', () => {
    const hello = ctx.watch.hello();
    async function* events(): AsyncGenerator<Uint8Array> {
      yield utf8.encode(`event: hello\ndata: ${hello}\n\n`);
      // Nothing else to say: the stream's end is the news. A comment now and then keeps proxies from cutting it.
      for (;;) {
        await new Promise<void>((r) => setTimeout(r, WATCH_KEEPALIVE_MS).unref?.());
        yield utf8.encode(': keep-alive\n\n');
      }
    }
    return streamResponse(events(), { status: 200, headers: WATCH_HEADERS });
  });

  /**
   * A heartbeat the relay vouches for (`from`: the sender it stamped), its
   * NodeMessage unsigned and already parsed: for a node this tracker knows,
   * with the same key; anything else registers (signed) first. The caller
   * counts it ok, updates the node gauge and kicks the admission queue: once
   * per beat for a request, once per batch for a batch.
   */
  function vouchedBeat(from: string, raw: unknown): NodeRecord {
    // The usual beat passes a hand check (node-message-check.ts); anything else, and every error, is the schema's.
    const beat = plainNodeBeat(raw) ?? schemaNodeBeat(raw);
    if (beat.peer_id !== from) {
      metrics.registrations.inc({ kind: 'heartbeat', result: 'refused' });
      throw new MeshError('MESH_ERR_FORBIDDEN', `this heartbeat speaks for ${beat.peer_id}, but the relay says it comes from ${from}`);
    }
    const known = registry.nodes.get(from);
    if (!known) {
      metrics.registrations.inc({ kind: 'heartbeat', result: 'unknown' });
      throw notRegistered(from);
    }
    // Fields listed in `same` are the record's: its key among them, which then matches.
    const msg = filledBeat(beat, known);
    if (known.publicKey !== msg.public_key) {
      metrics.registrations.inc({ kind: 'heartbeat', result: 'refused' });
      throw new MeshError('MESH_ERR_FORBIDDEN', 'public_key differs from the registered one: register again (signed)');
    }
    const wasDraining = known.draining;
    const n = registry.heartbeat(msg);
    if (n.draining !== wasDraining) logger.info({ peer_id: n.peerId, serving: n.serving }, n.draining ? 'node draining: no new sessions routed to it' : 'node takes sessions again');
    return n;
  }
  const beatsOk = metrics.registrations.labels({ kind: 'heartbeat', result: 'ok' });

  function schemaNodeBeat(raw: unknown): NodeBeat {
    const parsed = nodeBeatSchema.safeParse(raw);
    if (!parsed.success) {
      metrics.registrations.inc({ kind: 'heartbeat', result: 'malformed' });
      const issue = parsed.error.issues[0]!;
      throw new MeshError('MESH_ERR_BAD_REQUEST', `field "${issue.path.join('.') || '(root)'}": ${issue.message}; expected a NodeMessage`);
    }
    return parsed.data;
  }

  /**
   * A heartbeat over the relay socket (`POST /api/nodes/beat`, body: the
   * NodeMessage itself, unsigned): the relay vouches for the sender (`from`,
   * stamped on the frame), so no signature is checked and no connection is
   * opened.
   */
  ctx.relayBeat = (from, body) => {
    if (!from) throw new MeshError('MESH_ERR_UNAUTHORIZED', 'an unsigned heartbeat needs the relay to vouch for its sender (a fast-path frame through a relay); otherwise sign it and POST /api/nodes/heartbeat');
    let raw: unknown;
    try {
      raw = JSON.parse(utf8Decoder.decode(body));
    } catch {
      throw new MeshError('MESH_ERR_BAD_REQUEST', 'body is not JSON: send the NodeMessage');
    }
    const answer = answerFor(vouchedBeat(from, raw));
    beatsOk.inc();
    ctx.updateNodeGauge();
    ctx.admission.kick();
    return answer;
  };

  /**
   * A relay's batch of heartbeats (docs/protocol.md §9.1), in one pass: each
   * checked exactly as a single relay beat, each answered alone (one node's
   * error never touches another's answer); the gauge and the admission queue
   * once for the batch, not once per beat. The answers go out as JSON text
   * built from parts the batch shares (sharedAnswer), not as objects
   * stringified whole.
   */
  ctx.relayBeats = (beats) => {
    const texts: string[] = new Array(beats.length);
    let shared: SharedAnswer | undefined;
    let ok = 0;
    for (let i = 0; i < beats.length; i++) {
      try {
        const n = vouchedBeat(beats[i]!.from, beats[i]!.body);
        // Made at the first beat answered 200 (a batch of errors only needs none).
        shared ??= sharedAnswer();
        texts[i] = `{"status":200,"body":${answerText(n, shared)}}`;
        ok++;
      } catch (e) {
        const err = e instanceof MeshError ? e : new MeshError('MESH_ERR_INTERNAL', 'internal error; the tracker keeps serving');
        if (!(e instanceof MeshError)) logger.error({ err: e, peer_id: beats[i]!.from }, 'batched relay heartbeat failed');
        texts[i] = JSON.stringify({ status: err.status, body: err.toBody() });
      }
    }
    if (ok > 0) {
      beatsOk.inc(ok);
      ctx.updateNodeGauge();
      ctx.admission.kick();
    }
    return `[${texts.join(',')}]`;
  };

  app.post('/api/nodes/heartbeat', async ({ req }) => {
    const msg = await signedNodeMessage(req, 'heartbeat');
    let n: NodeRecord;
    const wasDraining = registry.nodes.get(msg.peer_id)?.draining;
    try {
      n = registry.heartbeat(msg);
    } catch (e) {
      metrics.registrations.inc({ kind: 'heartbeat', result: 'unknown' });
      throw e;
    }
    metrics.registrations.inc({ kind: 'heartbeat', result: 'ok' });
    // One line per change: a node that stops taking sessions (paused, frozen, closing) or takes them again.
    if (wasDraining !== undefined && n.draining !== wasDraining) logger.info({ peer_id: n.peerId, serving: n.serving }, n.draining ? 'node draining: no new sessions routed to it' : 'node takes sessions again');
    ctx.updateNodeGauge();
    // Fresh KV figures: room may have freed up for waiting chats.
    ctx.admission.kick();
    return json(200, answerFor(n));
  });
}

