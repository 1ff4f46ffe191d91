import { mkdtempSync, readFileSync, rmSync, existsSync } from 'node:fs';
import { tmpdir } from 'node:os';
import { join } from 'node:path';
import { afterEach, describe, expect, it } from 'vitest';
import { installTraceFromEnv } from '../../src/cli/trace-file.ts';
import { setTrace, trace } from '../../src/protocol/trace.ts';

describe('MESHNET_TRACE (src/cli/trace-file.ts)', () => {
  const dir = mkdtempSync(join(tmpdir(), 'meshnet-trace-test-'));
  afterEach(() => setTrace(undefined));

  it('is off unless the variable is set: no sink, no file', () => {
    installTraceFromEnv('node', {});
    expect(trace).toBeUndefined();
    expect(existsSync(join(dir, 'none.log'))).toBe(false);
  });

  it('appends one line per stamp, in order, on the shared clock, within the flush period', async () => {
    const file = join(dir, 'trace.log');
    const before = performance.timeOrigin + performance.now();
    installTraceFromEnv('relay', { MESHNET_TRACE: file });
    expect(trace).toBeTypeOf('function');
    trace!('in:/forward', 'chat-1', '36');
    trace!('hop', 'chat-1', 36);
    trace!('uncork');
    const after = performance.timeOrigin + performance.now();
    // Buffered: flushed every 250 ms, not on each stamp.
    await new Promise((r) => setTimeout(r, 400));
    const lines = readFileSync(file, 'utf8').trimEnd().split('\n');
    expect(lines).toHaveLength(3);
    const fields = lines.map((l) => l.split(' '));
    expect(fields.map((f) => f.slice(1))).toEqual([
      [String(process.pid), 'relay', 'in:/forward', 'chat-1', '36'],
      [String(process.pid), 'relay', 'hop', 'chat-1', '36'],
      [String(process.pid), 'relay', 'uncork', '-', '-'],
    ]);
    const times = fields.map((f) => Number(f[0]));
    for (const t of times) {
      expect(t).toBeGreaterThanOrEqual(before - 0.001);
      expect(t).toBeLessThanOrEqual(after + 0.001);
    }
    expect([...times].sort((a, b) => a - b)).toEqual(times);
    rmSync(dir, { recursive: true, force: true });
  });
});
