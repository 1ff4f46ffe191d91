/**
 * Registration of the published architectures with the tracker's model
 * loader over HTTP: each preset sizes from its safetensors headers under the
 * published tensor names, and a config of an unsupported model_type or rope
 * type is refused with a message naming what is supported.
 */
import { mkdtempSync, mkdirSync, rmSync, writeFileSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterAll, beforeAll, describe, expect, it } from 'vitest';
import { ensureModel } from '../../src/cli/models.ts';
import { startStaticServer, type StaticServer } from '../../src/cli/static-server.ts';
import { expectedTensorShape, layerTensorNames } from '../../src/model/config.ts';
import { loadModelSpec } from '../../src/tracker/model-registry.ts';

const SIZING = { weightBytesPerParam: 4, kvReserveContextTokens: 256, kvReserveSessions: 1 };
const PRESETS = ['tiny-llama31', 'tiny-smollm2', 'tiny-mistral', 'tiny-qwen3', 'tiny-phi3', 'tiny-phi4mini'] as const;

describe('tracker registration of the published architectures', () => {
  const work = mkdtempSync(join(tmpdir(), 'meshnet-arch-reg-'));
  let st: StaticServer;
  beforeAll(async () => {
    for (const p of PRESETS) await ensureModel(p, join(work, p));
    mkdirSync(join(work, 'gemma'));
    writeFileSync(join(work, 'gemma', 'config.json'), JSON.stringify({ architectures: ['Gemma2ForCausalLM'], model_type: 'gemma2', vocab_size: 256000 }));
    mkdirSync(join(work, 'yarn'));
    writeFileSync(
      join(work, 'yarn', 'config.json'),
      JSON.stringify({ architectures: ['Qwen3ForCausalLM'], model_type: 'qwen3', vocab_size: 512, hidden_size: 64, intermediate_size: 192, num_hidden_layers: 4, num_attention_heads: 4, rms_norm_eps: 1e-6, max_position_embeddings: 40960, rope_scaling: { rope_type: 'yarn', factor: 4, original_max_position_embeddings: 32768 } }),
    );
    st = await startStaticServer({ root: work });
  }, 60_000);
  afterAll(async () => {
    await st?.close();
    rmSync(work, { recursive: true, force: true });
  });

  it.each(PRESETS)('%s sizes every layer from the published tensor names in its safetensors header', async (preset) => {
    const spec = await loadModelSpec(preset, `${st.url}/${preset}/`, fetch, SIZING);
    expect(spec.sizedFrom).toBe('safetensors');
    const c = spec.config;
    const params = layerTensorNames(c, 0).reduce((n, t) => n + expectedTensorShape(c, t)!.reduce((a, b) => a * b, 1), 0);
    expect(spec.layerBytes).toEqual(Array.from({ length: c.numLayers }, () => params * 4));
  });

  it('refuses an unsupported model_type and rope type, naming what is supported', async () => {
    await expect(loadModelSpec('gemma', `${st.url}/gemma/`, fetch, SIZING)).rejects.toThrow(/unsupported model_type "gemma2" \(supported: llama, mistral, qwen2, qwen3, phi3\)/);
    await expect(loadModelSpec('yarn', `${st.url}/yarn/`, fetch, SIZING)).rejects.toThrow(/"yarn" is not supported \(supported: default, llama3, longrope\)/);
  });
});
