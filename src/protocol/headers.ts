/** Header names of the node HTTP surface (PROTOCOL.md §5), lowercase. */
export const H = {
  shape: 'x-meshnet-shape',
  dtype: 'x-meshnet-dtype',
  startLayer: 'x-meshnet-start-layer',
  endLayer: 'x-meshnet-end-layer',
  session: 'x-meshnet-session',
  position: 'x-meshnet-position',
  sampling: 'x-meshnet-sampling',
  route: 'x-meshnet-route',
  routeSignature: 'x-meshnet-route-signature',
  /** ms since epoch after which a head refuses the signed route. */
  routeExpires: 'x-meshnet-route-expires',
  requestId: 'x-meshnet-request-id',
  contentType: 'content-type',
} as const;

export type HeaderMap = Record<string, string>;

/** Header names are case-insensitive on the wire; the code works on lowercase keys. */
export function normalizeHeaders(headers: Record<string, unknown> | undefined): HeaderMap {
  const out: HeaderMap = {};
  if (!headers) return out;
  for (const [k, v] of Object.entries(headers)) {
    if (v === undefined || v === null) continue;
    out[k.toLowerCase()] = Array.isArray(v) ? v.join(', ') : String(v);
  }
  return out;
}

export function isTextContentType(ct: string | undefined): boolean {
  if (!ct) return false;
  const t = ct.toLowerCase();
  return t.startsWith('text/') || t.includes('json') || t.includes('javascript') || t.includes('xml');
}
