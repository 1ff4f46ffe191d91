/**
 * What a page serves, from its URL:
 * - with a tracker, whatever span it assigns:
 *   `?relay=ws://…&tracker=http://…[&model=<name at the tracker>]`;
 * - without, a fixed span: `?relay=ws://…&model=<base url>&layers=0-6`;
 * both `[&backend=wasm|webgpu|auto][&threads=2][&budget=<MiB>][&weights=f32|f16|q4][&hop=chain|star]`
 * (`hop`: how the page drives a pipeline when it is the head; absent: chain),
 * `[&rtc=on|off][&ice=stun:host:port[,…]]` (data channels to other pages: on by
 * default; `ice`: STUN servers for pages behind NATs), `[&ice_policy=relay]`
 * (ICE through the `ice` TURN servers only: the page's own addresses are never
 * offered; with none, no channel can open and every hop goes by the relay),
 * and for benches
 * `[&rtc_delay_ms=20]` (each message a channel receives is held that long: a
 * WAN leg's one-way delay),
 * and for tests `[&test_lose_gpu=N[,M…]]`: the k-th GPU backend destroys its
 * device before its N-th session run (src/host/browser/gpu-test-hooks.ts).
 * Parsed with zod: a URL is outside data.
 */
import { z } from 'zod';
import type { NodeConfig } from '../host/browser/engine.ts';
import { WEIGHT_FORMATS } from '../model/weight-format.ts';

const layersRe = /^(\d{1,4})-(\d{1,4})$/;

const paramsSchema = z.object({
  relay: z.string().regex(/^wss?:\/\//, 'relay must be a ws:// or wss:// URL'),
  model: z.string().regex(/^https?:\/\//, 'model must be an http(s) base URL'),
  layers: z
    .string()
    .regex(layersRe, 'layers must look like 0-6 (first layer, then the layer to stop before)')
    .transform((s) => s.match(layersRe)!.slice(1, 3).map(Number) as [number, number])
    .refine(([a, b]) => a < b, 'layers: the first must be below the end'),
  backend: z.enum(['auto', 'wasm', 'webgpu']).optional(),
  threads: z.coerce.number().int().min(1).max(64).optional(),
  // Fractions allowed: the tracker sizes spans from it, and test meshes split tiny models with a few MiB.
  budget: z.coerce.number().min(0.25).max(65536).optional(),
  weights: z.enum(WEIGHT_FORMATS).optional(),
  hop: z.enum(['chain', 'star']).optional(),
  rtc: z.enum(['on', 'off']).optional(),
  ice: z
    .string()
    .max(2048)
    .transform((v) => v.split(','))
    .pipe(z.array(z.string().regex(/^(stun|stuns|turn|turns):[^\s,]{1,200}$/, 'ice must list stun: or turn: URLs, comma-separated')).max(8))
    .optional(),
  ice_policy: z.enum(['all', 'relay']).optional(),
  rtc_delay_ms: z.coerce.number().min(0).max(10_000).optional(),
  test_lose_gpu: z
    .string()
    .regex(/^\d{1,6}(,\d{1,6}){0,7}$/, 'test_lose_gpu must look like 7 or 7,9')
    .transform((v) => v.split(',').map(Number))
    .optional(),
});

const trackedSchema = z.object({
  relay: paramsSchema.shape.relay,
  tracker: z.string().regex(/^https?:\/\//, 'tracker must be an http(s) base URL'),
  model: z.string().min(1).max(200).optional(),
  backend: paramsSchema.shape.backend,
  threads: paramsSchema.shape.threads,
  budget: paramsSchema.shape.budget,
  weights: paramsSchema.shape.weights,
  hop: paramsSchema.shape.hop,
  rtc: paramsSchema.shape.rtc,
  ice: paramsSchema.shape.ice,
  ice_policy: paramsSchema.shape.ice_policy,
  rtc_delay_ms: paramsSchema.shape.rtc_delay_ms,
  test_lose_gpu: paramsSchema.shape.test_lose_gpu,
});

export type UrlConfigResult = { ok: true; config: NodeConfig } | { ok: false; missing: boolean; message: string };

/** Reads the config from a query string; `missing` is true when the page was opened without one. */
export function configFromSearch(search: string): UrlConfigResult {
  const q = new URLSearchParams(search);
  if (!q.has('relay') && !q.has('model') && !q.has('layers') && !q.has('tracker')) return { ok: false, missing: true, message: 'This page needs a span to serve.' };
  const raw: Record<string, string> = {};
  for (const k of ['relay', 'tracker', 'model', 'layers', 'backend', 'threads', 'budget', 'weights', 'hop', 'rtc', 'ice', 'ice_policy', 'rtc_delay_ms', 'test_lose_gpu']) {
    const v = q.get(k);
    if (v !== null && v !== '') raw[k] = v;
  }
  if (raw.tracker !== undefined) return trackedConfig(raw);
  const parsed = paramsSchema.safeParse(raw);
  if (!parsed.success) {
    const issue = parsed.error.issues[0]!;
    return { ok: false, missing: false, message: `${issue.path.join('.') || 'url'}: ${issue.message}` };
  }
  const p = parsed.data;
  const config: NodeConfig = {
    relayUrl: p.relay,
    modelUrl: p.model.endsWith('/') ? p.model : `${p.model}/`,
    startLayer: p.layers[0],
    endLayer: p.layers[1],
  };
  // Absent parameters leave the node's stored settings in force.
  if (p.backend !== undefined) config.backend = p.backend;
  if (p.threads !== undefined) config.threads = p.threads;
  if (p.budget !== undefined) config.memoryBudgetBytes = p.budget * 1024 * 1024;
  if (p.weights !== undefined) config.weights = p.weights;
  if (p.hop !== undefined) config.hopMode = p.hop;
  rtcConfig(config, p);
  if (p.test_lose_gpu !== undefined) config.testLoseGpuAfterRuns = p.test_lose_gpu;
  return { ok: true, config };
}

function trackedConfig(raw: Record<string, string>): UrlConfigResult {
  const parsed = trackedSchema.safeParse(raw);
  if (!parsed.success) {
    const issue = parsed.error.issues[0]!;
    return { ok: false, missing: false, message: `${issue.path.join('.') || 'url'}: ${issue.message}` };
  }
  const p = parsed.data;
  const config: NodeConfig = { relayUrl: p.relay, trackerUrl: p.tracker };
  if (p.model !== undefined) config.modelName = p.model;
  if (p.backend !== undefined) config.backend = p.backend;
  if (p.threads !== undefined) config.threads = p.threads;
  if (p.budget !== undefined) config.memoryBudgetBytes = Math.round(p.budget * 1024 * 1024);
  if (p.weights !== undefined) config.weights = p.weights;
  if (p.hop !== undefined) config.hopMode = p.hop;
  rtcConfig(config, p);
  if (p.test_lose_gpu !== undefined) config.testLoseGpuAfterRuns = p.test_lose_gpu;
  return { ok: true, config };
}

function rtcConfig(config: NodeConfig, p: { rtc?: 'on' | 'off' | undefined; ice?: string[] | undefined; ice_policy?: 'all' | 'relay' | undefined; rtc_delay_ms?: number | undefined }): void {
  if (p.rtc !== undefined) config.rtc = p.rtc === 'on';
  if (p.ice !== undefined) config.iceServers = p.ice.map((urls) => ({ urls }));
  if (p.ice_policy === 'relay') config.icePolicy = 'relay';
  if (p.rtc_delay_ms !== undefined) config.rtcDelayMs = p.rtc_delay_ms;
}
