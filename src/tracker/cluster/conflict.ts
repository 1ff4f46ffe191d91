/** JetStream's answer to a compare-and-swap that lost: another writer moved the key's revision first. */
const WRONG_LAST_SEQUENCE = 10071;

export function isConflict(e: unknown): boolean {
  return (e as { code?: number })?.code === WRONG_LAST_SEQUENCE || /wrong last sequence/i.test((e as Error)?.message ?? '');
}
