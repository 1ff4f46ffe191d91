/** The Node.js host's half of the contract: the `ws` socket the Node host uses, typed as the core expects. */
export { NodeWebSocketConstructor as NodeWebSocket } from '../../src/host/node/socket.ts';
