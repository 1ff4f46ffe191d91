/**
 * Defaults of `meshnet node` (src/host/node/index.ts), apart from the host so
 * that `meshnet node --help` prints them without loading onnxruntime.
 */
export const NODE_HOST_DEFAULTS = {
  port: 0,
  host: '127.0.0.1',
  budgetMb: 1024,
  injectDelayMs: 0,
  maxBodyBytes: 64 * 1024 * 1024,
  maxContext: 2048,
  hopOrder: 'relay',
  hopMode: 'chain',
  /** The model name with a static span (--layers) and no tracker to ask. */
  staticModel: 'default',
} as const;
