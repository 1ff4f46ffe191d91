import { describe, expect, it } from 'vitest';
import { configFromSearch } from '../../../src/app/url-config.ts';
import { formatBytes, percent, sparklinePoints } from '../../../src/app/format.ts';
import { formatDuration, headline, pauseLabel } from '../../../src/app/view.ts';
import { askPersist, describeStorage, storageInfo } from '../../../src/app/storage-info.ts';
import { watchPower } from '../../../src/app/power.ts';
import { emptyStatus } from '../../../src/app/controller.ts';
import { StatsWindow } from '../../../src/node/runtime/stats.ts';
import { decide } from '../../../src/host/browser/backends.ts';
import { spanTensorNames } from '../../../src/host/browser/span-weights.ts';
import { describeError } from '../../../src/host/browser/surface.ts';
import { QuotaError } from '../../../src/host/browser/storage.ts';
import { ModelFetchError } from '../../../src/model/errors.ts';
import { fixtureConfig } from '../../../src/model/fixture.ts';

describe('configFromSearch', () => {
  it('reads relay, model, layers and an optional backend from the URL', () => {
    const r = configFromSearch('?relay=ws://h:1&model=http://m/x&layers=0-6&backend=wasm&threads=2&budget=128');
    expect(r).toEqual({ ok: true, config: { relayUrl: 'ws://h:1', modelUrl: 'http://m/x/', startLayer: 0, endLayer: 6, backend: 'wasm', threads: 2, memoryBudgetBytes: 128 * 2 ** 20 } });
  });
  it('leaves backend and budget unset when absent, so stored settings apply', () => {
    const r = configFromSearch('?relay=wss://h&model=https://m/&layers=3-4');
    expect(r.ok && r.config.backend).toBe(undefined);
    expect(r.ok && r.config.memoryBudgetBytes).toBe(undefined);
  });
  it('reports a page opened without a span as missing, and a bad one with the field at fault', () => {
    expect(configFromSearch('')).toMatchObject({ ok: false, missing: true });
    expect(configFromSearch('?relay=http://h&model=http://m/&layers=0-2')).toMatchObject({ ok: false, missing: false, message: expect.stringMatching(/^relay/) });
    expect(configFromSearch('?relay=ws://h&model=http://m/&layers=4-2')).toMatchObject({ ok: false, message: expect.stringMatching(/^layers/) });
    expect(configFromSearch('?relay=ws://h&model=http://m/&layers=0-2&backend=cuda')).toMatchObject({ ok: false, message: expect.stringMatching(/^backend/) });
  });
  it('with a tracker takes no layers (the tracker assigns them), a model name instead of a URL, and a fractional budget', () => {
    expect(configFromSearch('?relay=ws://h:1&tracker=http://t:2&model=tiny&budget=1.5&backend=wasm')).toEqual({
      ok: true,
      config: { relayUrl: 'ws://h:1', trackerUrl: 'http://t:2', modelName: 'tiny', memoryBudgetBytes: 1.5 * 2 ** 20, backend: 'wasm' },
    });
    expect(configFromSearch('?relay=ws://h:1&tracker=ftp://t')).toMatchObject({ ok: false, message: expect.stringMatching(/^tracker/) });
    expect(configFromSearch('?tracker=http://t')).toMatchObject({ ok: false, message: expect.stringMatching(/^relay/) });
  });
  it('reads the data channels\' settings: rtc=on|off, STUN/TURN servers, a bench delay; refuses other ICE URLs', () => {
    expect(configFromSearch('?relay=ws://h:1&tracker=http://t:2&rtc=off')).toEqual({ ok: true, config: { relayUrl: 'ws://h:1', trackerUrl: 'http://t:2', rtc: false } });
    expect(configFromSearch('?relay=ws://h:1&tracker=http://t:2&ice=stun:s.example:3478,turn:t.example:3478&rtc_delay_ms=20')).toEqual({
      ok: true,
      config: { relayUrl: 'ws://h:1', trackerUrl: 'http://t:2', iceServers: [{ urls: 'stun:s.example:3478' }, { urls: 'turn:t.example:3478' }], rtcDelayMs: 20 },
    });
    expect(configFromSearch('?relay=ws://h&model=http://m/&layers=0-2&rtc=on')).toMatchObject({ ok: true, config: { rtc: true } });
    expect(configFromSearch('?relay=ws://h:1&tracker=http://t:2&ice=http://evil')).toMatchObject({ ok: false, message: expect.stringMatching(/^ice/) });
    expect(configFromSearch('?relay=ws://h:1&tracker=http://t:2&rtc=maybe')).toMatchObject({ ok: false, message: expect.stringMatching(/^rtc/) });
    // Relay-only ICE (TURN only: the page's own addresses are never offered).
    expect(configFromSearch('?relay=ws://h:1&tracker=http://t:2&ice_policy=relay')).toMatchObject({ ok: true, config: { icePolicy: 'relay' } });
    expect(configFromSearch('?relay=ws://h:1&tracker=http://t:2&ice_policy=all')).toEqual({ ok: true, config: { relayUrl: 'ws://h:1', trackerUrl: 'http://t:2' } });
    expect(configFromSearch('?relay=ws://h:1&tracker=http://t:2&ice_policy=none')).toMatchObject({ ok: false, message: expect.stringMatching(/^ice_policy/) });
  });
  it('reads hop=star|chain into the head\'s hop mode, leaves it unset when absent, and refuses anything else', () => {
    expect(configFromSearch('?relay=ws://h:1&tracker=http://t:2&hop=star')).toEqual({ ok: true, config: { relayUrl: 'ws://h:1', trackerUrl: 'http://t:2', hopMode: 'star' } });
    expect(configFromSearch('?relay=ws://h&model=http://m/&layers=0-2&hop=chain')).toMatchObject({ ok: true, config: { hopMode: 'chain' } });
    const absent = configFromSearch('?relay=ws://h:1&tracker=http://t:2');
    expect(absent.ok && 'hopMode' in absent.config).toBe(false);
    expect(configFromSearch('?relay=ws://h:1&tracker=http://t:2&hop=ring')).toMatchObject({ ok: false, missing: false, message: expect.stringMatching(/^hop/) });
    expect(configFromSearch('?relay=ws://h&model=http://m/&layers=0-2&hop=STAR')).toMatchObject({ ok: false, message: expect.stringMatching(/^hop/) });
  });
});

