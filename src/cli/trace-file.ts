/**
 * `MESHNET_TRACE=path`: the stamps of src/node/trace.ts appended to `path`,
 * one line each, from every `meshnet node` and `meshnet relay` that has the
 * variable (bench/hop-trace.ts reads them):
 *
 *   <ms since epoch, µs precision> <pid> <role> <stage> <session|-> <position|->
 *
 * The time is performance.timeOrigin + performance.now(): the same clock in
 * every process on one machine, finer than Date.now(). Lines are buffered
 * and appended (O_APPEND, one write per flush, so processes sharing the file
 * never split a line) every 250 ms and at exit: a stamp costs an array push,
 * not a write(2) on the data path.
 */
import { closeSync, openSync, writeSync } from 'node:fs';
import { setTrace } from '../protocol/trace.ts';

/** Install the file sink when MESHNET_TRACE is set; `role` names the process in the lines (node, relay). */
export function installTraceFromEnv(role: string, env: NodeJS.ProcessEnv = process.env): void {
  const path = env.MESHNET_TRACE;
  if (!path) return;
  const fd = openSync(path, 'a');
  const origin = performance.timeOrigin;
  const prefix = ` ${process.pid} ${role} `;
  let lines: string[] = [];
  const flush = (): void => {
    if (lines.length === 0) return;
    const text = lines.join('');
    lines = [];
    writeSync(fd, text);
  };
  setTrace((stage, session, position) => {
    lines.push(`${(origin + performance.now()).toFixed(3)}${prefix}${stage} ${session || '-'} ${position ?? '-'}\n`);
  });
  setInterval(flush, 250).unref();
  process.on('exit', () => {
    flush();
    closeSync(fd);
  });
}
