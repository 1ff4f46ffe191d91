/** The Node.js host's half of the contract: the `ws` package's socket, typed as the core expects. */
import { WebSocket } from 'ws';
import type { WebSocketConstructor } from '../../../src/node/socket.ts';

export const NodeWebSocket = WebSocket as unknown as WebSocketConstructor;
