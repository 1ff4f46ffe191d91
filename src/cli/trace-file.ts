/**
 * `MESHNET_TRACE=path`: the stamps of src/protocol/trace.ts appended to
 * `path`, one line each, from every `meshnet node` and `meshnet relay` that
 * has the variable (bench/hop-trace.ts reads them):
 *
 *   <ms since epoch, µs precision> <pid> <role> <stage> <session|-> <position|->
 *
 * The time is performance.timeOrigin + performance.now(): the same clock in
 * every process on one machine, finer than Date.now(). A stamp only stores
 * the time and its arguments (no string is built on the data path: stamps
 * sit on every step's critical path); lines are formatted and appended
 * (O_APPEND, one write per flush, so processes sharing the file never split
 * a line) every 250 ms, when the buffer fills, and at exit.
 */
import { closeSync, openSync, writeSync } from 'node:fs';
import { setTrace } from '../protocol/trace.ts';

/** Stamps held between flushes; a full buffer is flushed on the spot. */
const CAPACITY = 1 << 14;

/** Install the file sink when MESHNET_TRACE is set; `role` names the process in the lines (node, relay). */
export function installTraceFromEnv(role: string, env: NodeJS.ProcessEnv = process.env): void {
  const path = env.MESHNET_TRACE;
  if (!path) return;
  const fd = openSync(path, 'a');
  const origin = performance.timeOrigin;
  const prefix = ` ${process.pid} ${role} `;
  const times = new Float64Array(CAPACITY);
  const stages: string[] = new Array<string>(CAPACITY);
  const sessions: Array<string | undefined> = new Array<string | undefined>(CAPACITY);
  const positions: Array<string | number | undefined> = new Array<string | number | undefined>(CAPACITY);
  let n = 0;
  const flush = (): void => {
    if (n === 0) return;
    let text = '';
    for (let i = 0; i < n; i++) {
      text += `${(origin + times[i]!).toFixed(3)}${prefix}${stages[i]} ${sessions[i] || '-'} ${positions[i] ?? '-'}\n`;
      sessions[i] = undefined;
      positions[i] = undefined;
    }
    n = 0;
    writeSync(fd, text);
  };
  setTrace((stage, session, position) => {
    times[n] = performance.now();
    stages[n] = stage;
    sessions[n] = session;
    positions[n] = position;
    if (++n === CAPACITY) flush();
  });
  setInterval(flush, 250).unref();
  process.on('exit', () => {
    flush();
    closeSync(fd);
  });
}
