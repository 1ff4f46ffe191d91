import { PassThrough } from 'node:stream';
import { describe, expect, it } from 'vitest';
import { formatRows, terminalView, type NodeRow } from '../../src/cli/browser-mesh.ts';

const row = (p: Partial<NodeRow>): NodeRow => ({ index: 0, peerId: 'a1b2c3d4e5f6', state: 'serving', layers: [0, 4], downloadPct: undefined, tokensServed: 0, requestsPerMinute: 0, backend: 'wasm', restarts: 0, error: undefined, ...p });

function plainOut(): { stream: NodeJS.WriteStream; text: () => string } {
  const s = new PassThrough();
  let text = '';
  s.on('data', (d) => (text += d));
  return { stream: Object.assign(s, { isTTY: false }) as unknown as NodeJS.WriteStream, text: () => text };
}

describe('meshnet mesh terminal view', () => {
  it('tabulates state with download progress, inclusive layer ranges, tokens and restarts, and shows an error inline', () => {
    const lines = formatRows([row({ state: 'downloading', downloadPct: 42, layers: [4, 8] }), row({ index: 1, state: 'error', layers: undefined, error: 'MESH_ERR_QUOTA: full', restarts: 2 })]);
    expect(lines).toHaveLength(3);
    expect(lines[1]).toMatch(/^1\s+a1b2c3d4\s+downloading 42%\s+4-7\s+wasm\s+0\s+0\s+0$/);
    expect(lines[2]).toMatch(/^2 .* error .* - .* 2 {2}MESH_ERR_QUOTA: full$/);
  });

  it('without a TTY prints a line only when a node changes, and new tokens at most every period', () => {
    const out = plainOut();
    const view = terminalView(out.stream, 60_000);
    view.update([row({ state: 'downloading', downloadPct: 3 })]);
    view.update([row({ state: 'downloading', downloadPct: 7 })]); // same decile: quiet
    view.update([row({ state: 'serving' })]);
    view.update([row({ state: 'serving', tokensServed: 5 })]); // tokens within the period: quiet
    const lines = out.text().trim().split('\n');
    expect(lines).toEqual(['node 1 a1b2c3d4: downloading 3%, layers 0-3, wasm, 0 tokens served', 'node 1 a1b2c3d4: serving, layers 0-3, wasm, 0 tokens served']);
    expect(out.text()).not.toContain('\x1b[');
  });
});
