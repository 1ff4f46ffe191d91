/**
 * Preload (`node --import bench/lib/ort-cpu.mjs`) that counts the process
 * CPU time spent inside onnxruntime-node's native session.run, for
 * bench/profile-chats.ts --ort-cpu. onnxruntime-node runs a session
 * synchronously on the main thread, so process CPU around the native call is
 * ORT's own work (plus whatever V8 helper threads did meanwhile). Unlike the
 * V8 profiler's wall-clock samples it does not count time the process sat
 * preempted inside the call on a busy machine.
 *
 * On SIGUSR2 the counters are written to $MESHNET_ORT_CPU_DIR/ort-<pid>.json.
 */
import { createRequire } from 'node:module';
import { writeFileSync } from 'node:fs';
import { join } from 'node:path';

const require = createRequire(join(process.cwd(), 'package.json'));
const { binding } = require('onnxruntime-node/dist/binding.js');
const stats = { runs: 0, cpu_ms: 0, wall_ms: 0 };
// The native class's methods are read-only: sessions are made from a subclass instead (backend.js looks it up per session).
binding.InferenceSession = class extends binding.InferenceSession {
  run(...args) {
    const c0 = process.cpuUsage();
    const t0 = performance.now();
    try {
      return super.run(...args);
    } finally {
      const c = process.cpuUsage(c0);
      stats.runs++;
      stats.cpu_ms += (c.user + c.system) / 1000;
      stats.wall_ms += performance.now() - t0;
    }
  }
};
const dir = process.env.MESHNET_ORT_CPU_DIR ?? '.';
process.on('SIGUSR2', () => writeFileSync(join(dir, `ort-${process.pid}.json`), JSON.stringify(stats)));
