/**
 * Checkpoints by Hugging Face hub id: `hf:ORG/REPO[@REVISION]`.
 *
 * A hub id becomes an ordinary base URL, `ENDPOINT/ORG/REPO/resolve/SHA/`,
 * with the revision pinned to its commit sha once resolved, so the loaders
 * (safetensors.ts, tokenizer.ts) need nothing hub-specific and every node
 * the tracker hands that URL loads the same bytes. What the hub adds is in
 * the fetch wrapper here:
 *  - its 302 from /resolve/ to the file CDN (another origin) is followed by
 *    hand, keeping `Range` and dropping `Authorization`: HF_TOKEN goes to
 *    the hub origin only, never to the CDN;
 *  - 401/403 become an error that says to accept the license and set the token;
 *  - a body shorter than its Content-Length is an error, not corrupted
 *    weights, and one that stalls (no byte for a minute) is an error, not a hang.
 * Pure: fetch is injected, no Node API. Browser nodes fetch the pinned URL
 * directly: the browser follows the redirect itself (it cannot read a manual
 * one), keeping Range and sending no token.
 */
import { ModelFetchError } from './errors.ts';

export const DEFAULT_HUB_ENDPOINT = 'https://huggingface.co';

export interface HubRef {
  /** "ORG/REPO". */
  repo: string;
  /** Branch, tag or commit sha as given ("main" when none). */
  revision: string;
}

const SEGMENT = /^[A-Za-z0-9][A-Za-z0-9._-]{0,95}$/;
const SHA = /^[0-9a-f]{40}$/;

export function isHubRef(s: string): boolean {
  return s.startsWith('hf:');
}

