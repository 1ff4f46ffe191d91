/**
 * Heartbeats batched by the relay (docs/protocol.md §9.1). A node sends its
 * beat to the relay as one small text message; the relay gathers the beats
 * addressed to one tracker for a few milliseconds and hands them over in one
 * message, which the tracker answers in one message after one synchronous
 * pass. At thousands of donors this is what a tracker mostly does, and the
 * per-message cost (WebSocket parse, stream bookkeeping, an async handler
 * and an answer frame per beat) was ~8x the beat's own work.
 *
 *   node ──{type:'beat', id, to, body}──────────────▶ relay   (one per beat)
 *   relay ──{type:'beats', batch, beats:[{from, body}]}──▶ tracker (one per window)
 *   relay ◀──{type:'beats-answer', batch, answers:[{status, body}]}── tracker
 *   node ◀──{type:'beat-answer', id, status, body}─── relay
 *
 * `from` is stamped by the relay (as on the fast path's frames), so the
 * NodeMessage travels unsigned. Both ends opt in: the relay lists
 * BEAT_BATCH_FEATURE in `registered.features`, the tracker in its register
 * `info.features`. A node on an older relay, or beating a tracker that does
 * not take batches, keeps the `POST /api/nodes/beat` request.
 */
import { z } from 'zod';

/** The feature a relay announces (registered.features) and a tracker declares (register info.features). */
export const BEAT_BATCH_FEATURE = 'beat-batch';

/** A beat message (node → relay) larger than this is refused: a NodeMessage is ~1 KiB. */
export const MAX_BEAT_MESSAGE_CHARS = 64 * 1024;
/** At most this many beats in one batch (relay → tracker): bounds one synchronous pass at the tracker (~20 µs each). */
export const MAX_BEATS_PER_BATCH = 512;

const peerId = z.string().regex(/^[0-9a-f]{32}$/, 'a peer id: 32 lowercase hex digits');

/** node → relay. `id` is the node's own, echoed in the answer; `body` the NodeMessage. */
export const beatMessageSchema = z.object({
  type: z.literal('beat'),
  id: z.number().int().min(0).max(0xffffffff),
  to: peerId,
  body: z.record(z.string(), z.unknown()),
});
export type BeatMessage = z.infer<typeof beatMessageSchema>;

/** relay → tracker. */
export const beatBatchSchema = z.object({
  type: z.literal('beats'),
  batch: z.number().int().min(0).max(0xffffffff),
  beats: z.array(z.object({ from: peerId, body: z.unknown() })).max(MAX_BEATS_PER_BATCH),
});
export type BeatBatch = z.infer<typeof beatBatchSchema>;

/** One beat's answer: 200 and the tracker's answer, or an error status and `{error:{code, message}}`. */
export const beatAnswerEntrySchema = z.object({ status: z.number().int().min(100).max(599), body: z.unknown() });
export type BeatAnswerEntry = z.infer<typeof beatAnswerEntrySchema>;

/** tracker → relay: `answers[i]` is the answer to `beats[i]`; or `error` when the batch itself was refused. */
export const beatBatchAnswerSchema = z.object({
  type: z.literal('beats-answer'),
  batch: z.number().int().min(0).max(0xffffffff),
  answers: z.array(z.unknown()).max(MAX_BEATS_PER_BATCH).optional(),
  error: z.object({ code: z.string(), message: z.string() }).optional(),
});

/** relay → node. */
export const beatAnswerSchema = z.object({
  type: z.literal('beat-answer'),
  id: z.number().int().min(0).max(0xffffffff),
  status: z.number().int().min(100).max(599),
  body: z.unknown(),
});
export type BeatAnswer = z.infer<typeof beatAnswerSchema>;
