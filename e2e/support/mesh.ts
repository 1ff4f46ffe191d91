/**
 * What the e2e specs share: a relay process, a model server with byte
 * counters, a Node-side peer that calls pages through the relay (fast path)
 * or by /rpc, and page helpers that wait for a state.
 */
import type { Page } from '@playwright/test';
import WebSocket from 'ws';
import { ensureModel } from '../../src/cli/models.ts';
import { startStaticServer, type StaticServer } from '../../src/cli/static-server.ts';
import { fixtureConfig, makeModel, type FixturePreset } from '../../src/model/fixture.ts';
import { ReferenceModel } from '../../src/model/reference.ts';
import type { MeshReply } from '../../src/protocol/envelopes.ts';
import { Identity, MemoryKeyStore } from '../../src/net/identity.ts';
import { RelayClient } from '../../src/net/relay-client.ts';
import { relayHop } from '../../src/net/relay-hop.ts';
import type { WebSocketConstructor } from '../../src/net/socket.ts';
import type { NodeStatus } from '../../src/host/browser/engine.ts';
import { weightsFromFiles } from '../../test/helpers/weights.ts';
import { startRelayProcess, type RelayProcess } from '../../test/helpers/relay-process.ts';
import { startTrackerProc, type TrackerProc } from '../../test/helpers/mesh.ts';

export { startRelayProcess, type RelayProcess };

export const WS = WebSocket as unknown as WebSocketConstructor;

export function appUrl(): string {
  const u = process.env.MESHNET_APP_URL;
  if (!u) throw new Error('MESHNET_APP_URL is unset: run through playwright.config.ts (global setup)');
  return u;
}

export async function startModelServer(preset: FixturePreset): Promise<StaticServer> {
  const dir = await ensureModel(preset);
  return startStaticServer({ root: dir, port: 0, host: '127.0.0.1' });
}

const refs = new Map<string, ReferenceModel>();
export function reference(preset: FixturePreset): ReferenceModel {
  let r = refs.get(preset);
  if (!r) {
    r = new ReferenceModel(fixtureConfig(preset), weightsFromFiles(makeModel(preset)));
    refs.set(preset, r);
  }
  return r;
}

export function nodeUrl(relay: RelayProcess, model: StaticServer, layers: [number, number], extra: Record<string, string> = {}): string {
  // rtc=off: no data channels (their test asks for them inside a network namespace; out of one they would reach past loopback).
  const q = new URLSearchParams({ relay: relay.url, model: model.url.endsWith('/') ? model.url : `${model.url}/`, layers: `${layers[0]}-${layers[1]}`, rtc: 'off', ...extra });
  return `${appUrl()}?${q}`;
}

export async function status(page: Page): Promise<NodeStatus> {
  return page.evaluate(() => window.meshnet!.engine.status());
}

/** Waits until the node reports `state` (failing early, with the reason, on an unexpected error). */
export async function waitForState(page: Page, state: NodeStatus['state'], timeoutMs = 60_000): Promise<NodeStatus> {
  const t0 = Date.now();
  for (;;) {
    const s = await status(page).catch(() => undefined);
    if (s?.state === state) return s;
    if (s?.state === 'error' && state !== 'error') throw new Error(`node failed: ${s.error?.code}: ${s.error?.message}`);
    if (Date.now() - t0 > timeoutMs) throw new Error(`node stayed ${s?.state ?? 'unreachable'} for ${timeoutMs} ms, wanted ${state}`);
    await page.waitForTimeout(100);
  }
}

/** A Node-side caller registered with the relay: reaches pages by the fast path. */
export async function startCaller(relay: RelayProcess): Promise<RelayClient> {
  const identity = await Identity.loadOrCreate(new MemoryKeyStore());
  const client = new RelayClient({ relayUrl: relay.url, WebSocket: WS, identity, info: { role: 'e2e-caller' } });
  client.start();
  await client.ready(10_000);
  return client;
}

/** What most specs share: a real relay process, a model server and a caller peer on that relay. */
export interface RelayMesh {
  relay: RelayProcess;
  model: StaticServer;
  caller: RelayClient;
}

export async function startRelayMesh(preset: FixturePreset = 'tiny'): Promise<RelayMesh> {
  const [relay, model] = await Promise.all([startRelayProcess(), startModelServer(preset)]);
  return { relay, model, caller: await startCaller(relay) };
}

export async function stopRelayMesh(m: Partial<RelayMesh>): Promise<void> {
  m.caller?.close();
  await Promise.all([m.relay?.stop(), m.model?.close()]);
}

export interface ForwardArgs {
  activation: Uint8Array;
  shape: [number, number, number];
  dtype?: 'f32' | 'bf16' | 'f16';
  session?: string;
  position?: number;
  startLayer?: number;
  endLayer?: number;
  sampling?: Record<string, number>;
}

function forwardHeaders(a: ForwardArgs): Record<string, string> {
  const h: Record<string, string> = { 'x-meshnet-shape': a.shape.join(','), 'x-meshnet-dtype': a.dtype ?? 'f32', 'content-type': 'application/octet-stream' };
  if (a.session !== undefined) h['x-meshnet-session'] = a.session;
  if (a.position !== undefined) h['x-meshnet-position'] = String(a.position);
  if (a.startLayer !== undefined) h['x-meshnet-start-layer'] = String(a.startLayer);
  if (a.endLayer !== undefined) h['x-meshnet-end-layer'] = String(a.endLayer);
  if (a.sampling) h['x-meshnet-sampling'] = JSON.stringify(a.sampling);
  return h;
}

export function forwardFast(caller: RelayClient, peerId: string, a: ForwardArgs): Promise<MeshReply> {
  return caller.request(peerId, { method: 'POST', path: '/forward', headers: forwardHeaders(a), body: a.activation }, { timeoutMs: 60_000 });
}

export function forwardRpc(relay: RelayProcess, peerId: string, a: ForwardArgs): Promise<MeshReply> {
  return relayHop(`${relay.url.replace(/\/ws$/, '')}/rpc/${peerId}`, { method: 'POST', path: '/forward', headers: forwardHeaders(a), body: a.activation }, { WebSocket: WS, timeoutMs: 60_000 });
}

export { maxAbsDiff } from '../../test/helpers/shard.ts';

/** A relay, the tiny model's server and a tracker process serving it: the browser-mesh specs' setting. */
export interface TrackerMesh {
  relay: RelayProcess;
  model: StaticServer;
  tracker: TrackerProc;
}

export async function startTrackerMesh(): Promise<TrackerMesh> {
  const [relay, model] = await Promise.all([startRelayProcess(), startModelServer('tiny')]);
  const tracker = await startTrackerProc(['--model', `tiny=${model.url}`, '--relay', relay.url, '--heartbeat-interval-ms', '1000']);
  return { relay, model, tracker };
}

export async function stopTrackerMesh(m: Partial<TrackerMesh>): Promise<void> {
  await m.tracker?.stop();
  await Promise.all([m.relay?.stop(), m.model?.close()]);
}
