/**
 * Errors keep their identity across the worker boundary: Comlink's default
 * `throw` handler sends name/message/stack only; this one adds `code` and
 * `status` (MeshError), so the page can branch on the code instead of
 * matching message text. Imported for its effect by both sides.
 */
import { transferHandlers, type TransferHandler } from 'comlink';

interface Thrown {
  value: unknown;
}
interface SerializedError {
  isError: boolean;
  value: unknown;
}

const throwHandler: TransferHandler<Thrown, SerializedError> = {
  canHandle: (v): v is Thrown => typeof v === 'object' && v !== null && 'value' in v,
  serialize({ value }) {
    if (value instanceof Error) {
      const e = value as Error & { code?: unknown; status?: unknown };
      return [{ isError: true, value: { message: e.message, name: e.name, stack: e.stack, code: typeof e.code === 'string' ? e.code : undefined, status: typeof e.status === 'number' ? e.status : undefined } }, []];
    }
    return [{ isError: false, value }, []];
  },
  deserialize(s) {
    if (s.isError) throw Object.assign(new Error((s.value as { message: string }).message), s.value);
    throw s.value;
  },
};

const builtin = transferHandlers.get('throw');
// Keep Comlink's own recognition of thrown values (its private marker); only the serialization changes.
if (builtin) transferHandlers.set('throw', { canHandle: builtin.canHandle, serialize: throwHandler.serialize, deserialize: throwHandler.deserialize } as TransferHandler<unknown, unknown>);