/** `hf:ORG/REPO[@REVISION]` → repo + revision; anything else is a clear error. */
export function parseHubRef(s: string): HubRef {
  if (!isHubRef(s)) throw new TypeError(`"${s}" is not a hub id (expected hf:ORG/REPO[@REVISION])`);
  const body = s.slice(3);
  const at = body.indexOf('@');
  const repo = at < 0 ? body : body.slice(0, at);
  const revision = at < 0 ? 'main' : body.slice(at + 1);
  const parts = repo.split('/');
  if (parts.length !== 2 || !parts.every((p) => SEGMENT.test(p) && !p.includes('..'))) {
    throw new TypeError(`"${s}": expected hf:ORG/REPO[@REVISION] with ORG and REPO made of letters, digits, "-", "_", "."`);
  }
  if (revision === '' || /[\s?#]/.test(revision) || revision.includes('..')) throw new TypeError(`"${s}": bad revision "${revision}"`);
  return { repo, revision };
}

export function isCommitSha(revision: string): boolean {
  return SHA.test(revision);
}

/** `HF_ENDPOINT` without a trailing slash (a mirror, or the test mimic), else the public hub. */
export function hubEndpoint(env: { HF_ENDPOINT?: string | undefined } = {}): string {
  const e = env.HF_ENDPOINT?.trim() || DEFAULT_HUB_ENDPOINT;
  return e.replace(/\/+$/, '');
}

/** Base URL of a checkpoint at one revision (pinned when `revision` is a sha). */
export function hubBaseUrl(endpoint: string, repo: string, revision: string): string {
  return `${endpoint}/${repo}/resolve/${encodeURIComponent(revision)}/`;
}

/** A file URL under `endpoint` as repo + revision + file, or null when it is not a /resolve/ URL there. */
export function parseHubFileUrl(endpoint: string, url: string): { repo: string; revision: string; file: string } | null {
  if (!url.startsWith(endpoint + '/')) return null;
  const m = /^([^/]+\/[^/]+)\/resolve\/([^/]+)\/(.+)$/.exec(url.slice(endpoint.length + 1).split(/[?#]/)[0]!);
  if (!m) return null;
  return { repo: m[1]!, revision: decodeURIComponent(m[2]!), file: decodeURIComponent(m[3]!) };
}

/** 401/403 from the hub: a gated or private repo (or, without a token, one that does not exist). */
export class HubAccessError extends ModelFetchError {
  constructor(repo: string, what: string, status: number, hadToken: boolean) {
    const page = `https://huggingface.co/${repo}`;
    super(
      what,
      hadToken
        ? `HTTP ${status} from the hub for ${repo}: HF_TOKEN was sent but does not grant access; accept the model's license at ${page} with the account that owns the token (or check that the repo exists)`
        : `HTTP ${status} from the hub for ${repo}: the repo is gated or private (or does not exist); accept its license at ${page} and set HF_TOKEN to a token of that account`,
      status,
    );
    this.name = 'HubAccessError';
  }
}

export interface HubFetchOptions {
  /** Hub origin + path prefix (hubEndpoint()). */
  endpoint: string;
  /** HF_TOKEN: sent as a Bearer token to the hub origin only. */
  token?: string;
  /**
   * Follow redirects by hand (Node): Range kept, Authorization only on the
   * hub origin. Browsers cannot read a manual redirect; they follow it
   * themselves (the Fetch standard keeps Range and drops Authorization
   * across origins). @defaultValue true
   */
  manualRedirects?: boolean;
  /** A body that sends nothing for this long while read is an error. @defaultValue 60000 */
  idleTimeoutMs?: number;
}

const REDIRECTS = new Set([301, 302, 303, 307, 308]);
const MAX_REDIRECTS = 10;

function requestUrl(input: RequestInfo | URL): string {
  return typeof input === 'string' ? input : input instanceof URL ? input.href : input.url;
}

/**
 * The same response, whose body errors when it ends before Content-Length
 * bytes (a connection cut mid-file) or when no byte arrives for `idleMs`
 * while one is awaited (a server that stalls without closing).
 */
function guardedBody(res: Response, what: string, idleMs: number): Response {
  if (!res.body) return res;
  const len = res.headers.get('content-length');
  const expected = len !== null && /^\d+$/.test(len) && !res.headers.get('content-encoding') ? Number(len) : null;
  const reader = res.body.getReader();
  let got = 0;
  const body = new ReadableStream<Uint8Array>({
    async pull(ctl) {
      let timer: ReturnType<typeof setTimeout> | undefined;
      const stalled = new Promise<never>((_, reject) => {
        timer = setTimeout(() => reject(new ModelFetchError(what, `stalled: no data for ${idleMs / 1000} s after ${got} bytes`)), idleMs);
      });
      try {
        const r = await Promise.race([reader.read(), stalled]);
        if (r.done) {
          if (expected !== null && got !== expected) throw new ModelFetchError(what, `truncated: the server sent ${got} of ${expected} bytes`);
          ctl.close();
          return;
        }
        got += r.value.byteLength;
        ctl.enqueue(r.value);
      } catch (e) {
        void reader.cancel(e).catch(() => undefined);
        throw e;
      } finally {
        clearTimeout(timer);
      }
    },
    cancel: (reason) => reader.cancel(reason),
  });
  return new Response(body, { status: res.status, statusText: res.statusText, headers: res.headers });
}

/**
 * fetch for checkpoints that may live on the hub. URLs outside `endpoint`
 * pass through untouched (a plain static server keeps working).
 */
export function hubFetch(base: typeof fetch, o: HubFetchOptions): typeof fetch {
  const hubOrigin = new URL(o.endpoint).origin;
  const manual = o.manualRedirects ?? true;
  const wrapped = async (input: RequestInfo | URL, init: RequestInit = {}): Promise<Response> => {
    const first = requestUrl(input);
    const hubFile = parseHubFileUrl(o.endpoint, first);
    if (!hubFile) return base(input, init);
    const what = `${hubFile.repo}@${hubFile.revision}/${hubFile.file}`;
    const headers = new Headers(init.headers);
    let url = new URL(first);
    for (let hop = 0; ; hop++) {
      const h = new Headers(headers);
      if (o.token && url.origin === hubOrigin) h.set('authorization', `Bearer ${o.token}`);
      else h.delete('authorization');
      let res: Response;
      try {
        res = await base(url.href, { ...init, headers: h, redirect: manual ? 'manual' : 'follow' });
      } catch (e) {
        if ((e as Error).name === 'AbortError') throw e;
        throw new ModelFetchError(what, `cannot reach ${url.origin}: ${(e as { cause?: Error }).cause?.message ?? (e as Error).message}`);
      }
      if (manual && REDIRECTS.has(res.status)) {
        const loc = res.headers.get('location');
        await res.body?.cancel();
        if (!loc) throw new ModelFetchError(what, `HTTP ${res.status} without a Location from ${url.href}`, res.status);
        if (hop >= MAX_REDIRECTS) throw new ModelFetchError(what, `more than ${MAX_REDIRECTS} redirects from ${first}`);
        url = new URL(loc, url);
        continue;
      }
      if (res.status === 401 || res.status === 403) {
        await res.body?.cancel();
        throw new HubAccessError(hubFile.repo, what, res.status, o.token !== undefined && o.token !== '');
      }
      return guardedBody(res, what, o.idleTimeoutMs ?? 60_000);
    }
  };
  return wrapped as typeof fetch;
}

export interface ResolvedHubModel {
  repo: string;
  /** The revision as asked for ("main", a tag, or a sha). */
  revision: string;
  /** The commit it resolved to. */
  sha: string;
  /** `ENDPOINT/ORG/REPO/resolve/SHA/`: what the tracker hands to nodes. */
  url: string;
}

const RevisionAnswer = (v: unknown): string | null => {
  const sha = (v as { sha?: unknown } | null)?.sha;
  return typeof sha === 'string' && isCommitSha(sha) ? sha : null;
};

/**
 * Pin `hf:ORG/REPO[@REVISION]` to a commit: GET /api/models/ORG/REPO/revision/REV
 * (its `sha`), or, when that API is not served (some mirrors), the
 * X-Repo-Commit header of config.json's /resolve/ answer. A sha needs no lookup.
 */
export async function resolveHubModel(fetchFn: typeof fetch, ref: string | HubRef, o: { endpoint: string; token?: string; signal?: AbortSignal }): Promise<ResolvedHubModel> {
  const { repo, revision } = typeof ref === 'string' ? parseHubRef(ref) : ref;
  const done = (sha: string): ResolvedHubModel => ({ repo, revision, sha, url: hubBaseUrl(o.endpoint, repo, sha) });
  if (isCommitSha(revision)) return done(revision);
  const auth: Record<string, string> = o.token ? { authorization: `Bearer ${o.token}` } : {};
  const api = `${o.endpoint}/api/models/${repo}/revision/${encodeURIComponent(revision)}`;
  let res: Response;
  try {
    res = await fetchFn(api, { headers: auth, signal: o.signal });
  } catch (e) {
    if ((e as Error).name === 'AbortError') throw e;
    throw new ModelFetchError(`hf:${repo}@${revision}`, `cannot reach the hub at ${o.endpoint}: ${(e as { cause?: Error }).cause?.message ?? (e as Error).message}`);
  }
  if (res.status === 401 || res.status === 403) {
    await res.body?.cancel();
    throw new HubAccessError(repo, `hf:${repo}@${revision}`, res.status, Boolean(o.token));
  }
  // The hub says which in X-Error-Code; any other 404 (a mirror without the API) falls through to X-Repo-Commit.
  const code = res.headers.get('x-error-code');
  if (res.status === 404 && (code === 'RepoNotFound' || code === 'RevisionNotFound')) {
    await res.body?.cancel();
    const which = code === 'RevisionNotFound' ? `no revision "${revision}" in ${repo}` : `no repo ${repo}`;
    throw new ModelFetchError(`hf:${repo}@${revision}`, `HTTP 404 from ${o.endpoint}: ${which}`, 404);
  }
  if (res.ok) {
    let sha: string | null;
    try {
      sha = RevisionAnswer(await res.json());
    } catch {
      sha = null;
    }
    if (sha) return done(sha);
  } else {
    await res.body?.cancel();
  }
  // No usable API answer: the commit the hub reports while resolving a file.
  const head = await hubFetch(fetchFn, { endpoint: o.endpoint, token: o.token })(hubBaseUrl(o.endpoint, repo, revision) + 'config.json', { method: 'HEAD', signal: o.signal });
  await head.body?.cancel();
  const commit = head.headers.get('x-repo-commit');
  if (head.status === 404) throw new ModelFetchError(`hf:${repo}@${revision}`, `HTTP 404 from ${o.endpoint}: no config.json at revision "${revision}" of ${repo}`, 404);
  if (!commit || !isCommitSha(commit)) throw new ModelFetchError(`hf:${repo}@${revision}`, `the hub at ${o.endpoint} named no commit for revision "${revision}" (API: HTTP ${res.status})`);
  return done(commit);
}
