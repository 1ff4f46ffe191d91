/**
 * A lost GPU device (simulated with GPUDevice.destroy() on Dawn in Node,
 * SwiftShader) never hangs a request: the call in flight and every later
 * call fail at once with MESH_ERR_UNAVAILABLE naming the loss, and the
 * executor says it was lost so its host can rebuild it or fall back to WASM.
 * And a buffer the device cannot allocate is a MESH_ERR_DEVICE_MEMORY (507).
 */
import { describe, expect, it } from 'vitest';
import { installNodeWebGpu } from '../../src/host/node/webgpu.ts';
import { createOrtWebBackend } from '../../src/host/browser/onnx.ts';
import type { MeshError } from '../../src/protocol/errors.ts';
import { FusedShardExecutor } from '../../src/shard/fused-executor.ts';
import { fixture } from '../helpers/shard.ts';

const WASM = new URL('../../node_modules/onnxruntime-web/dist/', import.meta.url).href;

describe('fused executor when the GPU device is lost', () => {
  it('fails the call in flight and later calls with MESH_ERR_UNAVAILABLE, never hangs', async () => {
    await installNodeWebGpu();
    const backend = await createOrtWebBackend('webgpu', { numThreads: 1, wasmPaths: WASM });
    const f = fixture('tiny');
    const ex = await FusedShardExecutor.create({ config: f.cfg, backend, weights: () => f.weights, startLayer: 0, endLayer: f.cfg.numLayers, projections: 'f32', maxContext: 64 });
    const first = await ex.forward({ session: 's', position: 0, tokenIds: [5, 6, 7] });
    expect(first.kind).toBe('token');
    expect(ex.deviceLost).toBeNull();

    // A buffer the device cannot hold: a clear 507, not a crash or a hang.
    const big = (await backend.device!.alloc('float32', [2 ** 31]).catch((e: unknown) => e)) as MeshError;
    expect([big.code, big.status]).toEqual(['MESH_ERR_DEVICE_MEMORY', 507]);
    expect(big.message).toMatch(/could not allocate 8589934592 bytes/);

    const inFlight = ex.forward({ session: 's', position: 3, tokenIds: [8] }).catch((e: unknown) => e as MeshError);
    (backend.device as unknown as { device: GPUDevice }).device.destroy();
    const err = await inFlight;
    // Either the step finished before the loss was reported, or it failed with the loss: never a hang.
    if (err instanceof Error) expect([err.code, err.status]).toEqual(['MESH_ERR_UNAVAILABLE', 503]);
    await backend.device!.lost;
    expect(ex.deviceLost).toMatch(/destroyed/);

    const later = (await ex.forward({ session: 't', position: 0, tokenIds: [1] }).catch((e: unknown) => e)) as MeshError;
    expect([later.code, later.status]).toEqual(['MESH_ERR_UNAVAILABLE', 503]);
    expect(later.message).toMatch(/GPU device was lost/);
  }, 300_000);
});