describe('format', () => {
  it('formats bytes with binary units and floors percentages so 100 % means done', () => {
    expect(formatBytes(512)).toBe('512 B');
    expect(formatBytes(1536)).toBe('1.5 KiB');
    expect(formatBytes(300 * 2 ** 20)).toBe('300 MiB');
    expect(percent(999, 1000)).toBe(99);
    expect(percent(1000, 1000)).toBe(100);
    expect(percent(1, 0)).toBe(0);
  });
  it('draws the sparkline across the box, highest value at the top', () => {
    const pts = sparklinePoints([0, 5, 10], 100, 20).split(' ').map((p) => p.split(',').map(Number));
    expect(pts.map((p) => p[0])).toEqual([0, 50, 100]);
    expect(pts[2]![1]).toBeLessThan(pts[1]![1]!);
    expect(pts[0]![1]).toBe(19);
  });
});

describe('headline', () => {
  it('shows download progress, the served span, and the error code', () => {
    expect(headline({ ...emptyStatus(), state: 'downloading', download: { loadedBytes: 421, totalBytes: 1000 } })).toBe('Downloading 42 %');
    expect(headline({ ...emptyStatus(), state: 'serving', model: { baseUrl: '', name: 'm', numLayers: 12, startLayer: 0, endLayer: 6, holdsHead: false } })).toBe('Serving layers 0–5');
    expect(headline({ ...emptyStatus(), state: 'error', error: { code: 'MESH_ERR_QUOTA', message: '', action: '', retryable: true } })).toBe('Error: MESH_ERR_QUOTA');
  });
});

describe('StatsWindow', () => {
  it('counts requests in the last minute and tokens per second, forgetting older seconds', () => {
    const s = new StatsWindow();
    s.record(1_000_500, 3);
    s.record(1_000_900, 2);
    s.record(1_001_100, 7);
    expect(s.requestsPerMinute(1_001_500)).toBe(3);
    const tps = s.tokensPerSecond(1_001_500);
    expect(tps).toHaveLength(60);
    expect(tps.slice(-2)).toEqual([5, 7]);
    expect(s.requestsPerMinute(1_000_000 + 60_000)).toBe(1);
    expect(s.requestsPerMinute(1_000_000 + 61_000)).toBe(0);
    expect(s.tokens).toBe(12);
  });
});

describe('decide', () => {
  const gpu = { usable: true, fallback: false, fp16: true, adapter: 'x' };
  it('takes WebGPU only when it calibrates faster, with fp16 only when the adapter has shader-f16', () => {
    expect(decide(gpu, { webgpuMs: 1, wasmMs: 5 })).toMatchObject({ kind: 'webgpu', fp16: true });
    expect(decide({ ...gpu, fp16: false }, { webgpuMs: 1, wasmMs: 5 })).toMatchObject({ kind: 'webgpu', fp16: false });
    expect(decide(gpu, { webgpuMs: 9, wasmMs: 5 })).toMatchObject({ kind: 'wasm' });
  });
  it('never takes a fallback adapter or a missing one', () => {
    expect(decide({ ...gpu, fallback: true }, { webgpuMs: 1, wasmMs: 5 }).kind).toBe('wasm');
    expect(decide({ usable: false, fallback: false, fp16: false, adapter: 'none', reason: 'no WebGPU' }).reason).toMatch(/no WebGPU/);
  });
});

