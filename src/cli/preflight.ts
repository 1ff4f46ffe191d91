/**
 * Checks a command makes before it starts anything: is the tracker or relay
 * it was given there? A wrong URL is the likeliest reason it is not, so the
 * command stops with one line naming the URL and the option to fix, rather
 * than retrying in the background forever. (Once running, a node or tracker
 * rides out a tracker or relay restart by reconnecting.)
 */
import { z } from 'zod';
import { CliError } from './failure.ts';

const TIMEOUT_MS = 5000;

function reason(e: unknown): string {
  const cause = (e as { cause?: { code?: string; message?: string } }).cause;
  if (cause?.code === 'ECONNREFUSED') return 'connection refused';
  if (cause?.code === 'ENOTFOUND') return 'no such host';
  if ((e as Error).name === 'TimeoutError') return `no answer in ${TIMEOUT_MS / 1000} s`;
  return cause?.message ?? (e as Error).message;
}

function httpUrl(url: string, option: string, schemes: string[]): URL {
  let u: URL;
  try {
    u = new URL(url);
  } catch {
    throw new CliError(`${option} ${url} is not a URL: give ${schemes.map((s) => `${s}//host:port`).join(' or ')}`);
  }
  if (!schemes.includes(u.protocol)) throw new CliError(`${option} ${url} must start with ${schemes.map((s) => `${s}//`).join(' or ')}`);
  return u;
}

const trackerInfo = z.object({ public_key: z.string(), peer_id: z.string(), models: z.array(z.string()), models_pending: z.array(z.string()).default([]) }).loose();
export type TrackerInfo = z.infer<typeof trackerInfo>;

/** GET /api/tracker: the tracker's key and models; a CliError naming the URL when it does not answer as a tracker. */
export async function reachTracker(url: string, option = '--tracker'): Promise<TrackerInfo> {
  const base = httpUrl(url, option, ['http:', 'https:']);
  const at = new URL('api/tracker', base.href.endsWith('/') ? base : `${base.href}/`);
  let res: Response;
  try {
    res = await fetch(at, { signal: AbortSignal.timeout(TIMEOUT_MS) });
  } catch (e) {
    throw new CliError(`cannot reach the tracker at ${url} (${reason(e)}): start \`meshnet tracker\` there, or fix ${option}`);
  }
  const parsed = trackerInfo.safeParse(await res.json().catch(() => undefined));
  if (!res.ok || !parsed.success) throw new CliError(`${url} does not answer like a meshnet tracker (HTTP ${res.status} from ${at.pathname}): fix ${option}`);
  return parsed.data;
}

/**
 * Can we connect to the relay? GET /healthz beside its /ws path. Only a
 * connection failure stops the command: a relay behind a proxy that forwards
 * /ws alone still answers something. `url` may list several relays (comma
 * separated; a node fails over between them): one that answers is enough.
 */
export async function reachRelay(url: string, option = '--relay'): Promise<void> {
  const urls = url.split(',').map((s) => s.trim()).filter((s) => s !== '');
  if (urls.length === 0) throw new CliError(`${option} is empty: give ws://host:port (several, comma-separated, to fail over)`);
  const failures: string[] = [];
  for (const one of urls) {
    const u = httpUrl(one, option, ['ws:', 'wss:', 'http:', 'https:']);
    const path = u.pathname === '' || u.pathname === '/' ? '/healthz' : u.pathname.replace(/\/[^/]*$/, '/healthz');
    const at = new URL(path, `${u.protocol === 'wss:' || u.protocol === 'https:' ? 'https:' : 'http:'}//${u.host}`);
    try {
      const res = await fetch(at, { signal: AbortSignal.timeout(TIMEOUT_MS) });
      await res.body?.cancel();
      return;
    } catch (e) {
      failures.push(`${one} (${reason(e)})`);
    }
  }
  throw new CliError(`cannot reach the relay at ${failures.join(', ')}: start \`meshnet relay\` there, or fix ${option}`);
}
