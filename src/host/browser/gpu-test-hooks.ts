/**
 * Test hooks around a GPU backend: failures a software GPU never has, made
 * on demand (`meshnet node` reads them from MESHNET_TEST_* variables, a page
 * from `?test_lose_gpu=`): the device destroyed before the N-th session run
 * (GPUDevice.destroy(), as a driver reset loses it), and a cap on the bytes
 * of graphs it accepts (DeviceAllocationError, 507).
 */
import type { OnnxBackend, OnnxSession } from '../../shard/backend.ts';
import { DeviceAllocationError } from './onnx.ts';

export function deviceOf(backend: OnnxBackend): GPUDevice | undefined {
  return (backend.device as unknown as { device?: GPUDevice } | undefined)?.device;
}

/** The test hooks around a GPU backend: a device destroyed before the N-th run, a memory cap on graph weights. */
export function withGpuTestHooks(backend: OnnxBackend, loseAtRun: number | undefined, memoryBytes: number | undefined): OnnxBackend {
  if (loseAtRun === undefined && memoryBytes === undefined) return backend;
  let runs = 0;
  let held = 0;
  const beforeRun = () => {
    if (++runs === loseAtRun) deviceOf(backend)?.destroy();
  };
  return {
    name: backend.name,
    ...(backend.device ? { device: backend.device } : {}),
    async createSession(model, options) {
      if (memoryBytes !== undefined) {
        if (held + model.byteLength > memoryBytes) {
          throw new DeviceAllocationError(model.byteLength, `${held} of this device's ${memoryBytes} bytes are taken (MESHNET_TEST_GPU_MEMORY_BYTES)`);
        }
        held += model.byteLength;
      }
      const bytes = memoryBytes !== undefined ? model.byteLength : 0;
      const s = await backend.createSession(model, options).catch((e: unknown) => {
        held -= bytes;
        throw e;
      });
      const hooked: OnnxSession = {
        inputNames: s.inputNames,
        outputNames: s.outputNames,
        run: (feeds) => (beforeRun(), s.run(feeds)),
        runWith: (feeds, outputs) => (beforeRun(), s.runWith(feeds, outputs)),
        release: () => ((held -= bytes), s.release()),
      };
      return hooked;
    },
  };
}