describe('spanTensorNames', () => {
  const cfg = fixtureConfig('tiny'); // tied embeddings, 4 layers
  it('adds the embedding to the first span and the norm (and tied embedding) to the last', () => {
    expect(spanTensorNames(cfg, 0, 1)).toContain('model.embed_tokens.weight');
    expect(spanTensorNames(cfg, 1, 3).some((n) => !n.startsWith('model.layers.'))).toBe(false);
    expect(spanTensorNames(cfg, 3, 4)).toEqual(expect.arrayContaining(['model.norm.weight', 'model.embed_tokens.weight']));
    expect(spanTensorNames(fixtureConfig('small'), 11, 12)).toEqual(expect.arrayContaining(['lm_head.weight']));
  });
});

describe('describeError', () => {
  it('tells the donor what to do for a full disk and a lost model server', () => {
    expect(describeError(new QuotaError(5e8, 1e8, 2e8))).toMatchObject({ code: 'MESH_ERR_QUOTA', retryable: true, action: expect.stringMatching(/Free disk space/) });
    expect(describeError(new ModelFetchError('a.safetensors', 'cut'))).toMatchObject({ code: 'MESH_ERR_MODEL_FETCH', action: expect.stringMatching(/resumes/) });
    expect(describeError(new TypeError('Failed to fetch'))).toMatchObject({ code: 'MESH_ERR_MODEL_FETCH' });
  });
});

describe('the donor controls on the page', () => {
  const base = () => ({ ...emptyStatus(), state: 'paused' as const });
  it('labels the pause button Pause, "Pausing… N s" while the chats in flight finish, then Resume', () => {
    expect(pauseLabel({ ...emptyStatus(), state: 'serving' })).toBe('Pause');
    expect(pauseLabel({ ...base(), donor: { ...base().donor, paused: true }, drain: { reasons: ['donor'], graceLeftMs: 23_400, done: false } })).toBe('Pausing… 24 s');
    expect(pauseLabel({ ...base(), donor: { ...base().donor, paused: true }, drain: { reasons: ['donor'], graceLeftMs: 10_000, done: true } })).toBe('Resume');
    // Paused for the battery only: the donor's button still offers Pause.
    expect(pauseLabel({ ...base(), drain: { reasons: ['battery'], graceLeftMs: 0, done: true } })).toBe('Pause');
  });
  it('formats time given in minutes, then hours', () => {
    expect(formatDuration(59 * 60_000)).toBe('59 min');
    expect(formatDuration(150 * 60_000)).toBe('2.5 h');
    expect(formatDuration(130 * 3_600_000)).toBe('130 h');
  });
  it('says whether the browser keeps the shard, and the bytes used and free', async () => {
    const fmt = (n: number) => `${n} B`;
    expect(describeStorage({ persisted: false, usageBytes: 10, quotaBytes: 30 }, true, fmt)).toBe('10 B used, 20 B free · the browser refused to keep the layers: it may evict them under storage pressure (they would be downloaded again)');
    expect(describeStorage({ persisted: false, usageBytes: undefined, quotaBytes: undefined }, false, fmt)).toMatch(/^usage unknown · not kept yet/);
    expect(describeStorage({ persisted: true, usageBytes: 1, quotaBytes: 1 }, true, fmt)).toMatch(/kept: the browser will not evict/);
    expect(await askPersist(undefined)).toBeUndefined();
    expect(await askPersist({ persist: () => Promise.reject(new Error('no')) })).toBe(false);
    expect(await storageInfo({ persisted: async () => true, estimate: async () => ({ usage: 5, quota: 9 }) })).toEqual({ persisted: true, usageBytes: 5, quotaBytes: 9 });
  });
  it('reads the battery where the API exists, and says charging where it does not', async () => {
    const seen: boolean[] = [];
    expect(await watchPower({}, (p) => seen.push(p.charging))).toEqual({ available: false, charging: true, level: undefined });
    let fire: () => void = () => {};
    const battery = { charging: true, level: 0.5, addEventListener: (t: string, l: () => void) => void (t === 'chargingchange' && (fire = l)) };
    const first = await watchPower({ getBattery: async () => battery }, (p) => seen.push(p.charging));
    expect(first).toEqual({ available: true, charging: true, level: 0.5 });
    battery.charging = false;
    fire();
    expect(seen).toEqual([true, true, false]);
  });
});
