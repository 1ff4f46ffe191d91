/**
 * Property: whatever the relay sends — random bytes, mutated frames, random
 * or mutated JSON — the bridge neither throws nor leaves a rejection
 * unhandled, and each input is either answered once (with the id it named)
 * or ignored with a logged reason.
 */
import { setImmediate as tick } from 'node:timers/promises';
import fc from 'fast-check';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import {
  FLAG_ONE_WAY,
  FRAME_HEAD_BYTES,
  FrameKind,
  MeshError,
  encodeCancelFrame,
  encodeDataFrame,
  encodeRequestFrame,
  encodeResponseFrame,
  hexToBytes,
  readFrameHead,
  type MeshRequest,
  type MeshResponse,
} from '../../src/protocol/index.ts';
import { registeredClient, type Harness } from '../helpers/fake-socket.ts';

const SOURCE = hexToBytes('0123456789abcdef0123456789abcdef');

const handler = async (req: MeshRequest): Promise<MeshResponse> => {
  if (req.path.includes('throw')) throw new Error('handler bug');
  if (req.path.includes('mesh')) throw new MeshError('MESH_ERR_BAD_SHAPE', 'bad shape');
  return { status: 200, headers: req.headers, body: req.body };
};

const header = fc.dictionary(fc.oneof(fc.constantFrom('content-type', 'x-meshnet-shape', 'x-meshnet-session'), fc.string({ minLength: 1, maxLength: 12 })), fc.string({ maxLength: 20 }), { maxKeys: 4 });

const validFrame = fc.oneof(
  fc.record({ streamId: fc.nat(), method: fc.constantFrom('GET', 'POST', 'DELETE'), path: fc.constantFrom('/forward', '/throw', '/mesh', '/health'), headers: header, body: fc.uint8Array({ maxLength: 64 }) }).map((r) => {
    try {
      return encodeRequestFrame({ ...r, peerId: SOURCE });
    } catch {
      return encodeRequestFrame({ ...r, headers: {}, peerId: SOURCE });
    }
  }),
  fc.record({ streamId: fc.nat(), status: fc.integer({ min: 100, max: 599 }), body: fc.uint8Array({ maxLength: 32 }) }).map((r) => encodeResponseFrame(r)),
  fc.tuple(fc.nat(), fc.uint8Array({ maxLength: 32 }), fc.boolean()).map(([id, b, end]) => encodeDataFrame(id, b, end)),
  fc.nat().map((id) => encodeCancelFrame(id)),
);

const mutatedFrame = fc.tuple(validFrame, fc.array(fc.tuple(fc.nat(), fc.integer({ min: 0, max: 255 })), { maxLength: 4 }), fc.option(fc.nat(), { nil: undefined })).map(([frame, flips, cut]) => {
  const out = new Uint8Array(frame);
  for (const [i, v] of flips) if (out.length > 0) out[i % out.length] = v;
  return cut === undefined ? out : out.subarray(0, cut % (out.length + 1));
});

const binaryInput = fc.oneof({ weight: 1, arbitrary: fc.uint8Array({ maxLength: 80 }) }, { weight: 2, arbitrary: validFrame }, { weight: 5, arbitrary: mutatedFrame });

const validEnvelope = fc.record({
  type: fc.constant('relay-http-request'),
  request_id: fc.string({ minLength: 1, maxLength: 20 }),
  method: fc.constantFrom('GET', 'POST'),
  path: fc.constantFrom('/forward', '/throw', '/mesh'),
  headers: header,
  body_base64: fc.option(fc.base64String({ maxLength: 40 }), { nil: undefined }),
});
const anyJson = fc.jsonValue({ maxDepth: 3 });
const mutatedEnvelope = fc.tuple(validEnvelope, fc.constantFrom('request_id', 'method', 'path', 'headers', 'body_base64', 'type'), anyJson, fc.boolean()).map(([env, key, value, drop]) => {
  const copy: Record<string, unknown> = { ...env };
  if (drop) delete copy[key];
  else copy[key] = value;
  return JSON.stringify(copy);
});
const textInput = fc.oneof(
  fc.string({ maxLength: 60 }),
  anyJson.map((v) => JSON.stringify(v)),
  validEnvelope.map((v) => JSON.stringify(v)),
  mutatedEnvelope,
  fc.record({ type: fc.constantFrom('challenge', 'registered', 'error', 'relay-http-response', 'nope'), request_id: fc.option(fc.string({ maxLength: 8 }), { nil: undefined }) }).map((v) => JSON.stringify(v)),
);

describe('bridge under random and mutated input', () => {
  let h: Harness;
  let unhandled = 0;
  const onUnhandled = (): void => {
    unhandled++;
  };
  beforeAll(async () => {
    process.on('unhandledRejection', onUnhandled);
    h = await registeredClient({ handler, minBackoffMs: 1, maxBackoffMs: 2 });
  });
  afterAll(() => {
    process.off('unhandledRejection', onUnhandled);
    h.client.close();
  });

  it('answers each of 12,000 inputs at most once, with its own id, or logs why it ignored it; never throws', async () => {
    let answered = 0;
    let ignored = 0;
    await fc.assert(
      fc.asyncProperty(fc.oneof(binaryInput, textInput), async (input) => {
        const sentBefore = h.socket.sent.length;
        const logsBefore = h.logs.length;
        if (typeof input === 'string') h.socket.text(input);
        else h.socket.binary(input);
        await tick();
        await tick();
        const sent = h.socket.sent.slice(sentBefore);
        const logs = h.logs.slice(logsBefore);
        expect(h.client.state).toBe('registered');
        expect(sent.length).toBeLessThanOrEqual(1);
        if (sent.length === 1) {
          answered++;
          const answer = sent[0]!;
          if (typeof input === 'string') {
            const id = (JSON.parse(input) as { request_id: unknown }).request_id;
            expect(typeof answer).toBe('string');
            const a = JSON.parse(answer as string) as { type: string; request_id: unknown; status: number };
            expect(a.type).toBe('relay-http-response');
            expect(a.request_id).toBe(id);
          } else {
            expect(typeof answer).not.toBe('string');
            expect(readFrameHead(answer as Uint8Array).streamId).toBe(readFrameHead(input).streamId);
            expect(input.byteLength).toBeGreaterThanOrEqual(FRAME_HEAD_BYTES);
          }
        } else {
          ignored++;
          // A one-way REQUEST (FLAG_ONE_WAY) that decoded is served and, by design, not answered.
          const oneWay = typeof input !== 'string' && input.byteLength >= FRAME_HEAD_BYTES && input[0] === 1 && input[1] === FrameKind.Request && (input[2]! & FLAG_ONE_WAY) !== 0;
          if (!oneWay) expect(logs.some((l) => l.event === 'ignored' || l.event === 'relay-error')).toBe(true);
        }
        expect(h.client.pendingIncoming).toBe(0);
      }),
      { numRuns: 12_000 },
    );
    expect(unhandled).toBe(0);
    // The generators must reach both outcomes in bulk, or the property proves little.
    expect(answered).toBeGreaterThan(2000);
    expect(ignored).toBeGreaterThan(2000);
  });
});
