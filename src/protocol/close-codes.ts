/**
 * WebSocket close codes of the relay's `/ws` and a node's `/link`
 * (docs/protocol.md §8; 4000–4999 is the application range).
 */
export const CLOSE = {
  normal: 1000,
  goingAway: 1001,
  protocolError: 1002,
  policy: 1008,
  tooBig: 1009,
  tryAgainLater: 1013,
  badSignature: 4001,
  replaced: 4002,
  registerTimeout: 4003,
  slowConsumer: 4004,
} as const;
