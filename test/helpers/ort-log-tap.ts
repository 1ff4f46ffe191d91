/**
 * onnxruntime-web's WASM module writes its log with fs.writeSync(1|2, …)
 * (emscripten's Node output): importing this module taps those lines, so a
 * test can count the GPU programs a run dispatched or read the graph
 * transformers' verdicts. Import it before onnxruntime-web is loaded (the
 * GPU tests load it with a dynamic import after their static ones).
 */
import fs from 'node:fs';
import { syncBuiltinESMExports } from 'node:module';

/** Set `tapping` around the runs whose log lines a test wants in `lines`; the rest are dropped. */
export const ortLog = { lines: [] as string[], tapping: false };

const writeSync = fs.writeSync;
fs.writeSync = ((fd: number, data: unknown, ...rest: unknown[]) => {
  if ((fd === 1 || fd === 2) && typeof data === 'string' && /\[[IV]:onnxruntime/.test(data)) {
    if (ortLog.tapping) ortLog.lines.push(data);
    return data.length;
  }
  return (writeSync as (...a: unknown[]) => number)(fd, data, ...rest);
}) as typeof fs.writeSync;
syncBuiltinESMExports();
