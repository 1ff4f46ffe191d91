/**
 * What the browser node runs a span on, by backend, adapter and asked weight
 * format: fused graphs unless they cannot serve (then plain, saying why); f16
 * only on WebGPU with shader-f16, else f32 with the reason the page shows.
 */
import { describe, expect, it } from 'vitest';
import { configFromSearch } from '../../../src/app/url-config.ts';
import { fixtureConfig } from '../../../src/model/fixture.ts';
import { graphsFor } from '../../../src/host/browser/adapter.ts';

describe('graphsFor', () => {
  const cfg = fixtureConfig('tiny');

  it('runs f32 and 4-bit weights on the fused graphs, on WASM and WebGPU', () => {
    expect(graphsFor(cfg, 'wasm', false, 'q4')).toMatchObject({ graphs: { kind: 'fused', projections: 'q4' }, weights: 'q4', precision: 'f32 activations (WASM)', why: expect.stringMatching(/slower than f32/) });
    expect(graphsFor(cfg, 'webgpu', false, 'q4').why).toBeUndefined();
    expect(graphsFor(cfg, 'webgpu', false, 'f32')).toMatchObject({ graphs: { kind: 'fused', projections: 'f32' }, weights: 'f32', precision: expect.stringMatching(/no shader-f16/) });
    expect(graphsFor(cfg, 'wasm', false, 'f32').why).toBeUndefined();
  });

  it('runs f16 only with shader-f16 (plain graphs, saying why), else f32 with the reason', () => {
    expect(graphsFor(cfg, 'webgpu', true, 'f16')).toMatchObject({ graphs: { kind: 'plain', dtype: 'f16' }, weights: 'f16', why: expect.stringMatching(/fused graphs are f32 or 4-bit only/) });
    // SwiftShader: no shader-f16.
    expect(graphsFor(cfg, 'webgpu', false, 'f16')).toMatchObject({ graphs: { kind: 'fused', projections: 'f32' }, weights: 'f32', precision: 'f32 activations: f16 was asked but the adapter has no shader-f16' });
    expect(graphsFor(cfg, 'wasm', false, 'f16')).toMatchObject({ weights: 'f32', precision: expect.stringMatching(/needs WebGPU with shader-f16/) });
  });

  it('falls back to plain f32 graphs where the fused graphs refuse the config, with the reason', () => {
    const odd = { ...cfg, headDim: 24 };
    expect(graphsFor(odd, 'wasm', false, 'q4')).toMatchObject({ graphs: { kind: 'plain', dtype: 'f32' }, weights: 'f32', why: expect.stringMatching(/refuse this model \(head_dim 24.*instead of 4-bit/) });
  });
});

describe('?weights=', () => {
  it('reads the weight format from the URL, with or without a tracker, and refuses an unknown one', () => {
    expect(configFromSearch('?relay=ws://h:1&model=http://m/x&layers=0-2&weights=q4')).toMatchObject({ ok: true, config: { weights: 'q4' } });
    expect(configFromSearch('?relay=ws://h:1&tracker=http://t:2&weights=f16')).toMatchObject({ ok: true, config: { weights: 'f16' } });
    const r = configFromSearch('?relay=ws://h:1&model=http://m/x&layers=0-2');
    expect(r.ok && r.config.weights).toBeUndefined();
    expect(configFromSearch('?relay=ws://h:1&model=http://m/x&layers=0-2&weights=int8')).toMatchObject({ ok: false, message: expect.stringMatching(/^weights/) });
  });
});
