/**
 * One table of error codes: the code's status is every answer's status,
 * docs/protocol.md §6 lists exactly these codes with these statuses, no
 * source file names a code outside the table, and remote errors decode one
 * way.
 */
import { readFileSync, readdirSync, statSync } from 'node:fs';
import { join } from 'node:path';
import { describe, expect, it } from 'vitest';
import { errorReply } from '../../src/protocol/envelopes.ts';
import { ERROR_STATUS, MeshError, codeForStatus, isMeshErrorCode, remoteError, type MeshErrorCode } from '../../src/protocol/errors.ts';

const root = new URL('../../', import.meta.url).pathname;
const utf8 = new TextEncoder();

/** `| \`CODE\` | status | meaning |` rows of §6. */
function documentedCodes(): Map<string, number> {
  const doc = readFileSync(join(root, 'docs/protocol.md'), 'utf8');
  const section = doc.slice(doc.indexOf('## 6. Error codes'), doc.indexOf('## 7.'));
  const rows = new Map<string, number>();
  for (const m of section.matchAll(/^\| `(MESH_ERR_[A-Z_]+)` \| (\d{3}) \| (.+) \|$/gm)) {
    expect(m[3]!.trim().length, `${m[1]} has a sentence`).toBeGreaterThan(10);
    rows.set(m[1]!, Number(m[2]));
  }
  return rows;
}

function sourceFiles(dir: string): string[] {
  return readdirSync(dir).flatMap((name) => {
    const p = join(dir, name);
    return statSync(p).isDirectory() ? sourceFiles(p) : p.endsWith('.ts') ? [p] : [];
  });
}

describe('error codes', () => {
  it('are documented in protocol.md §6, each with its status and a sentence, and nothing else is', () => {
    expect(Object.fromEntries(documentedCodes())).toEqual(ERROR_STATUS);
  });

  it('named anywhere in src/ or workers/ are codes of the table', () => {
    const unknown: string[] = [];
    for (const file of [...sourceFiles(join(root, 'src')), ...sourceFiles(join(root, 'workers'))]) {
      for (const m of readFileSync(file, 'utf8').matchAll(/['"`](MESH_ERR_[A-Z_]+)['"`]/g)) if (!isMeshErrorCode(m[1])) unknown.push(`${file}: ${m[1]}`);
    }
    expect(unknown).toEqual([]);
  });

  it('carry their code\'s status', () => {
    for (const code of Object.keys(ERROR_STATUS) as MeshErrorCode[]) expect(new MeshError(code, 'x').status).toBe(ERROR_STATUS[code]);
  });
});

describe('remoteError', () => {
  it('keeps a known code with that code\'s status, whatever status the answer came with', () => {
    const e = remoteError(421, utf8.encode(JSON.stringify({ error: { code: 'MESH_ERR_LAYER_RANGE', message: 'not a head' } })), 'head h1');
    expect([e.code, e.status, e.message, e.details]).toEqual(['MESH_ERR_LAYER_RANGE', 416, 'head h1: not a head', { remote_status: 421 }]);
    const same = remoteError(404, { error: { code: 'MESH_ERR_NO_SUCH_PEER', message: 'gone' } });
    expect([same.code, same.status, same.details]).toEqual(['MESH_ERR_NO_SUCH_PEER', 404, {}]);
  });

  it('reads an unknown or missing code from the status, keeping the unknown one', () => {
    const e = remoteError(503, utf8.encode('{"error":{"code":"E_FUTURE","message":"later"}}'));
    expect([e.code, e.status, e.message, e.details]).toEqual(['MESH_ERR_UNAVAILABLE', 503, 'later', { remote_code: 'E_FUTURE', remote_status: 503 }]);
    const html = remoteError(404, utf8.encode('<html>not found</html>'), 'tracker /api/x');
    expect([html.code, html.message]).toEqual(['MESH_ERR_NOT_FOUND', 'tracker /api/x: HTTP 404']);
    expect(remoteError(500, new Uint8Array(0)).code).toBe('MESH_ERR_UPSTREAM');
    expect(remoteError(418, undefined).code).toBe('MESH_ERR_UPSTREAM');
  });

  it('keeps a numeric retry_after_ms (a MESH_ERR_BUSY refusal says when to come back), and errorReply answers it as Retry-After', () => {
    const busy = remoteError(503, { error: { code: 'MESH_ERR_BUSY', message: 'no KV room', retry_after_ms: 1500, kv_free_bytes: 0 } }, 'hop h2');
    expect([busy.code, busy.status, busy.details]).toEqual(['MESH_ERR_BUSY', 503, { retry_after_ms: 1500 }]);
    expect(remoteError(503, { error: { code: 'MESH_ERR_BUSY', message: 'x', retry_after_ms: 'soon' } }).details).toEqual({});
    const reply = errorReply(busy);
    expect([reply.status, reply.headers['retry-after']]).toEqual([503, '2']);
    expect(errorReply(new MeshError('MESH_ERR_BUSY', 'x', { retry_after_ms: 10 })).headers['retry-after']).toBe('1');
    expect(errorReply(new MeshError('MESH_ERR_TIMEOUT', 'slow')).headers['retry-after']).toBeUndefined();
  });

  it('without a status (a stream\'s error frame, an error event) is MESH_ERR_UPSTREAM unless the code is known', () => {
    expect(remoteError(undefined, { error: { code: 'MESH_ERR_TIMEOUT', message: 'slow' } }).code).toBe('MESH_ERR_TIMEOUT');
    const e = remoteError(undefined, { error: { code: 'NOPE', message: 'x' } });
    expect([e.code, e.details]).toEqual(['MESH_ERR_UPSTREAM', { remote_code: 'NOPE' }]);
    expect(remoteError(undefined, utf8.encode('garbage')).message).toBe('an error without a message');
  });

  it('maps each status to one of its codes (protocol.md §6), and a remote 500 to MESH_ERR_UPSTREAM', () => {
    for (const [code, status] of Object.entries(ERROR_STATUS)) {
      const mapped = codeForStatus(status);
      if (status === 500) expect(mapped).toBe('MESH_ERR_UPSTREAM');
      else expect(ERROR_STATUS[mapped], `${code} (${status}) → ${mapped}`).toBe(status);
    }
    expect([codeForStatus(400), codeForStatus(404), codeForStatus(502), codeForStatus(503)]).toEqual(['MESH_ERR_BAD_REQUEST', 'MESH_ERR_NOT_FOUND', 'MESH_ERR_UPSTREAM', 'MESH_ERR_UNAVAILABLE']);
  });
});
