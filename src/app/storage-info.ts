/**
 * The donor's storage: whether the browser keeps the shard under storage
 * pressure (`navigator.storage.persist()`, asked when the PWA is installed or
 * the donor ticks "keep my shard"), and how much the site uses and may use.
 * `persist()` and `persisted()` exist on Window only; a refusal is an answer,
 * not an error: the node keeps working, and the page says the layers may be
 * evicted (and then downloaded again).
 */

export interface StorageManagerLike {
  persist?(): Promise<boolean>;
  persisted?(): Promise<boolean>;
  estimate?(): Promise<{ usage?: number; quota?: number }>;
}

export interface StorageInfo {
  /** undefined: the browser has no persistence API (or it threw). */
  persisted: boolean | undefined;
  usageBytes: number | undefined;
  quotaBytes: number | undefined;
}

export async function storageInfo(sm: StorageManagerLike | undefined): Promise<StorageInfo> {
  const [persisted, est] = await Promise.all([sm?.persisted?.().catch(() => undefined), sm?.estimate?.().catch(() => undefined)]);
  return { persisted, usageBytes: est?.usage, quotaBytes: est?.quota };
}

/** Asks the browser to keep this site's storage; the answer (false: refused), or undefined without the API. */
export async function askPersist(sm: StorageManagerLike | undefined): Promise<boolean | undefined> {
  if (typeof sm?.persist !== 'function') return undefined;
  try {
    return await sm.persist();
  } catch {
    return false;
  }
}

/** One line for the page. */
export function describeStorage(s: StorageInfo, asked: boolean, format: (n: number) => string): string {
  const use = s.usageBytes !== undefined && s.quotaBytes !== undefined ? `${format(s.usageBytes)} used, ${format(Math.max(0, s.quotaBytes - s.usageBytes))} free` : 'usage unknown';
  const kept =
    s.persisted === true ? 'kept: the browser will not evict the layers'
    : s.persisted === undefined ? 'this browser cannot be asked to keep the layers'
    : asked ? 'the browser refused to keep the layers: it may evict them under storage pressure (they would be downloaded again)'
    : 'not kept yet: tick "keep my shard" to ask the browser';
  return `${use} · ${kept}`;
}
